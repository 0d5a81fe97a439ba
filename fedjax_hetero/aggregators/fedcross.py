"""FedCross multi-model cross-aggregation (Hu et al., "FedCross: Towards Accurate
Federated Learning via Multi-Model Cross-Aggregation", ICDE 2024).

The server keeps K homogeneous *middleware models*, held here as ONE stacked
pytree: every leaf has a leading axis of size K, slot i being middleware model
i. One round (Algorithm 1): slot i is trained by the i-th (randomly ordered)
sampled client and uploaded as ``v_i``; each slot picks a collaborative model
among the *other* uploads (CoModelSel, Sec. III-B) and is replaced by
``w_i = alpha * v_i + (1 - alpha) * v_co(i)`` (CrossAggr), all K outputs
computed from the uploads. The global model ``w_g = mean_i w_i`` is used only
for evaluation and never sent to clients.

Every function is pure and jittable; sizes (K, number of propellers) and the
string options are static. Provenance in the docstrings: "paper" is the text
of the paper, "authors' code" the authors' compiled ``Training_FedCross`` (see
the project's FedCross spec, which also describes the PyTorch ``state_dict``
layout the code walks).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.aggregators import checks

Stacked = Any  # a pytree whose leaves all have a leading axis of size K
Scalar = Any  # a Python or JAX scalar

SIMILARITY_KINDS = ("cosine", "paper", "layerwise")
STRATEGIES = ("in_order", "lowest_similarity", "highest_similarity")


def _num_models(stacked: Stacked) -> int:
  leaves = jax.tree.leaves(stacked)
  if not leaves:
    raise ValueError("the stacked middleware models have no leaves")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    shapes = ", ".join(f"{path} {shape}" for path, shape in checks.leaf_shapes(stacked).items())
    raise ValueError(f"every leaf needs the same leading (model) axis; got leading sizes {sizes} ({shapes})")
  num_models = sizes.pop()
  _check_num_models(num_models)
  return num_models


def _check_num_models(num_models: int) -> None:
  if num_models < 2:  # in-order divides by K - 1, and nobody else exists to collaborate with
    raise ValueError(f"FedCross needs at least 2 middleware models, got {num_models}")


# ---------------------------------------------------------------------------
# Similarity
# ---------------------------------------------------------------------------


def _moments(leaf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Centred second moments of K flattened models: (C C^T, C m, m.m), C = X - m.

  Models that share an origin are nearly parallel, so the quantities that rank
  them (1 - cos, distances) are tiny next to |x|^2. Computing them from the
  centred models keeps float32 accurate where a raw Gram matrix would lose them
  to rounding.
  """
  num_models = leaf.shape[0]
  dtype = jnp.promote_types(leaf.dtype, jnp.float32)
  x = leaf.reshape(num_models, -1).astype(dtype)
  mean = jnp.mean(x, axis=0)
  centred = x - mean
  hi = jax.lax.Precision.HIGHEST  # no TF32/bf16 passes on accelerators
  return (jnp.matmul(centred, centred.T, precision=hi), jnp.matmul(centred, mean, precision=hi),
          jnp.dot(mean, mean, precision=hi))


def _sum_moments(stacked: Stacked) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`_moments` of all leaves flattened and concatenated (moments add over leaves)."""
  per_leaf = [_moments(leaf) for leaf in jax.tree.leaves(stacked)]
  return tuple(sum(parts[1:], parts[0]) for parts in zip(*per_leaf))


def _layer_moments(stacked: Stacked) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """`_moments` of each layer: the leaves under one parent node, in first-seen order."""
  layers: dict[tuple, list] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(stacked)[0]:
    layers.setdefault(tuple(path[:-1]), []).append(_moments(leaf))
  return [tuple(sum(parts[1:], parts[0]) for parts in zip(*leaves)) for leaves in layers.values()]


def _sq_norms_and_distances(gram, proj, sq_mean):
  """``|x_i|^2`` [K] and ``|x_i - x_j|^2`` [K, K] from the centred moments."""
  diag = jnp.diagonal(gram)
  sq_norms = jnp.maximum(sq_mean + 2.0 * proj + diag, 0.0)
  sq_dists = jnp.maximum(diag[:, None] + diag[None, :] - 2.0 * gram, 0.0)
  return sq_norms, sq_dists


def _cosine_from_moments(gram, proj, sq_mean) -> jax.Array:
  """Pairwise cosine; 0 where either model is all zeros (as ``torch.cosine_similarity``).

  Uses ``1 - cos = (|a - b|^2 - (|a| - |b|)^2) / (2 |a| |b|)`` with
  ``|a| - |b| = (|a|^2 - |b|^2) / (|a| + |b|)``; every term is a difference
  of models, never a difference of two near-equal large numbers.
  """
  diag = jnp.diagonal(gram)
  sq_norms, sq_dists = _sq_norms_and_distances(gram, proj, sq_mean)
  norms = jnp.sqrt(sq_norms)
  norm_sum = norms[:, None] + norms[None, :]
  sq_norm_diff = 2.0 * (proj[:, None] - proj[None, :]) + diag[:, None] - diag[None, :]
  norm_diff = sq_norm_diff / jnp.where(norm_sum > 0, norm_sum, 1.0)
  norm_prod = norms[:, None] * norms[None, :]
  safe_prod = jnp.where(norm_prod > 0, norm_prod, 1.0)
  one_minus_cos = jnp.maximum(sq_dists - norm_diff ** 2, 0.0) / (2.0 * safe_prod)
  return jnp.where(norm_prod > 0, jnp.clip(1.0 - one_minus_cos, -1.0, 1.0), 0.0)


def _paper_from_moments(gram, proj, sq_mean) -> jax.Array:
  """``x_i . x_j / (|x_i| + |x_j|)``; 0 where both models are all zeros."""
  sq_norms, _ = _sq_norms_and_distances(gram, proj, sq_mean)
  norms = jnp.sqrt(sq_norms)
  dots = sq_mean + proj[:, None] + proj[None, :] + gram
  norm_sum = norms[:, None] + norms[None, :]
  return jnp.where(norm_sum > 0, dots / jnp.where(norm_sum > 0, norm_sum, 1.0), 0.0)


def similarity_matrix(stacked: Stacked, kind: str = "cosine") -> jax.Array:
  """[K, K] pairwise similarity of the K stacked models (symmetric, full diagonal).

  kind (static):
    * ``"cosine"``: true cosine of all parameters flattened into one vector;
      what the paper means (Sec. III-B calls its formula "the classic cosine
      similarity") and the global cosine the authors' code computes but leaves
      unused.
    * ``"paper"``: the formula as printed in Sec. III-B,
      ``sum_i X_i Y_i / (sqrt(sum X_i^2) + sqrt(sum Y_i^2))`` -- a sum, not a
      product, of norms in the denominator (almost surely a typo, but it ranks
      partners differently, so it is offered for ablation).
    * ``"layerwise"``: the authors' code, ``sum_layers cos(layer_i, layer_j)``.
      A layer is a module: the leaves that share a parent node of the pytree
      (a flax ``{"kernel", "bias"}`` dict), flattened together. The code
      cosines consecutive ``state_dict`` entry pairs instead -- weight + bias
      for plain layers, but BN's five entries straddle pairs -- and counts the
      last pair twice; grouping by module is the structure-only analogue
      without name or order matching. Pass only the leaves you want compared
      (e.g. params without ``batch_stats``).

  The diagonal holds each model's self-similarity (1, |x|/2, number of
  non-zero layers respectively); the authors' table keeps it at 0. Selection
  masks it out, so that never matters there.
  """
  if kind not in SIMILARITY_KINDS:
    raise ValueError(f"unknown similarity kind {kind!r}; choose from {SIMILARITY_KINDS}")
  _num_models(stacked)
  checks.check_float_tree("stacked", stacked)  # (a NaN model would make every similarity 0: ties, no error)
  if kind == "layerwise":
    per_layer = [_cosine_from_moments(*moments) for moments in _layer_moments(stacked)]
    return sum(per_layer[1:], per_layer[0])
  moments = _sum_moments(stacked)
  return _cosine_from_moments(*moments) if kind == "cosine" else _paper_from_moments(*moments)


# ---------------------------------------------------------------------------
# Collaborative model selection (CoModelSel, Sec. III-B)
# ---------------------------------------------------------------------------


def in_order_partners(num_models: int, round_idx: Scalar) -> jax.Array:
  """In-order selection (Sec. III-B): ``partner(i) = (i + (r mod (K-1)) + 1) mod K``.

  0-based slots and 0-based round ``r``, as in the authors' code. The offset is
  in [1, K-1], so each round's map is a cyclic shift: a permutation without
  fixed points, and over any K-1 consecutive rounds slot i picks every other
  slot exactly once. ``num_models`` is static; ``round_idx`` may be traced.
  """
  _check_num_models(num_models)
  checks.check_round("round_idx", round_idx)
  offset = jnp.asarray(round_idx, jnp.int32) % (num_models - 1) + 1
  return (jnp.arange(num_models, dtype=jnp.int32) + offset) % num_models


def _as_similarity(sim: jax.Array) -> jax.Array:
  sim = jnp.asarray(sim)
  if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
    raise ValueError(f"similarity must be a square [K, K] matrix, got shape {sim.shape}")
  _check_num_models(sim.shape[0])
  if checks.is_concrete(sim):  # (a traced one is the engine's own, from `similarity_matrix`)
    values = np.asarray(sim, np.float64)
    bad = ~np.isfinite(values) & ~np.eye(len(values), dtype=bool)
    if bad.any():
      i, j = (int(k) for k in np.argwhere(bad)[0])
      raise ValueError(f"similarity[{i}, {j}] is {values[i, j]}; partners are chosen by comparing similarities, "
                       "which must be finite off the diagonal (a model holding nan or inf?)")
  return sim if jnp.issubdtype(sim.dtype, jnp.floating) else sim.astype(jnp.float32)


def highest_similarity_partners(sim: jax.Array) -> jax.Array:
  """Highest-similarity selection (Sec. III-B): ``argmax_{j != i} sim[i, j]``, int32 [K].

  Ties go to the lowest index, as the authors' code (start at slot 0, move
  only on a strictly larger value). That code does not exclude i itself and
  relies on its zero diagonal; the two agree unless no other model has a
  positive similarity, where we still never return i.
  """
  sim = _as_similarity(sim)
  masked = jnp.where(jnp.eye(sim.shape[0], dtype=bool), -jnp.inf, sim)
  return jnp.argmax(masked, axis=1).astype(jnp.int32)


def lowest_similarity_partners(sim: jax.Array) -> jax.Array:
  """Lowest-similarity selection (Sec. III-B; the paper's default): ``argmin_{j != i}``.

  Ties as the authors' code: the scan starts at ``(i + 1) mod K`` and then
  walks j = 0, 1, ... moving only on a strictly smaller value, so the winner
  is ``(i + 1) mod K`` if it attains the minimum, else the lowest index that
  does. Returns int32 [K].
  """
  sim = _as_similarity(sim)
  num_models = sim.shape[0]
  masked = jnp.where(jnp.eye(num_models, dtype=bool), jnp.inf, sim)
  first = jnp.argmin(masked, axis=1)
  start = (jnp.arange(num_models) + 1) % num_models
  start_value = jnp.take_along_axis(masked, start[:, None], axis=1)[:, 0]
  start_wins = start_value == jnp.min(masked, axis=1)
  return jnp.where(start_wins, start, first).astype(jnp.int32)


def select_partners(uploaded: Stacked, round_idx: Scalar, strategy: str = "lowest_similarity",
                    similarity: str = "layerwise") -> jax.Array:
  """CoModelSel for every slot (Alg. 1), int32 [K]; ``strategy``/``similarity`` static.

  Defaults follow the paper's experiments (lowest similarity) and the
  authors' code (layerwise similarity of the uploaded models).
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
  checks.check_round("round_idx", round_idx)
  if strategy == "in_order":
    return in_order_partners(_num_models(uploaded), round_idx)
  checks.check_float_tree("uploaded", uploaded)
  sim = similarity_matrix(uploaded, similarity)
  if strategy == "lowest_similarity":
    return lowest_similarity_partners(sim)
  return highest_similarity_partners(sim)


# ---------------------------------------------------------------------------
# Cross-aggregation and the global model
# ---------------------------------------------------------------------------


def cross_aggregate(uploaded: Stacked, partners: jax.Array, alpha: Scalar) -> Stacked:
  """CrossAggr (Alg. 1, Sec. III-B): ``w_i = alpha v_i + (1 - alpha) v_partner(i)``.

  All K results come from the uploaded models (simultaneous, as the authors'
  code). Applied to every leaf given, so pass ``batch_stats`` too to mix BN
  statistics as the authors' code does. ``alpha = 1`` returns ``uploaded``
  exactly; the paper uses ``alpha`` in [0.5, 1), 0.99 in its experiments.
  Concrete ``partners`` must never pair slot i with itself (ValueError).
  """
  num_models = _num_models(uploaded)
  checks.check_float_tree("uploaded", uploaded)
  checks.check_shape("partners", partners, (num_models,))
  checks.check_index_range("partners", partners, num_models)
  checks.check_no_self_index("partners", partners)
  checks.check_unit_interval("alpha", alpha)
  partners = jnp.asarray(partners, jnp.int32)

  def mix(v):
    return (alpha * v + (1.0 - alpha) * jnp.take(v, partners, axis=0)).astype(v.dtype)

  return jax.tree.map(mix, uploaded)


def global_model(stacked: Stacked) -> Stacked:
  """Global model ``w_g = (1/K) sum_i w_i`` (Sec. III-B, Eq. for global model generation).

  Unweighted: no sample-count weights. The paper averages the cross-aggregated
  middleware models; the authors' code averages the uploads before
  cross-aggregation -- call it on those for that variant (or use
  `fedcross_aggregate`). The two coincide for in-order selection (Eq. 2).
  """
  _num_models(stacked)
  checks.check_float_tree("stacked", stacked)
  return jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), stacked)


def fedcross_aggregate(uploaded: Stacked, partners: jax.Array, alpha: Scalar,
                       global_from: str = "middleware") -> tuple[Stacked, Stacked]:
  """One server step (Alg. 1 lines for CrossAggr and the global model): (middleware, global).

  ``global_from`` (static): ``"middleware"`` averages the new middleware
  models (paper), ``"uploaded"`` the uploads before mixing (authors' code).
  """
  if global_from not in ("middleware", "uploaded"):
    raise ValueError(f"global_from must be 'middleware' or 'uploaded', got {global_from!r}")
  middleware = cross_aggregate(uploaded, partners, alpha)
  return middleware, global_model(middleware if global_from == "middleware" else uploaded)


# ---------------------------------------------------------------------------
# Training acceleration (Sec. III-D); the paper gives neither shape, these are
# the spec's documented assumptions.
# ---------------------------------------------------------------------------


def propeller_partners(num_models: int, round_idx: Scalar, num_propellers: int) -> jax.Array:
  """In-order propeller models (Sec. III-D), int32 [K, P].

  Column p (0-based) is the in-order partner of round ``r + p``: offsets
  ``((r + p) mod (K-1)) + 1``, all distinct and never 0 for ``1 <= P <= K-1``,
  so each slot gets P different other models. P = 1 is in-order selection.
  """
  _check_num_models(num_models)
  if not 1 <= num_propellers <= num_models - 1:
    raise ValueError(f"num_propellers must be in [1, {num_models - 1}], got {num_propellers}")
  rounds = jnp.asarray(round_idx, jnp.int32) + jnp.arange(num_propellers, dtype=jnp.int32)
  offsets = rounds % (num_models - 1) + 1
  return (jnp.arange(num_models, dtype=jnp.int32)[:, None] + offsets[None, :]) % num_models


def propeller_aggregate(uploaded: Stacked, propellers: jax.Array, alpha: Scalar | None = None) -> Stacked:
  """Cross-aggregation with P propeller models per slot (Sec. III-D, first stage).

  ``w_i = alpha v_i + (1 - alpha) * mean_p v_propellers[i, p]``. With
  ``alpha=None`` (default) all P + 1 models weigh ``1/(P+1)``: the spec's
  recommended reading, which for P = K-1 is the authors' code's FedAvg warm-up
  (``fedcross_first_stage_bound``: every slot reset to the mean). The paper
  leaves P and the weights unspecified.
  """
  num_models = _num_models(uploaded)
  checks.check_float_tree("uploaded", uploaded)
  checks.check_shape("propellers", propellers, (num_models, None))
  checks.check_index_range("propellers", propellers, num_models)
  checks.check_no_self_index("propellers", propellers)
  if alpha is not None:
    checks.check_unit_interval("alpha", alpha)
  propellers = jnp.asarray(propellers, jnp.int32)
  num_propellers = propellers.shape[1]
  if num_propellers < 1:
    raise ValueError(f"propellers has shape {propellers.shape}; it needs at least one column (one propeller)")
  if alpha is None:
    alpha = 1.0 / (num_propellers + 1)

  def mix(v):
    total = jnp.take(v, propellers[:, 0], axis=0)
    for p in range(1, num_propellers):  # P gathers of [K, ...], never a [K, P, ...] copy
      total = total + jnp.take(v, propellers[:, p], axis=0)
    return (alpha * v + (1.0 - alpha) * (total / num_propellers)).astype(v.dtype)

  return jax.tree.map(mix, uploaded)


def dynamic_alpha(round_idx: Scalar, stage_start: int = 0, stage_length: int = 100, alpha_start: float = 0.5,
                  alpha_end: float = 0.99) -> jax.Array:
  """Dynamic alpha (Sec. III-D): linear ``alpha_start -> alpha_end`` over a stage.

  ``alpha_r = alpha_start + (alpha_end - alpha_start) * clip((r - stage_start)
  / stage_length, 0, 1)``: ``alpha_start`` up to the stage start, exactly
  ``alpha_end`` from round ``stage_start + stage_length`` on. The paper says
  only "gradually increase ... from 0.5 to a specific threshold (e.g. 0.99)";
  linear is an assumption. Its variants: DA for rounds [0, 100)
  (defaults), PM-DA with DA over [50, 100) (``stage_start=50,
  stage_length=50``). ``round_idx`` may be traced; returns float32.
  """
  if stage_length <= 0:
    raise ValueError(f"stage_length must be positive, got {stage_length}")
  checks.check_round("round_idx", round_idx)
  checks.check_unit_interval("alpha_start", alpha_start)
  checks.check_unit_interval("alpha_end", alpha_end)
  progress = (jnp.asarray(round_idx, jnp.float32) - stage_start) / stage_length
  return jnp.float32(alpha_start) + jnp.float32(alpha_end - alpha_start) * jnp.clip(progress, 0.0, 1.0)


# ---------------------------------------------------------------------------
# Tracking
# ---------------------------------------------------------------------------


def middleware_similarity_stats(stacked: Stacked) -> dict[str, jax.Array]:
  """Mean off-diagonal pairwise cosine and L2 distance of the K middleware models.

  Not in the paper (the authors' code logs an unnormalised similarity sum);
  these test its claim that the middleware models "eventually become similar"
  and show the drift behind the alpha = 0.999 collapse (Table III). Both use
  all parameters flattened.
  """
  num_models = _num_models(stacked)
  checks.check_float_tree("stacked", stacked)
  moments = _sum_moments(stacked)
  _, sq_dists = _sq_norms_and_distances(*moments)
  off_diagonal = ~jnp.eye(num_models, dtype=bool)
  num_pairs = num_models * (num_models - 1)

  def off_mean(matrix):
    return jnp.sum(jnp.where(off_diagonal, matrix, 0.0)) / num_pairs

  return {"mean_cosine": off_mean(_cosine_from_moments(*moments)),
          "mean_l2_distance": off_mean(jnp.sqrt(sq_dists))}
