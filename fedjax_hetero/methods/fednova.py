"""FedNova (Wang et al., NeurIPS 2020): normalized local updates and their server mean.

The pure server rule is `aggregators.fednova_delta`; this module holds a_i, the client term and the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_hetero import aggregators
from fedjax_hetero.client.terms import ClientTerm, Upload
from fedjax_hetero.config.declare import is_off
from fedjax_hetero.server.steps import ServerStep


def nova_normalizer(num_steps: jax.Array, optimizer: str, momentum: float) -> jax.Array:
  """FedNova's a_i (Wang et al. 2020, Sec. 4 and App. for momentum): the norm of the local
  aggregation vector. Plain SGD: ``tau``; SGD with momentum rho: ``[tau - rho(1 - rho^tau)/(1 - rho)]/(1 - rho)``.

  Adam has no such closed form; we use ``tau`` for it (each Adam step moves a weight by about
  the learning rate whatever the gradient scale, so the update grows linearly in ``tau``).
  """
  tau = jnp.asarray(num_steps, jnp.float32)
  if optimizer == "sgd" and not is_off(momentum):
    rho = momentum
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
  return tau


def nova_normalization(optimizer: str, momentum: float) -> ClientTerm:
  """FedNova's client side: upload ``delta / a_i`` and ``a_i`` (for `nova_mean`)."""

  def normalizer(_, final, memory, share):
    return nova_normalizer(final.num_steps, optimizer, momentum)

  def normalized(_, final, memory, share):
    a = normalizer(_, final, memory, share)
    safe = jnp.where(a > 0, a, 1.0)  # a client without steps (vmap padding) has a zero delta
    return jax.tree.map(lambda d: d / safe, final.delta)

  return ClientTerm("nova", delta=normalized, upload=Upload(normalizer, "weighted"))


def nova_mean(normalization) -> ServerStep:
  """FedNova's server update (Wang et al. 2020, Eq. 7) per element over its holders, from the
  normalized deltas and the ``a_i`` the ``normalization`` client term uploads
  (`nova_normalization`, `aggregators.fednova_delta`)."""

  def update(carry, state, inputs, plan):
    maps = inputs.federation.maps
    delta = aggregators.fednova_delta([r.delta_sum for r in inputs.results], inputs.weights,
                                      inputs.uploads(normalization), maps, carry.model, inputs.offset)
    coverage = aggregators.weighted_coverage(inputs.weights, maps, carry.model, inputs.offset)
    return carry._replace(delta=delta, coverage=coverage), state

  return ServerStep("nova", update, reads=(normalization,))
