"""Settings declared once: flags, config.json keys, checks and the method options' structure follow from it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.cli.datasets import defaults_for
from fedjax_hetero.cli.presets import PRESETS, values_for
from fedjax_hetero.config import (BACKEND_NAMES, FLAGS, FedFAOptions, MethodConfig, Proximal, RunConfig, as_dict,
                                  cli_flag, declare, flatten, from_dict)
from fedjax_hetero.methods import METHODS, build_method
from fedjax_hetero.methods.catalog import readers
from fedjax_hetero.rounds import backends
from fedjax_hetero.run import history
from fedjax_hetero.run.build import run_method


def test_every_setting_has_one_flag_and_one_key():
  leaves = list(declare.leaves(RunConfig()))
  assert len({leaf.flag for leaf in leaves}) == len({leaf.path for leaf in leaves}) == len(leaves) == len(FLAGS)
  assert {leaf.path for leaf in leaves} == set(flatten(RunConfig()))  # the config.json keys
  for leaf in leaves:
    assert cli_flag(leaf.path) == leaf.cli and leaf.cli.startswith("--")
  assert FLAGS["learning_rate"].cli == "--lr" and FLAGS["method"].path == "method.name"
  assert FLAGS["fedcross_global"].path == "method.fedcross.global_from"


def test_the_backend_names_are_the_engines():
  assert BACKEND_NAMES == backends.BACKENDS


def test_config_json_round_trips():
  config = RunConfig.from_flags(method="FedFA", groups=("resnet10", "resnet14"), fedfa_graft=False, seed=3)
  assert from_dict(json.loads(json.dumps(as_dict(config)))) == config


@pytest.mark.parametrize("leaf", [leaf for leaf in declare.leaves(RunConfig())
                                  if isinstance(leaf.setting.check, (declare.Integer, declare.Number))],
                         ids=lambda leaf: leaf.flag)
def test_each_numeric_setting_is_checked_naming_its_flag(leaf):
  with pytest.raises(ValueError, match=f"^{leaf.cli} must be"):
    RunConfig.from_flags(**{leaf.flag: float("nan") if isinstance(leaf.setting.check, declare.Number) else 1.5})


def test_an_option_family_applies_to_the_methods_that_read_it_only():
  changed = {Proximal: dict(prox_mu=0.2), FedFAOptions: dict(fedfa_graft=False)}
  for kind, flags in changed.items():
    options = RunConfig.from_flags(**flags).method
    for entry in METHODS.values():
      if kind in entry.options:
        build_method(entry.name, options)
      else:
        with pytest.raises(ValueError, match=f"applies to {', '.join(readers(kind))}, not {entry.name}$"):
          build_method(entry.name, options)
  assert build_method("HeteroAvg", RunConfig.from_flags(fedimpro_cut="conv1").method)  # shared: the whole run's


def test_every_method_family_is_read_by_some_method():
  families = [type(f.default) for f in dataclasses.fields(MethodConfig) if declare.is_settings(f.default)]
  assert all(readers(kind) for kind in families)


def test_a_presets_method_options_go_to_the_methods_that_read_them():
  fedcross = PRESETS["fedcross-cpu"]
  assert values_for(fedcross, "FedProx")["prox_mu"] == 0.01
  assert "prox_mu" not in values_for(fedcross, "FedCross")


def test_build_method_runs_once_per_run(tmp_path, monkeypatch):
  import fedjax_hetero.run.build as build

  calls = []
  real = build.build_method
  monkeypatch.setattr(build, "build_method", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
  cli.main("synthetic", ["--groups", "mlp@0.5,mlp", "--num-clients", "4", "--clients-per-round", "2", "--rounds",
                         "1", "--no-progress", "--compile-cache", "off", "--output-dir", str(tmp_path / "run")])
  assert calls == ["HeteroAvg"]


def test_an_older_config_json_is_upgraded():
  older = as_dict(RunConfig.from_flags(method="FedProx", groups=("mlp",)))
  older["method"] = {"name": "FedProx", "aggregate": "deltas", "prox_mu": None, "fedprox_mu": 0.01,
                     "moon_mu": None, "moon_temperature": 0.5, "inco_variant": None, "fedfa_graft": None,
                     "heterofl_bn_samples": None, "fedcross": as_dict(MethodConfig().fedcross)}
  config = history.upgrade(older, ignored := [])
  assert config.method.prox.mu == 0.01 and config.method.fedfa == FedFAOptions() and not ignored
  flat = {"method": "InCoAvg", "groups": ["mlp"], "learning_rate": 0.01, "inco_variant": "theorem",
          "fedprox_mu": 0.3, "fedgen_preset": "cifar100", "no_longer_a_setting": 1}
  config = history.upgrade(flat, ignored := [])
  assert (config.method.inco.variant, config.client.learning_rate, ignored) == ("theorem", 0.01, ["no_longer_a_setting"])
  assert config.method.prox == Proximal()  # InCoAvg reads no proximal term: an older config's value is dropped
  nested_with_a_string_section = dict(as_dict(RunConfig()), data="fashion_mnist")
  with pytest.raises(ValueError, match="'data' must be an object of settings"):
    history.upgrade(nested_with_a_string_section, [])


def test_the_build_step_names_the_flags():
  with pytest.raises(ValueError, match="^--method: unknown method 'FedMoon'; accepted: FedAvg"):
    run_method(RunConfig.from_flags(method="FedMoon"))
  with pytest.raises(ValueError, match="FedCross trains one architecture group, got 3"):
    run_method(RunConfig.from_flags(method="FedCross"))
  with pytest.raises(ValueError, match="--fedimpro-cut, group cnn@1: "):
    run_method(RunConfig.from_flags(fedimpro_cut="nowhere"))
  assert run_method(defaults_for("fashion_mnist").config()).name == "HeteroAvg"


def test_numpy_scalars_given_as_settings_are_written_as_plain_numbers():
  """Held-out probe 39: rounds=np.int64(1) trained, then config.json stopped at '"rounds": ' (not JSON
  serializable)."""
  import numpy as np

  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp@0.25",), rounds=np.int64(3),
                                learning_rate=np.float32(0.5), output_dir="unused")
  tree = json.loads(json.dumps(as_dict(config)))
  assert tree["rounds"] == 3 and tree["client"]["learning_rate"] == 0.5
