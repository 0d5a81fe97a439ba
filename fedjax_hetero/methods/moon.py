"""MOON (Li, He and Song, CVPR 2021): the model-contrastive client term on a projection head."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero.client.terms import ClientTerm, Loss, Memory, Variables


def _cosine(u: jax.Array, v: jax.Array, eps: float = 1e-8) -> jax.Array:
  return jnp.sum(u * v, -1) / jnp.maximum(jnp.linalg.norm(u, axis=-1) * jnp.linalg.norm(v, axis=-1), eps)


def model_contrastive_loss(z: jax.Array, z_global: jax.Array, z_previous: jax.Array, temperature: float,
                           mask: jax.Array) -> jax.Array:
  """MOON's model-contrastive loss (Li, He, Song 2021, Eq. 3), mean over real rows.

  ``-log(e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}))`` with cosine
  similarity, i.e. ``softplus((sim(z, z_prev) - sim(z, z_glob)) / tau)``.
  """
  positive = _cosine(z, z_global) / temperature
  negative = _cosine(z, z_previous) / temperature
  return jnp.sum(jax.nn.softplus(negative - positive) * mask) / jnp.maximum(mask.sum(), 1.0)


class ContrastiveAnchors(NamedTuple):
  """MOON's round state: the two frozen models the projection is contrasted with."""

  global_model: Variables  # the round's start (positive)
  previous_model: Variables  # the client's model after its previous round (negative)


def model_contrastive(mu: float, temperature: float) -> ClientTerm:
  """MOON: ``+ mu * l_con`` on the projection ``z`` of the "features" cut point, against the round's
  global model (positive) and the client's previous local model (negative), both frozen, eval mode."""
  from fedjax_hetero.models.projection import with_projection_head

  def project(ctx, variables, features):
    return ctx.model.apply(variables, features, method="project")

  def frozen_projection(ctx, variables):
    outputs, _ = ctx.forward(variables, ctx.batch.x, False, None, ("features",))
    return jax.lax.stop_gradient(project(ctx, variables, outputs.activations["features"]))

  def prepare(state, ctx):
    return frozen_projection(ctx, state.global_model), frozen_projection(ctx, state.previous_model)

  def loss(variables, state, frozen, outputs, ctx):
    z = project(ctx, variables, outputs.activations["features"])
    return mu * model_contrastive_loss(z, *frozen, temperature, ctx.batch.weights)

  return ClientTerm("moon", init=lambda r: ContrastiveAnchors(r.start, r.memory), loss=Loss(loss, prepare),
                    cuts=("features",),
                    memory=Memory(init=lambda v: v, next=lambda state, final, memory, share: final.variables),
                    wrap_model=with_projection_head)
