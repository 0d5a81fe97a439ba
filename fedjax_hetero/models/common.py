"""Pieces shared by the model zoo: width scaling, BN masks and cut-point runs.

Every model is a sequence of named *parts*; the output of a part is the
activation at the cut point of the same name. `run_parts` executes the parts
strictly after `start` up to and including `stop`, which is what lets callers
split a model anywhere (e.g. features -> logits for a classifier-only update).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
Part = tuple[str, Callable[[Array], Array]]


def scale_channels(channels: int, width: float) -> int:
  """Hidden channel count under a width multiplier (never below 1)."""
  return max(1, int(round(channels * width)))


def bn_mask(mask: Array | None, x: Array) -> Array | None:
  """Reshapes a per-example mask [B] to broadcast against `x` ([B,1,1,1] for NHWC).

  flax's `BatchNorm(mask=...)` takes the mask as a `where=` of its mean
  reductions, so it must broadcast to the full input shape.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != (x.shape[0],):
    raise ValueError(f"mask must have shape [batch]={(x.shape[0],)}, got {mask.shape}")
  return mask.astype(bool).reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def run_parts(parts: Sequence[Part], x: Array, start: str, stop: str) -> Array:
  """Applies the parts after cut point `start` through `stop` inclusive.

  The cut points are "input" followed by the part names. `start == stop`
  returns `x` unchanged; `start` after `stop` is an error.
  """
  cut_points = ("input",) + tuple(name for name, _ in parts)
  for arg, value in (("start", start), ("stop", stop)):
    if value not in cut_points:
      raise ValueError(f"unknown {arg} cut point {value!r}; expected one of {cut_points}")
  first, last = cut_points.index(start), cut_points.index(stop)
  if first > last:
    raise ValueError(f"start {start!r} comes after stop {stop!r} in {cut_points}")
  for _, fn in parts[first:last]:
    x = fn(x)
  return x
