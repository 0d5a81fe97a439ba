"""Layer-wise heterogeneous averaging and per-federation FedAvg.

Every rule is a pure, jittable function of pytrees. Clients are summarised per
architecture group as a weighted sum of their updates, ``S_g = sum_{c in g}
w_c * u_c`` (group-shaped), and the total weight ``W_g = sum_{c in g} w_c``;
summing inside a group first is exact because all clients of a group own the
same elements.

Dtypes: a result leaf keeps the dtype of the model leaf it replaces (float16 stays
float16); integer and bool leaves, which have no mean of their own dtype, are refused
(`checks.check_floating`).

A group of weight 0 contributes nothing: known (not traced), its sums are not read, so NaN
there cannot poison the mean (``0 * NaN`` is NaN); traced, `hetero_avg`, `hetero_avg_weights`
and `heterogeneous_mean_delta` select its sums out. `heterogeneous_sums`, the engine's, needs
a traced weight-0 group's sums to be zeros (a weighted sum over no client, as the engine's
are): a select there would put an op between the engine's arithmetic on the sums and the mean,
which changes how XLA:CPU fuses and contracts it, and so the last bits of FlexiFed's and
FedFA's numbers.

Sums are accumulated in float32 at least (float16 sums of two groups can overflow where
their mean does not; a group's sums are placed in the global layout in that dtype too) and
the result cast back.

A concrete non-finite value in the sums of a group whose weight is not 0 is refused
(`checks.check_finite_where_weighted`): it would spread into its whole layer's mean.

The public functions check their inputs (`checks`) and raise ValueError on misuse;
the private ones behind them compute.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from fedjax_hetero.aggregators import checks
from fedjax_hetero.aggregators.checks import is_weightless
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, coverage, embed


def masked_mean(weighted_sums: Variables, weight_sums: Variables, fallback: Variables) -> Variables:
  """``sum / weight`` where weight > 0, else ``fallback`` (nobody covered it), in the fallback's dtype."""
  checks.check_like("weight_sums", weight_sums, "weighted_sums", weighted_sums)
  checks.check_like("fallback", fallback, "weighted_sums", weighted_sums)
  checks.check_floating("weighted_sums", weighted_sums)
  checks.check_floating("fallback", fallback)
  checks.check_weight_tree("weight_sums", weight_sums)
  return _masked_mean(weighted_sums, weight_sums, fallback)


def _masked_mean(weighted_sums, weight_sums, fallback):
  def leaf(total, weight, old):
    covered = weight > 0
    return jnp.where(covered, total / jnp.where(covered, weight, 1.0), old).astype(jnp.result_type(old))

  return jax.tree.map(leaf, weighted_sums, weight_sums, fallback)


def heterogeneous_sums(group_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
                       group_maps: Sequence[SubmodelMap], global_like: Variables,
                       offset=0) -> tuple[Variables, Variables]:
  """Global-shaped numerator and denominator of the layer-wise mean.

  numerator = sum_g embed(S_g), denominator = sum_g W_g * coverage_g, both in at least float32; ``offset``
  places the rolled windows of rolling maps (FedRolex).
  """
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset, "group_sums", group_sums)
  checks.check_floating("global_like", global_like)
  checks.check_finite_where_weighted("group_sums", group_sums, group_weights)
  return _heterogeneous_sums(group_sums, group_weights, group_maps, global_like, offset)


def _heterogeneous_sums(group_sums, group_weights, group_maps, global_like, offset):
  zeros = jax.tree.map(_accumulator, global_like)  # (a group's sums are placed in this dtype: not cast down first)
  numerator = zeros
  for sums, weight, group_map in zip(group_sums, group_weights, group_maps):
    if is_weightless(weight):
      continue
    numerator = jax.tree.map(jnp.add, numerator, embed(sums, group_map, zeros, offset))
  return numerator, _weighted_coverage(group_weights, group_maps, global_like, offset)


def _accumulator(leaf):
  return jnp.zeros(leaf.shape, jnp.promote_types(leaf.dtype, jnp.float32))


def _selected(group_sums, group_weights):
  """Each group's sums, zeros where its traced weight is 0 (as a known weight of 0 leaves them unread)."""
  return [sums if checks.is_concrete(weight) else
          jax.tree.map(lambda x, w=weight: jnp.where(w > 0, x, jnp.zeros_like(x)), sums)
          for sums, weight in zip(group_sums, group_weights)]


def weighted_coverage(group_weights: Sequence[jax.Array], group_maps: Sequence[SubmodelMap],
                      global_like: Variables, offset=0) -> Variables:
  """``sum_g W_g * coverage_g``: per element, the total weight of the groups that hold it."""
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset)
  return _weighted_coverage(group_weights, group_maps, global_like, offset)


def _weighted_coverage(group_weights, group_maps, global_like, offset):
  total = jax.tree.map(_accumulator, global_like)
  for weight, group_map in zip(group_weights, group_maps):
    total = jax.tree.map(lambda t, m, w=weight: t + w * m, total, coverage(group_map, global_like, offset=offset))
  return total


def heterogeneous_mean_delta(group_delta_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
                             group_maps: Sequence[SubmodelMap], global_like: Variables, offset=0) -> Variables:
  """Layer-wise mean of client deltas over the clients that own each element.

  InCo paper Sec. 3.1 (the equation for ``w_{l_i}``): each element is averaged
  over exactly the sampled clients whose architecture contains it; elements
  nobody owns this round get a zero update.
  """
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset, "group_delta_sums",
                      group_delta_sums)
  checks.check_floating("global_like", global_like)
  checks.check_finite_where_weighted("group_delta_sums", group_delta_sums, group_weights)
  return _heterogeneous_mean_delta(_selected(group_delta_sums, group_weights), group_weights, group_maps, global_like,
                                   offset)


def _heterogeneous_mean_delta(group_delta_sums, group_weights, group_maps, global_like, offset):
  numerator, denominator = _heterogeneous_sums(group_delta_sums, group_weights, group_maps, global_like, offset)
  zeros = jax.tree.map(jnp.zeros_like, global_like)
  return _masked_mean(numerator, denominator, zeros)


def hetero_avg(global_vars: Variables, group_delta_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
               group_maps: Sequence[SubmodelMap], offset=0) -> Variables:
  """HeteroAvg on deltas: ``w <- w + mean_{c owns l} Δ_c`` per element (InCo Sec. 3.1)."""
  checks.check_groups("global_vars", global_vars, group_maps, group_weights, offset, "group_delta_sums",
                      group_delta_sums)
  checks.check_floating("global_vars", global_vars)
  checks.check_finite_where_weighted("group_delta_sums", group_delta_sums, group_weights)
  delta = _heterogeneous_mean_delta(_selected(group_delta_sums, group_weights), group_weights, group_maps,
                                    global_vars, offset)
  return jax.tree.map(jnp.add, global_vars, delta)


def hetero_avg_weights(global_vars: Variables, group_weight_sums: Sequence[Variables],
                       group_weights: Sequence[jax.Array], group_maps: Sequence[SubmodelMap], offset=0) -> Variables:
  """HeteroAvg on uploaded weights: ``w_l = mean_{c owns l} w_{c,l}``, untouched if uncovered.

  Equal to `hetero_avg` when every client started from the current global
  weights; kept because some methods upload weights rather than deltas.
  """
  checks.check_groups("global_vars", global_vars, group_maps, group_weights, offset, "group_weight_sums",
                      group_weight_sums)
  checks.check_floating("global_vars", global_vars)
  checks.check_finite_where_weighted("group_weight_sums", group_weight_sums, group_weights)
  numerator, denominator = _heterogeneous_sums(_selected(group_weight_sums, group_weights), group_weights, group_maps,
                                               global_vars, offset)
  return _masked_mean(numerator, denominator, global_vars)


def fedavg(variables: Variables, delta_sum: Variables, weight: jax.Array) -> Variables:
  """FedAvg (McMahan et al. 2017, Alg. 1): ``w <- w + sum_c w_c Δ_c / sum_c w_c``.

  Unchanged when no client took part (``weight == 0``, traced or not), whatever ``delta_sum`` holds.
  """
  checks.check_like("delta_sum", delta_sum, "variables", variables)
  checks.check_floating("variables", variables)
  checks.check_weight("weight", weight)
  if not is_weightless(weight):
    checks.check_finite("delta_sum", delta_sum)
  took_part = weight > 0
  scale = 1.0 / jnp.where(took_part, weight, 1.0)
  return jax.tree.map(lambda w, d: jnp.where(took_part, w + scale * d, w).astype(jnp.result_type(w)), variables,
                      delta_sum)
