"""Gradient dissimilarity of a round's client updates, split into the model's low and high parts.

FedImpro's argument (Theorem 4.2) is that sharing feature distributions shrinks the high part's share of
the clients' gradient dissimilarity. The engine measures it for every method, per architecture group and
round, on the updates the clients upload:

    D_part = sum_c p_c ||d_c - d_bar||^2 / ||d_bar||^2,   d_bar = sum_c p_c d_c,   p_c = w_c / sum_c w_c

over the ``params`` leaves of the part (low: input -> cut, high: cut -> logits; `models.parameter_split`),
with ``w_c`` the clients' aggregation weights. The numerator alone, the *spread* ``sum_c p_c ||d_c - d_bar||^2``,
is logged too (``low_spread``, ``high_spread``): a method that adds an update component common to all clients
lowers the ratio through its denominator without bringing the clients closer. The cohort is reduced on the
device, so each client uploads only the squared norm of each leaf of its update (``update_norms``), and
``sum_c p_c ||d_c - d_bar||^2 = sum_c p_c ||d_c||^2 - ||d_bar||^2``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_hetero.client.terms import ClientTerm, with_upload

NAME = "dissimilarity"
PARTS = ("low", "high")
# A spread below this fraction of the mean update's squared norm is float rounding, not dissimilarity: what a
# single client's update leaves (its spread is exactly 0). It is logged as no value (NaN, None in metrics.jsonl).
NO_SPREAD = 1e-6


def update_norms() -> ClientTerm:
  """Uploads the squared norm of each ``params`` leaf of the client's update, weighted-summed over the cohort."""

  def finish(_, final, memory, share):
    return with_upload(final, NAME, jax.tree.map(lambda d: jnp.sum(jnp.square(d)), final.delta["params"]))

  return ClientTerm(NAME, finish=finish)


def gradient_dissimilarity(delta_sum: Any, weight_sum: jax.Array, norm_sums: Any,
                           parts: dict[str, Any]) -> dict[str, jax.Array]:
  """``D_part`` (module docstring) for every part, and its numerator as ``<part>_spread``, from a cohort's sums:
  ``delta_sum = sum_c w_c d_c`` (variables), ``norm_sums = sum_c w_c ||d_c leaf||^2`` (per ``params`` leaf) and
  ``parts``: name -> a tree of bools over ``params`` marking the part's leaves. NaN when the mean update of a
  part is zero."""
  mean = jax.tree.map(lambda d: d / weight_sum, delta_sum["params"])
  out = {}
  for name, mask in parts.items():
    if not any(jax.tree.leaves(mask)):
      continue
    spread = sum(s / weight_sum for s, m in zip(jax.tree.leaves(norm_sums), jax.tree.leaves(mask)) if m)
    mean_norm = sum(jnp.sum(jnp.square(d)) for d, m in zip(jax.tree.leaves(mean), jax.tree.leaves(mask)) if m)
    spread = jnp.maximum(spread - mean_norm, 0.0)  # >= 0 but for float cancellation
    spread = jnp.where(spread > NO_SPREAD * mean_norm, spread, jnp.nan)
    out[f"{name}_spread"], out[name] = spread, spread / mean_norm
  return out
