"""Static maps between an architecture group's variables and the global ones.

A group's model is a *sub-model* of the global (largest) model: it owns a
subset of the global leaves (depth: fewer blocks per stage) and, of each leaf
it owns, the leading slice along every axis (width: fewer channels, as in
HeteroFL). Models name their layers by structural position (`stage3_block1/
conv2`), so the correspondence is the identity on tree paths; the map records,
for every global leaf, the shape of the slice the group owns (or ``None``).

Everything here is static Python structure built once from shapes; the three
operations on arrays (`extract`, `embed`, `coverage`) are pure and jittable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import traverse_util

Variables = Any  # a nested dict pytree as returned by flax `Module.init`
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class GroupMap:
  """Which leading slice of each global leaf a group owns.

  Attributes:
    owned: for every global leaf path, the group's leaf shape, or ``None`` if
      the group does not have that layer (depth heterogeneity).
  """

  owned: Mapping[Path, tuple[int, ...] | None]

  def __hash__(self) -> int:  # static structure: usable as a jit static argument
    return hash(tuple(self.owned.items()))

  @property
  def paths(self) -> tuple[Path, ...]:
    return tuple(p for p, s in self.owned.items() if s is not None)

  def restrict(self, collection: str) -> "GroupMap":
    """The map of one variable collection (e.g. ``"params"``), for trees holding only that collection."""
    return GroupMap(owned={p: s for p, s in self.owned.items() if p[0] == collection})

  def num_owned(self) -> int:
    """Number of scalars the group owns."""
    total = 0
    for shape in self.owned.values():
      if shape is not None:
        size = 1
        for d in shape:
          size *= d
        total += size
    return total


def _flat_shapes(tree: Variables) -> dict[Path, tuple[int, ...]]:
  flat = traverse_util.flatten_dict(_as_dict(tree))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def _as_dict(tree: Variables) -> dict:
  # flax may hand back FrozenDict; flatten_dict wants a plain mapping.
  return {k: _as_dict(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def build_group_map(global_shapes: Variables, group_shapes: Variables, group_name: str = "group") -> GroupMap:
  """Builds the map of a group onto the global tree from the two trees' shapes.

  Accepts arrays or `jax.ShapeDtypeStruct` leaves (e.g. from `jax.eval_shape`).
  Raises ValueError naming the first leaf that is not a sub-slice of the global.
  """
  global_flat = _flat_shapes(global_shapes)
  group_flat = _flat_shapes(group_shapes)
  for path, shape in group_flat.items():
    if path not in global_flat:
      raise ValueError(f"{group_name}: layer {'/'.join(path)} does not exist in the global model; "
                       "every group must be a depth/width subset of the largest model")
    gshape = global_flat[path]
    if len(shape) != len(gshape) or any(s > g for s, g in zip(shape, gshape)):
      raise ValueError(f"{group_name}: layer {'/'.join(path)} has shape {shape}, which is not a "
                       f"leading slice of the global shape {gshape}")
  return GroupMap(owned={path: group_flat.get(path) for path in global_flat})


def pick_global(group_shapes: Sequence[Variables], names: Sequence[str]) -> int:
  """Index of the group every other group embeds into (the largest one)."""
  sizes = [sum(_size(s) for s in _flat_shapes(t).values()) for t in group_shapes]
  biggest = max(range(len(sizes)), key=sizes.__getitem__)
  for tree, name in zip(group_shapes, names):
    build_group_map(group_shapes[biggest], tree, name)  # raises if it does not embed
  return biggest


def _size(shape: tuple[int, ...]) -> int:
  n = 1
  for d in shape:
    n *= d
  return n


def _leading_slice(shape: tuple[int, ...]) -> tuple[slice, ...]:
  return tuple(slice(0, d) for d in shape)


def extract(global_vars: Variables, group_map: GroupMap) -> Variables:
  """The group's variables: its owned leading slice of each global leaf it owns."""
  flat = traverse_util.flatten_dict(_as_dict(global_vars))
  out = {path: flat[path][_leading_slice(shape)] for path, shape in group_map.owned.items() if shape is not None}
  return traverse_util.unflatten_dict(out)


def embed(group_vars: Variables, group_map: GroupMap, global_like: Variables) -> Variables:
  """Zero-pads a group-shaped tree to the global shapes (zeros where not owned)."""
  flat = traverse_util.flatten_dict(_as_dict(group_vars))
  like = traverse_util.flatten_dict(_as_dict(global_like))
  out = {}
  for path, target in like.items():
    shape = group_map.owned[path]
    if shape is None:
      out[path] = jnp.zeros(target.shape, target.dtype)
    else:
      pad = [(0, g - s) for s, g in zip(shape, target.shape)]
      out[path] = jnp.pad(flat[path].astype(target.dtype), pad)
  return traverse_util.unflatten_dict(out)


def coverage(group_map: GroupMap, global_like: Variables, dtype=jnp.float32) -> Variables:
  """A global-shaped 0/1 mask of the elements the group owns."""
  like = traverse_util.flatten_dict(_as_dict(global_like))
  out = {}
  for path, target in like.items():
    shape = group_map.owned[path]
    if shape is None:
      out[path] = jnp.zeros(target.shape, dtype)
    else:
      out[path] = jnp.pad(jnp.ones(shape, dtype), [(0, g - s) for s, g in zip(shape, target.shape)])
  return traverse_util.unflatten_dict(out)


def identity_map(tree: Variables) -> GroupMap:
  """The map of a model onto itself (one architecture = its own federation)."""
  return GroupMap(owned=_flat_shapes(tree))


def shapes_of(tree: Variables) -> Variables:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
