"""Gradient dissimilarity of a round's client updates, split into the model's low and high parts.

FedImpro's argument (Theorem 4.2) is that sharing feature distributions shrinks the high part's share of
the clients' gradient dissimilarity. `tracked` adds its measurement to any method, as an ordinary client term
and server step (the run's builder does when ``--dissimilarity`` is on), per architecture group and round, on
the updates the clients upload:

    D_part = sum_c p_c ||d_c - d_bar||^2 / ||d_bar||^2,   d_bar = sum_c p_c d_c,   p_c = w_c / sum_c w_c

over the ``params`` leaves of the part (low: input -> cut, high: cut -> logits; `models.parameter_split`),
with ``w_c`` the clients' aggregation weights. The numerator alone, the *spread* ``sum_c p_c ||d_c - d_bar||^2``,
is logged too (``low_spread``, ``high_spread``): a method that adds an update component common to all clients
lowers the ratio through its denominator without bringing the clients closer. The cohort is reduced on the
device, so each client uploads only the squared norm of each leaf of its update (``update_norms``), and
``sum_c p_c ||d_c - d_bar||^2 = sum_c p_c ||d_c||^2 - ||d_bar||^2``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client.terms import ClientTerm, update_leaf_sums
from fedjax_hetero.methods.api import Method
from fedjax_hetero.models import parameter_split, resolve_cut
from fedjax_hetero.server.steps import ServerStep

NAME = "dissimilarity"
# A spread below this fraction of the mean update's squared norm is float rounding, not dissimilarity: what a
# single client's update leaves (its spread is exactly 0). It is logged as no value (NaN, None in metrics.jsonl).
NO_SPREAD = 1e-6


@functools.cache  # one term: trainers that carry it stay equal, and share their programs
def update_norms() -> ClientTerm:
  """Uploads the squared norm of each ``params`` leaf of the client's update (one vector in the leaves' order),
  weighted-summed over the cohort."""

  return ClientTerm(NAME, upload=update_leaf_sums(jnp.square))


def gradient_dissimilarity(weight_sum: jax.Array, norm_sum: jax.Array, delta_norm: jax.Array) -> tuple[Any, Any]:
  """``(D, spread)`` of one part (module docstring) from a cohort's sums over the part's elements: ``weight_sum =
  sum_c w_c``, ``norm_sum = sum_c w_c ||d_c||^2`` and ``delta_norm = ||sum_c w_c d_c||^2``. NaN when the mean update
  is zero, or the spread only float rounding (`NO_SPREAD`)."""
  spread, mean_norm = norm_sum / weight_sum, delta_norm / jnp.square(weight_sum)
  spread = jnp.maximum(spread - mean_norm, 0.0)  # >= 0 but for float cancellation
  spread = jnp.where(spread > NO_SPREAD * mean_norm, spread, jnp.nan)
  return spread / mean_norm, spread


@functools.lru_cache(maxsize=64)
def _parts(model, input_shape: tuple[int, ...], cut: str | None) -> dict[str, np.ndarray]:
  """Each part's ``params`` leaves, as indices in the order of ``jax.tree.leaves``."""
  low, high = parameter_split(model, jnp.zeros((1,) + input_shape, jnp.float32), resolve_cut(model, cut))
  return {"low": np.flatnonzero(jax.tree.leaves(low)), "high": np.flatnonzero(jax.tree.leaves(high))}


def dissimilarity_step(norms: ClientTerm, cut: str | None = None) -> ServerStep:
  """Logs ``D_part`` and the spreads of every member group under ``"dissimilarity"`` (a group none of whose
  clients trained: no value), from the group's sums and the uploads of ``norms`` (`update_norms`), split at
  ``cut`` (None: each model's `decoupling_cut`). Changes nothing else."""

  def init(model, federation):
    for member in federation.models:  # a bad cut fails before any compute
      _parts(member, tuple(federation.store.images.shape[1:]), cut)
    return ()

  def update(carry, state, inputs, plan):
    federation, values = inputs.federation, {}
    shape = tuple(federation.store.images.shape[1:])
    for member, (group, model, weight, norm_sums) in enumerate(zip(
        federation.group_names, federation.models, inputs.weights, inputs.uploads(norms))):
      values[group] = {}
      for part, leaves in _parts(model, shape, cut).items():
        if len(leaves):
          d, spread = gradient_dissimilarity(weight, jnp.sum(jnp.take(norm_sums, leaves)),
                                             inputs.delta_norm(member, leaves))
          values[group].update({f"{part}_spread": spread, part: d})
    return carry._replace(metrics={**carry.metrics, NAME: values}), state

  return ServerStep(NAME, update, init, reads=(norms,))


def tracked(method: Method, cut: str | None = None) -> Method:
  """``method`` with the dissimilarity metric: the `update_norms` term and its `dissimilarity_step` last. The
  extra upload can change results in the last float bits."""
  norms = update_norms()
  return dataclasses.replace(method, terms=method.terms + (norms,),
                             server=method.server + (dissimilarity_step(norms, cut),))
