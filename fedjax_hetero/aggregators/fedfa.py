"""FedFA's scalable aggregation: per-kernel norm equalisation before the mean over holders.

Park and Joe-Wong, "Federated Learning with Flexible Architectures" (ECML-PKDD
2024), Algorithm 1 lines 12-22 and the scaled weights of Sec. 4.3. Clients
upload their weights ``M_c`` (after layer grafting, Alg. 2, which lives in the
group's `SubmodelMap`: `hetero.maps.graft`). For every kernel ``l``:

    ||M_95,c||   = L2 norm of the elements of M_c^(l) with |w| <= their 95th percentile of |w|   (line 12)
    alpha_c^(l)  = mean_{kappa covering l} ||M_95,kappa|| / ||M_95,c||                           (line 18)
    M_G^(l)[e]   = sum_{c covering e} N_c alpha_c M_c[e] / sum_{c covering e} N_c               (lines 19-22)

Decisions where the paper is silent (spec fedfa.md §7):

- Kernels: the leaves of the ``params`` collection with two or more axes
  (conv and dense kernels, and embedding tables where a model has them),
  decided by leaf rank and collection, never by name. Biases, BatchNorm scales
  and offsets (one axis) and every other collection (BatchNorm statistics) are
  averaged with alpha = 1.
- ``center="median"`` (an ablation; the paper's is the mean) scales every
  kernel to the cohort's median trimmed norm, which a minority of outsized
  uploads (an attacker's boosted update) cannot move, where they pull the mean up.
- The percentile is taken of |w| over the whole leaf (one-sided on magnitudes,
  numpy's linear interpolation); ``norm="rms"`` divides the L2 norm by the
  square root of the number of kept elements, so that kernels of different
  widths compare per element (the literal L2 favours thin clients, §7.3).
- The mean in the numerator of alpha runs over the cohort's clients whose
  sub-model covers (some of) global leaf ``l``, each client once; with depth
  grafting a shallow client covers the deeper blocks through its grafted copy.
- A kernel whose trimmed norm is 0 (e.g. a client that uploaded zeros) gets
  alpha = 1 and is left out of the other clients' mean: no NaN, and a broken
  upload does not shrink everyone else's kernel. ``stats["fallbacks"]`` counts
  them.
- Elements no client covers keep their old value (Alg. 1 would divide by 0).
- As in `hetero_avg`: the new model keeps each leaf's dtype, integer leaves are refused,
  and a group (client) of weight 0 adds nothing to the sums, even NaN: `scalable_sums` where
  the weight is not traced, `scalable_aggregate` always (its sums are its own). Its clients'
  trimmed norms still count in the cohort mean ``mu_l`` (the paper's cohort; NaN never does).

Exact with per-group sums: alpha_c = mu_l / n_c with ``mu_l`` the cohort mean,
so ``sum_c N_c alpha_c M_c = mu_l * sum_c N_c M_c / n_c`` (+ the alpha = 1 part
of zero-norm kernels). Each client uploads ``M_c / n_c`` (`client_parts`, a
function of its own weights only), the engine sums those inside the group like
any weighted upload, and the server multiplies by ``mu_l`` (`scalable_sums`).
`scalable_aggregate` is the per-client form of the paper (each client its own
group), for use without the engine.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import traverse_util

from fedjax_hetero.aggregators import checks
from fedjax_hetero.aggregators.checks import is_weightless
from fedjax_hetero.aggregators.hetero_avg import _accumulator
from fedjax_hetero.hetero.maps import Path, SubmodelMap, Variables, coverage, embed, flatten

NORMS = ("l2", "rms")
CENTERS = ("mean", "median")
PERCENTILE = 95.0


def is_kernel(path: Path, leaf: Any) -> bool:
  """Whether FedFA scales this leaf: a ``params`` leaf with >= 2 axes (see the module docstring)."""
  return len(path) > 0 and path[0] == "params" and len(jnp.shape(leaf)) >= 2


def kernels(tree: Variables) -> Variables:
  """The subtree of ``tree`` holding its kernels (`is_kernel`)."""
  return traverse_util.unflatten_dict({p: x for p, x in flatten(tree).items() if is_kernel(p, x)})


def _check_norm(norm: str, percentile: float, center: str = "mean") -> None:
  if norm not in NORMS:
    raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
  if center not in CENTERS:
    raise ValueError(f"center must be one of {', '.join(CENTERS)}, got {center!r}")
  if isinstance(percentile, (int, float)) and not 0.0 < percentile <= 100.0:  # (a traced one: its run's was checked)
    raise ValueError(f"percentile must be in (0, 100], got {percentile}")


def trimmed_norm(x: jax.Array, percentile: float = PERCENTILE, norm: str = "l2") -> jax.Array:
  """``||M_95%||`` (Alg. 1 line 12): the L2 norm (or RMS) of the elements with |w| <= the percentile of |w|."""
  _check_norm(norm, percentile)
  checks.check_float_tree("x", x)
  if jnp.size(x) == 0:
    raise ValueError(f"x is empty (shape {tuple(jnp.shape(x))}): a trimmed norm needs at least one element")
  return _trimmed_norm(x, percentile, norm)


def _trimmed_norm(x, percentile, norm):
  magnitude = jnp.abs(jnp.ravel(x).astype(jnp.float32))
  keep = magnitude <= jnp.quantile(magnitude, percentile / 100.0)
  squares = jnp.sum(jnp.where(keep, magnitude * magnitude, 0.0))
  if norm == "rms":
    squares = squares / jnp.maximum(jnp.sum(keep), 1)
  return jnp.sqrt(squares)


class ClientParts(NamedTuple):
  """One client's share of the scaled aggregation, kernels only (trees like `kernels` of its variables)."""

  scaled: Variables  # M_c / n_c where n_c > 0, else 0
  fallback: Variables  # M_c where n_c == 0 (alpha = 1), else 0
  norms: Variables  # n_c = ||M_95,c|| per kernel (scalars)


def client_parts(variables: Variables, percentile: float = PERCENTILE, norm: str = "l2") -> ClientParts:
  """What a client uploads for the scaled aggregation: its kernels divided by their trimmed norms."""
  _check_norm(norm, percentile)
  checks.check_float_tree("variables", variables)
  return _client_parts(variables, percentile, norm)


def _client_parts(variables, percentile, norm):
  own = kernels(variables)
  norms = jax.tree.map(lambda x: _trimmed_norm(x, percentile, norm), own)
  scaled = jax.tree.map(lambda x, n: jnp.where(n > 0, x / jnp.where(n > 0, n, 1.0), 0.0).astype(x.dtype), own, norms)
  fallback = jax.tree.map(lambda x, n: jnp.where(n > 0, 0.0, x).astype(x.dtype), own, norms)
  return ClientParts(scaled, fallback, norms)


def scalable_sums(global_like: Variables, group_maps: Sequence[SubmodelMap], weight_sums: Sequence[Variables],
                  group_weights: Sequence[jax.Array], scaled_sums: Sequence[Variables],
                  fallback_sums: Sequence[Variables], norms: Sequence[Variables], valid: Sequence[jax.Array],
                  offset=0, center: str = "mean") -> tuple[Variables, Variables, dict[str, jax.Array]]:
  """Global-shaped numerator and denominator of the scaled mean (Alg. 1 lines 15-21), from group sums.

  Per group g (clients c, weights w_c): ``weight_sums[g] = sum_c w_c M_c`` (every leaf),
  ``scaled_sums[g]``/``fallback_sums[g] = sum_c w_c`` `ClientParts` (kernels), ``norms[g]``: the clients'
  ``n_c`` stacked on a leading axis whose real rows ``valid[g]`` marks. Numerator per kernel ``l``:
  ``mu_l * sum_g embed(scaled) + sum_g embed(fallback)`` (``mu_l`` the cohort's mean, or median, ``n_c``),
  elsewhere ``sum_g embed(weight_sums)``;
  denominator ``sum_g W_g coverage_g``. Returns also ``stats``: min and max alpha over (client, kernel)
  pairs and the number of zero-norm fallbacks.
  """
  _check_norm("l2", PERCENTILE, center)
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset, "weight_sums", weight_sums)
  checks.check_floating("global_like", global_like)
  checks.check_lengths({"weight_sums": weight_sums, "scaled_sums": scaled_sums, "fallback_sums": fallback_sums,
                        "norms": norms, "valid": valid})
  global_kernels = kernels(global_like)
  for name, trees in (("scaled_sums", scaled_sums), ("fallback_sums", fallback_sums)):
    checks.check_group_trees(name, trees, "group_maps", group_maps, "kernels(global_like)", global_kernels)
  for name, trees in (("weight_sums", weight_sums), ("scaled_sums", scaled_sums), ("fallback_sums", fallback_sums)):
    checks.check_finite_where_weighted(name, trees, group_weights)
  for i, (rows, ok, group_map) in enumerate(zip(norms, valid, group_maps)):
    checks.check_shape(f"valid[{i}]", ok, (None,))
    expected = {k: (len(ok),) for k in checks.group_shapes(group_map, global_kernels)}
    checks.check_tree(f"norms[{i}]", rows, expected, f"group_maps[{i}] (one norm per client row and kernel)")
  return _scalable_sums(global_like, group_maps, weight_sums, group_weights, scaled_sums, fallback_sums, norms,
                        valid, offset, center)


def _cohort_center(group_maps, norms, valid, kernel_paths, center):
  """mu_l: the mean (or median) trimmed norm over the clients pushing a nonzero-norm kernel into global leaf l;
  0 where there is none."""
  rows_of = {p: [] for p in kernel_paths}
  for group_map, rows, ok in zip(group_maps, norms, valid):
    flat_rows = flatten(rows)
    for link in group_map.push:
      if link.global_ in rows_of:
        n = flat_rows[link.client]
        rows_of[link.global_].append((n, ok & (n > 0)))
  if center == "median":
    return {p: jnp.nan_to_num(jnp.nanmedian(jnp.concatenate([jnp.where(u, n, jnp.nan) for n, u in rows])))
            if rows else jnp.float32(0) for p, rows in rows_of.items()}
  return {p: sum((jnp.sum(jnp.where(u, n, 0.0)) for n, u in rows), jnp.float32(0))
          / jnp.maximum(sum((jnp.sum(u) for _, u in rows), jnp.float32(0)), 1.0) for p, rows in rows_of.items()}


def _scalable_sums(global_like, group_maps, weight_sums, group_weights, scaled_sums, fallback_sums, norms, valid,
                   offset, center="mean"):
  flat_global = flatten(global_like)
  kernel_paths = [p for p, x in flat_global.items() if is_kernel(p, x)]
  mu = _cohort_center(group_maps, norms, valid, kernel_paths, center)

  zeros = jax.tree.map(_accumulator, global_like)  # (float32 at least: float16 sums overflow)
  plain, scaled, fallback = zeros, zeros, zeros
  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  for group_map, weight, sums, s, f in zip(group_maps, group_weights, weight_sums, scaled_sums, fallback_sums):
    if is_weightless(weight):
      continue
    plain = add(plain, embed(sums, group_map, zeros, offset))  # (placed in the accumulator's dtype)
    scaled = add(scaled, embed(s, group_map, zeros, offset))
    fallback = add(fallback, embed(f, group_map, zeros, offset))
  flat_plain, flat_scaled, flat_fallback = flatten(plain), flatten(scaled), flatten(fallback)
  numerator = {p: mu[p] * flat_scaled[p] + flat_fallback[p] if p in mu else flat_plain[p] for p in flat_global}
  denominator = zeros
  for weight, group_map in zip(group_weights, group_maps):
    denominator = jax.tree.map(lambda t, m, w=weight: t + w * m, denominator,
                               coverage(group_map, global_like, offset=offset))

  alphas, used, fallbacks = [], [], jnp.float32(0)
  for group_map, rows, ok in zip(group_maps, norms, valid):
    flat_rows = flatten(rows)
    for link in group_map.push:
      if link.global_ in mu:
        n = flat_rows[link.client]
        alphas.append(mu[link.global_] / jnp.where(n > 0, n, 1.0))
        used.append(ok & (n > 0))
    fallbacks += sum((jnp.sum(ok & (n <= 0)) for n in flat_rows.values()), jnp.float32(0))
  alpha, used = (jnp.concatenate(alphas), jnp.concatenate(used)) if alphas else (jnp.ones(1), jnp.zeros(1, bool))
  stats = {"alpha_min": jnp.min(jnp.where(used, alpha, jnp.inf)),
           "alpha_max": jnp.max(jnp.where(used, alpha, -jnp.inf)), "fallbacks": fallbacks}
  return traverse_util.unflatten_dict(numerator), denominator, stats


def scalable_aggregate(global_model: Variables, client_models: Sequence[Variables], client_weights: Sequence[Any],
                       client_maps: Sequence[SubmodelMap], percentile: float = PERCENTILE, norm: str = "l2",
                       offset=0, center: str = "mean") -> tuple[Variables, dict[str, jax.Array]]:
  """FedFA's aggregation of the clients' (grafted) weights, one client at a time (Alg. 1 lines 12-22).

  ``client_maps[c]`` places client ``c``'s variables in the global model (with `hetero.maps.graft` for
  depth grafting, Alg. 2). Returns the new global model (old values where nobody covers an element) and
  the stats of `scalable_sums`; ``center`` as there.
  """
  _check_norm(norm, percentile, center)
  checks.check_groups("global_model", global_model, client_maps, client_weights, offset, "client_models",
                      client_models)
  checks.check_floating("global_model", global_model)
  checks.check_floating("client_models", client_models)
  checks.check_finite_where_weighted("client_models", client_models, client_weights)
  return _scalable_aggregate(global_model, list(client_models), [jnp.asarray(w, jnp.float32) for w in client_weights],
                             tuple(client_maps), float(percentile), norm, offset, center)


@functools.partial(jax.jit, static_argnames=("client_maps", "percentile", "norm", "center"))
def _scalable_aggregate(global_model, client_models, client_weights, client_maps, percentile, norm, offset, center):
  parts = [_client_parts(m, percentile, norm) for m in client_models]
  scale = lambda tree, w: jax.tree.map(lambda x: jnp.where(w > 0, w * x, jnp.zeros_like(x)), tree)  # (0 * NaN is NaN)
  numerator, denominator, stats = _scalable_sums(
      global_model, client_maps, [scale(m, w) for m, w in zip(client_models, client_weights)], client_weights,
      [scale(p.scaled, w) for p, w in zip(parts, client_weights)],
      [scale(p.fallback, w) for p, w in zip(parts, client_weights)],
      [jax.tree.map(lambda n: n[None], p.norms) for p in parts], [jnp.ones((1,), bool)] * len(parts), offset,
      center)
  covered = jax.tree.map(lambda d: d > 0, denominator)
  new = jax.tree.map(lambda c, n, d, old: jnp.where(c, n / jnp.where(c, d, 1.0), old).astype(old.dtype), covered,
                     numerator, denominator, global_model)
  return new, stats
