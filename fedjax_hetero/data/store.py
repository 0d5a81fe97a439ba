"""All clients' data on the device: uint8 images, labels, and a padded index table."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.data import checks
from fedjax_hetero.data.partition import class_counts


@dataclasses.dataclass(frozen=True, eq=False)
class FederatedStore:
  """Device-resident federated training data.

  Attributes:
    images: uint8 [N, H, W, C], every training sample once.
    labels: int32 [N].
    index_table: int32 [num_clients, max_size]; row c lists client c's sample
      ids, padded with 0 past ``sizes[c]``.
    sizes: host int64 [num_clients], real length of each row.
    mean, std: per-channel normalization in [0, 1] pixel units.
  """

  images: jax.Array
  labels: jax.Array
  index_table: jax.Array
  sizes: np.ndarray
  num_classes: int
  mean: tuple[float, ...]
  std: tuple[float, ...]

  @classmethod
  def build(cls, images: np.ndarray, labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int,
            mean: Sequence[float], std: Sequence[float]) -> "FederatedStore":
    """The store of uint8 ``images`` [N, H, W, C] with integer ``labels`` in [0, ``num_classes``), one array of
    sample ids in [0, N) per client (``parts``), and one ``mean`` and ``std`` > 0 per channel; a ValueError
    naming the argument otherwise (`fedjax_hetero.data.checks`)."""
    shape = checks.check_images("images", images)
    num_classes = checks.check_num_classes("num_classes", num_classes)
    checks.check_labels("labels", labels, shape[0], num_classes)
    checks.check_normalization(mean, std, shape[-1])
    checks.check_parts("parts", parts, shape[0])
    sizes = np.array([len(p) for p in parts], np.int64)
    table = np.zeros((len(parts), max(1, int(sizes.max()))), np.int32)
    for row, part in zip(table, parts):
      row[:len(part)] = part
    # (`jax.device_put` of host arrays: `jnp.asarray` compiles a program per array on the device)
    return cls(images=jax.device_put(np.asarray(images, np.uint8)),
               labels=jax.device_put(np.asarray(labels, np.int32)), index_table=jax.device_put(table), sizes=sizes,
               num_classes=num_classes, mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std))

  @property
  def num_clients(self) -> int:
    return len(self.sizes)

  @property
  def max_size(self) -> int:
    return int(self.index_table.shape[1])

  @functools.cached_property
  def label_counts(self) -> np.ndarray:
    """Host int64 [num_clients, num_classes]: every client's label counts."""
    table = np.asarray(self.index_table)
    parts = [table[c, :n] for c, n in enumerate(self.sizes)]
    return class_counts(np.asarray(self.labels), parts, self.num_classes)

  def with_label_counts(self, counts: Any) -> "FederatedStore":
    """The same store with ``counts`` as its `label_counts` (one run's, traced in a program of many runs:
    `many_runs`)."""
    store = dataclasses.replace(self)
    vars(store)["label_counts"] = counts  # where the cached property keeps its value
    return store


def normalize(images: jax.Array, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
  x = images.astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def sample_clients(num_clients: int, clients_per_round: int, seed: int, round_index: int) -> np.ndarray:
  """The round's participants: uniform without replacement, a pure function of (seed, round)."""
  rng = np.random.default_rng([seed, round_index])
  return np.sort(rng.choice(num_clients, size=clients_per_round, replace=False))
