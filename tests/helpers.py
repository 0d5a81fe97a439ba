"""Helpers shared by several test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util


def numpy_variables(shapes, seed: int):
  """Variables shaped like ``shapes`` (e.g. ``jax.eval_shape(model.init, ...)``), filled with numpy.

  ``model.init`` compiles one PRNG kernel per leaf shape; this avoids those compiles and gives
  BatchNorm statistics and scales non-trivial values.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for path, leaf in traverse_util.flatten_dict(dict(shapes)).items():
    if path[-1] == "var":
      value = rng.uniform(0.5, 1.5, leaf.shape)
    elif path[-1] == "scale":
      value = 1.0 + 0.1 * rng.normal(size=leaf.shape)
    elif path[-1] in ("bias", "mean"):
      value = 0.1 * rng.normal(size=leaf.shape)
    else:
      value = rng.normal(size=leaf.shape) / np.sqrt(max(1, np.prod(leaf.shape[:-1])))
    out[path] = jnp.asarray(value, jnp.float32)
  return traverse_util.unflatten_dict(out)


def model_variables(model, sample_input, seed: int):
  """``numpy_variables`` for ``model`` on inputs shaped like ``sample_input``."""
  return numpy_variables(jax.eval_shape(model.init, jax.random.key(0), sample_input), seed)


def random_batch(seed: int, size: int, num_classes: int = 4, image_shape: tuple[int, ...] = (8, 8, 1)):
  """``(uint8 images [size, *image_shape], int32 labels [size])`` drawn from ``seed``."""
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.integers(0, 256, (size, *image_shape)), jnp.uint8)
  labels = jnp.asarray(rng.integers(0, num_classes, size), jnp.int32)
  return images, labels
