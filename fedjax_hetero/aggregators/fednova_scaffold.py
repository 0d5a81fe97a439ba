"""Server steps of the base methods beyond averaging: FedNova and SCAFFOLD, heterogeneous.

Like `hetero_avg`, every rule takes each architecture group's weighted sums of
client uploads, the groups' total weights and their `SubmodelMap`s, and works
element-wise over exactly the sampled clients that own an element; with one
group and the identity map they are the homogeneous rules of the papers. As there, results keep
the model's dtypes, integer leaves and a weighted group's non-finite sums are refused, and a group of weight 0
contributes nothing (`fednova_delta`, the
engine's, needs a traced weight-0 group's sums to be zeros).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from fedjax_hetero.aggregators import checks
from fedjax_hetero.aggregators.checks import is_weightless
from fedjax_hetero.aggregators.hetero_avg import (_heterogeneous_mean_delta, _heterogeneous_sums, _selected,
                                                  _weighted_coverage)
from fedjax_hetero.hetero.maps import SubmodelMap, Variables


def fednova_delta(group_normalized_sums: Sequence[Variables], group_weights: Sequence[jax.Array],
                  group_a_sums: Sequence[jax.Array], group_maps: Sequence[SubmodelMap],
                  global_like: Variables, offset=0) -> Variables:
  """FedNova's server update (Wang et al. 2020, Eq. 7), per element over its owners.

  With client weights ``p_i`` (normalized over the owners), normalized updates
  ``d_i = delta_i / a_i`` and ``tau_eff = sum_i p_i a_i``, the update is
  ``tau_eff * sum_i p_i d_i``. Inputs per group: ``S_g = sum w_i d_i``,
  ``W_g = sum w_i`` and ``A_g = sum w_i a_i``. Elements no sampled client owns get 0.
  With equal ``a_i`` this is exactly the (heterogeneous) FedAvg delta. As `heterogeneous_sums` (the engine's), a
  traced weight-0 group's sums must be zeros.
  """
  checks.check_lengths({"group_normalized_sums": group_normalized_sums, "group_weights": group_weights,
                        "group_a_sums": group_a_sums, "group_maps": group_maps})
  checks.check_groups("global_like", global_like, group_maps, group_weights, offset, "group_normalized_sums",
                      group_normalized_sums)
  checks.check_weights("group_a_sums", group_a_sums, positive_total=False)
  checks.check_floating("global_like", global_like)
  checks.check_finite_where_weighted("group_normalized_sums", group_normalized_sums, group_weights)
  numerator, denominator = _heterogeneous_sums(group_normalized_sums, group_weights, group_maps, global_like, offset)
  a_sums = [0.0 if is_weightless(w) else a for a, w in zip(group_a_sums, group_weights)]  # (0 * NaN is NaN)
  tau_numerator = _weighted_coverage(a_sums, group_maps, global_like, offset)

  def leaf(n, d, t, like):
    covered = d > 0
    safe = jnp.where(covered, d, 1.0)
    return jnp.where(covered, (t / safe) * (n / safe), 0.0).astype(jnp.result_type(like))

  return jax.tree.map(leaf, numerator, denominator, tau_numerator, global_like)


def scaffold_server_control(control: Variables, group_control_delta_sums: Sequence[Variables],
                            group_weights: Sequence[jax.Array], group_maps: Sequence[SubmodelMap],
                            offset=0) -> Variables:
  """SCAFFOLD's server control update (Karimireddy et al. 2020, Alg. 1 line 17) as NIID-Bench does it:
  ``c <- c + mean_i delta_c_i`` over the sampled clients (that own the element), rather than the
  paper's ``|S|/N`` scaling. ``control`` and the sums may cover ``params`` only (``{"params": ...}``):
  the maps act on whatever subtree they are given."""
  checks.check_groups("control", control, group_maps, group_weights, offset, "group_control_delta_sums",
                      group_control_delta_sums)
  checks.check_floating("control", control)
  checks.check_finite_where_weighted("group_control_delta_sums", group_control_delta_sums, group_weights)
  delta = _heterogeneous_mean_delta(_selected(group_control_delta_sums, group_weights), group_weights, group_maps,
                                    control, offset)
  return jax.tree.map(jnp.add, control, delta)
