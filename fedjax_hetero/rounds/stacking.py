"""Trees stacked over a leading axis (many runs' states, rows and data) and taken back, without an eager jax
operation per leaf: each compiles a program for every leaf shape it meets, on an accelerator a compilation each."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import light_jit


def stack(trees: Sequence[Any]) -> Any:
  """``trees``' leaves (one structure) stacked on a new leading axis: host arrays on the host, device arrays in one
  program."""
  columns = list(zip(*(jax.tree.leaves(t) for t in trees)))
  on_device = [c for c in columns if not isinstance(c[0], np.ndarray)]
  stacked = iter(_stack_on_device(on_device) if on_device else ())
  return jax.tree.unflatten(jax.tree.structure(trees[0]),
                            [np.stack(c) if isinstance(c[0], np.ndarray) else next(stacked) for c in columns])


@light_jit
def _stack_on_device(columns: list[tuple[jax.Array, ...]]) -> list[jax.Array]:
  return [jnp.stack(c) for c in columns]


@light_jit
def take_rows(tree: Any, rows: np.ndarray) -> Any:
  """Rows ``rows`` of every leaf of ``tree`` (stacked on its leading axis), in one program."""
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), tree)


@functools.partial(jax.jit, static_argnums=1)
def unstack(tree: Any, count: int) -> list[Any]:
  """Every one of the ``count`` rows of ``tree`` as a tree, in one program."""
  return [jax.tree.map(lambda x: x[r], tree) for r in range(count)]
