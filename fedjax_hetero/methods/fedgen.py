"""FedGen as a client term and a server step (Zhu, Hong and Zhou 2021; its generator and losses, pure, in
`methods.fedgen_generator`).

Every architecture group is its own federation with its own feature generator.
After aggregation the "fedgen" server step trains the generator on the round's
uploaded models (stacked by the "fedgen" client term) and their label counts;
it broadcasts the generator, the round's regularizer coefficients and the
group's label distribution to the clients, whose "fedgen" term adds FedGen's
generative regularizer to their loss.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.methods import fedgen_generator as gen
from fedjax_hetero.client.terms import ClientTerm, Loss, Upload
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.server.steps import Plan, ServerStep


class FedGenShare(NamedTuple):
  generator: Variables  # the generator's params and batch_stats (frozen on the client)
  coefficients: jax.Array  # [alpha, beta] of the round
  label_probs: jax.Array  # [C]: uniform over the labels the group's clients hold


def generator_for(config: gen.FedGenConfig, model: nn.Module, num_classes: int,
                  input_shape: tuple[int, ...]) -> gen.Generator:
  """The generator of a group's model: features of its "features" cut point, one per model and the config's
  generator sizes (its numbers may be traced, in a job's program)."""
  return _generator(model, num_classes, tuple(input_shape), config.noise_dim, config.hidden_dim, config.embedding)


@functools.cache
def _generator(model: nn.Module, num_classes: int, input_shape: tuple[int, ...], noise_dim: int, hidden_dim: int,
               embedding: bool) -> gen.Generator:
  if "features" not in tuple(getattr(model, "cut_points", ())):
    raise ValueError(f"FedGen generates the features its clients' heads classify, but {type(model).__name__} "
                     "has no 'features' cut point")
  width = gen.feature_width(model, jnp.zeros((1,) + input_shape, jnp.float32))
  return gen.Generator(num_classes=num_classes, latent_dim=width, noise_dim=noise_dim, hidden_dim=hidden_dim,
                       embedding=embedding)


class RegularizerState(NamedTuple):
  """A FedGen client's round state."""

  key: jax.Array  # the client's round key; each real step folds in its count
  share: FedGenShare


def generative_regularizer(config: gen.FedGenConfig) -> ClientTerm:
  """FedGen's client side: ``+ gen.client_regularizer`` with the server's frozen generator, and
  the upload of the final model (stacked) for the server's ensemble."""

  def init(r):
    return RegularizerState(r.key, r.share)

  def prepare(state, ctx):
    # Counting real steps only, so padded steps (vmap cohorts) do not shift the key sequence.
    return jax.random.fold_in(state.key, ctx.num_steps.astype(jnp.uint32))

  def loss(variables, state, step_key, outputs, ctx):
    share = state.share
    generator = generator_for(config, ctx.model, share.label_probs.shape[0], ctx.batch.x.shape[1:])
    alpha, beta = share.coefficients[0], share.coefficients[1]
    return gen.client_regularizer(
        gen.feature_head(ctx.model), variables, generator, share.generator, outputs.logits, ctx.batch.labels,
        share.label_probs, step_key, alpha=alpha, beta=beta, gen_batch_size=config.gen_batch_size,
        mask=ctx.batch.weights, gen_ratio=config.gen_batch_size / ctx.batch.labels.shape[0])[0]

  return ClientTerm("fedgen", init=init, loss=Loss(loss, prepare),
                    upload=Upload(lambda _, final, memory, share: final.variables, "stack"), share=True)


def generator_training(config: gen.FedGenConfig, regularizer: ClientTerm) -> ServerStep:
  """FedGen's server step (Alg. 1): the federation's generator learns from the round's models uploaded by
  the ``regularizer`` term (`generative_regularizer`) and their clients' label counts, and is broadcast to
  it; its state carries the Adam moments across rounds."""

  def generator(federation):
    return generator_for(config, federation.models[0], federation.store.num_classes,
                         tuple(federation.store.images.shape[1:]))

  def init(model, federation):
    if len(federation.models) != 1:
      raise ValueError("FedGen's generator needs one federation per architecture group")
    init_fn = jax.jit(gen.init_generator, static_argnums=(0, 2))
    return init_fn(generator(federation), federation.init_key(), config.weight_decay)

  def update(carry, state, inputs, plan):
    federation = inputs.federation
    valid, cohort = inputs.valid[0], inputs.cohorts[0]
    table = jnp.asarray(federation.store.label_counts, jnp.float32)
    counts = jnp.where(valid[:, None], table[jnp.clip(cohort, 0, table.shape[0] - 1)], 0.0)
    state, parts = gen.train_generator_round(
        state, config, generator(federation), gen.feature_head(federation.models[0]), inputs.uploads(regularizer)[0],
        counts, plan.inputs, inputs.key, valid)
    stats = {federation.name: {k: v.mean() for k, v in parts.items()}}
    return carry._replace(metrics={**carry.metrics, "fedgen_generator": stats}), state

  def broadcast(state, federation, member, round_index):
    counts = federation.store.label_counts[federation.clients[member]]
    return FedGenShare({"params": state.params, "batch_stats": state.batch_stats},
                       jnp.asarray(gen.client_coefficients(config, round_index), jnp.float32),
                       gen.present_label_probs(counts))

  def plan(round_index):
    return Plan(inputs=np.float32(config.generator_learning_rate(round_index)))

  return ServerStep("fedgen", update, init, broadcast, plan, reads=(regularizer,))
