"""Input checks shared by the aggregators, one short function per check.

Every check raises a ValueError naming the argument, the leaf path where
relevant, the bad value and what is allowed. Length, structure and shape
checks are static and run while tracing; value checks (finite, range) run only
on concrete values, never on a `jax.core.Tracer`, so jitted callers pay
nothing and get bit-for-bit the same program.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.hetero.maps import SubmodelMap


def is_concrete(value: Any) -> bool:
  """True unless ``value`` is being traced (under jit, vmap, grad, ...)."""
  return not isinstance(value, jax.core.Tracer)


def _key_name(key: Any) -> str:
  if isinstance(key, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
    return str(key.key)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  return str(key)


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """``{"params/dense/kernel": shape, ...}`` of every leaf of ``tree``."""
  return {"/".join(_key_name(k) for k in path): tuple(np.shape(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_lengths(sequences: Mapping[str, Any]) -> int:
  """Every per-group sequence is a sequence (not a single tree) with the same number of entries; returns it."""
  for name, seq in sequences.items():
    if isinstance(seq, Mapping) or not hasattr(seq, "__len__"):
      raise ValueError(f"{name} must be a sequence with one entry per group, got a {type(seq).__name__}")
  lengths = {name: len(seq) for name, seq in sequences.items()}
  if len(set(lengths.values())) > 1:
    listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
    raise ValueError(f"per-group sequences differ in length ({listed}); each needs one entry per group")
  return next(iter(lengths.values()), 0)


def check_tree(name: str, tree: Any, expected: Mapping[str, tuple[int, ...]], source: str) -> None:
  """``tree`` has exactly the leaf paths of ``expected``, each with the expected shape (``source`` says whose)."""
  got = leaf_shapes(tree)
  missing = [path for path in expected if path not in got]
  if missing:
    raise ValueError(f"{name} is missing leaf {missing[0]}, expected by {source}")
  extra = [path for path in got if path not in expected]
  if extra:
    raise ValueError(f"{name} has leaf {extra[0]}, not expected by {source}")
  for path, shape in expected.items():
    if got[path] != tuple(shape):
      raise ValueError(f"{name} leaf {path} has shape {got[path]}; {source} requires {tuple(shape)}")


def check_like(name: str, tree: Any, reference_name: str, reference: Any) -> None:
  """``tree`` has the leaf paths and shapes of ``reference``."""
  check_tree(name, tree, leaf_shapes(reference), reference_name)


def check_submodel_maps(name: str, group_maps: Sequence[Any], global_name: str, global_like: Any) -> None:
  """Every map is a `SubmodelMap` of a model that has every leaf of ``global_like``, at its shape."""
  global_shapes = leaf_shapes(global_like)
  for i, group_map in enumerate(group_maps):
    if not isinstance(group_map, SubmodelMap):
      raise ValueError(f"{name}[{i}] must be a SubmodelMap, got a {type(group_map).__name__}")
    known = {"/".join(path): tuple(shape) for path, shape in group_map.global_shapes}
    for path, shape in global_shapes.items():
      if path not in known:
        raise ValueError(f"{global_name} has leaf {path}, which the global model of {name}[{i}] does not have")
      if shape != known[path]:
        raise ValueError(f"{global_name} leaf {path} has shape {shape}; {name}[{i}] requires {known[path]}")


def group_shapes(group_map: SubmodelMap, global_like: Any) -> dict[str, tuple[int, ...]]:
  """Leaf path -> shape of the group's own (sub-model) leaves that the map pushes into ``global_like``."""
  global_paths = set(leaf_shapes(global_like))
  return {"/".join(link.client): tuple(link.window.shape) for link in group_map.push
          if "/".join(link.global_) in global_paths}


def check_group_trees(name: str, trees: Sequence[Any], maps_name: str, group_maps: Sequence[SubmodelMap],
                      global_name: str, global_like: Any) -> None:
  """Every group's tree has exactly its sub-model's leaves (those mapped into ``global_like``) and shapes."""
  for i, (tree, group_map) in enumerate(zip(trees, group_maps)):
    check_tree(f"{name}[{i}]", tree, group_shapes(group_map, global_like),
               f"{maps_name}[{i}] (its sub-model's leaves in {global_name})")


def check_groups(global_name: str, global_like: Any, group_maps: Sequence[SubmodelMap], group_weights: Sequence[Any],
                 offset=0, trees_name: str | None = None, group_trees: Sequence[Any] = ()) -> None:
  """The shared checks of the per-group rules (lengths, maps, group-shaped trees, weights, offset)."""
  sequences = {"group_weights": group_weights, "group_maps": group_maps}
  if trees_name is not None:
    sequences = {trees_name: group_trees, **sequences}
  check_lengths(sequences)
  check_submodel_maps("group_maps", group_maps, global_name, global_like)
  if trees_name is not None:
    check_group_trees(trees_name, group_trees, "group_maps", group_maps, global_name, global_like)
  check_weights("group_weights", group_weights)
  check_scalar("offset", offset)
  check_integer("offset", offset)


def check_shape(name: str, value: Any, shape: tuple[int | None, ...]) -> None:
  """``value`` has ``shape`` (None: any size on that axis)."""
  got = tuple(np.shape(value))
  if len(got) != len(shape) or any(want is not None and g != want for g, want in zip(got, shape)):
    wanted = "(" + ", ".join("any" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    raise ValueError(f"{name} has shape {got}; it must have shape {wanted}")


def check_scalar(name: str, value: Any) -> None:
  if np.ndim(value) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {tuple(np.shape(value))}")


def check_numeric(name: str, value: Any) -> None:
  """A number or an array of numbers (not None, text or an object array that numpy would fail on unnamed)."""
  dtype = _dtype(value) if value is not None and not isinstance(value, (str, bytes)) else None
  if dtype is None or not jnp.issubdtype(dtype, jnp.number):  # (jnp's: bfloat16 is a number)
    raise ValueError(f"{name} must be a number, got {value!r}" + (f" (dtype {dtype})" if dtype is not None else ""))


def check_weight(name: str, value: Any) -> None:
  """A scalar weight: a number, finite and >= 0 (when concrete)."""
  check_numeric(name, value)
  check_scalar(name, value)
  if is_concrete(value):
    number = float(np.asarray(value))
    if not (math.isfinite(number) and number >= 0):
      raise ValueError(f"{name} is {number}; a weight must be finite and >= 0")


def check_weights(name: str, weights: Sequence[Any], positive_total: bool = True) -> None:
  """Scalar weights, each finite and >= 0, and (``positive_total``) summing to more than 0 (when concrete)."""
  for i, weight in enumerate(weights):
    check_weight(f"{name}[{i}]", weight)
  if positive_total and all(is_concrete(w) for w in weights):
    total = sum(float(np.asarray(w)) for w in weights)
    if total <= 0:
      raise ValueError(f"{name} sum to {total} over {len(weights)} groups; at least one weight must be positive")


def check_weight_tree(name: str, tree: Any) -> None:
  """Every element of every concrete leaf is finite and >= 0."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not is_concrete(leaf):
      continue
    values = np.asarray(leaf)
    bad = ~(np.isfinite(values) & (values >= 0))
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{name} leaf {'/'.join(_key_name(k) for k in path)} holds {values[where]} at {where}; "
                       "weights must be finite and >= 0")


def check_floating(name: str, tree: Any) -> None:
  """Every leaf is floating point (bfloat16 included): a mean of integer or bool leaves (a step counter) would
  come back float or truncated, and the aggregators never change a leaf's dtype. Static: jitted callers pay
  nothing."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not jnp.issubdtype(_dtype(leaf), jnp.floating):
      raise ValueError(f"{name} leaf {_path_name(path)} is {_dtype(leaf)}; the aggregators take floating-point "
                       "weights only: take integer and bool leaves (e.g. a step counter) out of the tree and keep "
                       "them yourself")


def check_float_tree(name: str, tree: Any) -> None:
  """Every leaf is floating point (`check_floating`) and, when concrete, finite (a NaN weight has no norm,
  share or mean to aggregate)."""
  check_floating(name, tree)
  check_finite(name, tree)


def check_finite(name: str, tree: Any) -> None:
  """Every concrete leaf is finite: one NaN or inf of a client's upload would spread into every weight of its
  layer's mean, with no error."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_concrete(leaf) and not np.isfinite(np.asarray(leaf)).all():
      raise ValueError(f"{name} leaf {_path_name(path)} holds a non-finite value (NaN or inf); the aggregators "
                       "take finite weights")


def is_weightless(weight: Any) -> bool:
  """Whether ``weight`` is known (not traced) to be 0: its group's sums are then not read at all."""
  return is_concrete(weight) and float(np.asarray(weight)) == 0.0


def check_finite_where_weighted(name: str, trees: Sequence[Any], weights: Sequence[Any]) -> None:
  """`check_finite` on each entry of ``trees`` whose weight is not known to be 0 (a weight-0 entry is not read)."""
  for i, (tree, weight) in enumerate(zip(trees, weights)):
    if not is_weightless(weight):
      check_finite(f"{name}[{i}]", tree)


def _path_name(path: Any) -> str:
  return "/".join(_key_name(k) for k in path) or "(the array)"


def _dtype(value: Any) -> np.dtype:
  return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype


def check_integer(name: str, value: Any) -> None:
  """An integer (array), not a float or bool that would be silently truncated."""
  dtype = _dtype(value)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} must hold integers, got dtype {dtype}")


def check_round(name: str, value: Any) -> None:
  """A round index: an integer scalar, >= 0 when concrete (a traced one passes)."""
  if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
    raise ValueError(f"{name} must be an integer round index, got {value!r}")
  check_scalar(name, value)
  check_integer(name, value)
  if is_concrete(value) and int(np.asarray(value)) < 0:
    raise ValueError(f"{name} is {int(np.asarray(value))}; a round index is >= 0")


def check_index_range(name: str, value: Any, size: int) -> None:
  """Integer indices in [0, size) (the range only when concrete)."""
  check_integer(name, value)
  if is_concrete(value):
    values = np.asarray(value)
    bad = (values < 0) | (values >= size)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{name} holds {values[where]} at {where}; indices must be in [0, {size})")


def check_no_self_index(name: str, value: Any) -> None:
  """Row i of integer indices never holds i (a model is not its own partner; only when concrete)."""
  if is_concrete(value):
    values = np.asarray(value)
    rows = np.arange(values.shape[0]).reshape((-1,) + (1,) * (values.ndim - 1))
    bad = values == rows
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{name}[{', '.join(map(str, where))}] is {where[0]}, slot {where[0]} itself; each slot "
                       "must be mixed with another slot's model")


def check_unit_interval(name: str, value: Any) -> None:
  """A scalar in [0, 1] (the range only when concrete)."""
  check_scalar(name, value)
  if is_concrete(value):
    number = float(np.asarray(value))
    if not 0.0 <= number <= 1.0:
      raise ValueError(f"{name} is {number}; it must be in [0, 1]")
