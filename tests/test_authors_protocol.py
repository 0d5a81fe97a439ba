"""The InCo authors' protocol switches: --image-size, --normalize, --partition-file, --test-first, --sample-seed,
the inco-authors-cpu preset and scripts/convert_inco_split.py (docs/reproduction.md)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import re
import shlex

import chex
import numpy as np
import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.config import DataConfig, RunConfig
from fedjax_hetero.data import load_partition_file, resize_images, save_partition_file, synthetic_dataset
from fedjax_hetero.data.store import normalize, sample_clients
from fedjax_hetero.rounds import body
from fedjax_hetero.run.build import build_simulation, partitioned_dataset
from tests.helpers import REPO

NUM_CLIENTS = 6
DATASET = synthetic_dataset(num_train=120, num_test=40, image_shape=(8, 8, 1), seed=0)


def config(**flags) -> RunConfig:
  flags = {"num_clients": NUM_CLIENTS, "partition": "iid", **flags}
  return RunConfig.from_flags(dataset="synthetic", groups=("mlp",), clients_per_round=3, rounds=1, batch_size=16,
                              progress=False, **flags)


def _load_converter():
  spec = importlib.util.spec_from_file_location("convert_inco_split", os.path.join(REPO, "scripts",
                                                                                   "convert_inco_split.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


converter = _load_converter()


# ------------------------------------------------------------------------------------------------ --image-size


def torch_bilinear_weights(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in] weights of ATen's upsample_bilinear2d with align_corners=False (torchvision's Resize on a
  tensor): source x = (x_out + 0.5) n_in / n_out - 0.5, clamped at 0, the upper neighbour clamped at n_in - 1."""
  weights = np.zeros((n_out, n_in))
  for o in range(n_out):
    source = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
    low = int(np.floor(source))
    weights[o, low] += 1 - (source - low)
    weights[o, min(low + 1, n_in - 1)] += source - low
  return weights


def test_resize_a_known_image():
  image = np.array([[0, 240], [80, 160]], np.uint8)[None, :, :, None]
  resized = resize_images(image, 4)
  assert resized.shape == (1, 4, 4, 1) and resized.dtype == np.uint8
  np.testing.assert_array_equal(resized[0, :, :, 0], [[0, 60, 180, 240], [20, 70, 170, 220], [60, 90, 150, 180],
                                                      [80, 100, 140, 160]])


def test_resize_28_to_32_is_torchs_bilinear_and_keeps_channels():
  images = np.random.default_rng(0).integers(0, 256, (5, 28, 28, 3), dtype=np.uint8)
  weights = torch_bilinear_weights(28, 32)
  expected = np.einsum("oh,nhwc,pw->nopc", weights, images.astype(np.float64), weights)
  resized = resize_images(images, 32, chunk=2)  # chunks join up
  assert resized.shape == (5, 32, 32, 3)
  np.testing.assert_array_equal(resized, np.clip(np.rint(expected), 0, 255))
  assert resize_images(images, 28) is images


def test_image_size_resizes_train_and_test_once():
  dataset, parts = partitioned_dataset(config(image_size=12), DATASET)
  assert dataset.train_images.shape[1:] == dataset.test_images.shape[1:] == (12, 12, 1)
  np.testing.assert_array_equal(dataset.test_images, resize_images(DATASET.test_images, 12))
  assert sum(len(p) for p in parts) == len(DATASET.train_labels)


# ------------------------------------------------------------------------------------------------ --normalize


def test_normalize_none_feeds_pixels_in_0_1():
  dataset, _ = partitioned_dataset(config(normalize="none"), DATASET)
  assert dataset.mean == (0.0,) and dataset.std == (1.0,)
  x = np.asarray(normalize(dataset.train_images, dataset.mean, dataset.std))
  assert x.min() >= 0 and x.max() <= 1
  np.testing.assert_allclose(x, DATASET.train_images / 255.0, rtol=1e-6)
  default, _ = partitioned_dataset(config(), DATASET)
  assert default.mean == DATASET.mean and default.std == DATASET.std


# ------------------------------------------------------------------------------------------------ --partition-file


def some_parts(num_clients: int = NUM_CLIENTS, used: int = 100) -> list[np.ndarray]:
  """A split of the first ``used`` training samples only (as the authors' 50,000 of 60,000)."""
  return [p.astype(np.int64) for p in np.array_split(np.random.default_rng(1).permutation(used), num_clients)]


def test_partition_file_round_trip_npz_and_json(tmp_path):
  parts = some_parts()
  save_partition_file(str(tmp_path / "split.npz"), parts)
  with open(tmp_path / "split.json", "w") as f:
    json.dump([p.tolist() for p in parts], f)
  for name in ("split.npz", "split.json"):
    loaded = load_partition_file(str(tmp_path / name))
    assert len(loaded) == NUM_CLIENTS and all(a.dtype == np.int64 for a in loaded)
    chex.assert_trees_all_equal(loaded, parts)  # the file's order within a client is kept
    _, used = partitioned_dataset(config(partition_file=str(tmp_path / name)), DATASET)
    chex.assert_trees_all_equal(used, parts)


@pytest.mark.parametrize("parts, fragment", [
    (some_parts(4), "holds 4 clients, but --num-clients is 6"),
    ([*some_parts()[:-1], np.array([3, 120])], "client 5 holds sample index 120, outside the 120 training samples"),
    ([*some_parts()[:-1], np.array([-1, 2])], "client 5 holds sample index -1"),
    ([*some_parts()[:-1], np.array([], np.int64)], "client 5 has no samples"),
    ([*some_parts()[:-1], np.array([0.5])], "client 5's indices must be a 1-D integer array"),
    ([*some_parts()[:-1], np.full(50, 110)], "client[5] lists sample id 110 50 times; a client holds each sample once"),
    ([*some_parts()[:-1], some_parts()[0][:3]], "is in client[0] and client[5]; a partition gives each sample to one"),
])
def test_partition_file_errors_name_the_flag(tmp_path, parts, fragment):
  path = str(tmp_path / "split.npz")
  np.savez(path, **{str(c): p for c, p in enumerate(parts)})
  with pytest.raises(ValueError, match=f"--partition-file {re.escape(repr(path))}.*{re.escape(fragment)}"):
    partitioned_dataset(config(partition_file=path), DATASET)


def test_partition_file_bad_files(tmp_path):
  np.savez(tmp_path / "keys.npz", a=np.arange(3), b=np.arange(3))
  (tmp_path / "not.npz").write_text("no zip")
  (tmp_path / "split.txt").write_text("[[1]]")
  (tmp_path / "bad.json").write_text('{"0": [1]}')
  for name, fragment in (("keys.npz", "needs the keys 0..1, one per client, got a, b"),
                         ("not.npz", "is not an .npz file"), ("split.txt", "must end in .npz"),
                         ("bad.json", "a .json partition must be a list")):
    with pytest.raises(ValueError, match=fragment):
      DataConfig(num_clients=2, partition_file=str(tmp_path / name)).check_paths()
  with pytest.raises(ValueError, match="--partition-file '.*missing.npz' is not a file"):
    DataConfig(partition_file=str(tmp_path / "missing.npz")).check_paths()
  with pytest.raises(ValueError, match="--partition-file and --max-train-samples exclude each other"):
    DataConfig(partition_file="x.npz", max_train_samples=500)


BAD_FLAGS = [
    ("--image-size 0", "--image-size must be an integer >= 1, got 0"),
    ("--normalize unit", "argument --normalize: invalid choice: 'unit'"),
    ("--test-first 0", "--test-first must be an integer >= 1, got 0"),
    ("--test-first 10 --max-test-samples 20", "--test-first and --max-test-samples exclude each other"),
    ("--sample-seed -1", "--sample-seed must be an integer in [0, 4294967295], got -1"),
    ("--partition-file {tmp}/three.npz", "--partition-file '{tmp}/three.npz' holds 3 clients, but --num-clients is 10"),
    ("--partition-file {tmp}/none.npz", "--partition-file '{tmp}/none.npz' is not a file"),
]


@pytest.mark.parametrize("args, fragment", BAD_FLAGS, ids=[a for a, _ in BAD_FLAGS])
def test_the_cli_rejects_bad_values_before_loading_data(args, fragment, tmp_path, capsys, monkeypatch, no_compute):
  save_partition_file(str(tmp_path / "three.npz"), some_parts(3))
  monkeypatch.setattr(cli, "run_checked", lambda *_, **__: pytest.fail("the run started"))
  argv = shlex.split(f"--groups cnn@0.25 --num-clients 10 --no-progress --compile-cache off "
                     f"--output-dir {tmp_path}/out {args}".format(tmp=tmp_path))
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  assert info.value.code == 2
  assert fragment.format(tmp=tmp_path) in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ --test-first


def test_test_first_evaluates_exactly_the_first_n_images(monkeypatch):
  with pytest.raises(ValueError, match="--test-first 41 exceeds the 40 test samples of synthetic"):
    partitioned_dataset(config(test_first=41), DATASET)
  sim, _ = build_simulation(config(test_first=13, normalize="none"), DATASET, log=lambda _: None)
  np.testing.assert_array_equal(np.asarray(sim.spec.test_images), DATASET.test_images[:13])
  np.testing.assert_array_equal(np.asarray(sim.spec.test_labels), DATASET.test_labels[:13])
  assert sim.spec.store.mean == (0.0,) and sim.spec.trainers[0].std == (1.0,)
  seen = []
  real = body.correct_predictions
  monkeypatch.setattr(body, "correct_predictions", lambda model, variables, images, labels, *rest: seen.append(
      labels.shape[0]) or real(model, variables, images, labels, *rest))
  accuracy = sim.evaluate(sim.init_state())["mlp"]
  assert seen == [13] and abs(accuracy * 13 - round(accuracy * 13)) < 1e-6


# ------------------------------------------------------------------------------------------------ --sample-seed


def cohorts(sim, rounds: int = 6) -> list[list[int]]:
  return [sim.spec.method.sampler.sample((), r, sim.spec.sampling).clients.tolist() for r in range(rounds)]


def test_sample_seed_changes_the_cohorts_alone():
  base = config(seed=3, num_clients=12)
  default, default_parts = build_simulation(base, DATASET, log=lambda _: None)
  # Today's cohorts: a pure function of (--seed, round).
  assert cohorts(default) == [sample_clients(12, 3, 3, r).tolist() for r in range(6)]
  same, _ = build_simulation(base.replace(sample_seed=3), DATASET, log=lambda _: None)
  assert cohorts(same) == cohorts(default)
  other, other_parts = build_simulation(base.replace(sample_seed=4), DATASET, log=lambda _: None)
  assert cohorts(other) == [sample_clients(12, 3, 4, r).tolist() for r in range(6)] != cohorts(default)
  chex.assert_trees_all_equal(other_parts, default_parts)  # the partition keeps --seed
  chex.assert_trees_all_equal(other.init_state().models, default.init_state().models)  # and so does the init


# ------------------------------------------------------------------------------------------------ the preset


def test_inco_authors_cpu_preset(monkeypatch, tmp_path, capsys):
  configs = []
  monkeypatch.setattr(cli, "run_checked", lambda c, *_, **__: configs.append(c) or {
      "final_accuracy": {}, "best_mean_accuracy": None, "train_seconds_all_rounds": 0.0})
  split = str(tmp_path / "split.npz")
  save_partition_file(split, some_parts(100, used=1000))
  cli.main("fashion_mnist", ["--preset", "inco-authors-cpu", "--partition-file", split])
  cli.main("fashion_mnist", ["--preset", "inco-cpu"])
  authors, plain = configs
  assert (authors.data.image_size, authors.data.normalize, authors.data.test_first, authors.eval_every,
          authors.data.partition_file) == (32, "none", 9728, 1, split)
  assert authors.replace(image_size=None, normalize="dataset", test_first=None, eval_every=5, partition_file=None,
                         output_dir=plain.output.dir) == plain
  assert "--partition-file" in capsys.readouterr().out  # the description says to add the split


# ------------------------------------------------------------------------------------------------ the converter


def authors_style_npy(split: dict) -> bytes:
  """A .npy as the authors saved theirs: np.save of a dict (a 0-d object array, pickled)."""
  stream = io.BytesIO()
  np.save(stream, split, allow_pickle=True)
  return stream.getvalue()


def test_converter_round_trip(tmp_path):
  split = {0: [5, 1, 7], 2: np.array([0, 3]), 1: [2, 4, 6]}  # lists, as in their file, and an array
  (tmp_path / "fix.npy").write_bytes(authors_style_npy(split))
  converter.main([str(tmp_path / "fix.npy"), str(tmp_path / "split.npz")])
  chex.assert_trees_all_equal(load_partition_file(str(tmp_path / "split.npz")),
                              [np.array([5, 1, 7]), np.array([2, 4, 6]), np.array([0, 3])])
  with pytest.raises(ValueError, match="client keys 0..1"):
    converter.split_parts({0: [1], 2: [3]})


class _Payload:
  def __reduce__(self):
    return (os.getcwd, ())  # harmless if it ran; the unpickler must refuse it before


def test_converter_refuses_a_non_numpy_global():
  for data in (pickle.dumps({0: _Payload()}), authors_style_npy({0: _Payload()})):
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load the global (posix|os|nt)\.getcwd"):
      converter.load_split(io.BytesIO(data))
  with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
    converter.load_split(io.BytesIO(b"cbuiltins\neval\n(S'1'\ntR."))
