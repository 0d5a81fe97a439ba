"""In-memory image classification datasets as uint8 NHWC numpy arrays."""

from __future__ import annotations

import dataclasses
import gzip
import numbers
import os
import zlib
from typing import Any

import numpy as np

from fedjax_hetero.data import checks
from fedjax_hetero.validation import check_integer, check_number

# cifar100_coarse: CIFAR-100 with its 20 superclass labels (the FedCross authors' code trains on these).
DATASETS: tuple[str, ...] = ("fashion_mnist", "cifar10", "cifar100", "cifar100_coarse", "svhn_cropped", "synthetic")

DATA_DIR_ENV = "FEDJAX_HETERO_DATA_DIR"
FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
FASHION_MNIST_IMAGE_SHAPE = (28, 28)
FASHION_MNIST_CLASSES = 10

# Standard published per-channel constants, in [0, 1] pixel units.
_NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn_cropped": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
TFDS_DATASETS: tuple[str, ...] = ("cifar10", "cifar100", "svhn_cropped")

_IDX_UBYTE = 0x08


class DataNotFoundError(RuntimeError):
  """Raised when a dataset's files cannot be found or prepared."""


class CorruptDataError(DataNotFoundError, ValueError):
  """Raised when a dataset's file is there but truncated or corrupt; names the file and how to get it again.
  Also a ValueError: a file's content is a bad value, as a malformed IDX header always was."""


def _fashion_mnist_refetch_hint(path: str) -> str:
  if os.path.dirname(os.path.abspath(path)) == FASHION_MNIST_SYSTEM_DIR:
    return ("get it again: apt-get install --reinstall dataset-fashion-mnist (apt-get install "
            f"dataset-fashion-mnist puts fresh copies into {FASHION_MNIST_SYSTEM_DIR})")
  return (f"get it again: apt-get install dataset-fashion-mnist puts good copies into {FASHION_MNIST_SYSTEM_DIR} "
          "(add --reinstall if it is installed); copy them over this one or drop --data-dir to use them")


def _corrupt(path: str, problem: str) -> CorruptDataError:
  return CorruptDataError(f"Fashion-MNIST file {path} is truncated or corrupt ({problem}); "
                          f"{_fashion_mnist_refetch_hint(path)}")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: arrays make field-wise ==/hash meaningless.
class ArrayDataset:
  """A train/test image classification dataset held in host memory.

  Images are uint8 [N, H, W, C]; labels are int32 [N]. `mean`/`std` are
  per-channel constants in [0, 1] pixel units for (x / 255 - mean) / std.
  """

  name: str
  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int
  mean: tuple[float, ...]
  std: tuple[float, ...]

  def __post_init__(self) -> None:
    checks.check_num_classes("num_classes", self.num_classes)
    for split in ("train", "test"):
      images = getattr(self, f"{split}_images")
      labels = getattr(self, f"{split}_labels")
      if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(
            f"{split}_images must be uint8 [N,H,W,C], got {images.dtype} {images.shape}")
      if labels.dtype != np.int32 or labels.shape != images.shape[:1]:
        raise ValueError(
            f"{split}_labels must be int32 [{images.shape[0]}], got {labels.dtype} {labels.shape}")
      if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
        raise ValueError(f"{split}_labels must lie in [0, {self.num_classes})")
    if self.train_images.shape[1:] != self.test_images.shape[1:]:
      raise ValueError(
          f"train/test image shapes differ: {self.train_images.shape[1:]} vs "
          f"{self.test_images.shape[1:]}")
    checks.check_normalization(self.mean, self.std, self.train_images.shape[-1])

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """(H, W, C) of one image."""
    return tuple(self.train_images.shape[1:])  # type: ignore[return-value]

  def subset(self, num_train: int | None, num_test: int | None, seed: int = 0) -> ArrayDataset:
    """A class-balanced random subset (None keeps a split whole); deterministic in `seed`. The test subset is the
    same whatever ``num_train`` is (a whole training split draws its permutation too, and drops it)."""
    check_integer("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    train_idx = _balanced_choice(self.train_labels, num_train, rng, "num_train")
    test_idx = _balanced_choice(self.test_labels, num_test, rng, "num_test")
    return dataclasses.replace(
        self,
        train_images=self.train_images[train_idx],
        train_labels=self.train_labels[train_idx],
        test_images=self.test_images[test_idx],
        test_labels=self.test_labels[test_idx],
    )


def _balanced_choice(labels: np.ndarray, n: int | None, rng: np.random.Generator, name: str) -> np.ndarray:
  """Sorted indices of n samples drawn round-robin over classes in random order."""
  total = len(labels)
  if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= total):
    raise ValueError(f"{name} must be None or an integer in [0, {total}] (the samples of the split), got {n!r}")
  perm = rng.permutation(total)  # (drawn for a whole split too: the draws after it do not depend on n)
  if n is None:
    return np.arange(total)
  shuffled = labels[perm]
  order = np.argsort(shuffled, kind="stable")
  sorted_labels = shuffled[order]
  # Rank of each sample within its class; taking the lowest ranks first
  # balances the classes as far as their sizes allow.
  rank = np.empty(total, dtype=np.int64)
  rank[order] = np.arange(total) - np.searchsorted(sorted_labels, sorted_labels, side="left")
  return np.sort(perm[np.argsort(rank, kind="stable")[:n]])


def resize_images(images: np.ndarray, size: int, chunk: int = 4096) -> np.ndarray:
  """uint8 [N, H, W, C] images resized to [N, size, size, C] by `jax.image.resize` "bilinear", rounded back to uint8.

  Upsampling (Fashion-MNIST 28 -> 32) gives torch's ``F.interpolate(mode="bilinear", align_corners=False)``, which
  is torchvision's ``Resize`` on a tensor: half-pixel centres, edges clamped. Downsampling is antialiased (the
  triangle filter widened by the scale, as PIL does; not checked against torchvision). The rounding is at most half
  a grey level (0.002 in [0, 1] units) away from the float images torchvision would give.
  """
  import jax  # only here: the data module is otherwise numpy
  import jax.numpy as jnp

  check_integer("size", size, minimum=1)
  check_integer("chunk", chunk, minimum=1)
  n, height, width, channels = checks.check_images("images", images)
  if (height, width) == (size, size):
    return images
  out = np.empty((n, size, size, channels), np.uint8)
  for start in range(0, n, chunk):
    x = jnp.asarray(images[start:start + chunk], jnp.float32)
    resized = jax.image.resize(x, (len(x), size, size, channels), "bilinear")
    out[start:start + len(x)] = np.clip(np.rint(np.asarray(resized)), 0, 255)
  return out


# --------------------------------------------------------------------------- IDX


def _read_idx(path: str, ndim: int) -> np.ndarray:
  """Parses an (optionally gzipped) IDX file of unsigned bytes; CorruptDataError if it cannot."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      raw = f.read()
  except PermissionError as e:
    raise DataNotFoundError(f"Fashion-MNIST file {path} cannot be read: {e}") from e
  except (EOFError, OSError, zlib.error) as e:  # truncated gzip, bad gzip header or CRC, bad deflate data
    raise _corrupt(path, f"{type(e).__name__}: {e}") from e
  header = 4 + 4 * ndim
  if len(raw) < 4:
    raise _corrupt(path, f"{len(raw)} bytes, fewer than the {header}-byte IDX header")
  if raw[0] != 0 or raw[1] != 0 or raw[2] != _IDX_UBYTE or raw[3] != ndim:
    expected = (_IDX_UBYTE << 8) | ndim
    raise _corrupt(path, f"bad IDX magic number {int.from_bytes(raw[:4], 'big')}, expected {expected} "
                         f"(ubyte, {ndim}-D)")
  if len(raw) < header:
    raise _corrupt(path, f"{len(raw)} bytes, fewer than the {header}-byte IDX header")
  dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
  if len(raw) - header != int(np.prod(dims)):
    raise _corrupt(path, f"header says {dims} but holds {len(raw) - header} data bytes")
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_idx_files(directory: str) -> list[str] | None:
  """Paths of the four Fashion-MNIST files (gzipped or not), or None if any is missing."""
  paths = []
  for name in FASHION_MNIST_FILES:
    for candidate in (name + ".gz", name):
      path = os.path.join(directory, candidate)
      if os.path.isfile(path):
        paths.append(path)
        break
    else:
      return None
  return paths


def _fashion_mnist_from_idx(paths: list[str]) -> ArrayDataset:
  train_x, train_y, test_x, test_y = (
      _read_idx(p, ndim) for p, ndim in zip(paths, (3, 1, 3, 1)))
  for x, y, x_path, y_path in ((train_x, train_y, paths[0], paths[1]), (test_x, test_y, paths[2], paths[3])):
    if len(x) != len(y):
      raise _corrupt(y_path, f"{len(y)} labels for the {len(x)} images of {x_path}")
    if x.shape[1:] != FASHION_MNIST_IMAGE_SHAPE:
      raise _corrupt(x_path, f"images of shape {x.shape[1:]}, expected {FASHION_MNIST_IMAGE_SHAPE}")
    if y.size and y.max() >= FASHION_MNIST_CLASSES:
      raise _corrupt(y_path, f"label {y.max()}, expected 0 to {FASHION_MNIST_CLASSES - 1}")
  _check_plausible(paths, train_x, train_y, test_x)
  mean, std = _NORMALIZATION["fashion_mnist"]
  return ArrayDataset(
      name="fashion_mnist",
      train_images=train_x[..., None].copy(),
      train_labels=train_y.astype(np.int32),
      test_images=test_x[..., None].copy(),
      test_labels=test_y.astype(np.int32),
      num_classes=FASHION_MNIST_CLASSES,
      mean=mean,
      std=std,
  )


def _check_plausible(paths: list[str], train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray) -> None:
  """Files that parse but cannot be Fashion-MNIST's training and test sets: the training images no more
  than the test images (60,000 and 10,000: the files of one split under the other's names), or training
  labels missing a class."""
  if len(train_x) <= len(test_x):
    raise CorruptDataError(
        f"Fashion-MNIST's training file {paths[0]} holds {len(train_x)} images and its test file {paths[2]} "
        f"{len(test_x)}: the training set is the larger one (60,000 against 10,000), so the train and test "
        f"files look swapped; {_fashion_mnist_refetch_hint(paths[0])}")
  missing = sorted(set(range(FASHION_MNIST_CLASSES)) - set(np.unique(train_y).tolist()))
  if missing:
    raise _corrupt(paths[1], f"its labels hold no image of class {', '.join(map(str, missing))}; Fashion-MNIST's "
                             f"training set holds all {FASHION_MNIST_CLASSES}")


def load_fashion_mnist(data_dir: str | None = None) -> ArrayDataset:
  """Loads Fashion-MNIST from IDX files, falling back to tfds.

  Search order: `data_dir` (only, if given), `$FEDJAX_HETERO_DATA_DIR/fashion-mnist`,
  `/usr/share/datasets/fashion-mnist`, then `tfds.data_source('fashion_mnist')`.
  """
  if data_dir is not None:
    paths = _find_idx_files(data_dir)
    if paths is None:
      raise DataNotFoundError(
          f"Fashion-MNIST IDX files not found in --data-dir {data_dir!r}; expected "
          f"{', '.join(FASHION_MNIST_FILES)} (each optionally with .gz)")
    return _fashion_mnist_from_idx(paths)

  candidates = [FASHION_MNIST_SYSTEM_DIR]
  if os.environ.get(DATA_DIR_ENV):
    candidates.insert(0, os.path.join(os.environ[DATA_DIR_ENV], "fashion-mnist"))
  for directory in candidates:
    paths = _find_idx_files(directory)
    if paths is not None:
      return _fashion_mnist_from_idx(paths)

  how_to = (
      "Fashion-MNIST not found. Get it one of these ways:\n"
      "  1. apt-get install dataset-fashion-mnist   (installs the IDX files into "
      f"{FASHION_MNIST_SYSTEM_DIR})\n"
      f"  2. pass --data-dir DIR (or set {DATA_DIR_ENV}=D with D/fashion-mnist) where the "
      f"directory holds {', '.join(FASHION_MNIST_FILES)} (optionally .gz)\n"
      "  3. pip install tensorflow-datasets   (downloads it on first use; needs network once)")
  try:
    return _load_tfds_dataset("fashion_mnist", None, "label")
  except DataNotFoundError as e:
    raise DataNotFoundError(f"{how_to}\n(tfds fallback failed: {e})") from e


# -------------------------------------------------------------------------- tfds


def _tfds_split(tfds: Any, name: str, split: str, data_dir: str | None, label_key: str):
  """Reads one tfds split into (uint8 images, int32 labels, num_classes)."""
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir)
  except Exception as e:  # tfds raises many types (network, missing files, missing extras).
    where = f"in data_dir {data_dir!r}" if data_dir else "in the default tfds data dir"
    raise DataNotFoundError(
        f"tfds dataset {name!r} (split {split!r}) is not prepared {where} and could not be "
        f"downloaded: {type(e).__name__}: {e}\n"
        "tfds needs network access once to download and prepare it, e.g.\n"
        f"  python -c \"import tensorflow_datasets as tfds; tfds.builder('{name}')"
        ".download_and_prepare()\"\n"
        "or pass --data-dir DIR pointing at a directory that holds prepared tfds data.") from e
  features = source.dataset_info.features
  if label_key not in features:
    raise ValueError(f"label_key {label_key!r} not in {name!r} features {sorted(features.keys())}")
  num_records = len(source)
  images = np.empty((num_records, *features["image"].shape), dtype=np.uint8)
  labels = np.empty(num_records, dtype=np.int32)
  for i in range(num_records):
    record = source[i]
    images[i] = record["image"]
    labels[i] = record[label_key]
  return images, labels, int(features[label_key].num_classes)


def _load_tfds_dataset(name: str, data_dir: str | None, label_key: str) -> ArrayDataset:
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise DataNotFoundError(
        f"Loading {name!r} needs tensorflow-datasets: pip install 'fedjax_hetero[tfds]'") from e
  train_x, train_y, num_classes = _tfds_split(tfds, name, "train", data_dir, label_key)
  test_x, test_y, _ = _tfds_split(tfds, name, "test", data_dir, label_key)
  mean, std = _NORMALIZATION[name]
  return ArrayDataset(
      name=name if label_key == "label" else f"{name}_{label_key}",
      train_images=train_x,
      train_labels=train_y,
      test_images=test_x,
      test_labels=test_y,
      num_classes=num_classes,
      mean=mean,
      std=std,
  )


def load_tfds(name: str, data_dir: str | None = None, label_key: str = "label") -> ArrayDataset:
  """Loads cifar10 / cifar100 / svhn_cropped via `tfds.data_source` (no TensorFlow needed).

  `label_key="coarse_label"` gives the 20 CIFAR-100 superclasses.
  """
  if name not in TFDS_DATASETS:
    raise ValueError(f"load_tfds supports {TFDS_DATASETS}, got {name!r}")
  return _load_tfds_dataset(name, data_dir, label_key)


# --------------------------------------------------------------------- synthetic


def synthetic_dataset(
    num_train: int = 512,
    num_test: int = 256,
    image_shape: tuple[int, int, int] = (8, 8, 1),
    num_classes: int = 4,
    seed: int = 0,
    noise_std: float = 32.0,
) -> ArrayDataset:
  """Easily learnable data: a fixed random uint8 prototype per class plus Gaussian noise."""
  checks.check_num_classes("num_classes", num_classes)
  check_integer("num_train", num_train, minimum=1)
  check_integer("num_test", num_test, minimum=0)
  image_shape = checks.check_image_shape("image_shape", image_shape)
  check_number("noise_std", noise_std, minimum=0)
  check_integer("seed", seed, minimum=0)
  rng = np.random.default_rng(seed)
  prototypes = rng.integers(0, 256, size=(num_classes, *image_shape)).astype(np.float32)

  def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
    noisy = prototypes[labels] + rng.normal(0.0, noise_std, size=(n, *image_shape))
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8), labels

  train_x, train_y = sample(num_train)
  test_x, test_y = sample(num_test)
  pixels = train_x.reshape(-1, image_shape[-1]) / 255.0
  mean = pixels.mean(axis=0)
  std = np.maximum(pixels.std(axis=0), 1e-3)
  return ArrayDataset(
      name="synthetic",
      train_images=train_x,
      train_labels=train_y,
      test_images=test_x,
      test_labels=test_y,
      num_classes=num_classes,
      mean=tuple(float(m) for m in mean),
      std=tuple(float(s) for s in std),
  )


def load_dataset(name: str, data_dir: str | None = None, **kwargs: Any) -> ArrayDataset:
  """Loads a dataset by name (one of DATASETS); kwargs go to the specific loader."""
  if name == "fashion_mnist":
    return load_fashion_mnist(data_dir, **kwargs)
  if name in TFDS_DATASETS:
    return load_tfds(name, data_dir, **kwargs)
  if name == "cifar100_coarse":
    return load_tfds("cifar100", data_dir, label_key="coarse_label", **kwargs)
  if name == "synthetic":
    return synthetic_dataset(**kwargs)
  raise ValueError(f"unknown dataset {name!r}; accepted: {', '.join(DATASETS)}")
