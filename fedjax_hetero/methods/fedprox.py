"""FedProx (Li et al., MLSys 2020): the proximal client term. Its server side is the plain mean (`server.steps`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_hetero.client.terms import ClientTerm, Loss, Variables


def proximal_term(params: Variables, anchor: Variables, mu: float) -> jax.Array:
  """FedProx's proximal term (Li et al. 2020, Eq. 2): ``mu/2 ||w - w^t||^2`` over all leaves of ``params``."""
  squares = jax.tree.map(lambda p, a: jnp.sum(jnp.square(p - a)), params, anchor)
  return 0.5 * mu * sum(jax.tree.leaves(squares))


def proximal(mu: float) -> ClientTerm:
  """FedProx: ``+ mu/2 ||w - w^t||^2`` with ``w^t`` the parameters the client started the round from."""
  return ClientTerm("prox", init=lambda r: r.start["params"],
                    loss=Loss(lambda v, anchor, _, out, ctx: proximal_term(v["params"], anchor, mu)))
