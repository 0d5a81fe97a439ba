"""Bad inputs, each rejected with an error that names it, before any compute; and properties of good ones.

To probe a new bad input, add one line to a table:

* `BAD_FLAGS`: command-line arguments (split like a shell; ``{tmp}`` is a fresh folder, ``{file}`` an existing
  file) and a fragment the error must contain, naming the flag. The CLI must exit with status 2, print
  ``error: ...`` (argparse: ``... error: argument ...``) and no traceback, and reject the input before it
  loads any data (`fedjax_hetero.cli.run.run_experiment` is never called).
* `BAD_DATASETS`: a Fashion-MNIST file, how it is damaged, and a fragment of the error; the run stops while
  loading the data, before any training.
* `MISUSE`: a library call (configs, partitioners, sub-model maps, aggregators; more aggregator cases are in
  tests/test_aggregator_inputs.py) and a regex the ValueError's message must match.
"""

from __future__ import annotations

import functools
import gzip
import os
import shlex
import shutil

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedjax_hetero.cli import run as cli
from fedjax_hetero.cli.datasets import defaults_for
from fedjax_hetero import aggregators as A
from fedjax_hetero import config as run_config
from fedjax_hetero import engine
from fedjax_hetero.algorithms.fedgen import FedGenConfig
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.config import DataConfig, OutputConfig, RunConfig
from fedjax_hetero.data import (DataNotFoundError, class_counts, dirichlet, iid_imbalanced, load_fashion_mnist,
                                partition)
from fedjax_hetero.data.datasets import FASHION_MNIST_FILES, FASHION_MNIST_SYSTEM_DIR, CorruptDataError
from fedjax_hetero.hetero import build_group_map, coverage, embed, extract, graft, pick_global
from fedjax_hetero.validation import cli_flag

# ------------------------------------------------------------------------------------------------ the CLI

# A small, valid run; a case's arguments come after these and override them.
BASE_ARGS = ("--groups cnn@0.5,cnn@0.25 --num-clients 10 --clients-per-round 2 --rounds 1 --max-train-samples 200 "
             "--max-test-samples 50 --no-progress --compile-cache off --output-dir {tmp}/out")

# (arguments, fragment of the error)
BAD_FLAGS = [
    # sizes and counts: zero and negative
    ("--max-test-samples 0", "--max-test-samples must be an integer >= 1, got 0"),
    ("--max-test-samples -5", "--max-test-samples must be an integer >= 1, got -5"),
    ("--max-train-samples 0", "--max-train-samples must be an integer >= 1, got 0"),
    ("--max-train-samples 50", "--max-train-samples 50 is too few for --num-clients 10: partition dirichlet needs"),
    ("--max-train-samples 15 --partition shards", "--max-train-samples 15 is too few for --num-clients 10"),
    ("--batch-size 0", "--batch-size must be an integer >= 1, got 0"),
    ("--batch-size -32", "--batch-size must be an integer >= 1, got -32"),
    ("--epochs 0", "--epochs must be an integer >= 1, got 0"),
    ("--steps-per-call 0", "--steps-per-call must be an integer >= 1, got 0"),
    ("--clients-per-round 0", "--clients-per-round must be an integer >= 1, got 0"),
    ("--clients-per-round 11", "--clients-per-round 11 exceeds --num-clients 10"),
    ("--num-clients 0", "--num-clients must be an integer >= 1, got 0"),
    ("--num-clients -3", "--num-clients must be an integer >= 1, got -3"),
    ("--num-clients 1 --clients-per-round 1", "--num-clients 1 is fewer than the 2 architecture groups (--groups)"),
    ("--classes-per-client 0 --partition shards", "--classes-per-client must be an integer >= 1, got 0"),
    ("--rounds 0", "--rounds must be an integer >= 1, got 0"),
    ("--eval-every 0", "--eval-every must be an integer >= 1, got 0"),
    ("--checkpoint-every -1", "--checkpoint-every must be an integer >= 1, got -1"),
    ("--keep-checkpoints 0", "--keep-checkpoints must be an integer >= 1, got 0"),
    ("--fedimpro-num-synthetic 0", "--fedimpro-num-synthetic must be an integer >= 1, got 0"),
    ("--fedcross-propellers -1", "--fedcross-propellers must be an integer >= 0, got -1"),
    ("--fedcross-propeller-rounds -2", "--fedcross-propeller-rounds must be an integer >= 0, got -2"),
    ("--fedcross-warmup-rounds -1", "--fedcross-warmup-rounds must be an integer >= 0, got -1"),
    ("--fedcross-dynamic-alpha-rounds -1", "--fedcross-dynamic-alpha-rounds must be an integer >= 0, got -1"),
    ("--fedcross-propeller-rounds 5", "--fedcross-propeller-rounds 5 needs --fedcross-propellers >= 1"),
    ("--fedcross-propellers 2", "--fedcross-propellers 2 needs --fedcross-propeller-rounds >= 1"),
    ("--method FedCross --groups cnn --fedcross-propellers 2 --fedcross-propeller-rounds 5",
     "--fedcross-propellers must be at most 1 (--clients-per-round 2 minus 1"),
    ("--method FedCross --groups cnn --clients-per-round 1", "--clients-per-round must be >= 2 for FedCross"),
    # negative, out-of-range and non-finite numbers
    ("--lr 0", "--lr must be a finite number > 0, got 0.0"),
    ("--lr -0.1", "--lr must be a finite number > 0, got -0.1"),
    ("--lr inf", "--lr must be a finite number > 0, got inf"),
    ("--lr nan", "--lr must be a finite number > 0, got nan"),
    ("--weight-decay -5", "--weight-decay must be a finite number >= 0, got -5.0"),
    ("--weight-decay nan", "--weight-decay must be a finite number >= 0, got nan"),
    ("--momentum -0.1", "--momentum must be a finite number in [0, 1), got -0.1"),
    ("--momentum 1", "--momentum must be a finite number in [0, 1), got 1.0"),
    ("--momentum nan", "--momentum must be a finite number in [0, 1), got nan"),
    ("--alpha 0", "--alpha must be a finite number > 0, got 0.0"),
    ("--alpha -1", "--alpha must be a finite number > 0, got -1.0"),
    ("--alpha inf", "--alpha must be a finite number > 0, got inf"),
    ("--alpha -1 --partition iid", "--alpha must be a finite number > 0, got -1.0"),
    ("--prox-mu -1", "--prox-mu must be a finite number >= 0, got -1.0"),
    ("--prox-mu inf", "--prox-mu must be a finite number >= 0, got inf"),
    ("--fedprox-mu -0.1", "--fedprox-mu was renamed: pass --prox-mu"),
    ("--moon-mu -5", "--moon-mu must be a finite number >= 0, got -5.0"),
    ("--moon-mu nan", "--moon-mu must be a finite number >= 0, got nan"),
    ("--moon-temperature 0", "--moon-temperature must be a finite number > 0, got 0.0"),
    ("--moon-temperature -0.5", "--moon-temperature must be a finite number > 0, got -0.5"),
    ("--moon-temperature inf", "--moon-temperature must be a finite number > 0, got inf"),
    ("--fedcross-alpha 1.5", "--fedcross-alpha must be a finite number in [0, 1], got 1.5"),
    ("--fedcross-alpha -0.1", "--fedcross-alpha must be a finite number in [0, 1], got -0.1"),
    ("--fedcross-alpha nan", "--fedcross-alpha must be a finite number in [0, 1], got nan"),
    ("--fedimpro-beta 1", "--fedimpro-beta must be a finite number in [0, 1), got 1.0"),
    ("--fedimpro-beta -0.5", "--fedimpro-beta must be a finite number in [0, 1), got -0.5"),
    ("--fedimpro-std-max 0", "--fedimpro-std-max must be a finite number > 0, got 0.0"),
    ("--fedimpro-std-max -1", "--fedimpro-std-max must be a finite number > 0, got -1.0"),
    ("--fedimpro-weight -1", "--fedimpro-weight must be a finite number >= 0, got -1.0"),
    ("--fedimpro-noise -0.5", "--fedimpro-noise must be a finite number >= 0, got -0.5"),
    ("--fedimpro-noise inf", "--fedimpro-noise must be a finite number >= 0, got inf"),
    ("--seed -1", "--seed must be an integer in [0, 4294967295], got -1"),
    ("--seed 4294967296", "--seed must be an integer in [0, 4294967295], got 4294967296"),
    ("--divergence-loss-factor 0.5", "--divergence-loss-factor must be a finite number > 1, got 0.5"),
    ("--divergence-rollback-lr-factor 2", "--divergence-rollback-lr-factor must be a finite number in (0, 1), got 2.0"),
    ("--divergence-max-rollbacks -1", "--divergence-max-rollbacks must be an integer >= 0, got -1"),
    ("--group-draw 0.5,0.6", "--group-draw must be non-negative probabilities summing to 1, got (0.5, 0.6)"),
    ("--group-draw 1", "--group-draw needs one probability per architecture group (2), got 1"),
    ("--group-draw 0.5,x", "argument --group-draw: expected comma-separated probabilities, got '0.5,x'"),
    ("--malicious-fraction 1.5", "--malicious-fraction must be a finite number in [0, 1], got 1.5"),
    ("--backdoor-scale -1", "--backdoor-scale must be a finite number >= 0, got -1.0"),
    # paths
    ("--output-dir {file}", "--output-dir '{file}' is a file, not a directory"),
    ("--output-dir {file}/run", "--output-dir '{file}/run' cannot be created: '{file}' is a file"),
    ("--output-dir ''", "--output-dir must be a non-empty string, got ''"),
    ("--data-dir {file}", "--data-dir '{file}' is a file, not a directory"),
    ("--data-dir {tmp}/missing", "--data-dir '{tmp}/missing' does not exist"),
    ("--compile-cache {file}", "--compile-cache '{file}' is a file, not a directory"),
    ("--resume --overwrite", "--resume and --overwrite exclude each other"),
    # names
    ("--groups ''", "at least one architecture group is needed (--groups)"),
    ("--groups cnn@0", "--groups: bad group spec 'cnn@0': width must be a finite number > 0"),
    ("--groups cnn@nan", "--groups: bad group spec 'cnn@nan': width must be a finite number > 0"),
    ("--groups cnn,foo", "--groups: unknown model 'foo'"),
    ("--method Nope", "--method: unknown method 'Nope'; accepted: FedAvg"),
    ("--method FedCross", "FedCross trains one architecture group, got 2"),
    ("--method FedNova --aggregate weights", "--aggregate applies to FedAvg, HeteroAvg"),
    ("--inco-variant paper", "--inco-variant applies to InCoAvg, InCoProx, InCoScaffold, InCoNova, InCoMOON, not"),
    ("--fedimpro-cut nope", "--fedimpro-cut, group cnn@0.5"),
    ("--preset fedimpro-cpu --max-train-samples 50", "--max-train-samples 50 is too few for --num-clients 10"),
    # argparse's own checks
    ("--seed abc", "argument --seed: invalid int value: 'abc'"),
    ("--max-test-samples 1.5", "argument --max-test-samples: invalid int value: '1.5'"),
    ("--lr fast", "argument --lr: invalid float value: 'fast'"),
    ("--backend tpu", "argument --backend: invalid choice: 'tpu'"),
    ("--partition pathological", "argument --partition: invalid choice: 'pathological'"),
    ("--preset nope", "unknown preset 'nope'"),
]


def _must_not_run(config, **_):
  raise AssertionError("the CLI started a run with a bad input")


def run_cli(tmp_path, args: str) -> int:
  """``python -m experiments.fmnist BASE_ARGS args`` in this process, expected to exit; its exit status."""
  a_file = tmp_path / "a_file"
  a_file.write_text("not a folder")
  argv = shlex.split(f"{BASE_ARGS} {args}".format(tmp=tmp_path, file=a_file))
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  return info.value.code


def fill(text: str, tmp_path) -> str:
  return text.format(tmp=tmp_path, file=tmp_path / "a_file")


@pytest.mark.parametrize("args, fragment", BAD_FLAGS, ids=[args for args, _ in BAD_FLAGS])
def test_the_cli_rejects_a_bad_flag_before_loading_data(args, fragment, tmp_path, capsys, monkeypatch, no_compute):
  monkeypatch.setattr(cli, "run_experiment", _must_not_run)
  code = run_cli(tmp_path, args)
  captured = capsys.readouterr()
  assert code == 2
  assert fill(fragment, tmp_path) in captured.err, captured.err
  assert "error: " in captured.err and "Traceback" not in captured.err + captured.out
  assert not (tmp_path / "out").exists()  # nothing created before the input was checked


def test_every_case_is_listed_once_and_the_base_run_is_valid(tmp_path, capsys, monkeypatch):
  assert len({args for args, _ in BAD_FLAGS}) == len(BAD_FLAGS)
  configs = []
  monkeypatch.setattr(cli, "run_experiment", lambda config, **_: configs.append(config) or {
      "final_accuracy": {}, "best_mean_accuracy": None, "train_seconds_all_rounds": 0.0})
  cli.main("fashion_mnist", shlex.split(fill(BASE_ARGS, tmp_path)))
  assert len(configs) == 1 and configs[0].data.max_test_samples == 50


def test_every_flag_a_message_names_is_a_cli_flag():
  """`cli_flag` spells every setting as the parser does, so a message's flag is what the user typed."""
  parser = cli.build_parser(defaults_for("fashion_mnist").config(), "test")
  options = {option for action in parser._actions for option in action.option_strings}
  for flag, leaf in run_config.FLAGS.items():
    assert cli_flag(leaf.path) == leaf.cli in options, (flag, leaf.path)
  assert cli_flag("client.learning_rate") == "--lr" and cli_flag("method.fedgen.ensemble_lr") == "--fedgen-ensemble-lr"


# ------------------------------------------------------------------------------------ damaged dataset files

IMAGES_TRAIN, LABELS_TRAIN, IMAGES_TEST, LABELS_TEST = (name + ".gz" for name in FASHION_MNIST_FILES)


def idx_bytes(array: np.ndarray) -> bytes:
  return bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape) + \
      array.astype(np.uint8).tobytes()


def small_fashion_mnist(rng) -> dict[str, bytes]:
  """Valid gzipped IDX files of a 200 + 50 sample Fashion-MNIST look-alike, by file name."""
  return {IMAGES_TRAIN: gzip.compress(idx_bytes(rng.integers(0, 256, (200, 28, 28)))),
          LABELS_TRAIN: gzip.compress(idx_bytes(np.arange(200) % 10)),
          IMAGES_TEST: gzip.compress(idx_bytes(rng.integers(0, 256, (50, 28, 28)))),
          LABELS_TEST: gzip.compress(idx_bytes(np.arange(50) % 10))}


def in_idx(edit):
  """A damage that changes the decompressed IDX bytes (the gzip stays valid)."""
  return lambda data: gzip.compress(edit(gzip.decompress(data)))


def flip_a_byte(data: bytes) -> bytes:
  middle = len(data) // 2
  return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


# (description, file, damage: bytes -> bytes, fragment of the error)
BAD_DATASETS = [
    ("truncated gzip", IMAGES_TRAIN, lambda data: data[:len(data) // 2], "EOFError"),
    ("cut to its first 10 bytes", LABELS_TRAIN, lambda data: data[:10], "EOFError"),
    ("empty file", LABELS_TEST, lambda data: b"", "0 bytes, fewer than the 8-byte IDX header"),
    ("not gzip at all", IMAGES_TEST, lambda data: b"<html>404 Not Found</html>", "BadGzipFile"),
    ("a flipped byte in the compressed data", IMAGES_TRAIN, flip_a_byte, "truncated or corrupt ("),
    ("bad CRC", LABELS_TRAIN, lambda data: data[:-8] + bytes(8), "BadGzipFile"),
    ("wrong IDX magic", LABELS_TRAIN, in_idx(lambda raw: b"\x00\x00\x0d\x01" + raw[4:]), "bad IDX magic number 3329"),
    ("images without their last rows", IMAGES_TEST, in_idx(lambda raw: raw[:-100]), "header says (50, 28, 28) but"),
    ("header shorter than its dimensions", IMAGES_TRAIN, in_idx(lambda raw: raw[:9]), "fewer than the 16-byte IDX"),
    ("labels of another size", LABELS_TEST, in_idx(lambda raw: idx_bytes(np.zeros(7))), "7 labels for the 50 images"),
    ("a label out of range", LABELS_TRAIN, in_idx(lambda raw: raw[:-1] + bytes([200])), "label 200, expected 0 to 9"),
    ("images of another size", IMAGES_TEST, in_idx(lambda raw: idx_bytes(np.zeros((50, 14, 56)))),
     "images of shape (14, 56), expected (28, 28)"),
]


@pytest.fixture(scope="module")
def good_files():
  return small_fashion_mnist(np.random.default_rng(0))


def write_dataset(directory, files: dict[str, bytes]) -> None:
  directory.mkdir()
  for name, data in files.items():
    (directory / name).write_bytes(data)


def test_the_small_look_alike_loads(good_files, tmp_path):
  write_dataset(tmp_path / "data", good_files)
  dataset = load_fashion_mnist(str(tmp_path / "data"))
  chex.assert_shape(dataset.train_images, (200, 28, 28, 1))
  chex.assert_shape(dataset.test_labels, (50,))


@pytest.mark.parametrize("name, damage, fragment", [case[1:] for case in BAD_DATASETS],
                         ids=[case[0] for case in BAD_DATASETS])
def test_the_cli_names_a_damaged_dataset_file_and_how_to_get_it(name, damage, fragment, good_files, tmp_path, capsys,
                                                                 no_compute):
  data_dir = tmp_path / "data"
  write_dataset(data_dir, {**good_files, name: damage(good_files[name])})
  code = run_cli(tmp_path, f"--data-dir {data_dir}")
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err
  assert fragment in err, err
  assert f"error: Fashion-MNIST file {data_dir / name} is truncated or corrupt (" in err, err
  assert "apt-get install dataset-fashion-mnist" in err
  assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_truncated_copy_of_the_installed_files(tmp_path):
  if not os.path.isdir(FASHION_MNIST_SYSTEM_DIR):
    pytest.skip("Fashion-MNIST Debian package not installed (apt-get install dataset-fashion-mnist)")
  data_dir = tmp_path / "fashion-mnist"
  shutil.copytree(FASHION_MNIST_SYSTEM_DIR, data_dir)
  damaged = data_dir / IMAGES_TRAIN
  damaged.write_bytes(damaged.read_bytes()[:100_000])
  with pytest.raises(CorruptDataError, match="EOFError") as info:
    load_fashion_mnist(str(data_dir))
  assert isinstance(info.value, DataNotFoundError) and isinstance(info.value, ValueError)
  assert str(damaged) in str(info.value) and "apt-get install dataset-fashion-mnist" in str(info.value)


def test_an_output_folder_without_write_permission(tmp_path, monkeypatch):
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  if os.geteuid() == 0:  # root may write anywhere: the kernel's answer for a user is stood in for
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and os.fspath(path) != str(locked))
  with pytest.raises(ValueError, match=r"--output-dir '.*locked/run' cannot be written: no write permission"):
    OutputConfig(dir=str(locked / "run")).check_paths()


# ----------------------------------------------------------------------------------------------- the library

LABELS = np.arange(200) % 10


def shapes(**leaves):
  """``{"params": {name: ShapeDtypeStruct}}`` of the given leaf shapes."""
  return {"params": {name: jax.ShapeDtypeStruct(shape, np.float32) for name, shape in leaves.items()}}


def zeros(**leaves):
  return {"params": {name: np.zeros(shape, np.float32) for name, shape in leaves.items()}}


WIDE = dict(w=(4, 3), b=(3,))
NARROW = dict(w=(4, 2), b=(2,))
MAP = build_group_map(shapes(**WIDE), shapes(**NARROW), "narrow")
DEEP = {"params": {"block0": {"w": jax.ShapeDtypeStruct((2,), np.float32)},
                   "block1": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}}
SHALLOW = {"params": {"block0": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}}
SHALLOW_MAP = build_group_map(DEEP, SHALLOW, "shallow")
UP = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}}


def call(fn, *args, **kwargs):
  return functools.partial(fn, *args, **kwargs)


# (description, bad call, regex the ValueError's message must match)
MISUSE = [
    # --- configs built in code get the CLI's messages
    ("LocalConfig: infinite lr", call(LocalConfig, learning_rate=float("inf")), r"^--lr must be a finite number > 0"),
    ("LocalConfig: float epochs", call(LocalConfig, epochs=1.5), r"^--epochs must be an integer >= 1, got 1.5"),
    ("DataConfig: bool clients", call(DataConfig, num_clients=True), r"--num-clients must be an integer >= 1, got True"),
    ("DataConfig: text alpha", call(DataConfig, alpha="0.5"), r"--alpha must be a finite number > 0, got '0.5'"),
    ("OutputConfig: text flag", call(OutputConfig, resume="yes"), r"--resume must be true or false, got 'yes'"),
    ("FederationConfig: seed 2^32", call(engine.FederationConfig, seed=2 ** 32), r"--seed must be an integer in"),
    ("FederationConfig: NaN draw", call(engine.FederationConfig, group_draw=(float("nan"), 1.0)), r"--group-draw"),
    ("FederationConfig: a draw of text", call(engine.FederationConfig, group_draw="0.5,0.5"),
     r"--group-draw must be a sequence of probabilities"),
    ("RunConfig: a draw per group", call(RunConfig.from_flags, group_draw=(1.0,)),
     r"--group-draw needs one probability per architecture group \(3\), got 1"),
    ("RunConfig: groups as text", call(RunConfig.from_flags, groups="cnn"), r"--groups must be a sequence of group"),
    ("RunConfig: a group as a number", call(RunConfig.from_flags, groups=("cnn", 0.5)),
     r"--groups: a group spec is a string such as 'cnn@0.5', got 0.5"),
    ("FedGen: no learning rate", call(FedGenConfig, ensemble_lr=0.0),
     r"--fedgen-ensemble-lr must be a finite number > 0, got 0.0"),
    ("FedGen: growing decay", call(FedGenConfig, coefficient_decay=1.5), r"--fedgen-coefficient-decay must be .* in \(0, 1\]"),
    ("FedGen: negative weight", call(FedGenConfig, generative_alpha=-1.0), r"--fedgen-generative-alpha must be .* >= 0"),
    ("check_sizes: subset too big", call(DataConfig(max_train_samples=70000).check_sizes, 60000, 10000, 10),
     r"--max-train-samples 70000 exceeds the 60000 training samples of fashion_mnist"),
    ("check_sizes: test subset too big", call(DataConfig(max_test_samples=20000).check_sizes, 60000, 10000, 10),
     r"--max-test-samples 20000 exceeds the 10000 test samples"),
    ("check_sizes: classes", call(DataConfig(partition="shards", classes_per_client=20).check_sizes, 60000, 10000, 10),
     r"--classes-per-client 20 exceeds the 10 classes of fashion_mnist"),
    ("check_sizes: clients", call(DataConfig(num_clients=100).check_sizes, 500, 100, 10),
     r"fashion_mnist's training set of 500 is too few for --num-clients 100: partition dirichlet needs at least 1000"),
    # --- partitioners
    ("partition: 2-D labels", call(partition, LABELS.reshape(20, 10), "iid", 4, 0), r"labels must be a 1-D integer"),
    ("partition: float labels", call(partition, LABELS * 1.0, "iid", 4, 0), r"1-D integer array, got float64"),
    ("partition: negative label", call(partition, LABELS - 1, "iid", 4, 0), r"labels must be >= 0, got -1"),
    ("partition: fractional clients", call(partition, LABELS, "iid", 2.5, 0), r"num_clients must be an integer"),
    ("partition: too many clients", call(partition, LABELS, "iid", 300, 0), r"num_clients=300 exceeds the 200"),
    ("partition: NaN alpha", call(partition, LABELS, "dirichlet", 4, 0, alpha=float("nan")), r"alpha .* got nan"),
    ("partition: infinite alpha", call(partition, LABELS, "dirichlet", 4, 0, alpha=float("inf")), r"got inf"),
    ("partition: min_size", call(partition, LABELS, "dirichlet", 4, 0, min_size=-1), r"min_size must be >= 0"),
    ("dirichlet: infeasible min_size", call(dirichlet, LABELS, 10, 0.5, 0, min_size=30),
     r"min_size=30 is infeasible: 10 clients x 30 > 200"),
    ("partition: fractional classes", call(partition, LABELS, "shards", 4, 0, classes_per_client=1.5),
     r"classes_per_client must be an integer"),
    ("partition: too many shards", call(partition, LABELS, "shards", 150, 0, classes_per_client=2),
     r"num_clients \* classes_per_client = 300 shards exceeds the 200"),
    ("iid_imbalanced: negative sigma", call(iid_imbalanced, LABELS, 4, 0, sigma=-1.0), r"sigma .* >= 0, got -1.0"),
    ("iid_imbalanced: infinite sigma", call(iid_imbalanced, LABELS, 4, 0, sigma=float("inf")), r"got inf"),
    ("class_counts: label past the classes", call(class_counts, LABELS, [np.arange(200)], 5),
     r"labels must be < num_classes=5, got 9"),
    # --- sub-model maps
    ("build_group_map: unknown layer", call(build_group_map, shapes(**WIDE), shapes(x=(2,)), "narrow"),
     r"^narrow: layer params/x does not exist in the global model"),
    ("build_group_map: wider group", call(build_group_map, shapes(**NARROW), shapes(**WIDE), "wide"),
     r"^wide: layer params/\w has shape \([\d, ]+\), which is not a leading slice"),
    ("build_group_map: another rank", call(build_group_map, shapes(**WIDE), shapes(w=(4, 2, 1)), "g"),
     r"layer params/w has shape \(4, 2, 1\), which is not a leading slice of the global shape \(4, 3\)"),
    ("extract: not a map", call(extract, zeros(**WIDE), {"params": {}}), r"group_map must be a SubmodelMap, got a dict"),
    ("extract: leaf of a wrong shape", call(extract, zeros(w=(5, 3), b=(3,)), MAP),
     r"global_vars leaf params/w has shape \(5, 3\); the global model of group_map has \(4, 3\)"),
    ("extract: extra leaf", call(extract, zeros(**WIDE, z=(1,)), MAP),
     r"global_vars has leaf params/z, which the global model of group_map does not have"),
    ("extract: float offset", call(extract, zeros(**WIDE), MAP, 0.5), r"offset must be an integer scalar, got float"),
    ("extract: vector offset", call(extract, zeros(**WIDE), MAP, np.arange(2)), r"got int64 of shape \(2,\)"),
    ("extract: not a tree", call(extract, [np.zeros(3)], MAP), r"global_vars must be a nested dict of arrays"),
    ("embed: global-shaped upload", call(embed, zeros(**WIDE), MAP, zeros(**WIDE)),
     r"group_vars leaf params/\w has shape \([\d, ]+\); the client model of group_map has"),
    ("embed: extra leaf", call(embed, zeros(**NARROW, z=(1,)), MAP, zeros(**WIDE)),
     r"group_vars has leaf params/z, which the client model of group_map does not have"),
    ("embed: global_like of another model", call(embed, zeros(**NARROW), MAP, zeros(w=(4, 3), b=(7,))),
     r"global_like leaf params/b has shape \(7,\); the global model of group_map has \(3,\)"),
    ("coverage: global_like of another model", call(coverage, MAP, zeros(w=(8, 3), b=(3,))),
     r"global_like leaf params/w has shape \(8, 3\)"),
    ("graft: missing block", call(graft, SHALLOW_MAP, [(("block1",), ("block5",))], "shallow"),
     r"shallow: the client model has no block block5 to graft"),
    ("graft: missing target", call(graft, SHALLOW_MAP, [(("block9",), ("block0",))], "shallow"),
     r"shallow: cannot graft params/block0/w onto params/block9/w: the global model has no such layer"),
    ("pick_global: a group that embeds nowhere", call(pick_global, [shapes(**WIDE), shapes(v=(9,))], ["a", "b"]),
     r"^b: layer params/v does not exist in the global model"),
    # --- aggregators, beyond tests/test_aggregator_inputs.py
    ("similarity_matrix: unknown kind", call(A.similarity_matrix, UP, "euclid"), r"unknown similarity kind 'euclid'"),
    ("select_partners: unknown strategy", call(A.select_partners, UP, 1, "random"), r"unknown strategy 'random'"),
    ("fedcross_aggregate: unknown global", call(A.fedcross_aggregate, UP, np.array([1, 2, 0]), 0.9, "mean"),
     r"global_from must be 'middleware' or 'uploaded', got 'mean'"),
    ("propeller_partners: none", call(A.propeller_partners, 3, 0, 0), r"num_propellers must be in \[1, 2\], got 0"),
    ("propeller_partners: every model", call(A.propeller_partners, 3, 0, 3), r"must be in \[1, 2\], got 3"),
    ("in_order_partners: one model", call(A.in_order_partners, 1, 0), r"at least 2 middleware models, got 1"),
    ("dynamic_alpha: empty stage", call(A.dynamic_alpha, 3, 0, 0), r"stage_length must be positive, got 0"),
    ("cross_aggregate: no leaves", call(A.cross_aggregate, {}, np.array([1, 0]), 0.5), r"have no leaves"),
    ("cross_layer_update: shapes differ", call(A.cross_layer_update, np.ones((3, 3)), np.ones((3, 2))),
     r"cross-layer target and source shapes differ: \(3, 3\) vs \(3, 2\)"),
    ("inco: unknown variant", call(A.inco, zeros(**WIDE), (), "best"), r"unknown InCo variant 'best'"),
    ("check_pairs: unknown leaf", call(A.check_pairs, [(("params", "w"), ("params", "v"))], zeros(**WIDE)),
     r"cross-layer pair names params/v, which is not a leaf of the model"),
]


@pytest.mark.parametrize("make_call, pattern", [c[1:] for c in MISUSE], ids=[c[0] for c in MISUSE])
def test_library_misuse_raises_a_named_value_error(make_call, pattern):
  with pytest.raises(ValueError, match=pattern):
    make_call()


def test_misuse_cases_are_listed_once_and_good_calls_pass():
  assert len({c[0] for c in MISUSE}) == len(MISUSE)
  narrow = extract(zeros(**WIDE), MAP, np.int32(1))
  chex.assert_trees_all_equal_shapes(narrow, zeros(**NARROW))
  chex.assert_trees_all_equal_shapes(embed(narrow, MAP, zeros(**WIDE)), zeros(**WIDE))
  chex.assert_trees_all_equal_shapes(extract({"params": {"w": np.zeros((4, 3))}}, MAP), {"params": {"w": narrow["params"]["w"]}})
  DataConfig(max_train_samples=1000).check_sizes(60000, 10000, 10)
  OutputConfig(dir="runs/x").check_paths()


def test_map_checks_run_while_tracing_and_accept_a_traced_offset():
  round_trip = jax.jit(lambda v, offset: embed(extract(v, MAP, offset), MAP, v, offset))
  chex.assert_trees_all_equal_shapes(round_trip(zeros(**WIDE), 3), zeros(**WIDE))
  with pytest.raises(ValueError, match=r"global_vars leaf params/w has shape \(5, 3\)"):
    jax.jit(lambda v: extract(v, MAP))(zeros(w=(5, 3), b=(3,)))


# ------------------------------------------------------------------------------------- aggregator properties

PROPERTY = settings(max_examples=10, deadline=None, database=None)
GLOBAL_SHAPES = {"params": {"w": (3, 2), "b": (2,)}}
GROUP_SHAPES = [{"params": {"w": (3, 1), "b": (1,)}}, GLOBAL_SHAPES]
GROUP_MAPS = [build_group_map(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), GLOBAL_SHAPES,
                                           is_leaf=lambda x: isinstance(x, tuple)),
                              jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), g,
                                           is_leaf=lambda x: isinstance(x, tuple)), f"g{i}")
              for i, g in enumerate(GROUP_SHAPES)]


def random_tree(tree_shapes, rng):
  return jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), tree_shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


@st.composite
def cohorts(draw):
  """Clients of both groups: (group of each client, weight of each client, a numpy generator)."""
  size = draw(st.integers(2, 5))
  groups = draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))
  weights = draw(st.lists(st.floats(0.1, 10.0), min_size=size, max_size=size))
  return np.array(groups), np.array(weights, np.float32), np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))


def group_inputs(groups, weights, deltas):
  """Each group's weighted sum of its clients' deltas and its total weight (the engine's reduction)."""
  sums, totals = [], []
  for g, group_shapes in enumerate(GROUP_SHAPES):
    members = [c for c in range(len(groups)) if groups[c] == g]
    zero = jax.tree.map(np.zeros, group_shapes, is_leaf=lambda x: isinstance(x, tuple))
    sums.append(functools.reduce(lambda acc, c: jax.tree.map(lambda a, d: a + weights[c] * d, acc, deltas[c]),
                                 members, jax.tree.map(lambda z: z.astype(np.float32), zero)))
    totals.append(float(sum(weights[c] for c in members)))
  return sums, totals


def a_sums(groups, weights, a_values):
  """FedNova's per-group sums of weight x local steps."""
  return [float(sum(w * a for grp, w, a in zip(groups, weights, a_values) if grp == g)) for g in range(len(GROUP_SHAPES))]


def assert_close(a, b):
  chex.assert_trees_all_equal_shapes(a, b)
  chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-5)


@PROPERTY
@given(cohort=cohorts(), scale=st.floats(0.01, 100.0))
def test_fedavg_uses_weights_normalized_to_sum_to_one(cohort, scale):
  _, weights, rng = cohort
  variables = random_tree(GLOBAL_SHAPES, rng)
  deltas = [random_tree(GLOBAL_SHAPES, rng) for _ in weights]
  summed = functools.reduce(lambda acc, d: jax.tree.map(np.add, acc, d),
                            [jax.tree.map(lambda x, w=w: w * x, d) for w, d in zip(weights, deltas)])
  got = A.fedavg(variables, summed, float(weights.sum()))
  p = weights / weights.sum()
  np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
  want = jax.tree.map(lambda v, *ds: v + sum(pi * d for pi, d in zip(p, ds)), variables, *deltas)
  assert_close(got, want)
  scaled = A.fedavg(variables, jax.tree.map(lambda x: np.float32(scale) * x, summed), float(scale * weights.sum()))
  assert_close(scaled, got)


@PROPERTY
@given(cohort=cohorts())
def test_averaging_identical_client_models_is_idempotent(cohort):
  groups, weights, rng = cohort
  model = random_tree(GLOBAL_SHAPES, rng)
  uploads = [extract(model, GROUP_MAPS[g]) for g in groups]
  sums, totals = group_inputs(groups, weights, uploads)
  averaged = A.hetero_avg_weights(model, sums, totals, GROUP_MAPS)
  assert_close(averaged, model)
  again = A.hetero_avg_weights(averaged, sums, totals, GROUP_MAPS)
  assert_close(again, averaged)
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (len(groups),) + x.shape), model)
  partners = rng.permutation(len(groups)).astype(np.int32)
  assert_close(A.cross_aggregate(stacked, partners, 0.3), stacked)


@PROPERTY
@given(cohort=cohorts(), data=st.data())
def test_aggregation_is_invariant_to_the_order_of_clients(cohort, data):
  groups, weights, rng = cohort
  order = np.array(data.draw(st.permutations(range(len(groups)))))
  global_vars = random_tree(GLOBAL_SHAPES, rng)
  deltas = [random_tree(GROUP_SHAPES[g], rng) for g in groups]
  a_values = rng.uniform(1.0, 4.0, len(groups)).astype(np.float32)
  base_sums, base_totals = group_inputs(groups, weights, deltas)
  perm_sums, perm_totals = group_inputs(groups[order], weights[order], [deltas[i] for i in order])
  assert_close(A.hetero_avg(global_vars, perm_sums, perm_totals, GROUP_MAPS),
               A.hetero_avg(global_vars, base_sums, base_totals, GROUP_MAPS))
  assert_close(A.fednova_delta(perm_sums, perm_totals, a_sums(groups[order], weights[order], a_values[order]),
                               GROUP_MAPS, global_vars),
               A.fednova_delta(base_sums, base_totals, a_sums(groups, weights, a_values), GROUP_MAPS, global_vars))
  # FedCross: relabelling the slots relabels the result.
  stacked = {"params": {"w": rng.normal(size=(len(groups), 3)).astype(np.float32)}}
  partners = np.array([(i + 1) % len(groups) for i in range(len(groups))], np.int32)
  inverse = np.argsort(order)
  relabelled = A.cross_aggregate(jax.tree.map(lambda x: x[order], stacked), inverse[partners[order]], 0.7)
  assert_close(relabelled, jax.tree.map(lambda x: x[order], A.cross_aggregate(stacked, partners, 0.7)))
