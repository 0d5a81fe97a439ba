"""Jitted, batched test-set evaluation of one model."""

from __future__ import annotations


from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import program_cache
from fedjax_hetero.data.store import normalize
from fedjax_hetero.hetero.maps import Variables

# XLA:CPU runs the models' convolutions fastest on batches of about 64-200 (the demo's three CNNs
# evaluate 10,000 images in 1.8 s at 200, 3.1 s at 1000); an accelerator barely notices the extra calls.
EVAL_BATCH = 200
ACCELERATOR_EVAL_BATCH = 1000  # the round program's in-program evaluation off the CPU: fewer, fuller steps


def accuracy(model: nn.Module, variables: Variables, images: jax.Array, labels: jax.Array,
             mean: tuple[float, ...], std: tuple[float, ...], batch_size: int = EVAL_BATCH) -> float:
  """Top-1 accuracy on ``images``/``labels`` (device arrays), all of them."""
  return correct_predictions(model, variables, images, labels, mean, std, batch_size) / int(labels.shape[0])


def correct_predictions(model: nn.Module, variables: Variables, images: jax.Array, labels: jax.Array,
                        mean: tuple[float, ...], std: tuple[float, ...], batch_size: int = EVAL_BATCH) -> int:
  """The number of correct top-1 predictions on ``images``/``labels`` (device arrays), all of them.

  Runs full batches with one jitted program and the remainder with a second
  (XLA:CPU runs a while loop over convolutions slowly, so batches are a host loop).
  """
  n = int(labels.shape[0])
  batch_size = min(batch_size, n)
  full = n - n % batch_size
  step = _batched(model, mean, std, batch_size)
  counts = [step(variables, images, labels, start) for start in range(0, full, batch_size)]
  if full < n:
    counts.append(_batched(model, mean, std, n - full)(variables, images, labels, full))
  # (summed on the host: summed by jax operations, the first round compiled programs of their own)
  return int(np.sum(jax.device_get(counts), dtype=np.int64))


def _count_batch(model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...], variables: Variables,
                 images: jax.Array, labels: jax.Array, start: Any, batch_size: int) -> jax.Array:
  batch = jax.lax.dynamic_slice_in_dim(images, start, batch_size)
  target = jax.lax.dynamic_slice_in_dim(labels, start, batch_size)
  logits = model.apply(variables, normalize(batch, mean, std), train=False)
  return (logits.argmax(-1) == target).sum()


@program_cache
def _batched(model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...], batch_size: int):
  return jax.jit(lambda variables, images, labels, start: _count_batch(model, mean, std, variables, images, labels,
                                                                       start, batch_size))


def count_correct(model: nn.Module, variables: Variables, images: jax.Array, labels: jax.Array,
                  mean: tuple[float, ...], std: tuple[float, ...], batch_size: int = EVAL_BATCH) -> jax.Array:
  """The number of correct top-1 predictions on all of ``images``, as one traceable computation (a device loop
  over the full batches, then the rest): `accuracy`'s count inside a program such as the round program's."""
  n = int(labels.shape[0])
  batch_size = min(batch_size, n)
  full = n - n % batch_size
  count = lambda start, size: _count_batch(model, mean, std, variables, images, labels, start, size)
  correct = jax.lax.fori_loop(0, full // batch_size, lambda i, total: total + count(i * batch_size, batch_size),
                              jnp.zeros((), jnp.int32))
  if full < n:
    correct = correct + count(full, n - full)
  return correct


def batch_norm_statistics(model: nn.Module, variables: Variables, images: jax.Array, mean: tuple[float, ...],
                          std: tuple[float, ...], batch_size: int = EVAL_BATCH) -> Variables:
  """``variables`` with every BatchNorm's running mean and variance the cumulative average, over the
  full batches of ``images`` (uint8, unnormalized), of its batch mean and (biased) batch variance in a
  training pass; the static BN of HeteroFL (Diao et al., ICLR 2021, Sec. 3). Images past the last
  full batch are left out. One jitted program per batch size, a host loop over the batches."""
  if "batch_stats" not in variables:
    return variables
  n = int(images.shape[0])
  if n == 0:
    raise ValueError("re-estimating BatchNorm statistics needs at least one image")
  batch_size = min(batch_size, n)
  step = _batch_statistics(model, mean, std, batch_size)
  total = jax.tree.map(jnp.zeros_like, variables["batch_stats"])
  count = n // batch_size
  for start in range(0, count * batch_size, batch_size):
    total = step(variables, images, start, total)
  return {**variables, "batch_stats": _divide(total, jnp.float32(count))}


@jax.jit
def _divide(tree: Any, count: jax.Array) -> Any:
  return jax.tree.map(lambda x: x / count, tree)


def batch_norm_momenta(model: nn.Module, variables: Variables, sample: jax.Array) -> list[float]:
  """The ``momentum`` of every `nn.BatchNorm` call of a training forward pass, in call order."""
  momenta: list[float] = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
      momenta.append(float(context.module.momentum))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]), variables, sample)
  return momenta


def batch_norm_keep(model: nn.Module, variables: Variables, sample: jax.Array) -> float:
  """``1 - momentum`` of the model's BatchNorm layers, which must share one momentum."""
  momenta = set(batch_norm_momenta(model, variables, sample))
  if len(momenta) != 1:
    raise ValueError(f"expected one BatchNorm momentum in the model, found {sorted(momenta)}")
  return 1.0 - momenta.pop()


def zero_start_statistics(model: nn.Module, variables: Variables, x: jax.Array, keep: float) -> Variables:
  """Every BatchNorm's batch mean and (biased) variance on ``x`` (normalized inputs), as ``batch_stats``: a
  training pass from zero statistics stores ``keep * batch statistic`` (``keep`` from `batch_norm_keep`),
  which is divided back out, so the result does not depend on the momentum."""
  zeros = jax.tree.map(jnp.zeros_like, variables["batch_stats"])
  _, updated = model.apply({**variables, "batch_stats": zeros}, x, train=True, mutable=["batch_stats"])
  return jax.tree.map(lambda s: s / keep, updated["batch_stats"])


@program_cache
def _batch_statistics(model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...], batch_size: int):

  @jax.jit
  def add(variables, images, start, total):
    x = normalize(jax.lax.dynamic_slice_in_dim(images, start, batch_size), mean, std)
    statistics = zero_start_statistics(model, variables, x, batch_norm_keep(model, variables, x))
    return jax.tree.map(jnp.add, total, statistics)

  return add
