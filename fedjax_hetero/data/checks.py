"""Checks of data handed to the library (images, labels, class counts, normalization, client index lists).

Each raises a ValueError that names the argument, the bad value and what is accepted. They run on host
arrays before anything is placed on a device or traced, so a wrong input fails where it was given instead of
as a NaN loss or a silently clamped gather many steps later.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np


def _dtype(values: Any) -> np.dtype:
  return values.dtype if hasattr(values, "dtype") else np.asarray(values).dtype


def check_num_classes(name: str, value: Any) -> int:
  """An integer >= 2 (a classifier of one class learns nothing)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 2:
    raise ValueError(f"{name} must be an integer >= 2, got {value!r}")
  return int(value)


def check_images(name: str, images: Any) -> tuple[int, ...]:
  """uint8 pixels [N, H, W, C] (0-255, as the loaders give them); returns the shape."""
  shape, dtype = tuple(np.shape(images)), _dtype(images)
  if dtype != np.uint8:
    hint = (" (floats in [0, 1]? multiply by 255, round and cast to uint8: the store normalizes pixels itself)"
            if np.issubdtype(dtype, np.floating) else "")
    raise ValueError(f"{name} must be uint8 pixels in [0, 255] of shape [N, H, W, C], got {dtype}{hint}")
  if len(shape) != 4:
    raise ValueError(f"{name} must have shape [N, H, W, C] (4 axes; add a channel axis for grey images), got {shape}")
  return shape


def check_labels(name: str, labels: Any, count: int, num_classes: int) -> None:
  """Integer class ids of shape [count], each in [0, num_classes)."""
  values = np.asarray(labels)
  if not np.issubdtype(values.dtype, np.integer) or values.shape != (count,):
    raise ValueError(f"{name} must be integer class ids of shape ({count},), one per image, got {values.dtype} "
                     f"{values.shape}")
  if values.size and (values.min() < 0 or values.max() >= num_classes):
    bad = int(values.min()) if values.min() < 0 else int(values.max())
    raise ValueError(f"{name} holds class {bad}, outside [0, {num_classes}) (num_classes={num_classes})")


def check_normalization(mean: Sequence[Any], std: Sequence[Any], channels: int) -> None:
  """One finite mean and one finite std > 0 per channel."""
  for name, values in (("mean", mean), ("std", std)):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != channels:
      raise ValueError(f"{name} needs one value per image channel ({channels}), got {values!r}")
    for i, value in enumerate(values):
      if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}[{i}] must be a finite number, got {value!r}")
      if name == "std" and value <= 0:
        raise ValueError(f"std[{i}] must be > 0 (pixels are divided by it), got {value!r}")


def check_disjoint(name: str, parts: Sequence[np.ndarray]) -> None:
  """Each sample id at most once in all of ``parts`` (one client's list, or two clients')."""
  every = np.concatenate([np.asarray(p, np.int64).ravel() for p in parts]) if len(parts) else np.zeros(0, np.int64)
  ids, counts = np.unique(every, return_counts=True)
  if not (counts > 1).any():
    return
  sample, count = int(ids[counts > 1][0]), int(counts[counts > 1][0])
  holders = [c for c, p in enumerate(parts) if np.any(np.asarray(p) == sample)]
  if len(holders) == 1:
    raise ValueError(f"{name}[{holders[0]}] lists sample id {sample} {count} times; a client holds each sample once")
  named = [f"{name}[{c}]" for c in holders[:4]] + (["more"] if len(holders) > 4 else [])
  shown = ", ".join(named[:-1]) + " and " + named[-1]
  raise ValueError(f"sample id {sample} is in {shown}; a partition gives each sample to one client "
                   f"({int((counts > 1).sum())} sample(s) are given more than once)")


def check_parts(name: str, parts: Sequence[Any], num_samples: int) -> None:
  """One non-empty 1-D integer array of sample ids per client, each id in [0, num_samples). (Clients may share
  samples here, as a benchmark's pool does; a partition file may not: `check_disjoint`.)"""
  if isinstance(parts, (str, bytes, np.ndarray)) or not hasattr(parts, "__len__") or not len(parts):
    raise ValueError(f"{name} must be a non-empty sequence of per-client sample-id arrays, got {type(parts).__name__}")
  for client, part in enumerate(parts):
    ids = check_sample_ids(f"{name}[{client}]", part, num_samples, "images")
    if ids.size == 0:
      raise ValueError(f"{name}[{client}] holds no sample: every client needs at least one")


def check_sample_ids(name: str, ids: Any, num_samples: int | None = None, samples: str = "samples") -> np.ndarray:
  """A 1-D array of integer sample ids (empty too), each in [0, num_samples) when that is given; returns it."""
  ids = np.asarray(ids)
  if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
    raise ValueError(f"{name} must be a 1-D array of integer sample ids, got {ids.dtype} {ids.shape}")
  if num_samples is not None and ids.size and (ids.min() < 0 or ids.max() >= num_samples):
    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
    raise ValueError(f"{name} holds sample id {bad}, outside the {num_samples} {samples} [0, {num_samples})")
  return ids


def check_image_shape(name: str, shape: Any) -> tuple[int, int, int]:
  """(H, W, C), three integers >= 1."""
  if (isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 3
      or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 1 for d in shape)):
    raise ValueError(f"{name} must be (H, W, C), three integers >= 1, got {shape!r}")
  return tuple(int(d) for d in shape)  # type: ignore[return-value]
