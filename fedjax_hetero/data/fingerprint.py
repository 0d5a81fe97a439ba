"""A cheap fingerprint of the data a run trains and evaluates on: each array's shape, dtype and a BLAKE2 digest.

Taken from what the run uses (the training images and labels after any subset or resize, the clients' index
table, the test images and labels), so it does not matter where the files came from: a copy of the same data
elsewhere has the same fingerprint, swapped or other files have another. Hashing the ~55 MB of Fashion-MNIST
takes about a tenth of a second.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np


def of_arrays(arrays: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
  """``{name: {"shape": [...], "dtype": "uint8", "blake2b": hex}}`` of host or device arrays."""
  out = {}
  for name, array in arrays.items():
    values = np.ascontiguousarray(np.asarray(array))
    out[name] = {"shape": list(values.shape), "dtype": str(values.dtype),
                 "blake2b": hashlib.blake2b(values.view(np.uint8).reshape(-1), digest_size=16).hexdigest()}
  return out


def of_data(store: Any, test_images: Any, test_labels: Any) -> dict[str, dict[str, Any]]:
  """The fingerprint of a run's data: its `FederatedStore` and its test set."""
  return of_arrays({"train_images": store.images, "train_labels": store.labels, "client_index_table": store.index_table,
                    "test_images": test_images, "test_labels": test_labels})


def _size(entry: Mapping[str, Any]) -> str:
  return "x".join(map(str, entry.get("shape", []))) + f" {entry.get('dtype', '?')}"


def differences(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """What differs between two fingerprints, one phrase per array (empty if they agree)."""
  out = []
  for name in sorted(set(recorded) | set(now)):
    before, after = recorded.get(name), now.get(name)
    if not isinstance(before, Mapping) or after is None:
      out.append(f"{name}: not in {'the record' if after is not None else 'this run'}")
    elif (before.get("shape"), before.get("dtype")) != (after["shape"], after["dtype"]):
      out.append(f"{name}: {_size(before)} then, {_size(after)} now")
    elif before.get("blake2b") != after["blake2b"]:
      out.append(f"{name}: the same size ({_size(after)}), other content")
  return out
