"""Settings a run would accept and then silently not use, or fail on deep inside compute; refused up front.

`check_settings` needs only the config (a run calls it before it takes its folder): a learning rate that is 0 in
float32 training arithmetic, and partition settings a ``--partition-file`` overrides. `check_fit` needs the
loaded data and the partition (before the store and the models are built): images too small for a group's
model, a batch larger than every client (every batch padded to it, for the same result), and clients that take
no local step. Each error names the flag.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import models
from fedjax_hetero.validation import cli_flag, first_line

# XLA:CPU flushes subnormal floats to zero, so a float32 learning rate below this is 0 in training.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# The partition settings a partition file replaces, and the values that mean "not set".
PARTITION_FILE_OVERRIDES = ("partition", "alpha", "classes_per_client")


def check_learning_rate(flag: str, learning_rate: float) -> None:
  """ValueError unless the learning rate survives float32 arithmetic (is at least float32's smallest normal)."""
  if 0 < learning_rate < FLOAT32_TINY:
    raise ValueError(f"{flag} {learning_rate:g} is 0 in float32 training arithmetic (below {FLOAT32_TINY:.3g}, the "
                     "smallest normal float32; XLA flushes smaller values to 0), so the weights would never change")


def check_settings(config: Any) -> None:
  """The config-only checks (see the module docstring); ValueError naming the flag."""
  check_learning_rate(cli_flag("client.learning_rate"), config.client.learning_rate)
  data = config.data
  if data.partition_file is None:
    return
  defaults = type(data)()
  for name in PARTITION_FILE_OVERRIDES:
    value = getattr(data, name)
    if value != getattr(defaults, name):
      raise ValueError(f"{cli_flag('data.' + name)} {value} has no effect with {cli_flag('data.partition_file')}: "
                       "the file gives every client its samples; drop it")


def _smallest_working_size(name: str, width: float, channels: int, start: int, limit: int = 256) -> int | None:
  for size in range(start + 1, limit + 1):
    if _image_problem(name, width, (size, size, channels)) is None:
      return size
  return None


def _image_problem(name: str, width: float, image_shape: tuple[int, ...]) -> str | None:
  """Why the group's model cannot take images of ``image_shape`` (an error tracing it, or a layer left with no
  values), None if it can; shapes only, nothing computed."""
  model = models.build_model(name, 10, width)
  try:
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *image_shape), jnp.float32))
  except Exception as e:  # noqa: BLE001 - whatever the model raises on a too small input
    return first_line(e, 160)
  empty = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
           if 0 in leaf.shape]
  return f"its layer {empty[0]} would have no values" if empty else None


def _check_images(config: Any, image_shape: tuple[int, ...]) -> None:
  size = config.data.image_size
  what = f"{cli_flag('data.image_size')} {size}" if size else f"the dataset's {image_shape[0]}x{image_shape[1]} images"
  for spec in config.groups:
    name, width = models.parse_group_spec(spec)
    problem = _image_problem(name, width, image_shape)
    if problem is None:
      continue
    smallest = _smallest_working_size(name, width, image_shape[-1], image_shape[0])
    hint = f"; the smallest size it takes is {smallest}" if smallest else ""
    raise ValueError(f"{what} is too small for group {spec}: {problem}{hint} ({cli_flag('data.image_size')})")


def _check_batches(config: Any, sizes: np.ndarray, log: Callable[[str], None]) -> None:
  local, flag = config.client, cli_flag("client.batch_size")
  largest = int(sizes.max()) if len(sizes) else 0
  if local.batch_size > largest and not local.drop_last:
    raise ValueError(f"{flag} {local.batch_size} exceeds the largest client's {largest} samples: every batch would be "
                     f"padded to {local.batch_size} rows for the same result; pass at most {largest}")
  stepless = int(np.sum([local.num_steps(int(n)) == 0 for n in sizes]))
  why = (f"fewer than {flag} {local.batch_size} samples with {cli_flag('client.drop_last')}" if local.drop_last
         else "no samples")
  if stepless == len(sizes):
    raise ValueError(f"no client would take a local step ({why}; the largest client has {largest}), so no round "
                     f"would change the model; lower {flag}" + ("" if not local.drop_last else " or drop --drop-last"))
  if stepless:
    log(f"warning: {stepless} of {len(sizes)} clients take no local step ({why}): a round that samples only "
        "them changes nothing")


def check_fit(config: Any, dataset: Any, parts: Sequence[np.ndarray], log: Callable[[str], None] = print) -> None:
  """The data-dependent checks (see the module docstring); ValueError naming the flag, before anything is built."""
  _check_images(config, tuple(dataset.image_shape))
  _check_batches(config, np.array([len(p) for p in parts], np.int64), log)

