"""End-to-end runs: resume equals an uninterrupted run, NaN stops a run (bad inputs: tests/test_runner_inputs.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import chex
import jax
import numpy as np
import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.config import RunConfig, as_dict
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.rounds import Simulation
from fedjax_hetero.rounds.rows import NonFiniteLossError
from fedjax_hetero.run import checkpoints
from fedjax_hetero.run.build import build_simulation
from fedjax_hetero.run.guard import DivergenceError
from fedjax_hetero.run.runner import run_experiment

# End to end (`pytest -m "not slow"` leaves it out). One worker runs the module, so its module-scoped runs train
# once (scripts/test.sh: --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("runner")]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("mlp@1", "mlp@0.5")


def quiet(_):
  pass


@pytest.fixture(scope="module")
def dataset():
  return synthetic_dataset(num_train=240, num_test=64, seed=0)


def base_config(output_dir, **changes):
  # steps_per_call=1: one step program per group to compile (chunks of steps through the runner:
  # test_fedgen_clusamp_engine's resume).
  flags = dict(dataset="synthetic", groups=GROUPS, num_clients=6, clients_per_round=3, rounds=4, checkpoint_every=2,
               eval_every=2, progress=False, output_dir=str(output_dir), batch_size=16, steps_per_call=1,
               dissimilarity=False)  # (its own tests are in test_dissimilarity.py)
  return RunConfig.from_flags(**{**flags, **changes})


def read_rows(output_dir):
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def restore(config, dataset, step=None):
  """The models of checkpoint `step` (the latest if None), via the runner's own manager."""
  sim, _ = build_simulation(config, dataset, log=quiet)
  template = sim.spec.state_shapes
  manager = checkpoints.manager(config.output.dir, config.output.checkpoint_every)
  if step is not None:
    assert step in manager.all_steps(), manager.all_steps()
    manager = _OnlyStep(manager, step)
  state = checkpoints.restore_latest(manager, template)
  return state, manager


class _OnlyStep:
  """A manager view whose latest step is `step` (so `restore_latest` loads that one)."""

  def __init__(self, manager, step):
    self._manager, self._step = manager, step

  def latest_step(self):
    return self._step

  def restore(self, *args, **kwargs):
    return self._manager.restore(*args, **kwargs)

  def all_steps(self):
    return self._manager.all_steps()

  @property
  def directory(self):
    return self._manager.directory


# ---------------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
  config = base_config(tmp_path_factory.mktemp("straight"))
  return config, run_experiment(config, dataset, log=quiet)


@pytest.fixture(scope="module")
def resumed(dataset, tmp_path_factory):
  out = tmp_path_factory.mktemp("resumed")
  first = run_experiment(base_config(out, rounds=2), dataset, log=quiet)
  rows_after_first = read_rows(out)
  logs = []
  config = base_config(out, rounds=4, resume=True)
  summary = run_experiment(config, dataset, log=logs.append)
  return config, first, rows_after_first, summary, logs


def test_resume_equals_uninterrupted_metrics(straight, resumed):
  straight_config, straight_summary = straight
  config, first, rows_after_first, summary, logs = resumed
  assert first["final_round"] == 2 and [r["round"] for r in rows_after_first] == [1, 2]
  assert any("resumed from round 2" in line for line in logs), logs
  a, b = read_rows(straight_config.output.dir), read_rows(config.output.dir)
  assert [r["round"] for r in a] == [r["round"] for r in b] == [1, 2, 3, 4]
  for ra, rb in zip(a, b):
    assert ra["clients"] == rb["clients"] and ra["examples"] == rb["examples"]
    assert ra["train_loss"] == rb["train_loss"], ra["round"]  # bit-for-bit, not approximately
    assert ra["train_loss_per_group"] == rb["train_loss_per_group"]
    assert ra["test_accuracy"] == rb["test_accuracy"]
  assert summary["final_accuracy"] == straight_summary["final_accuracy"]
  assert summary["final_round"] == straight_summary["final_round"] == 4


def test_stop_after_ends_at_a_call_with_a_checkpoint_and_resumes_bit_for_bit(dataset, straight, tmp_path):
  """--stop-after: the run ends at the end of the call that passes the seconds (here the first), saves its state
  there (between --checkpoint-every's rounds), and --resume finishes the run the uninterrupted run made."""
  logs = []
  first = run_experiment(base_config(tmp_path, stop_after=1e-6), dataset, log=logs.append)
  assert first["stopped_after"] == {"seconds": 1e-6, "completed_round": 1} and first["final_round"] == 1
  assert any("--stop-after 1e-06 s: stopped after round 1 of 4, checkpoint saved" in line for line in logs), logs
  assert checkpoints.manager(str(tmp_path), 2).all_steps() == [1]
  summary = run_experiment(base_config(tmp_path, resume=True), dataset, log=quiet)
  assert summary["stopped_after"] is None and summary["final_round"] == 4
  a, b = read_rows(straight[0].output.dir), read_rows(tmp_path)
  assert [(r["train_loss"], r["test_accuracy"]) for r in a] == [(r["train_loss"], r["test_accuracy"]) for r in b]
  chex.assert_trees_all_equal(restore(base_config(tmp_path), dataset)[0].models,
                              restore(straight[0], dataset)[0].models)


def test_stop_after_exits_with_its_status_from_the_command_line(tmp_path, capsys):
  args = ["--groups", "mlp@1,mlp@0.5", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "3",
          "--batch-size", "16", "--no-dissimilarity", "--no-progress", "--stop-after", "1e-6", "--output-dir",
          str(tmp_path)]
  with pytest.raises(SystemExit) as stopped:
    cli.main("synthetic", args)
  assert stopped.value.code == cli.STOPPED_AFTER_STATUS == 75
  assert "rerun the same command with --resume" in capsys.readouterr().out


def test_resume_equals_uninterrupted_checkpoints(dataset, straight, resumed):
  straight_state, straight_manager = restore(straight[0], dataset)
  resumed_state, resumed_manager = restore(resumed[0], dataset)
  assert straight_state.round == resumed_state.round == 4
  assert straight_manager.all_steps() == resumed_manager.all_steps() == [2, 4]
  chex.assert_trees_all_equal(resumed_state.models, straight_state.models)
  # Training did happen between the two kept checkpoints.
  mid_state, _ = restore(straight[0], dataset, step=2)
  leaves4, leaves2 = jax.tree.leaves(straight_state.models), jax.tree.leaves(mid_state.models)
  assert any(not np.array_equal(x, y) for x, y in zip(leaves4, leaves2))


def test_resume_of_a_method_with_client_memory_equals_an_uninterrupted_run(dataset, tmp_path):
  """The runner hands each round the state's client memory (updated in place), so every checkpoint must hold
  the memory as it was when saved: SCAFFOLD's control variates restored at round 2 give rounds 3-4 bit for bit.
  (One group: the memory is per client, whatever the groups; a second group's programs only added compile time.)"""
  memory_config = lambda name, **changes: base_config(tmp_path / name, method="HeteroScaffold", checkpoint_every=1,
                                                      groups=("mlp@1",), **changes)
  straight = memory_config("straight")
  run_experiment(straight, dataset, log=quiet)
  run_experiment(memory_config("resumed", rounds=2), dataset, log=quiet)
  resumed = memory_config("resumed", resume=True)
  run_experiment(resumed, dataset, log=quiet)
  for a, b in zip(read_rows(straight.output.dir), read_rows(resumed.output.dir), strict=True):
    assert a["train_loss"] == b["train_loss"] and a["test_accuracy"] == b["test_accuracy"], a["round"]
  (straight_state, _), (resumed_state, _) = restore(straight, dataset), restore(resumed, dataset)
  chex.assert_trees_all_equal(resumed_state.memory, straight_state.memory)
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(straight_state.memory))  # the variates trained
  mid_state, _ = restore(straight, dataset, step=3)  # (two checkpoints are kept: rounds 3 and 4)
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(mid_state.memory),
                                                      jax.tree.leaves(straight_state.memory)))


class Interrupted(Exception):
  pass


def test_resume_after_a_crash_between_checkpoints(dataset, straight, tmp_path, monkeypatch):
  """Killed in round 4 with rounds 1-3 logged but only round 2 checkpointed: round 3 is redone once."""
  config = base_config(tmp_path / "crashed")
  run_call = Simulation.run_call

  def crash_in_round_4(self, state, count, evaluate, *rest):
    if state.round == 3:
      raise Interrupted()
    return run_call(self, state, count, evaluate, *rest)

  monkeypatch.setattr(Simulation, "run_call", crash_in_round_4)
  with pytest.raises(Interrupted):
    run_experiment(config, dataset, log=quiet)
  assert [r["round"] for r in read_rows(config.output.dir)] == [1, 2, 3]
  manager = checkpoints.manager(config.output.dir, config.output.checkpoint_every)
  # (orbax also keeps round 1: a manager with no checkpoint yet saves its first step.)
  assert manager.latest_step() == 2 and 3 not in manager.all_steps(), manager.all_steps()

  monkeypatch.setattr(Simulation, "run_call", run_call)
  run_experiment(config.replace(resume=True), dataset, log=quiet)
  rows, want = read_rows(config.output.dir), read_rows(straight[0].output.dir)
  assert [r["round"] for r in rows] == [1, 2, 3, 4]
  assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in want]
  assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in want]
  chex.assert_trees_all_equal(restore(config, dataset)[0].models, restore(straight[0], dataset)[0].models)


def test_results_folder(resumed):
  config, _, _, summary, _ = resumed
  out = config.output.dir
  rows = read_rows(out)
  assert [r["round"] for r in rows] == [1, 2, 3, 4], "exactly one row per round after resume"
  for row in rows:
    for key in ("round", "train_loss", "round_seconds", "samples_per_s", "examples", "clients", "test_accuracy"):
      assert key in row, (key, row)
    assert math.isfinite(row["train_loss"]) and row["train_loss"] > 0
    assert row["round_seconds"] > 0 and row["samples_per_s"] > 0
    assert len(row["clients"]) == config.federation.clients_per_round
    if row["round"] % config.eval_every == 0:
      acc = row["test_accuracy"]
      assert set(acc) == set(GROUPS) | {"mean"}
      assert all(0.0 <= acc[g] <= 1.0 for g in GROUPS)
      assert acc["mean"] == pytest.approx(np.mean([acc[g] for g in GROUPS]))
    else:
      assert row["test_accuracy"] is None
  with open(os.path.join(out, "summary.json")) as f:
    on_disk = json.load(f)
  assert on_disk["final_round"] == 4
  assert on_disk["final_accuracy"] == rows[-1]["test_accuracy"] and on_disk["final_accuracy_round"] == 4
  assert on_disk["config"]["groups"] == list(GROUPS)
  assert set(on_disk["parameters_per_group"]) == set(GROUPS)
  assert on_disk["parameters_per_group"]["mlp@0.5"] < on_disk["parameters_per_group"]["mlp@1"]
  assert summary["final_accuracy"] == on_disk["final_accuracy"]
  with open(os.path.join(out, "accuracy.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.isfile(os.path.join(out, "partition.txt"))
  with open(os.path.join(out, "config.json")) as f:
    saved = json.load(f)
  segments, rollbacks, processes = saved.pop("segments"), saved.pop("rollbacks"), saved.pop("processes")
  assert saved == json.loads(json.dumps(as_dict(config)))
  assert processes == 1 and on_disk["processes"] == 1 and on_disk["devices"] == jax.device_count()
  assert [s["from_round"] for s in segments] == [1] and rollbacks == [], "a plain resume continues its segment"
  assert on_disk["segments"][0]["rounds"] == [1, 4]


def test_non_empty_output_dir_needs_resume_or_overwrite(dataset, straight):
  config = straight[0].replace(resume=False, overwrite=False)
  with pytest.raises(ValueError, match=r"output directory .* is not empty; pass --resume"):
    run_experiment(config, dataset, log=quiet)


@pytest.mark.parametrize("change, message", [
    ({"method": "FedAvg"}, r"method.name: 'HeteroAvg' -> 'FedAvg'"),
    ({"groups": ("mlp@1",)}, r"groups: \('mlp@1', 'mlp@0.5'\) -> \('mlp@1',\)"),
    ({"seed": 1, "alpha": 0.1}, r"data.alpha: 0.5 -> 0.1; federation.seed: 0 -> 1"),
])
@pytest.mark.parametrize("saved_in", ["config.json", "summary.json"])
def test_resume_with_other_settings_fails_before_compute(dataset, straight, tmp_path, no_compute, change, message,
                                                         saved_in):
  out = tmp_path / "copy"
  shutil.copytree(straight[0].output.dir, out)
  if saved_in == "summary.json":  # a folder written before config.json existed
    os.remove(out / "config.json")
  config = straight[0].replace(output_dir=str(out), resume=True, rounds=6, **change)
  with pytest.raises(ValueError, match=rf"^cannot resume '{re.escape(str(out))}' with different settings "
                                       rf"\({message}\); repeat the run's own flags"):
    run_experiment(config, dataset, log=quiet)


def test_a_resume_may_spell_the_method_in_another_case(straight):
  """Held-out probe 10: --method fedavg started a run that --method FedAvg --resume was refused to continue."""
  from fedjax_hetero.run import history

  saved = history.read(straight[0].output.dir, quiet)
  config = straight[0].replace(resume=True, rounds=6, method=straight[0].method.name.lower())
  assert history.check_resume(saved, config, 1, quiet) is None


def test_a_resume_may_spell_the_groups_another_way(dataset, straight, tmp_path):
  """Held-out probe U10: --groups cnn@0.25,cnn@0.1250 was refused to continue a run of cnn@0.25,cnn@0.125."""
  out = tmp_path / "copy"
  shutil.copytree(straight[0].output.dir, out)
  config = straight[0].replace(output_dir=str(out), resume=True, groups=("MLP", "mlp@0.50"))
  logs = []
  run_experiment(config, dataset, log=logs.append)
  assert any("nothing to train" in line for line in logs), logs
  with open(out / "config.json") as f:
    assert json.load(f)["groups"] == list(GROUPS)  # (the run's own spelling: its per-group metrics are named so)


# ------------------------------------------------------------------------------------------- NaN stop


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(dataset, tmp_path):
  out = tmp_path / "nan"
  # (Adam at its default rate: the programs `straight` compiled; only the diverging rate compiles new ones.)
  good = base_config(out, rounds=2, checkpoint_every=1)
  run_experiment(good, dataset, log=quiet)
  good_state, _ = restore(good, dataset)
  assert good_state.round == 2

  # Continue the same run with a learning rate that makes the loss overflow in round 3.
  diverging = good.replace(rounds=4, resume=True, learning_rate=1e30)
  with pytest.raises(DivergenceError, match=r"^round 3: training loss of group (mlp@1|mlp@0\.5) is") as info:
    run_experiment(diverging, dataset, log=quiet)
  assert isinstance(info.value, FloatingPointError) and info.value.group in ("mlp@1", "mlp@0.5")
  with open(out / "summary.json") as f:
    assert json.load(f)["stopped_by_divergence"]["group"] == info.value.group
  with pytest.raises(NonFiniteLossError, match=r"^round 3: training loss") as info:  # the guard off: the engine's own
    run_experiment(diverging.replace(on_divergence="off"), dataset, log=quiet)
  with open(out / "summary.json") as f:
    assert json.load(f)["stopped_by_divergence"]["group"] == info.value.group
  assert info.value.group in ("mlp@1", "mlp@0.5")

  state, manager = restore(good, dataset)
  assert 3 not in manager.all_steps() and manager.latest_step() == 2
  chex.assert_trees_all_equal(state.models, good_state.models)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state.models))
  assert [r["round"] for r in read_rows(out)] == [1, 2], "no row for the diverged round"

  # The run can go on from the good checkpoint, with a sane learning rate again.
  logs = []
  summary = run_experiment(good.replace(rounds=3, resume=True), dataset, log=logs.append)
  assert "resuming with changed local training: client.learning_rate: 1e+30 -> 0.001" in logs
  assert summary["final_round"] == 3
  assert [r["round"] for r in read_rows(out)] == [1, 2, 3]


def test_cli_reports_divergence_as_an_error(monkeypatch, capsys, tmp_path):
  def diverge(config, *_, **__):  # (the CLI passes its log by name)
    raise NonFiniteLossError("round 7: training loss of group cnn@0.5 is nan")

  monkeypatch.setattr(cli, "run_checked", diverge)
  with pytest.raises(SystemExit) as info:
    cli.main("synthetic", ["--output-dir", str(tmp_path / "o")])
  assert info.value.code == 2
  assert "error: round 7: training loss of group cnn@0.5 is nan" in capsys.readouterr().err
