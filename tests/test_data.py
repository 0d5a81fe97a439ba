"""Tests for fedjax_hetero.data: loaders and client partitioners."""

import gzip
import os

import numpy as np
import pytest

from fedjax_hetero.data import (DATASETS, ArrayDataset, DataNotFoundError, class_counts, dirichlet, iid, iid_imbalanced,
                                load_dataset, load_fashion_mnist, load_tfds, partition, partition_report,
                                plot_partition, shards, synthetic_dataset)

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
NUM_CLASSES = 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
  """10 classes x 6000 samples, shuffled."""
  return np.random.default_rng(0).permutation(np.repeat(np.arange(NUM_CLASSES), 6000))


SPLITS = {
    "iid": lambda y, n, s: iid(y, n, s),
    "iid_imbalanced": lambda y, n, s: iid_imbalanced(y, n, s),
    "dirichlet": lambda y, n, s: dirichlet(y, n, alpha=0.5, seed=s),
    "shards": lambda y, n, s: shards(y, n, classes_per_client=2, seed=s),
}


# ---------------------------------------------------------------- partitioners


@pytest.mark.parametrize("scheme", sorted(SPLITS))
def test_partition_covers_every_sample_once(labels, scheme):
  parts = SPLITS[scheme](labels, 20, 0)
  assert len(parts) == 20
  assert all(p.dtype == np.int64 for p in parts)
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
  via_dispatcher = partition(labels, scheme, 20, seed=0)
  assert all(np.array_equal(a, b) for a, b in zip(parts, via_dispatcher))


@pytest.mark.parametrize("scheme", sorted(SPLITS))
def test_partition_is_deterministic_in_seed(labels, scheme):
  a, b, c = (SPLITS[scheme](labels, 20, s) for s in (3, 3, 4))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def test_iid_sizes_differ_by_at_most_one(labels):
  sizes = [len(p) for p in iid(labels[:1003], 7, seed=0)]
  assert max(sizes) - min(sizes) <= 1


def test_iid_imbalanced_sizes():
  y = np.zeros(200, dtype=np.int64)
  sizes = np.array([len(p) for p in iid_imbalanced(y, 150, seed=0, sigma=2.0)])
  assert sizes.min() >= 1 and sizes.sum() == 200
  wide = np.array([len(p) for p in iid_imbalanced(np.zeros(60000, int), 20, seed=0, sigma=1.0)])
  assert wide.max() > 2 * wide.min()


def test_dirichlet_min_size(labels):
  parts = dirichlet(labels, 50, alpha=0.1, seed=1, min_size=100)
  assert min(len(p) for p in parts) >= 100


def _mean_label_entropy(labels, parts):
  counts = class_counts(labels, parts, NUM_CLASSES).astype(float)
  p = counts / counts.sum(axis=1, keepdims=True)
  return float(np.mean(-np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)))


def test_dirichlet_alpha_controls_skew(labels):
  skewed = _mean_label_entropy(labels, dirichlet(labels, 20, alpha=0.1, seed=0))
  uniform = _mean_label_entropy(labels, dirichlet(labels, 20, alpha=100.0, seed=0))
  assert uniform > 0.95 * np.log(NUM_CLASSES)
  assert skewed < 0.6 * uniform


def test_dirichlet_infeasible_min_size_raises(labels):
  with pytest.raises(ValueError, match="min_size"):
    dirichlet(labels[:100], 10, alpha=0.5, seed=0, min_size=11)


def test_shards_limit_classes_per_client(labels):
  # 40 shards of 1500: class boundaries (every 6000) fall on shard boundaries.
  counts = class_counts(labels, shards(labels, 20, classes_per_client=2, seed=0), NUM_CLASSES)
  assert ((counts > 0).sum(axis=1) <= 2).all()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(scheme="dirichlet", alpha=-1.0), "-1.0"),
        (dict(scheme="dirichlet", alpha=0.0), "alpha must be a finite number > 0"),
        (dict(scheme="pathological"), "pathological"),
        (dict(scheme="iid", num_clients=70000), "num_clients=70000 exceeds the 60000"),
        (dict(scheme="iid", num_clients=0), "num_clients"),
        (dict(scheme="shards", classes_per_client=11), "11"),
        (dict(scheme="shards", classes_per_client=0), "classes_per_client"),
    ],
)
def test_partition_rejects_bad_input(labels, kwargs, needle):
  args = dict(num_clients=10, seed=0) | kwargs
  with pytest.raises(ValueError, match=needle):
    partition(labels, **args)


def test_unknown_scheme_lists_accepted(labels):
  with pytest.raises(ValueError, match="dirichlet"):
    partition(labels, "bogus", 10, seed=0)


def test_class_counts_report_and_plot(labels, tmp_path):
  parts = partition(labels, "dirichlet", 30, seed=0, alpha=0.3)
  counts = class_counts(labels, parts, NUM_CLASSES)
  assert counts.shape == (30, NUM_CLASSES)
  np.testing.assert_array_equal(counts.sum(axis=1), [len(p) for p in parts])
  np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(labels))

  report = partition_report(labels, parts, NUM_CLASSES)
  assert "clients: 30" in report and "first 20 of 30" in report

  path = tmp_path / "partition.png"
  plot_partition(counts, str(path), title="test")
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert path.stat().st_size > 1000


# -------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def fashion() -> ArrayDataset:
  if not os.path.isdir(FASHION_DIR):
    pytest.skip(f"{FASHION_DIR} absent (apt-get install dataset-fashion-mnist)")
  return load_fashion_mnist(FASHION_DIR)


def test_fashion_mnist_real_files(fashion):
  assert fashion.train_images.shape == (60000, 28, 28, 1)
  assert fashion.test_images.shape == (10000, 28, 28, 1)
  assert fashion.image_shape == (28, 28, 1)
  assert fashion.train_images.dtype == np.uint8 and fashion.train_labels.dtype == np.int32
  assert fashion.num_classes == 10
  for y in (fashion.train_labels, fashion.test_labels):
    assert y.min() >= 0 and y.max() < 10
  np.testing.assert_array_equal(np.bincount(fashion.train_labels), np.full(10, 6000))
  np.testing.assert_allclose(fashion.train_images.mean() / 255, fashion.mean[0], atol=1e-3)
  np.testing.assert_allclose(fashion.train_images.std() / 255, fashion.std[0], atol=1e-3)


def test_fashion_mnist_missing_data_dir_raises(tmp_path):
  with pytest.raises(DataNotFoundError, match=str(tmp_path)) as info:
    load_fashion_mnist(str(tmp_path))
  assert "train-images-idx3-ubyte" in str(info.value)


def _write_idx(path, array, compress):
  header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
      int(d).to_bytes(4, "big") for d in array.shape)
  with (gzip.open if compress else open)(path, "wb") as f:
    f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_env_dir_and_idx_parsing(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  directory = tmp_path / "fashion-mnist"
  directory.mkdir()
  arrays = {
      "train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
      "train-labels-idx1-ubyte": np.arange(12) % 10,
      "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28)),
      "t10k-labels-idx1-ubyte": np.arange(5),
  }
  for i, (name, array) in enumerate(arrays.items()):
    compress = i % 2 == 0  # Mix gzipped and raw files.
    _write_idx(directory / (name + (".gz" if compress else "")), array, compress)
  monkeypatch.setenv("FEDJAX_HETERO_DATA_DIR", str(tmp_path))
  ds = load_fashion_mnist()
  np.testing.assert_array_equal(ds.train_images[..., 0], arrays["train-images-idx3-ubyte"])
  np.testing.assert_array_equal(ds.test_labels, arrays["t10k-labels-idx1-ubyte"])

  _write_idx(directory / "train-labels-idx1-ubyte", np.zeros((12, 1)), compress=False)
  with pytest.raises(ValueError, match="magic"):
    load_fashion_mnist(str(directory))


def test_load_tfds_cifar10_mock():
  tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets not installed")
  with tfds.testing.mock_data(num_examples=6):
    ds = load_tfds("cifar10")
    coarse = load_dataset("cifar100", label_key="coarse_label")
    by_name = load_dataset("cifar100_coarse")
  assert by_name.num_classes == 20 and by_name.name == "cifar100_coarse_label"
  assert ds.train_images.shape == (6, 32, 32, 3) and ds.train_images.dtype == np.uint8
  assert ds.test_images.shape == (6, 32, 32, 3)
  assert ds.train_labels.dtype == np.int32 and ds.num_classes == 10
  assert ds.mean == (0.4914, 0.4822, 0.4465)
  assert coarse.num_classes == 20 and coarse.train_labels.max() < 20


def test_load_dataset_unknown_name():
  with pytest.raises(ValueError, match="nope") as info:
    load_dataset("nope")
  assert all(name in str(info.value) for name in DATASETS)


def test_synthetic_dataset_and_subset():
  ds = load_dataset("synthetic", num_train=100, num_test=40, image_shape=(6, 5, 3), num_classes=5)
  assert ds.train_images.shape == (100, 6, 5, 3) and ds.test_images.shape == (40, 6, 5, 3)
  assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
  assert ds.image_shape == (6, 5, 3) and len(ds.mean) == len(ds.std) == 3
  assert set(np.unique(ds.train_labels)) == set(range(5))
  np.testing.assert_array_equal(
      synthetic_dataset(seed=1).train_images, synthetic_dataset(seed=1).train_images)

  small = ds.subset(num_train=20, num_test=None, seed=0)
  assert len(small.train_labels) == 20 and len(small.test_labels) == 40
  np.testing.assert_array_equal(np.bincount(small.train_labels), np.full(5, 4))
  again = ds.subset(20, None, seed=0)
  np.testing.assert_array_equal(small.train_images, again.train_images)
  with pytest.raises(ValueError, match="101"):
    ds.subset(101, None)


def test_the_test_subset_does_not_depend_on_the_training_subset():
  """(Fifth probe survey: runs with and without --max-train-samples were scored on different test images.)"""
  ds = load_dataset("synthetic", num_train=100, num_test=40, image_shape=(6, 5, 3), num_classes=5)
  tests = [ds.subset(n, 15, seed=3).test_images for n in (None, 20, 100)]
  for other in tests[1:]:
    np.testing.assert_array_equal(tests[0], other)


def test_synthetic_is_learnable():
  # Nearest class mean on the training set should classify test data well.
  ds = synthetic_dataset()
  x_train = ds.train_images.reshape(len(ds.train_images), -1).astype(float)
  x_test = ds.test_images.reshape(len(ds.test_images), -1).astype(float)
  centroids = np.stack([x_train[ds.train_labels == k].mean(0) for k in range(ds.num_classes)])
  pred = np.argmin(((x_test[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
  assert (pred == ds.test_labels).mean() > 0.95


def test_shards_that_straddle_classes_are_a_warning(labels):
  """(Eighth probe survey: 30 clients x 2 shards of 2,000 samples gave clients 1-4 classes, no word of it.)"""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run.preflight import _warn_straddling_shards

  config = RunConfig.from_flags(partition="shards", classes_per_client=2, num_clients=20)
  logs = []
  _warn_straddling_shards(config, labels, NUM_CLASSES, shards(labels, 20, classes_per_client=2, seed=0), logs.append)
  assert logs == []  # (40 shards of 1,500: aligned with the classes of 6,000)
  odd = labels[:59_000]  # 40 shards of 1,475: some straddle two classes
  _warn_straddling_shards(config, odd, NUM_CLASSES, shards(odd, 20, classes_per_client=2, seed=0), logs.append)
  [warning] = logs
  assert warning.startswith("warning: --classes-per-client 2: clients hold ") and "straddle class boundaries" in warning
