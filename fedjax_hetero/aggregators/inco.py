"""InCo Aggregation's server step: cross-layer updates on the aggregated delta.

Chan et al., "Internal Cross-layer Gradients for Extending Homogeneity to
Heterogeneity in Federated Learning" (arXiv 2308.11464; ICLR 2024). After the
layer-wise heterogeneous mean (`heterogeneous_mean_delta`, paper Sec. 3.1) the
server replaces the delta ``g_k`` of every *target* layer by a mix of it and
the delta ``g_0`` of a same-shape *source* layer of the same stage
(Algorithm 1, line 11); every other leaf keeps its plain average. The model
supplies the (target, source) pairs, e.g. `ResNet.cross_layer_pairs()`.

Notation: ``a = <g_0, g_0>``, ``b = <g_0, g_k>`` (Theorem 3.1), ``ĝ = g / ||g||``.
Variants (spec §1.5 and the ablations of §1.9), all in the form
``update = (x_k ± θ x_0) * scale`` with ``x = ĝ, scale = (||g_k|| + ||g_0||) / 2``
when normalized and ``x = g, scale = 1`` when not:

=================  ==========  ==============================  ====  ========
variant            normalized  θ                               sign  clip
=================  ==========  ==============================  ====  ========
"code" (default)   yes         clip(|b| / (a + eps), 0, 5)     +     ±0.1
"theorem"          yes         b / a if b < 0 else 0           −     no
"paper"            yes         b / a                           −     no
"no_normalization" no          clip(|b| / (a + eps), 0, 5)     +     no
"no_optimization"  yes         1                               +     no
"none"             no          1                               +     no
=================  ==========  ==============================  ====  ========

Decisions (spec §6):
- a and b always come from the *raw* aggregated deltas, as in the authors'
  code (§6.2), also for "theorem" and "paper"; Algorithm 1 does not say.
  So θ = b/a = cos(g_k, g_0) ||g_k|| / ||g_0|| is applied to unit vectors:
  "theorem" is the exact half-space projection of ĝ_k only when the two
  norms are equal, and "paper" is not orthogonal to g_0 (it would be with a,
  b from the normalized vectors, spec §1.5).
- Granularity "kernel" computes norms, a, b and θ per spatial kernel slice,
  i.e. per (Cin, Cout) pair of an HWIO conv kernel (reduce over axes (0, 1)),
  as the authors' code does for ResNets (§1.5, §6.3); leaves with fewer than 3
  axes (LayerNorm scales, dense kernels) are reduced whole, as the code does
  for ViT LayerNorm vectors. "tensor" uses one θ per leaf (the paper's reading).
- The code-derived variants ("code", "no_normalization", "no_optimization")
  guard with ``eps = 1e-7`` as the authors' code does: ``ĝ = g / (||g|| + eps)``
  and ``θ = |b| / (a + eps)``; the rescale uses the unguarded norms. "theorem"
  and "paper" are exact, with 0/0 read as 0.
- Coverage: the authors' code transforms only the parameters present in the
  round's aggregate. Here the caller passes the aggregation denominator (or
  any tree that is > 0 where an element was covered); uncovered target
  elements keep their delta (zero), and the source is restricted to the
  target's covered elements. This matters for the fixed-θ variants: with
  ``g_k = 0`` and θ = 1, ``ĝ_0 ||g_0|| / 2 != 0``. ("code" with ``g_k = 0`` gives
  ``b = 0``, hence θ = 0 and a zero update, but the mask makes all variants
  agree.) With width heterogeneity (not in the paper, spec §2.3) this applies
  InCo to the covered sub-tensor of each target.
- Norms, a, b and θ are computed in float32 at least (float16 squared norms
  of small deltas underflow); the update comes back in the delta's dtype.
- ``theta=`` forces θ (in the variant's own sign convention), e.g.
  ``variant="no_normalization", theta=0.0`` returns ``g_k`` unchanged:
  InCo reduces to HeteroAvg.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import traverse_util

from fedjax_hetero.aggregators import checks
from fedjax_hetero.hetero.maps import flatten

Array = jax.Array
Path = tuple[str, ...]
Pair = tuple[Path, Path]  # (target, source)

EPS = 1e-7
THETA_MAX = 5.0
UPDATE_CLIP = 0.1


class _Rule(NamedTuple):
  normalize: bool
  theta: str  # "abs_ratio": clip(|b|/(a+eps), 0, max); "ratio": b/a; "negative_ratio": b/a if b<0; "one"
  sign: float  # +1: x_k + θ x_0; -1: x_k - θ x_0
  clip: bool
  guarded: bool  # eps guards of the authors' code (else exact, 0/0 -> 0)


_RULES: dict[str, _Rule] = {
    "code": _Rule(True, "abs_ratio", 1.0, True, True),
    "theorem": _Rule(True, "negative_ratio", -1.0, False, False),
    "paper": _Rule(True, "ratio", -1.0, False, False),
    "no_normalization": _Rule(False, "abs_ratio", 1.0, False, True),
    "no_optimization": _Rule(True, "one", 1.0, False, True),
    "none": _Rule(False, "one", 1.0, False, True),
}
VARIANTS: tuple[str, ...] = tuple(_RULES)
GRANULARITIES: tuple[str, ...] = ("kernel", "tensor")


def _check(variant: str, granularity: str) -> _Rule:
  if variant not in _RULES:
    raise ValueError(f"unknown InCo variant {variant!r}; accepted: {', '.join(VARIANTS)}")
  if granularity not in GRANULARITIES:
    raise ValueError(f"unknown InCo granularity {granularity!r}; accepted: {', '.join(GRANULARITIES)}")
  return _RULES[variant]


def slice_axes(ndim: int, granularity: str) -> tuple[int, ...]:
  """Axes reduced for one θ: the spatial axes of a conv kernel ("kernel"), else all."""
  if granularity == "kernel" and ndim >= 3:
    return tuple(range(ndim - 2))  # HWIO: one slice per (Cin, Cout)
  return tuple(range(ndim))


def _inner(x: Array, y: Array, axes: tuple[int, ...]) -> Array:
  return jnp.sum(x * y, axis=axes, keepdims=True)


def _safe_div(x: Array, y: Array) -> Array:
  nonzero = y != 0
  return jnp.where(nonzero, x / jnp.where(nonzero, y, 1.0), 0.0)


def projection_coefficients(g_k: Array, g_0: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
  """``a = <g_0, g_0>``, ``b = <g_0, g_k>`` per slice (Theorem 3.1 / Eq. 2; App. B.2 for tensors)."""
  return _inner(g_0, g_0, axes), _inner(g_0, g_k, axes)


def cross_layer_theta(a: Array, b: Array, variant: str = "code", eps: float = EPS,
                      theta_max: float = THETA_MAX) -> Array:
  """θ of a variant from the projection coefficients.

  "theorem": Theorem 3.1 / Eq. 2, ``θ = b/a`` only where ``b < 0`` (the
  half-space projection is the identity otherwise); "paper": the "practical
  implementation" of Sec. 3.3 / Algorithm 1 line 11, ``θ = b/a`` always; the
  authors' code: ``clip(|b| / (a + eps), 0, theta_max)``; θ = 1 for the
  "w/o Optimization" ablations (Sec. 5.3).
  """
  rule = _check(variant, "tensor").theta
  if rule == "abs_ratio":
    return jnp.clip(jnp.abs(b) / (a + eps), 0.0, theta_max)
  if rule == "ratio":
    return _safe_div(b, a)
  if rule == "negative_ratio":
    return jnp.where(b < 0, _safe_div(b, a), 0.0)
  return jnp.ones_like(a)


def _cross_layer(g_k: Array, g_0: Array, variant: str, granularity: str, theta: float | Array | None,
                 eps: float, theta_max: float, update_clip: float | None) -> tuple[Array, Array, Array]:
  """The update, the source's signed mixing weight per slice (+: source added) and b per slice."""
  rule = _check(variant, granularity)
  if g_k.shape != g_0.shape:
    raise ValueError(f"cross-layer target and source shapes differ: {g_k.shape} vs {g_0.shape}")
  # In float32 at least: a float16 delta's squared norms underflow (a 3x3 slice of 1e-4 deltas has a = 1e-7).
  wide = jnp.promote_types(jnp.result_type(g_k, g_0), jnp.float32)
  g_k, g_0 = (g if g.dtype == wide else g.astype(wide) for g in (g_k, g_0))
  axes = slice_axes(g_k.ndim, granularity)
  a, b = projection_coefficients(g_k, g_0, axes)
  th = cross_layer_theta(a, b, variant, eps, theta_max) if theta is None else jnp.broadcast_to(
      jnp.asarray(theta, g_k.dtype), a.shape)
  if rule.normalize:
    norm_k = jnp.sqrt(_inner(g_k, g_k, axes))
    norm_0 = jnp.sqrt(a)
    if rule.guarded:
      x_k, x_0 = g_k / (norm_k + eps), g_0 / (norm_0 + eps)
    else:
      x_k, x_0 = _safe_div(g_k, norm_k), _safe_div(g_0, norm_0)
    update = (x_k + rule.sign * th * x_0) * ((norm_k + norm_0) / 2)
  else:
    update = g_k + rule.sign * th * g_0
  if rule.clip and update_clip is not None:
    update = jnp.clip(update, -update_clip, update_clip)
  return update, rule.sign * th, b


def cross_layer_update(g_k: Array, g_0: Array, variant: str = "code", granularity: str = "kernel", *,
                       theta: float | Array | None = None, eps: float = EPS, theta_max: float = THETA_MAX,
                       update_clip: float | None = UPDATE_CLIP) -> Array:
  """The cross-layer update of target delta ``g_k`` from source delta ``g_0`` (Algorithm 1, line 11).

  The default, variant "code" at granularity "kernel", is the authors' code:
  ``clip((ĝ_k + θ ĝ_0) (||g_k|| + ||g_0||) / 2, ±update_clip)`` with
  ``θ = clip(|b| / (a + eps), 0, theta_max)`` per 3x3 kernel slice; it is the
  variant behind the published numbers. See the module docstring for the
  others (Theorem 3.1 / Eq. 2, the paper's "practical" rule, the Sec. 5.3
  ablations). ``theta`` forces θ; ``update_clip=None`` disables the clip of
  "code" (the other variants never clip).
  """
  update = _cross_layer(g_k, g_0, variant, granularity, theta, eps, theta_max, update_clip)[0]
  return update.astype(jnp.result_type(g_k))


def check_pairs(pairs: Sequence[Pair], tree: Any) -> None:
  """Raises ValueError unless every pair names two floating-point leaves of ``tree`` with equal shapes.

  ``tree`` may hold arrays or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).
  """
  flat = flatten(tree)
  for pair in pairs:
    if isinstance(pair, str) or len(pair) != 2 or any(isinstance(p, str) or not all(isinstance(k, str) for k in p)
                                                      for p in pair):
      raise ValueError(f"a cross-layer pair must be (target_path, source_path), each a tuple of keys such as "
                       f"('params', 'conv1', 'kernel'); got {pair!r}")
    target, source = pair
    for path in (target, source):
      if tuple(path) not in flat:
        raise ValueError(f"cross-layer pair names {'/'.join(path)}, which is not a leaf of the model")
    checks.check_floating("cross-layer pair", traverse_util.unflatten_dict({tuple(p): flat[tuple(p)] for p in pair}))
    if flat[tuple(target)].shape != flat[tuple(source)].shape:
      raise ValueError(f"cross-layer pair {'/'.join(target)} <- {'/'.join(source)} has unequal shapes "
                       f"{flat[tuple(target)].shape} and {flat[tuple(source)].shape}")


def _mean_over(x: Array, live: Array) -> Array:
  """Mean of a per-slice statistic over the covered slices; NaN if there are none."""
  x = jnp.broadcast_to(x, live.shape).astype(jnp.float32)
  count = jnp.sum(live)
  return jnp.where(count > 0, jnp.sum(jnp.where(live, x, 0.0)) / jnp.maximum(count, 1), jnp.nan)


def inco(delta: Any, pairs: Sequence[Pair], variant: str = "code", granularity: str = "kernel", *,
         coverage: Any | None = None, theta: float | Array | None = None, eps: float = EPS,
         theta_max: float = THETA_MAX,
         update_clip: float | None = UPDATE_CLIP) -> tuple[Any, dict[str, dict[str, Array]]]:
  """InCo Aggregation's cross-layer step on a heterogeneously averaged delta (Algorithm 1, lines 6-11).

  Args:
    delta: the global-shaped mean delta, a nested dict of flax variables
      (e.g. ``{"params": ..., "batch_stats": ...}``); the pairs' paths index it.
    pairs: ``(target_path, source_path)`` flat paths; each target's delta is
      replaced by `cross_layer_update` of it and its source's (original) delta.
      Every other leaf, sources included, is returned untouched.
    variant, granularity, theta, eps, theta_max, update_clip: see
      `cross_layer_update`. Defaults reproduce the authors' code.
    coverage: a tree like ``delta`` that is > 0 where the element was averaged
      over at least one client (the aggregation denominator); ``None``: all
      covered. Uncovered target elements keep their delta.

  Returns:
    ``(new_delta, stats)``; ``stats["/".join(target)]`` holds ``theta``, the
    mean over covered slices of the source's mixing weight in the additive
    convention (update ∝ ĝ_k + θ ĝ_0, so "theorem"/"paper" report ``-b/a``),
    ``frac_b_positive``, the fraction of covered slices with ``b > 0``, and
    ``covered``, the fraction of slices covered (NaN means: none covered).
  """
  _check(variant, granularity)
  flat = flatten(delta)
  check_pairs(pairs, delta)
  checks.check_finite("delta", {"/".join(p): flat[tuple(p)] for pair in pairs for p in pair})
  if coverage is not None:
    checks.check_like("coverage", coverage, "delta", delta)
  cover = None if coverage is None else flatten(coverage)
  out = dict(flat)
  stats: dict[str, dict[str, Array]] = {}
  for target, source in pairs:
    target, source = tuple(target), tuple(source)
    g_k, g_0 = flat[target], flat[source]
    mask = jnp.ones(g_k.shape, bool) if cover is None else cover[target] > 0
    update, mix, b = _cross_layer(jnp.where(mask, g_k, 0), jnp.where(mask, g_0, 0), variant, granularity, theta,
                                  eps, theta_max, update_clip)
    out[target] = jnp.where(mask, update, g_k).astype(g_k.dtype)
    live = jnp.any(mask, axis=slice_axes(g_k.ndim, granularity), keepdims=True)  # covered slices
    stats["/".join(target)] = {"theta": _mean_over(mix, live), "frac_b_positive": _mean_over(b > 0, live),
                               "covered": jnp.mean(live.astype(jnp.float32))}
  return traverse_util.unflatten_dict(out), stats
