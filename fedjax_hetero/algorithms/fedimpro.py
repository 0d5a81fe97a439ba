"""FedImpro's pieces as pure functions ("Harnessing Client Drift with Decoupled Gradient Dissimilarity",
later published as FedImpro; the method and its open choices are read in the project's FedImpro spec).

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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero.config.options import LOSS_MODES, SAMPLE_SOURCES, FedImproConfig  # re-exported

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
  if not noise:
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
