"""Bad inputs to a run, rejected before any compute with an error naming them, and the command line's help."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import METHODS
from fedjax_hetero.rounds.backends import BACKENDS
from fedjax_hetero.run.build import run_method
from fedjax_hetero.run.runner import run_experiment
from tests.test_runner import REPO_ROOT, base_config, quiet

pytestmark = pytest.mark.slow  # (as the rest of the runner's tests; the help runs a subprocess)


# ------------------------------------------------------------------------------------------ bad inputs


BAD_ARGS = [
    ("synthetic", ["--method", "FedMoon"], r"unknown method 'FedMoon'; accepted: FedAvg, HeteroAvg"),
    ("imagenet", [], r"--dataset must be one of fashion_mnist, cifar10, cifar100, svhn_cropped, synthetic, "
                     r"cifar100_coarse, got 'imagenet'"),
    ("synthetic", ["--groups", "cnn@1,vgg@0.5"], r"bad group spec 'vgg@0.5': unknown model 'vgg'"),
    ("synthetic", ["--groups", "cnn@1,resnet99"], r"unknown model 'resnet99'"),
    ("synthetic", ["--alpha", "0"], r"--alpha must be a finite number > 0, got 0.0"),
    ("synthetic", ["--alpha", "-0.5"], r"--alpha must be a finite number > 0, got -0.5"),
    # The partitioner's message, or the runner's size check before it (`DataConfig.check_sizes`).
    ("synthetic", ["--num-clients", "600"],
     r"num_clients=600 exceeds the 512 training samples|training set of 512 is too few for --num-clients 600"),
    ("synthetic", ["--num-clients", "4", "--clients-per-round", "5"], r"--clients-per-round 5 exceeds --num-clients 4"),
    ("synthetic", ["--data-dir", "{tmp}/no/such/dir"], r"--data-dir '{tmp}/no/such/dir' does not exist"),
]


@pytest.mark.parametrize("dataset_name,argv,message", BAD_ARGS, ids=[
    "method", "dataset", "model", "model_without_width", "alpha_zero", "alpha_negative", "clients_gt_samples",
    "clients_per_round", "data_dir"])
def test_cli_rejects_bad_input_before_compute(dataset_name, argv, message, tmp_path, capsys, no_compute):
  out = tmp_path / "out"
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--output-dir", str(out), "--no-progress"]
  with pytest.raises(SystemExit) as info:
    cli.main(dataset_name, argv)
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert re.search(message.replace("{tmp}", re.escape(str(tmp_path))), err), err
  assert err.startswith("error: ")
  assert not (out / "metrics.jsonl").exists()


def test_cli_rejects_unknown_backend_choice(capsys, tmp_path, no_compute):
  with pytest.raises(SystemExit) as info:
    cli.main("synthetic", ["--backend", "tpu9", "--output-dir", str(tmp_path)])
  assert info.value.code == 2
  assert "invalid choice: 'tpu9'" in capsys.readouterr().err


@pytest.mark.parametrize("changes,message", [
    (dict(method="FedDyn"), r"unknown method 'FedDyn'"),
    (dict(dataset="mnist"), r"--dataset must be one of fashion_mnist, .*, got 'mnist'"),
    (dict(groups=("mlp@1", "transformer")), r"unknown model 'transformer'"),
    (dict(alpha=0.0), r"--alpha must be a finite number > 0, got 0.0"),
    (dict(alpha=float("nan")), r"--alpha must be a finite number > 0, got nan"),
    (dict(clients_per_round=7), r"--clients-per-round 7 exceeds --num-clients 6"),
    (dict(clients_per_round=0), r"--clients-per-round must be an integer >= 1, got 0"),
    (dict(data_dir="/definitely/not/here"), r"--data-dir '/definitely/not/here' does not exist"),
    (dict(backend="gpu"), r"--backend must be one of auto, sequential, vmap, sharded, got 'gpu'"),
    (dict(rounds=0), r"--rounds must be an integer >= 1, got 0"),
])
def test_config_validate(changes, message, tmp_path):
  """Values are checked when the config is built, paths when a run starts, the method in the build step."""
  with pytest.raises(ValueError, match=message):
    config = base_config(tmp_path, **changes)
    config.data.check_paths()
    run_method(config)


def test_more_clients_than_samples_is_rejected_before_compute(tmp_path, no_compute):
  small = synthetic_dataset(num_train=5, num_test=4, seed=0)
  config = base_config(tmp_path / "small", num_clients=6, clients_per_round=2)  # valid: only the data can tell
  with pytest.raises(ValueError, match=r"num_clients=6 exceeds the 5 training samples|training set of 5 is too few "
                                       r"for --num-clients 6"):
    run_experiment(config, small, log=quiet)
  assert not (tmp_path / "small" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------- CLI


def test_fmnist_help_lists_methods_and_backends():
  env = {**os.environ, "COLUMNS": "200", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "experiments.fmnist", "--help"], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  text = proc.stdout
  assert "usage:" in text
  for method in METHODS.values():
    assert method.name in text, method.name
  for backend in BACKENDS:
    assert re.search(rf"\b{backend}\b", text), backend
  assert "{" + ",".join(BACKENDS) + "}" in text
