"""FedImpro as a client term and a server step (pure pieces and the paper's choices in `algorithms.fedimpro`).

The "fedimpro" server step keeps the global per-class feature estimate (typed state, checkpointed with
the run) and broadcasts it; the "fedimpro" client term starts the round's local estimate from it, adds
the cross-entropy of the high part on features drawn from it to every step's loss (Eq. 6), updates the
local estimate from the step's real features at the cut (Eq. 7), and uploads it for the server's
per-class mean (Eq. 8).

Heterogeneous groups: the features at the cut of two groups can be pooled only when they have one
shape. The server keeps one estimate per distinct cut-point shape among a federation's groups: depth
groups of one width (ResNet10..26 at stage 2) share theirs, width groups each keep their own.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.algorithms import fedimpro as fi
from fedjax_hetero.client.local import masked_cross_entropy
from fedjax_hetero.client.terms import ClientTerm, with_upload
from fedjax_hetero.models import cut_shape, resolve_cut
from fedjax_hetero.server.steps import ServerStep

NAME = "fedimpro"
# The term draws from its own stream of the client's round key: the key itself also draws the client's batches.
KEY_STREAM = 0x46496D70


class ClientEstimate(NamedTuple):
  key: jax.Array
  received: fi.FeatureStats  # the round's global estimate (what synthetic features are drawn from)
  local: fi.FeatureStats  # the client's running estimate (Eq. 7), started from ``received``


class Synthetic(NamedTuple):
  features: jax.Array  # [N, D], drawn outside differentiation
  labels: jax.Array  # [N]
  mask: jax.Array  # [N] float: the rows in use (as many as the batch has real rows, unless fixed)


def high_part_logits(model: nn.Module, variables, features: jax.Array, mask: jax.Array, cut: str) -> jax.Array:
  """The high part's logits on ``features`` at ``cut``, in training mode; BatchNorm normalizes the synthetic
  rows in ``mask`` by their own statistics and its running statistics are left as the real batch set them."""
  if "batch_stats" in variables:
    logits, _ = model.apply(variables, features, train=True, mask=mask, start=cut, mutable=["batch_stats"])
    return logits
  return model.apply(variables, features, train=True, mask=mask, start=cut)


def feature_sharing(config: fi.FedImproConfig = fi.FedImproConfig()) -> ClientTerm:
  """FedImpro's client side: the cross-entropy of the high part on ``h_hat ~ N(mu[y_hat], sigma[y_hat])`` with
  class-balanced ``y_hat`` (Eq. 6), by default averaged with the real rows' (``loss="concat"``; ``"sum"`` adds
  ``weight * CE(synthetic)``), the per-class estimate of the real features at the cut (Eq. 7), and its upload."""
  cuts = lambda model: (resolve_cut(model, config.cut),)

  def init(r):
    key = jax.random.key(0) if r.key is None else r.key  # (no key: a shape-only use)
    return ClientEstimate(jax.random.fold_in(key, KEY_STREAM), r.share,
                          r.share._replace(seen=jnp.zeros_like(r.share.seen)))

  def prepare(state, ctx):
    # Counting real steps only, so padded steps (vmap cohorts) do not shift the key sequence.
    offset_key, feature_key = jax.random.split(jax.random.fold_in(state.key, ctx.num_steps.astype(jnp.uint32)))
    source = state.received if config.sample_from == "global" else state.local
    num_classes, rows = source.mean.shape[0], ctx.batch.labels.shape[0]
    num = config.num_synthetic or rows
    labels = fi.balanced_labels(num, num_classes, jax.random.randint(offset_key, (), 0, num_classes))
    in_use = jnp.ones(num) if config.num_synthetic else (jnp.arange(num) < ctx.batch.weights.sum())
    return Synthetic(fi.sample_features(source, labels, feature_key), labels, in_use.astype(jnp.float32))

  def loss(variables, state, synthetic, outputs, ctx):
    cut = cuts(ctx.model)[0]
    features = synthetic.features.reshape((synthetic.features.shape[0],) + outputs.activations[cut].shape[1:])
    logits = high_part_logits(ctx.model, variables, features, synthetic.mask, cut)
    synthetic_ce, _ = masked_cross_entropy(logits, synthetic.labels, synthetic.mask)
    synthetic_ce = config.weight * synthetic_ce
    if config.loss == "sum":
      return synthetic_ce
    real_ce, _ = masked_cross_entropy(outputs.logits, ctx.batch.labels, ctx.batch.weights)
    real, fake = ctx.batch.weights.sum(), synthetic.mask.sum()
    # The trainer already adds the real rows' mean CE; this term turns the total into the concatenated mean.
    return (real * real_ce + fake * synthetic_ce) / (real + fake) - real_ce

  def update(state, outputs, ctx):
    features = outputs.activations[cuts(ctx.model)[0]]
    local = fi.update_estimate(state.local, features.reshape(features.shape[0], -1), ctx.batch.labels,
                               ctx.batch.weights, config.beta, config.std_max)
    return state._replace(local=local)

  def finish(state, final, memory, share):
    noise_key = jax.random.fold_in(state.key, jnp.uint32(2**31))  # apart from the steps' keys (< 2**31)
    return with_upload(final, fi.client_upload(fi.noisy_upload(state.local, noise_key, config.noise)))

  return ClientTerm(NAME, init=init, prepare=prepare, loss=loss, update=update, finish=finish, upload="sum",
                    share=True, cuts=cuts)


@functools.cache
def shape_classes(models: tuple[nn.Module, ...], cut: str | None,
                  input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
  """For a federation's member models: the index of each member's estimate, and each estimate's feature shape
  (one estimate per distinct shape at the cut, in the members' order)."""
  sample = jnp.zeros((1,) + input_shape, jnp.float32)
  shapes = [cut_shape(m, sample, resolve_cut(m, cut)) for m in models]
  distinct = tuple(dict.fromkeys(shapes))
  return tuple(distinct.index(s) for s in shapes), distinct


def feature_statistics(config: fi.FedImproConfig, sharing: ClientTerm) -> ServerStep:
  """FedImpro's server step: the per-class mean over holders of the estimates the ``sharing`` term
  (`feature_sharing`) uploads (Eq. 8), one estimate per cut-point shape; broadcasts each group its estimate. Logs the classes known and the clients dropped for
  non-finite statistics."""

  def classes(federation):
    return shape_classes(federation.models, config.cut, tuple(federation.store.images.shape[1:]))

  def init(model, federation):
    _, shapes = classes(federation)
    return tuple(fi.prior_stats(federation.store.num_classes, math.prod(s)) for s in shapes)

  def update(carry, state, inputs, plan):
    member_class, _ = classes(inputs.federation)
    uploads = inputs.uploads(sharing)
    new_state, dropped = [], jnp.float32(0)
    for k, previous in enumerate(state):
      mine = [u for u, c in zip(uploads, member_class) if c == k]
      summed = jax.tree.map(lambda *xs: sum(xs), *mine)
      new_state.append(fi.server_mean(previous, summed))
      dropped = dropped + summed.dropped
    known = sum(s.seen.sum() for s in new_state) / len(new_state)
    metrics = {inputs.federation.name: {"dropped_clients": dropped, "known_classes": known}}
    return carry._replace(metrics={**carry.metrics, NAME: metrics}), tuple(new_state)

  def broadcast(state, federation, member, round_index):
    return state[classes(federation)[0][member]]

  return ServerStep(NAME, update, init, broadcast, reads=(sharing,))
