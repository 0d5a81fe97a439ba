"""Adaptive server optimizers (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Alg. 2).

The server takes the round's mean client update Delta_t as a negated gradient and steps

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = v_{t-1} + Delta_t^2                                      (FedAdagrad)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)  (FedYogi)
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                    (FedAdam)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

from v_{-1} = tau^2, without bias correction, as the paper does. It replaces any method's ``apply`` step, so it
works with every way of averaging: with architecture groups sharing a model, an element (and its m and v)
changes only in rounds where some client held it or another step updated it; elsewhere it waits. Batch
statistics are not gradients: they take the mean update as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_hetero import aggregators
from fedjax_hetero.config.server import ServerOptimizerConfig
from fedjax_hetero.methods.api import Method
from fedjax_hetero.server.steps import ServerStep
from fedjax_hetero.validation import check_choice, check_number

class AdaptiveState(NamedTuple):
  m: optax.Updates  # m_t, first moment of the pseudo-gradient
  v: optax.Updates  # v_t, second moment


SECOND_MOMENTS: dict[str, Callable] = {
    "adagrad": lambda v, g2, beta2: v + g2,
    "yogi": lambda v, g2, beta2: v - (1 - beta2) * g2 * jnp.sign(v - g2),
    "adam": lambda v, g2, beta2: beta2 * v + (1 - beta2) * g2,
}


def scale_by_adaptive_moments(kind: str, beta1: float, beta2: float, tau: float) -> optax.GradientTransformation:
  """``m_t / (sqrt(v_t) + tau)`` of gradients ``g`` (Alg. 2 with g = -Delta_t), v by ``kind``'s rule."""
  check_choice("kind", kind, SECOND_MOMENTS)
  for name, value, bounds in (("beta1", beta1, dict(minimum=0, below=1)), ("beta2", beta2, dict(minimum=0, below=1)),
                              ("tau", tau, dict(above=0))):
    if not isinstance(value, (jax.Array, np.ndarray)):  # (a swept setting comes traced: its config checked it)
      check_number(name, value, **bounds)
  second = SECOND_MOMENTS[kind]

  def init(params):
    return AdaptiveState(jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, tau**2), params))

  def update(grads, state, params=None):
    m = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.m, grads)
    v = jax.tree.map(lambda v, g: second(v, g * g, beta2), state.v, grads)
    return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v), AdaptiveState(m, v)

  return optax.GradientTransformation(init, update)


def adaptive_apply(o: ServerOptimizerConfig) -> ServerStep:
  """The ``apply`` step through ``o.optimizer``: parameters move by ``-eta`` times the scaled moments where
  held (some client's coverage, or a non-zero update), other collections add the mean update."""
  tx = scale_by_adaptive_moments(o.optimizer, o.beta1, o.beta2, o.tau)

  def init(model, federation):
    return tx.init(model["params"])

  def update(carry, state, inputs, plan):
    params, delta = carry.model["params"], carry.delta["params"]
    covered = carry.coverage  # (from the averaging step; computed here after one that leaves it out)
    if covered is None:
      covered = aggregators.weighted_coverage(inputs.weights, inputs.federation.maps, carry.model, inputs.offset)
    held = jax.tree.map(lambda c, d: (c > 0) | (d != 0), covered["params"], delta)
    direction, moved = tx.update(jax.tree.map(jnp.negative, delta), state)
    params = jax.tree.map(lambda p, u, h: jnp.where(h, p - o.lr * u, p), params, direction, held)
    state = AdaptiveState(*(jax.tree.map(jnp.where, held, new, old) for new, old in zip(moved, state)))
    others = {k: jax.tree.map(jnp.add, v, carry.delta[k]) for k, v in carry.model.items() if k != "params"}
    return carry._replace(model={**others, "params": params}), state

  return ServerStep("apply", update, init)


def with_server_optimizer(method: Method, o: ServerOptimizerConfig) -> Method:
  """``method`` with its ``apply`` step replaced by `adaptive_apply` (unchanged for ``none``); ValueError
  naming the flag when the method applies no mean update."""
  if o.optimizer == "none":
    return method
  names = [s.name for s in method.server]
  if "apply" not in names or method.sharing.stacked:
    raise ValueError(f"--server-optimizer {o.optimizer}: {method.name} applies no mean update to a server model "
                     f"(its server steps: {', '.join(names)}), so there is nothing for the optimizer to step")
  own = next(s for s in method.server if s.name == "apply")
  if own.init is not None:
    raise ValueError(f"--server-optimizer {o.optimizer}: {method.name} applies its mean update through an optimizer "
                     "of its own (its apply step keeps state); leave --server-optimizer out, or declare the method "
                     "with steps.apply_delta() and no optimizer")
  return dataclasses.replace(method, server=tuple(adaptive_apply(o) if s.name == "apply" else s
                                                  for s in method.server))
