"""FedImpro's pure pieces, its client term and its server step ("Harnessing Client Drift with Decoupled
Gradient Dissimilarity", later published as FedImpro; the method and its open choices are read in the
project's FedImpro spec).

The "fedimpro" server step keeps the global per-class feature estimate (typed state, checkpointed with
the run) and broadcasts it; the "fedimpro" client term starts the round's local estimate from it, adds
the cross-entropy of the high part on features drawn from it to every step's loss (Eq. 6), updates the
local estimate from the step's real features at the cut (Eq. 7), and uploads it for the server's
per-class mean (Eq. 8).

Heterogeneous groups: the features at the cut of two groups can be pooled only when they have one
shape. The server keeps one estimate per distinct cut-point shape among a federation's groups: depth
groups of one width (ResNet10..26 at stage 2) share theirs, width groups each keep their own.

The model is split at a cut point into a low part ``h = low(x)`` and a high part ``high(h)``. Every
client keeps a per-class diagonal Gaussian estimate of its features ``h`` (mean and standard deviation
per class and feature, Eq. 7), the server averages the estimates (Eq. 8) and sends the result back,
and local training adds the cross-entropy of the high part on features drawn from that Gaussian
(Eq. 6). The drawn features are constants, so their loss reaches only the high part.

Choices where the paper is silent or differs from the authors' code (each is a `FedImproConfig` field):

* ``beta`` (Eq. 7's momentum) is 0 by default: the authors' code weights the new batch by
  ``min(1, D / 5000)`` with D the feature size, so a stage-2 split (D = 32768) replaces the estimate
  by each batch's statistics. The paper gives no value.
* the estimate is of the standard deviation (the authors' code; Eq. 7 writes "variance"), unbiased
  over the batch's rows of the class, and every deviation of a client's estimate is clamped from
  above at ``std_max`` = 0.1 as in that code. A class needs one row to update its mean and two to
  update its deviation.
* synthetic labels are class-balanced, as in the authors' code and as the variance argument of
  Theorem 4.2 needs (the same synthetic distribution on every client): ``(offset + arange(n)) % C``
  with a random offset per step, so that no class is favoured when C does not divide n. Algorithm
  1's literal reading would reuse the batch's labels.
* as many synthetic features per step as the batch has real rows (the paper's N-hat = N; a partial
  last batch gets as few); the code draws ``C * (B // C + 1)``. ``num_synthetic`` fixes the count.
* the loss is the mean cross-entropy over the concatenated real and synthetic rows (``loss="concat"``),
  as in the authors' code and in the proof of Theorem 4.2 (Eq. 24 weights the real and the synthetic
  gradients by n/(n + n_hat) and n_hat/(n + n_hat)); ``loss="sum"`` is Eq. 6 as printed,
  ``CE(real) + weight * CE(synthetic)``. Measured on Fashion-MNIST (docs/reproduction.md), only the mean
  shrinks the high part's client spread by the theorem's factor (about 1/4 with n_hat = n), and it
  trains faster than the sum.
* the synthetic rows go through the high part in a pass of their own, so BatchNorm normalizes them
  by their own batch statistics (and its running statistics follow the real rows only); the
  authors' code passes real and synthetic rows as one batch.
* features are drawn from the round's global estimate (Algorithm 1); ``sample_from="local"`` draws
  them from the client's running estimate instead, as the authors' code does.
* the server averages each class over the clients that saw it (a client that never saw a class
  does not pull its mean towards its starting value); the code averages every class over all
  sampled clients. A class nobody has seen yet stays at the prior N(0, 1).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.client.local import masked_cross_entropy
from fedjax_hetero.client.terms import ClientTerm, Loss, Upload
from fedjax_hetero.config.declare import is_off
from fedjax_hetero.config.options import FedImproConfig
from fedjax_hetero.models import cut_shape, resolve_cut
from fedjax_hetero.server.steps import ServerStep

class FeatureStats(NamedTuple):
  """Per-class diagonal Gaussians of the features at the cut: ``mean``, ``std`` [C, D] and ``seen`` [C]
  (a client: which classes it has estimated this round; the server: which any client has ever seen)."""

  mean: jax.Array
  std: jax.Array
  seen: jax.Array


def prior_stats(num_classes: int, feature_size: int) -> FeatureStats:
  """The estimate before any client has seen a class: N(0, 1) for every feature."""
  return FeatureStats(jnp.zeros((num_classes, feature_size), jnp.float32),
                      jnp.ones((num_classes, feature_size), jnp.float32), jnp.zeros((num_classes,), jnp.float32))


def batch_class_stats(features: jax.Array, labels: jax.Array, mask: jax.Array,
                      num_classes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-class mean, unbiased standard deviation and row count of a batch's real rows.

  ``features`` [B, D], ``labels`` [B], ``mask`` [B] (1 for a real row). Returns ``(mean [C, D], std [C, D],
  count [C])``; the mean of a class without rows and the deviation of a class with fewer than two are 0.
  """
  onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32) * mask[:, None].astype(jnp.float32)
  count = onehot.sum(0)
  mean = (onehot.T @ features) / jnp.maximum(count, 1.0)[:, None]
  squares = onehot.T @ jnp.square(features - mean[labels])  # each row's deviation from its class mean
  std = jnp.sqrt(squares / jnp.maximum(count - 1.0, 1.0)[:, None])
  return mean, std, count


def update_estimate(stats: FeatureStats, features: jax.Array, labels: jax.Array, mask: jax.Array, beta: float,
                    std_max: float) -> FeatureStats:
  """Eq. 7 per class: ``mu_c <- beta mu_c + (1 - beta) mean_c(h)`` for every class with a row in the batch,
  ``sigma_c <- beta sigma_c + (1 - beta) std_c(h)`` for every class with two or more; then every deviation
  ``<= std_max`` (also those the batch did not update, e.g. a class seen one row at a time)."""
  mean, std, count = batch_class_stats(features, labels, mask, stats.mean.shape[0])
  has_mean, has_std = (count >= 1)[:, None], (count >= 2)[:, None]
  new_mean = jnp.where(has_mean, beta * stats.mean + (1.0 - beta) * mean, stats.mean)
  new_std = jnp.minimum(jnp.where(has_std, beta * stats.std + (1.0 - beta) * std, stats.std), std_max)
  return FeatureStats(new_mean, new_std, jnp.maximum(stats.seen, (count >= 1).astype(jnp.float32)))


def balanced_labels(num: int, num_classes: int, offset: jax.Array | int = 0) -> jax.Array:
  """``offset, offset + 1, ...`` modulo C, ``num`` of them: every class as often as the others (+-1); a
  random ``offset`` spreads the +1 over the classes."""
  return (jnp.arange(num, dtype=jnp.int32) + offset) % num_classes


def sample_features(stats: FeatureStats, labels: jax.Array, key: jax.Array) -> jax.Array:
  """``h ~ N(mu[y], diag(sigma[y]^2))`` per label: [N, D] (Eq. 6's synthetic features)."""
  noise = jax.random.normal(key, (labels.shape[0], stats.mean.shape[1]), jnp.float32)
  return stats.mean[labels] + stats.std[labels] * noise


def noisy_upload(stats: FeatureStats, key: jax.Array, noise: float) -> FeatureStats:
  """App. D.3's privacy noise: ``N(0, noise^2)`` added to every uploaded mean and deviation; a deviation made
  negative by the noise is reflected (``|sigma|``)."""
  if is_off(noise):
    return stats
  k_mean, k_std = jax.random.split(key)
  mean = stats.mean + noise * jax.random.normal(k_mean, stats.mean.shape, jnp.float32)
  std = jnp.abs(stats.std + noise * jax.random.normal(k_std, stats.std.shape, jnp.float32))
  return stats._replace(mean=mean, std=std)


class StatsUpload(NamedTuple):
  """A client's estimate as summed over a cohort: per class, the sums of the means and deviations of the
  clients that saw it, their number, and how many clients were dropped for non-finite statistics."""

  mean_sum: jax.Array  # [C, D]
  std_sum: jax.Array  # [C, D]
  holders: jax.Array  # [C]
  dropped: jax.Array  # []


def client_upload(stats: FeatureStats) -> StatsUpload:
  """One client's contribution to the server's per-class mean (`server_mean`); a client whose estimate of a
  class it saw is not finite contributes nothing and counts as dropped."""
  seen = stats.seen[:, None]
  finite = jnp.all(jnp.where(seen > 0, jnp.isfinite(stats.mean) & jnp.isfinite(stats.std), True))
  keep = finite.astype(jnp.float32)
  safe = lambda x: jnp.where((seen > 0) & finite, x, 0.0)  # (not x * keep: NaN * 0 is NaN)
  return StatsUpload(safe(stats.mean), safe(stats.std), stats.seen * keep, 1.0 - keep)


def server_mean(previous: FeatureStats, upload: StatsUpload) -> FeatureStats:
  """Eq. 8 per class over its holders: ``mu_g[c] = (1/|S_c|) sum_{i in S_c} mu_i[c]`` (and sigma alike), with
  S_c the round's clients that saw class c; a class no client saw this round keeps its previous value."""
  held = (upload.holders > 0)[:, None]
  count = jnp.maximum(upload.holders, 1.0)[:, None]
  return FeatureStats(jnp.where(held, upload.mean_sum / count, previous.mean),
                      jnp.where(held, upload.std_sum / count, previous.std),
                      jnp.maximum(previous.seen, (upload.holders > 0).astype(jnp.float32)))


NAME = "fedimpro"
# The term draws from its own stream of the client's round key: the key itself also draws the client's batches.
KEY_STREAM = 0x46496D70


class ClientEstimate(NamedTuple):
  key: jax.Array
  received: FeatureStats  # the round's global estimate (what synthetic features are drawn from)
  local: FeatureStats  # the client's running estimate (Eq. 7), started from ``received``


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


def feature_sharing(config: FedImproConfig = FedImproConfig()) -> ClientTerm:
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
    labels = balanced_labels(num, num_classes, jax.random.randint(offset_key, (), 0, num_classes))
    in_use = jnp.ones(num) if config.num_synthetic else (jnp.arange(num) < ctx.batch.weights.sum())
    return Synthetic(sample_features(source, labels, feature_key), labels, in_use.astype(jnp.float32))

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
    local = update_estimate(state.local, features.reshape(features.shape[0], -1), ctx.batch.labels,
                               ctx.batch.weights, config.beta, config.std_max)
    return state._replace(local=local)

  def estimate(state, final, memory, share):
    noise_key = jax.random.fold_in(state.key, jnp.uint32(2**31))  # apart from the steps' keys (< 2**31)
    return client_upload(noisy_upload(state.local, noise_key, config.noise))

  return ClientTerm(NAME, init=init, loss=Loss(loss, prepare), update=update, cuts=cuts,
                    upload=Upload(estimate, "sum"), share=True)


@functools.cache
def shape_classes(models: tuple[nn.Module, ...], cut: str | None,
                  input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
  """For a federation's member models: the index of each member's estimate, and each estimate's feature shape
  (one estimate per distinct shape at the cut, in the members' order)."""
  sample = jnp.zeros((1,) + input_shape, jnp.float32)
  shapes = [cut_shape(m, sample, resolve_cut(m, cut)) for m in models]
  distinct = tuple(dict.fromkeys(shapes))
  return tuple(distinct.index(s) for s in shapes), distinct


def feature_statistics(config: FedImproConfig, sharing: ClientTerm) -> ServerStep:
  """FedImpro's server step: the per-class mean over holders of the estimates the ``sharing`` term
  (`feature_sharing`) uploads (Eq. 8), one estimate per cut-point shape; broadcasts each group its estimate. Logs the classes known and the clients dropped for
  non-finite statistics."""

  def classes(federation):
    return shape_classes(federation.models, config.cut, tuple(federation.store.images.shape[1:]))

  def init(model, federation):
    _, shapes = classes(federation)
    return tuple(prior_stats(federation.store.num_classes, math.prod(s)) for s in shapes)

  def update(carry, state, inputs, plan):
    member_class, _ = classes(inputs.federation)
    uploads = inputs.uploads(sharing)
    new_state, dropped = [], jnp.float32(0)
    for k, previous in enumerate(state):
      mine = [u for u, c in zip(uploads, member_class) if c == k]
      summed = jax.tree.map(lambda *xs: sum(xs), *mine)
      new_state.append(server_mean(previous, summed))
      dropped = dropped + summed.dropped
    known = sum(s.seen.sum() for s in new_state) / len(new_state)
    metrics = {inputs.federation.name: {"dropped_clients": dropped, "known_classes": known}}
    return carry._replace(metrics={**carry.metrics, NAME: metrics}), tuple(new_state)

  def broadcast(state, federation, member, round_index):
    return state[classes(federation)[0][member]]

  return ServerStep(NAME, update, init, broadcast, reads=(sharing,))
