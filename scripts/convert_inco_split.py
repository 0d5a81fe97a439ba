"""Converts the InCo authors' fixed client split into a ``--partition-file``.

The authors' ``fed_experiments/InCo/fix_distribution/hetero-fix-100-0.5.npy``
(ChanYunHin/InCo-Aggregation) is a .npy holding one pickled object: a dict
{client: list (or array) of training-image indices}, keys 0..99. Their client
rank r (1..100) trains on entry r - 1, which becomes our client r - 1, so
contiguous groups of 20 clients line up with theirs. The pickle is read with an
unpickler that can rebuild numpy arrays, dtypes and scalars and nothing else:
any other global (a function a crafted file could call) is refused.

  python scripts/convert_inco_split.py hetero-fix-100-0.5.npy inco_split.npz
  python -m experiments.fmnist --preset inco-authors-cpu --partition-file inco_split.npz
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from fedjax_hetero.data import save_partition_file

# Looked up from numpy itself, so the module paths of numpy 1 (numpy.core) and 2 (numpy._core) both resolve.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_SCALAR = np.int64(0).__reduce__()[0]
_ALLOWED: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
  _ALLOWED[(_module, "_reconstruct")] = _RECONSTRUCT
  _ALLOWED[(_module, "scalar")] = _SCALAR


class NumpyOnlyUnpickler(pickle.Unpickler):
  """Unpickles plain containers and numpy arrays; raises `pickle.UnpicklingError` on any other global."""

  def find_class(self, module: str, name: str) -> Any:
    try:
      return _ALLOWED[(module, name)]
    except KeyError:
      raise pickle.UnpicklingError(f"refusing to load the global {module}.{name}: only numpy arrays are "
                                   "allowed in a split file") from None


def load_split(stream: BinaryIO) -> dict[Any, Any]:
  """The dict a .npy object array (or a bare pickle) holds, read with `NumpyOnlyUnpickler`."""
  if stream.read(6) == b"\x93NUMPY":
    stream.seek(0)
    version = npy_format.read_magic(stream)
    read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
    shape, _, dtype = read_header(stream)
    if dtype != np.dtype(object) or shape != ():
      raise ValueError(f"expected a .npy holding one pickled object, got dtype {dtype} shape {shape}")
  else:
    stream.seek(0)
  loaded = NumpyOnlyUnpickler(stream).load()
  split = loaded.item() if isinstance(loaded, np.ndarray) and loaded.shape == () else loaded
  if not isinstance(split, dict):
    raise ValueError(f"expected a dict {{client: indices}}, got {type(split).__name__}")
  return split


def split_parts(split: dict[Any, Any]) -> list[np.ndarray]:
  """The clients' index arrays, client 0 first; the keys must be the integers 0..K-1."""
  keys = sorted(int(k) for k in split)
  if keys != list(range(len(split))):
    raise ValueError(f"expected the client keys 0..{len(split) - 1}, got {keys[:5]}...")
  return [np.asarray(split[k], np.int64).reshape(-1) for k in keys]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", help="the authors' split, e.g. hetero-fix-100-0.5.npy")
  parser.add_argument("target", help="the .npz to write (keys 0..K-1, one index array per client)")
  args = parser.parse_args(argv)
  with open(args.source, "rb") as f:
    parts = split_parts(load_split(io.BytesIO(f.read())))
  save_partition_file(args.target, parts)
  sizes = np.array([len(p) for p in parts])
  every = np.concatenate(parts)
  print(f"{args.target}: {len(parts)} clients, sizes {sizes.min()}-{sizes.max()} (total {sizes.sum()}, "
        f"{len(np.unique(every))} distinct), indices {every.min()}-{every.max()}", file=sys.stderr)


if __name__ == "__main__":
  main()
