"""Sub-model maps: where a client's variables sit inside the global (server) variables.

Every client leaf is a *window* of one global leaf: the leading block of each
axis (HeteroFL's width slices; the whole leaf when the shapes are equal) or,
on *rolled* axes, a block that starts at an offset and wraps around (FedRolex's
rolling window; the offset is a traced value, usually the round index, so a
new window compiles nothing). A map has two sides:

* **pull** (`extract`): every client leaf <- its window of one global leaf;
* **push** (`embed`, `coverage`): every global leaf <- the sum of the client
  leaves placed into it, each at its window.

Normally push is pull inverted. Depth grafting (FedFA, `graft`) adds pushes of
a shallow client's last block into the deeper global blocks it lacks, so one
client leaf feeds several global leaves; several client leaves may also pull
one global leaf. The layer-wise mean over holders (`aggregators.
heterogeneous_sums`) only needs `embed` and `coverage`, so it serves every kind.

Groups of one shared federation may also keep *own* copies of some leaves
(`separate`, NeFL's inconsistent parameters): every group but the one whose
model the federation keeps pulls and pushes those client leaves through a
global leaf of its own, under the top-level key ``"own"`` (``("own",
"group2", "params", "stem_bn", "scale")``), at full shape. Nobody else pushes
into it, so the layer-wise mean over holders averages it over that group's
clients only; the kept group uses the leaves at their usual place. `complete`
adds the copies to the federation's initial variables.

Models name their layers by structural position (``stage3_block1/conv2``), so
the correspondence is found from shapes and tree paths, never by matching
parameter names. Maps are static, hashable Python structure built once; the
array operations are pure and jittable, and accept any subtree of the
variables (e.g. ``params`` only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

Variables = Any  # a nested dict pytree as returned by flax `Module.init`
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Window:
  """A client leaf's place in a global leaf: ``shape`` at the start of every axis, except that
  on the ``rolled`` axes it starts at the offset and wraps around."""

  shape: tuple[int, ...]
  rolled: tuple[int, ...] = ()

  def index(self, global_shape: tuple[int, ...], offset) -> tuple[Any, ...]:
    """Per axis: a static slice, or an index array for a rolled axis (use with `jnp.ix_` semantics)."""
    return tuple((offset + jnp.arange(n)) % g if axis in self.rolled else slice(0, n)
                 for axis, (n, g) in enumerate(zip(self.shape, global_shape)))

  def take(self, leaf: jax.Array, offset) -> jax.Array:
    if not self.rolled:
      return leaf[tuple(slice(0, n) for n in self.shape)]
    for axis, index in enumerate(self.index(leaf.shape, offset)):
      leaf = jnp.take(leaf, index, axis=axis) if axis in self.rolled else jax.lax.slice_in_dim(
          leaf, 0, index.stop, axis=axis)
    return leaf

  def place(self, leaf: jax.Array, global_shape: tuple[int, ...], dtype, offset) -> jax.Array:
    """``leaf`` put into zeros of ``global_shape`` at this window."""
    leaf = leaf.astype(dtype)
    if not self.shape:  # a scalar leaf (jnp.pad takes no empty padding)
      return leaf
    if not self.rolled:
      return jnp.pad(leaf, [(0, g - n) for n, g in zip(self.shape, global_shape)])
    index = [jnp.arange(n) if isinstance(i, slice) else i for i, n in zip(self.index(global_shape, offset), self.shape)]
    return jnp.zeros(global_shape, dtype).at[jnp.ix_(*index)].set(leaf)


@dataclasses.dataclass(frozen=True)
class Link:
  """One client leaf <-> one global leaf, at a window."""

  client: Path
  global_: Path
  window: Window


@dataclasses.dataclass(frozen=True)
class SubmodelMap:
  """A client model's place in the global one (see the module docstring).

  Attributes:
    pull: the link every client leaf is extracted through (one per client leaf).
    push: the links the global leaves are rebuilt from (any number per global leaf).
    global_shapes: every global leaf's shape, in path order.
  """

  pull: tuple[Link, ...]
  push: tuple[Link, ...]
  global_shapes: tuple[tuple[Path, tuple[int, ...]], ...]

  @property
  def owned(self) -> dict[Path, tuple[int, ...] | None]:
    """For every global leaf, the shape of the window the client holds of it (None: none)."""
    held = {link.global_: link.window.shape for link in self.push}
    return {path: held.get(path) for path, _ in self.global_shapes}

  def num_owned(self) -> int:
    """Number of scalars the client model holds."""
    return sum(math.prod(link.window.shape) for link in self.pull)

  @property
  def rolling(self) -> bool:
    return any(link.window.rolled for link in self.pull + self.push)


def _as_dict(tree: Variables) -> dict:
  # flax may hand back FrozenDict; flatten_dict wants a plain mapping.
  return {k: _as_dict(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def flatten(tree: Variables) -> dict[Path, Any]:
  """``{("params", "conv1", "kernel"): leaf, ...}`` of a nested-dict (or FrozenDict) pytree."""
  return traverse_util.flatten_dict(_as_dict(tree))


def _name(path: Path) -> str:
  return "/".join(path)


# Input checks of the public functions: structure and shapes only, so they run while tracing and add nothing
# to a jitted program.

ARRAYS, SHAPES = "an array", "an array or a jax.ShapeDtypeStruct"  # what a tree's leaves may be (`_leaf_shapes`)


def _leaf_shapes(function: str, name: str, tree: Mapping, expected: str) -> dict[Path, tuple[int, ...]]:
  """Every leaf's shape of the argument ``name`` of ``function``, once each leaf is what ``expected`` says: an
  array, or, where only shapes are used (`SHAPES`), also a `jax.ShapeDtypeStruct`."""
  shapes = {}
  for path, leaf in flatten(tree).items():
    is_array = hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    if not is_array or (expected == ARRAYS and isinstance(leaf, jax.ShapeDtypeStruct)):
      shape_given = isinstance(leaf, tuple) and all(isinstance(n, int) for n in leaf)
      hint = f" (for a shape, jax.ShapeDtypeStruct({leaf}, jnp.float32))" if shape_given and expected == SHAPES else ""
      raise TypeError(f"{function}: {name} leaf {_name(path)} is {type(leaf).__name__} {leaf!r:.40}; expected "
                      f"{expected}{hint}, as in a model's variables (model.init(...)"
                      f"{' or jax.eval_shape of it' if expected == SHAPES else ''})")
    shapes[path] = tuple(leaf.shape)
  return shapes


def _variables_shapes(function: str, name: str, tree: Variables) -> dict[Path, tuple[int, ...]]:
  """`_leaf_shapes` of a tree of arrays or shapes, once it is a tree."""
  if not isinstance(tree, Mapping):
    raise TypeError(f"{function}: {name} must be a model's variables (a nested dict of arrays or shapes, e.g. "
                    f"model.init(...) or jax.eval_shape of it), got {type(tree).__name__} {tree!r:.60}")
  return _leaf_shapes(function, name, tree, SHAPES)


def _check_map(group_map: Any) -> None:
  if not isinstance(group_map, SubmodelMap):
    raise ValueError(f"group_map must be a SubmodelMap, got a {type(group_map).__name__}")


def _check_tree(function: str, name: str, tree: Variables, leaves: str, expected: Mapping[Path, tuple[int, ...]],
                whose: str) -> None:
  """Every leaf of ``tree`` is one of ``expected``, at its shape (a subtree may leave leaves out), and is what
  ``leaves`` says (`_leaf_shapes`)."""
  if not isinstance(tree, Mapping):
    raise ValueError(f"{name} must be a nested dict of arrays, got a {type(tree).__name__}")
  for path, shape in _leaf_shapes(function, name, tree, leaves).items():
    if path not in expected:
      raise ValueError(f"{name} has leaf {_name(path)}, which {whose} does not have")
    if shape != tuple(expected[path]):
      raise ValueError(f"{name} leaf {_name(path)} has shape {shape}; {whose} has {tuple(expected[path])}")


def _check_global_tree(function: str, name: str, tree: Variables, group_map: SubmodelMap, leaves: str) -> None:
  _check_tree(function, name, tree, leaves, dict(group_map.global_shapes), "the global model of group_map")


def _check_client_tree(function: str, name: str, tree: Variables, group_map: SubmodelMap) -> None:
  _check_tree(function, name, tree, ARRAYS, {link.client: link.window.shape for link in group_map.pull},
              "the client model of group_map")


def _check_offset(offset: Any) -> None:
  dtype = offset.dtype if hasattr(offset, "dtype") else np.asarray(offset).dtype
  if np.ndim(offset) != 0 or not np.issubdtype(dtype, np.integer):
    raise ValueError(f"offset must be an integer scalar, got {dtype} of shape {tuple(np.shape(offset))}")


def build_group_map(global_shapes: Variables, group_shapes: Variables, group_name: str = "group",
                    rolling: bool = False) -> SubmodelMap:
  """The map of a depth/width sub-model, from the two trees' shapes (arrays or `jax.ShapeDtypeStruct`s).

  Every group leaf is the leading slice of the global leaf at the same path, or with ``rolling``
  a rolled window on every axis where it is narrower (FedRolex). Raises ValueError naming the first
  leaf that is not a sub-slice of the global one.
  """
  global_flat = _variables_shapes("build_group_map", "global_shapes", global_shapes)
  links = []
  for path, shape in _variables_shapes("build_group_map", "group_shapes", group_shapes).items():
    if path not in global_flat:
      raise ValueError(f"{group_name}: layer {_name(path)} does not exist in the global model; "
                       "every group must be a depth/width subset of the largest model")
    gshape = global_flat[path]
    if len(shape) != len(gshape) or any(s > g for s, g in zip(shape, gshape)):
      raise ValueError(f"{group_name}: layer {_name(path)} has shape {shape}, which is not a "
                       f"leading slice of the global shape {gshape}")
    rolled = tuple(a for a, (s, g) in enumerate(zip(shape, gshape)) if s < g) if rolling else ()
    links.append(Link(path, path, Window(shape, rolled)))
  return SubmodelMap(tuple(links), tuple(links), tuple(global_flat.items()))


def identity_map(tree: Variables) -> SubmodelMap:
  """The map of a model onto itself (one architecture is its own federation)."""
  _variables_shapes("identity_map", "tree", tree)
  return build_group_map(tree, tree)


def graft(group_map: SubmodelMap, blocks: Iterable[tuple[Path, Path]], group_name: str = "group") -> SubmodelMap:
  """``group_map`` with depth grafting (FedFA): each ``(global_block, client_block)`` pair of module
  paths (without the collection, e.g. ``("stage1_block2",), ("stage1_block0",)``) also pushes every
  leaf the client holds under ``client_block`` into the same leaf under ``global_block``.

  Raises ValueError if a grafted leaf has no global counterpart of the same shape (e.g. a client
  deeper than the global model).
  """
  shapes = dict(group_map.global_shapes)
  extra = []
  for global_block, client_block in blocks:
    width = len(client_block)
    found = False
    for link in group_map.pull:
      collection, rest = link.client[:1], link.client[1:]
      if rest[:width] != tuple(client_block):
        continue
      target = collection + tuple(global_block) + rest[width:]
      source_shape = shapes.get(link.global_)
      if shapes.get(target) != source_shape:
        raise ValueError(f"{group_name}: cannot graft {_name(link.client)} onto {_name(target)}: "
                         f"the global model has {'no such layer' if target not in shapes else shapes[target]}")
      extra.append(Link(link.client, target, link.window))
      found = True
    if not found:
      raise ValueError(f"{group_name}: the client model has no block {_name(client_block)} to graft")
  return dataclasses.replace(group_map, push=group_map.push + tuple(extra))


OWN = "own"  # top-level key of the groups' own leaves in a shared federation's variables (`separate`)


def separate(group_maps: Sequence[SubmodelMap], own: Sequence[Collection[Path]], keep: int,
             group_names: Sequence[str] | None = None) -> tuple[SubmodelMap, ...]:
  """The maps of one shared federation in which every group ``g != keep`` keeps its own copy of its client
  leaves ``own[g]`` (flattened paths, any collection): they link, at full shape, to the global leaf
  ``(OWN, f"group{g}") + path``, which every map lists among its global shapes and only group ``g`` pushes
  into. Group ``keep`` (the one whose model the federation keeps) uses its leaves in place. Other pushes of
  an own leaf (grafting) are dropped: an own leaf feeds its copy only. Raises ValueError naming the group
  if a path is not one of its client leaves.
  """
  if len(own) != len(group_maps):
    raise ValueError(f"own needs one set of paths per group map ({len(group_maps)}), got {len(own)}")
  names = list(group_names) if group_names is not None else [f"group{g}" for g in range(len(group_maps))]
  copies: list[dict[Path, Link]] = []
  for g, (group_map, paths) in enumerate(zip(group_maps, own)):
    _check_map(group_map)
    pulls = {link.client: link for link in group_map.pull}
    unknown = sorted(set(map(tuple, paths)) - set(pulls))
    if unknown:
      raise ValueError(f"{names[g]}: cannot keep {_name(unknown[0])} as its own: the group's model has no such leaf")
    copies.append({} if g == keep else {
        p: Link(p, (OWN, f"group{g}") + p, Window(pulls[p].window.shape)) for p in sorted(map(tuple, paths))})
  extra = tuple((link.global_, link.window.shape) for links in copies for link in links.values())
  out = []
  for group_map, links in zip(group_maps, copies):
    pull = tuple(links.get(link.client, link) for link in group_map.pull)
    push = tuple(link for link in group_map.push if link.client not in links) + tuple(links.values())
    out.append(SubmodelMap(pull, push, group_map.global_shapes + extra))
  return tuple(out)


def complete(global_vars: Variables, base_maps: Sequence[SubmodelMap], group_maps: Sequence[SubmodelMap],
             offset=0) -> Variables:
  """``global_vars`` with the global leaves that ``group_maps`` (`separate`'s) add: each copy starts as
  the group's leaf extracted through its map before separation, ``base_maps[g]``."""
  if not isinstance(global_vars, Mapping):
    raise ValueError(f"global_vars must be a nested dict of arrays, got a {type(global_vars).__name__}")
  _leaf_shapes("complete", "global_vars", global_vars, ARRAYS)
  flat = flatten(global_vars)
  for base, group_map in zip(base_maps, group_maps):
    origin = {link.client: link for link in base.pull}
    for link in group_map.pull:
      if link.global_ not in flat:
        source = origin[link.client]
        flat[link.global_] = source.window.take(flat[source.global_], offset)
  return traverse_util.unflatten_dict(flat)


def pick_global(group_shapes: Sequence[Variables], names: Sequence[str]) -> int:
  """Index of the group every other group embeds into (the largest one)."""
  if len(names) != len(group_shapes):
    raise ValueError(f"pick_global: names needs one name per group ({len(group_shapes)}), got {len(names)}")
  sizes = [sum(math.prod(s) for s in _variables_shapes("pick_global", f"group_shapes[{i}] ({name})", t).values())
           for i, (t, name) in enumerate(zip(group_shapes, names))]
  biggest = max(range(len(sizes)), key=sizes.__getitem__)
  for tree, name in zip(group_shapes, names):
    build_group_map(group_shapes[biggest], tree, name)  # raises if it does not embed
  return biggest


def extract(global_vars: Variables, group_map: SubmodelMap, offset=0) -> Variables:
  """The client's variables: each client leaf's window of its global leaf.

  Takes any subtree of the global variables (e.g. ``params`` only) and returns the matching subtree.
  """
  _check_map(group_map)
  _check_global_tree("extract", "global_vars", global_vars, group_map, ARRAYS)
  _check_offset(offset)
  flat = flatten(global_vars)
  out = {link.client: link.window.take(flat[link.global_], offset) for link in group_map.pull if link.global_ in flat}
  return traverse_util.unflatten_dict(out)


def embed(group_vars: Variables, group_map: SubmodelMap, global_like: Variables, offset=0) -> Variables:
  """Global-shaped tree: every global leaf is the sum of the client leaves pushed into it (zeros if none)."""
  _check_map(group_map)
  _check_client_tree("embed", "group_vars", group_vars, group_map)
  _check_global_tree("embed", "global_like", global_like, group_map, SHAPES)
  _check_offset(offset)
  flat = flatten(group_vars)
  pushes = _pushes(group_map)
  out = {}
  for path, target in flatten(global_like).items():
    placed = [link.window.place(flat[link.client], target.shape, target.dtype, offset)
              for link in pushes.get(path, ()) if link.client in flat]
    out[path] = sum(placed[1:], placed[0]) if placed else jnp.zeros(target.shape, target.dtype)
  return traverse_util.unflatten_dict(out)


def coverage(group_map: SubmodelMap, global_like: Variables, dtype=jnp.float32, offset=0) -> Variables:
  """Global-shaped count of the client elements pushed into every element (0/1 without grafting)."""
  _check_map(group_map)
  _check_global_tree("coverage", "global_like", global_like, group_map, SHAPES)
  _check_offset(offset)
  pushes = _pushes(group_map)
  out = {}
  for path, target in flatten(global_like).items():
    placed = [link.window.place(jnp.ones(link.window.shape, dtype), target.shape, dtype, offset)
              for link in pushes.get(path, ())]
    out[path] = sum(placed[1:], placed[0]) if placed else jnp.zeros(target.shape, dtype)
  return traverse_util.unflatten_dict(out)


def _pushes(group_map: SubmodelMap) -> dict[Path, list[Link]]:
  pushes: dict[Path, list[Link]] = {}
  for link in group_map.push:
    pushes.setdefault(link.global_, []).append(link)
  return pushes
