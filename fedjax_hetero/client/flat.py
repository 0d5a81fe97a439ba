"""Variables as one flat vector per collection: the layout the union mapping's clients train in.

XLA compiles each distinct kernel of a program once, and a program's compile time grows with the number of distinct
kernels (docs/performance.md). A per-leaf tree of variables costs a kernel per leaf for every elementwise pass over
it (the optimizer's update, the held mask, the select of a discarded step); on one flat vector each pass is one
kernel. The model reads its leaves back with `FlatLayout.unravel`. With each leaf's offset a traced scalar (passed
into the program, `FlatLayout.offsets`), the kernels that read a leaf depend on its shape only, so two layers of one
shape share their kernels as they do with a tree; with offsets known to XLA every reading kernel would be distinct.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

Variables = Any
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where every leaf of a variables tree lies in its collection's flat vector (static: equal layouts are equal)."""

  leaves: tuple[tuple[Path, tuple[int, ...]], ...]  # (collection, *path) and shape, in jax's order (sorted paths)
  # `offsets` as traced scalars (`at`), so that a kernel reading a leaf is one per shape; None: slices XLA knows.
  starts: Sequence[Any] | None = dataclasses.field(default=None, compare=False)

  @classmethod
  def of(cls, variables: Variables) -> "FlatLayout":
    """The layout of ``variables`` (arrays or shape structs)."""
    return cls(tuple((path, tuple(leaf.shape))
                     for path, leaf in sorted(traverse_util.flatten_dict(dict(variables)).items())))

  @property
  def offsets(self) -> tuple[np.int32, ...]:
    """Every leaf's first element in its collection's vector, in the layout's order."""
    starts, ends = [], {}
    for path, shape in self.leaves:
      starts.append(np.int32(ends.get(path[0], 0)))
      ends[path[0]] = ends.get(path[0], 0) + math.prod(shape)
    return tuple(starts)

  def at(self, starts: Sequence[Any]) -> "FlatLayout":
    """This layout reading its leaves at ``starts`` (`offsets`, passed into the program as arguments)."""
    return dataclasses.replace(self, starts=tuple(starts))

  def ravel(self, variables: Variables) -> dict[str, jax.Array]:
    """Each collection of ``variables`` (the layout's or some of them) as one vector, its leaves in order."""
    flat = traverse_util.flatten_dict(dict(variables))
    vectors: dict[str, list[jax.Array]] = {}
    for path, _ in self.leaves:
      if path[0] in variables:
        vectors.setdefault(path[0], []).append(jnp.ravel(flat[path]))
    return {name: jnp.concatenate(parts) for name, parts in vectors.items()}

  def unravel(self, flat: dict[str, jax.Array]) -> Variables:
    """The variables tree of ``flat`` (`ravel`'s inverse; leading axes before the vectors' are kept)."""
    leaves, starts = {}, self.offsets if self.starts is None else self.starts
    for name, vector in flat.items():
      members = [(i, path, shape) for i, (path, shape) in enumerate(self.leaves) if path[0] == name]
      shapes, at = tuple(shape for _, _, shape in members), tuple(starts[i] for i, _, _ in members)
      # (not for differentiation: autodiff's gradient of a read is a vector-sized update per leaf; a
      # differentiated function reads the leaves first, see `client.local.LocalTrainer.train_step`)
      if self.starts is None:
        values = [jax.lax.slice_in_dim(vector, s, s + math.prod(shape), axis=-1)
                  for s, shape in zip(map(int, at), shapes)]
      else:
        values = [jax.lax.dynamic_slice_in_dim(vector, s, math.prod(shape), axis=-1, allow_negative_indices=False)
                  for s, shape in zip(at, shapes)]
      values = [jax.lax.reshape(v, vector.shape[:-1] + shape) for v, shape in zip(values, shapes)]
      leaves.update({path: value for (_, path, _), value in zip(members, values)})
    return traverse_util.unflatten_dict(leaves)

