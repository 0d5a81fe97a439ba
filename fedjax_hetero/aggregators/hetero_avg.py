"""Layer-wise heterogeneous averaging and per-federation FedAvg.

Every rule is a pure, jittable function of pytrees. Clients are summarised per
architecture group as a weighted sum of their updates, ``S_g = sum_{c in g}
w_c * u_c`` (group-shaped), and the total weight ``W_g = sum_{c in g} w_c``;
summing inside a group first is exact because all clients of a group own the
same elements.

The public functions check their inputs (`checks`) and raise ValueError on misuse;
the private ones behind them compute.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from fedjax_hetero.aggregators import checks
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, coverage, embed



def masked_mean(weighted_sums: Variables, weight_sums: Variables, fallback: Variables) -> Variables:
  """``sum / weight`` where weight > 0, else ``fallback`` (nobody covered it)."""
  checks.check_like("weight_sums", weight_sums, "weighted_sums", weighted_sums)
  checks.check_like("fallback", fallback, "weighted_sums", weighted_sums)
  checks.check_weight_tree("weight_sums", weight_sums)
  return _masked_mean(weighted_sums, weight_sums, fallback)


def _masked_mean(weighted_sums, weight_sums, fallback):
  def leaf(total, weight, old):
    covered = weight > 0
    return jnp.where(covered, total / jnp.where(covered, weight, 1.0), old)

  return jax.tree.map(leaf, weighted_sums, weight_sums, fallback)


def heterogeneous_sums(group_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
                       group_maps: Sequence[SubmodelMap], global_like: Variables,
                       offset=0) -> tuple[Variables, Variables]:
  """Global-shaped numerator and denominator of the layer-wise mean.

  numerator = sum_g embed(S_g), denominator = sum_g W_g * coverage_g; ``offset`` places the rolled
  windows of rolling maps (FedRolex).
  """
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset, "group_sums", group_sums)
  return _heterogeneous_sums(group_sums, group_weights, group_maps, global_like, offset)


def _heterogeneous_sums(group_sums, group_weights, group_maps, global_like, offset):
  numerator = jax.tree.map(jnp.zeros_like, global_like)
  for sums, group_map in zip(group_sums, group_maps):
    numerator = jax.tree.map(jnp.add, numerator, embed(sums, group_map, global_like, offset))
  return numerator, _weighted_coverage(group_weights, group_maps, global_like, offset)


def weighted_coverage(group_weights: Sequence[jax.Array], group_maps: Sequence[SubmodelMap],
                      global_like: Variables, offset=0) -> Variables:
  """``sum_g W_g * coverage_g``: per element, the total weight of the groups that hold it."""
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset)
  return _weighted_coverage(group_weights, group_maps, global_like, offset)


def _weighted_coverage(group_weights, group_maps, global_like, offset):
  total = jax.tree.map(jnp.zeros_like, global_like)
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
  return _heterogeneous_mean_delta(group_delta_sums, group_weights, group_maps, global_like, offset)


def _heterogeneous_mean_delta(group_delta_sums, group_weights, group_maps, global_like, offset):
  numerator, denominator = _heterogeneous_sums(group_delta_sums, group_weights, group_maps, global_like, offset)
  zeros = jax.tree.map(jnp.zeros_like, global_like)
  return _masked_mean(numerator, denominator, zeros)


def hetero_avg(global_vars: Variables, group_delta_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
               group_maps: Sequence[SubmodelMap], offset=0) -> Variables:
  """HeteroAvg on deltas: ``w <- w + mean_{c owns l} Δ_c`` per element (InCo Sec. 3.1)."""
  checks.check_groups("global_vars", global_vars, group_maps, group_weights, offset, "group_delta_sums",
                      group_delta_sums)
  delta = _heterogeneous_mean_delta(group_delta_sums, group_weights, group_maps, global_vars, offset)
  return jax.tree.map(jnp.add, global_vars, delta)


def hetero_avg_weights(global_vars: Variables, group_weight_sums: Sequence[Variables],
                       group_weights: Sequence[jax.Array], group_maps: Sequence[SubmodelMap], offset=0) -> Variables:
  """HeteroAvg on uploaded weights: ``w_l = mean_{c owns l} w_{c,l}``, untouched if uncovered.

  Equal to `hetero_avg` when every client started from the current global
  weights; kept because some methods upload weights rather than deltas.
  """
  checks.check_groups("global_vars", global_vars, group_maps, group_weights, offset, "group_weight_sums",
                      group_weight_sums)
  numerator, denominator = _heterogeneous_sums(group_weight_sums, group_weights, group_maps, global_vars, offset)
  return _masked_mean(numerator, denominator, global_vars)


def fedavg(variables: Variables, delta_sum: Variables, weight: jax.Array) -> Variables:
  """FedAvg (McMahan et al. 2017, Alg. 1): ``w <- w + sum_c w_c Δ_c / sum_c w_c``.

  Unchanged when no client took part (``weight == 0``).
  """
  checks.check_like("delta_sum", delta_sum, "variables", variables)
  checks.check_weight("weight", weight)
  scale = jnp.where(weight > 0, 1.0 / jnp.where(weight > 0, weight, 1.0), 0.0)
  return jax.tree.map(lambda w, d: w + scale * d, variables, delta_sum)
