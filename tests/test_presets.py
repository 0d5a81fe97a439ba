"""`--preset`: the papers' protocols and their CPU-sized versions."""

from __future__ import annotations

import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.cli.presets import PRESETS, get_preset, paper_deviations
from fedjax_hetero.config import Proximal
from fedjax_hetero.methods import build_method
from tests.test_prox import prox_mu


@pytest.fixture
def captured(monkeypatch):
  """Runs `cli.main` without compute; returns the configs it would have run."""
  configs = []

  def fake_run(config, *_, **__):
    configs.append(config)
    return {"final_accuracy": {}, "best_mean_accuracy": None, "train_seconds_all_rounds": 0.0}

  monkeypatch.setattr(cli, "run_checked", fake_run)
  return configs


def test_inco_preset_is_the_papers_protocol(captured, capsys):
  cli.main("fashion_mnist", ["--preset", "inco"])
  (config,) = captured
  assert config.groups == ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")
  assert (config.data.num_clients, config.federation.clients_per_round, config.data.alpha, config.client.epochs,
          config.client.batch_size) == (100, 10, 0.5, 5, 64)
  assert (config.client.optimizer, config.client.learning_rate, config.rounds, config.method.name) == (
      "adam", 1e-3, 500, "InCoAvg")
  assert "differs from the paper" not in capsys.readouterr().out


def test_cpu_preset_says_how_it_differs_and_flags_override(captured, capsys):
  cli.main("fashion_mnist", ["--preset", "inco-cpu", "--rounds", "7", "--method", "HeteroNova"])
  (config,) = captured
  assert config.rounds == 7 and config.method.name == "HeteroNova" and config.groups[0] == "resnet10@0.125"
  out = capsys.readouterr().out
  assert "REDUCED SCALE" in out and "rounds=7 (paper 500)" in out and "method" not in out.split("differs")[1]


def test_a_subset_of_the_data_is_a_difference_from_the_paper(captured, capsys):
  """The papers' protocols train and test on the whole dataset as the library reads it (presets.DATA_PIPELINE)."""
  cli.main("fashion_mnist", ["--preset", "inco", "--max-train-samples", "5000", "--image-size", "32"])
  out = capsys.readouterr().out
  assert ("differs from the paper's protocol in: max_train_samples=5000 (paper unset), image_size=32 (paper unset)"
          in out)
  cli.main("fashion_mnist", ["--preset", "fedcross-cpu", "--max-test-samples", "600", "--normalize", "none"])
  out = capsys.readouterr().out
  assert "max_test_samples=600 (paper unset), normalize='none' (paper 'dataset')" in out


def test_fedcross_cpu_preset(captured):
  cli.main("fashion_mnist", ["--preset", "fedcross-cpu"])
  (config,) = captured
  assert (config.method.name, config.groups, config.client.batch_size, config.client.optimizer,
          config.client.momentum) == ("FedCross", ("cnn_cifar",), 50, "sgd", 0.5)
  assert (config.method.fedcross.alpha, config.method.fedcross.strategy) == (0.99, "lowest_similarity")
  assert paper_deviations(PRESETS["fedcross-cpu"], PRESETS["fedcross"].values) == {}


def test_unknown_preset(capsys):
  with pytest.raises(SystemExit):
    cli.main("fashion_mnist", ["--preset", "nope"])
  assert "unknown preset 'nope'; accepted: inco, inco-cpu, fedcross, fedcross-cpu" in capsys.readouterr().err
  with pytest.raises(ValueError, match="unknown preset"):
    get_preset("nope")


def test_fedcross_preset_baselines_follow_the_authors_framework(captured):
  cli.main("fashion_mnist", ["--preset", "fedcross-cpu", "--method", "FedProx"])
  cli.main("fashion_mnist", ["--preset", "fedcross-cpu", "--method", "FedCross"])
  prox, cross = captured
  assert prox.federation.weighting == "num_samples"
  # FedProx gets the paper's CIFAR-10 mu; FedCross, with no proximal term, gets none.
  assert prox_mu(build_method("FedProx", prox.method, prox.client)) == pytest.approx(0.01)
  assert prox_mu(build_method("FedCross", cross.method, cross.client)) == 0
  assert cross.method.prox == Proximal()  # the protocol's FedProx mu is not FedCross's option


@pytest.mark.parametrize("name", ["fedfa", "fedfa-cpu", "fedfa-cifar10"])
def test_fedfa_presets_say_what_of_the_papers_training_they_leave_out(name, captured, capsys):
  """(A probe survey: the FedFA presets trained without the paper's static BatchNorm, and `fedfa` without
  HeteroFL's learning-rate milestone, saying neither.)"""
  cli.main("fashion_mnist", ["--preset", name])
  (config,) = captured
  out = capsys.readouterr().out
  assert not config.method.fedfa.static_bn and "the paper's static BatchNorm" in out and "--fedfa-static-bn" in out
  assert "milestone" in out or "lr decay" in out
