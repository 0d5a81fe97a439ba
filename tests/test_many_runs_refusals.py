"""Many runs in one program: what cannot be swept, or cannot share a program, is refused before any compute (and
before a run's folder is written), naming the setting and why; a sweep's runs are the product of its values."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from fedjax_hetero.config import MethodConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import build_method
from fedjax_hetero.rounds.many import ManyRuns, NotBatchable
from fedjax_hetero.run.jobs import parse_sweep, run_together, runs_of
from tests.golden_setting import golden_simulation
from tests.test_many_runs import ROUNDS, golden_runs, tiny_config
from tests.test_round_program import fused


@pytest.mark.parametrize("text, message", [
    ("federation.clients_per_round=2,3", r"--sweep federation.clients_per_round: it is a count: the shapes"),
    ("client.batch_size=8,16", r"--sweep client.batch_size: it is a count"),
    ("method.name=FedAvg,FedProx", r"--sweep method.name: it is a choice: it selects what the runs' program"),
    ("groups=mlp,cnn", r"--sweep groups: it is a choice"),
    ("federation.seed=0,1", r"--sweep federation.seed: the seed goes by --seeds"),
    ("client.learning_rat=0.1", r"--sweep 'client.learning_rat': no such setting"),
    ("client.learning_rate=1e-3,x", r"expected client.learning_rate=V1,V2,... with numbers"),
    ("method.prox.mu=0,0.1", r"--sweep method.prox.mu: zero and non-zero values make different programs"),
])
def test_what_changes_shapes_or_the_method_cannot_be_swept(text, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    parse_sweep(text, tiny_config(tmp_path))


def test_runs_whose_programs_differ_are_refused_before_compute(request, tmp_path):
  from fedjax_hetero.run.build import run_method
  from fedjax_hetero.run.jobs import swept
  base = golden_simulation("FedProx", "vmap", "mlp")
  program = fused(base, rounds_per_call=ROUNDS)
  other = fused(base, rounds_per_call=ROUNDS, config=dataclasses.replace(base.spec.config, clients_per_round=2))
  no_mu = MethodConfig(prox=dataclasses.replace(MethodConfig().prox, mu=0.0))
  zero = fused(base, rounds_per_call=ROUNDS, method=build_method("FedProx", no_mu, base.spec.local))
  configs = [tiny_config(tmp_path), tiny_config(tmp_path, clients_per_round=2)]
  methods = [run_method(c) for c in configs]
  request.getfixturevalue("no_compute")  # (the simulations above computed their shapes)
  with pytest.raises(NotBatchable, match=r"run 1: its cohorts hold other numbers of clients"):
    ManyRuns([program, other])
  with pytest.raises(NotBatchable, match=r"run 0: it runs on the host loop"):
    ManyRuns([base, base])
  with pytest.raises(NotBatchable, match=r"run 1: its method's client terms or server steps differ"):
    ManyRuns([program, zero])
  with pytest.raises(NotBatchable, match=r"federation.clients_per_round cannot differ between runs of one program"):
    swept(configs, methods, None)


def test_the_cli_refuses_a_sweep_of_a_shape_before_compute(tmp_path, capsys, no_compute):
  from fedjax_hetero.cli import run as cli
  with pytest.raises(SystemExit) as exit_:
    cli.main("synthetic", ["--output-dir", str(tmp_path / "o"), "--seeds", "0,1", "--sweep", "client.batch_size=8,16"])
  assert exit_.value.code == 2
  assert "--sweep client.batch_size: it is a count" in capsys.readouterr().err


def test_a_sweep_no_program_takes_is_refused_before_the_data_loads_or_a_folder_is_written(tmp_path, capsys,
                                                                                          no_compute):
  """Held-out probe U8: a sweep's refusal came after every run's folder was written, and those blocked a retry."""
  from fedjax_hetero.cli import run as cli
  with pytest.raises(SystemExit) as exit_:
    cli.main("synthetic", ["--output-dir", str(tmp_path / "o"), "--round-program", "fused", "--no-progress", "--num-clients", "6",
                           "--clients-per-round", "2",
                           "--sweep", "data.client_eval_fraction=0.1,0.2"])
  assert exit_.value.code == 2
  assert "data.client_eval_fraction cannot differ between runs of one program" in capsys.readouterr().err
  assert os.listdir(tmp_path) == []


def test_runs_whose_programs_differ_are_refused_before_a_folder_is_written(tmp_path):
  runs = [tiny_config(tmp_path / "a", prox_mu=0.0), tiny_config(tmp_path / "b", prox_mu=0.1)]
  with pytest.raises(NotBatchable, match=r"run 1: its method's client terms or server steps differ"):
    run_together(runs, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("changes, why", [
    (dict(round_program="host"), r"the rounds run as a host loop \(--round-program host"),
    (dict(method="CluSamp", groups=("mlp",)), r"CluSamp's sampler \(clustered\) updates host-side state"),
    (dict(backend="sharded"), r"the sharded backend splits cohorts over devices"),
])
def test_runs_that_cannot_share_a_program_are_named_and_go_one_after_another(changes, why, tmp_path):
  from fedjax_hetero.run.build import run_method
  from fedjax_hetero.run.jobs import batchable
  config = tiny_config(tmp_path, **changes)
  assert re.match(why, batchable(config, run_method(config)))
  assert batchable(tiny_config(tmp_path), run_method(tiny_config(tmp_path))) is None


@pytest.mark.slow
def test_a_run_over_the_memory_budget_fails_naming_the_estimate():
  sims, values, specialize = golden_runs("FedAvg", "client.learning_rate", 3e-3)
  batch = ManyRuns(sims[:1], values[:1], specialize, memory_budget=1)
  with pytest.raises(MemoryError, match=r"one run's program needs about \d+ MiB \(XLA's estimate\), more than the budget"):
    batch.run([0], [sims[0].init_state()], ROUNDS, set())


def test_runs_that_differ_in_rounds_or_evaluation_are_refused_naming_the_flags(tmp_path, no_compute):
  runs = runs_of(tiny_config(tmp_path / "o"), [0, 1])
  with pytest.raises(ValueError, match=r"must share --rounds \(4, 6\), --eval-every \(1, 2\): run them as separate"):
    run_together([runs[0], runs[1].replace(rounds=6, eval_every=1)])


def test_a_setting_swept_twice_or_values_that_name_one_folder_are_refused(tmp_path):
  config = tiny_config(tmp_path / "o")
  with pytest.raises(ValueError, match=r"--sweep client.learning_rate is given twice"):
    runs_of(config, [0], [("client.learning_rate", (0.01, 0.02)), ("client.learning_rate", (0.03,))])
  with pytest.raises(ValueError, match=r"two runs of the job would share the folder .*o_client.learning_rate=0.1_s0"):
    runs_of(config, [0], [("client.learning_rate", (0.1000001, 0.1000002))])


def test_runs_of_a_sweep_are_the_product_in_folders_named_after_what_they_set(tmp_path):
  config = tiny_config(tmp_path / "o")
  runs = runs_of(config, [0, 1], [parse_sweep("client.learning_rate=1e-3,3e-3", config)])
  assert [os.path.basename(r.output.dir) for r in runs] == [
      "o_client.learning_rate=0.001_s0", "o_client.learning_rate=0.001_s1", "o_client.learning_rate=0.003_s0",
      "o_client.learning_rate=0.003_s1"]
  assert [(r.client.learning_rate, r.federation.seed) for r in runs] == [(1e-3, 0), (1e-3, 1), (3e-3, 0), (3e-3, 1)]
