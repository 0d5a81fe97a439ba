"""When runs go wrong: the divergence guard in a run (stop, rollback; the guard alone: tests/test_guard.py),
resuming past a damaged checkpoint or a half-written metrics line, and the segments a resumed run records."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import pytest

from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import Method
from fedjax_hetero.rounds import mapping
from fedjax_hetero.rounds.rows import NonFiniteLossError
from fedjax_hetero.rounds.state import ServerState
from fedjax_hetero.run import checkpoints, results_folder, runner
from fedjax_hetero.run.guard import DivergenceError
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.server import ServerStep, apply_delta, mean_delta
from tests.test_runner import GROUPS, base_config, read_rows, restore

# End to end (`pytest -m "not slow"` leaves it out). One worker runs the module, so its module-scoped runs train
# once (scripts/test.sh: --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("recovery")]


@pytest.fixture(scope="module")
def dataset():
  return synthetic_dataset(num_train=240, num_test=64, seed=0)


# --------------------------------------------------------------------------------------- stop and rollback


HEALTHY_ACCURACY = {1: 0.5, 2: 0.90625, 3: 0.59375}  # of 64 test samples; the best round is not the latest
HEALTHY = dict(rounds=3, eval_every=1, checkpoint_every=1, keep_checkpoints=1, optimizer="sgd", learning_rate=0.05)


@pytest.fixture(scope="module")
def healthy(dataset, tmp_path_factory):
  """The results folder of three healthy rounds (evaluated and checkpointed each round; accuracies
  `HEALTHY_ACCURACY`, keeping one latest checkpoint besides the best), trained once for the tests below."""
  out = tmp_path_factory.mktemp("healthy") / "run"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(mapping, "correct_counts", lambda spec, state, *rest: [
        round(HEALTHY_ACCURACY[state.round] * len(spec.test_labels))] * len(spec.groups))
    run_experiment(base_config(out, **HEALTHY), dataset, log=lambda _: None)
  return out


def healthy_then_diverging(out, healthy, **guard):
  """A copy of the `healthy` folder at ``out``, resumed for 8 rounds with Adam at lr 1e6: (config, accuracies)."""
  shutil.copytree(healthy, out)
  accuracies = {r["round"]: r["test_accuracy"]["mean"] for r in read_rows(out)}
  assert accuracies == HEALTHY_ACCURACY
  return base_config(out, **HEALTHY).replace(rounds=8, resume=True, optimizer="adam", learning_rate=1e6,
                                             **guard), accuracies


def best_round(accuracies):
  return max(accuracies, key=lambda r: (accuracies[r], r))


def test_the_checkpoint_manager_keeps_and_names_the_best_across_reopening(tmp_path):
  state = lambda r: ServerState(r, ({"params": {"w": jnp.full(2, float(r))}},), ((),), (), ((),))
  manager = checkpoints.manager(str(tmp_path), every=1, keep=1)
  for r, accuracy in [(1, 0.5), (2, 0.9), (3, 0.3), (4, 0.2)]:
    checkpoints.save(manager, state(r), accuracy=accuracy)
  manager.wait_until_finished()
  assert manager.all_steps() == [2, 4] and checkpoints.best_step(manager) == 2
  reopened = checkpoints.manager(str(tmp_path), every=1, keep=1)  # what a resumed run sees
  assert checkpoints.best_step(reopened) == 2
  checkpoints.save(reopened, state(5))
  reopened.wait_until_finished()
  assert reopened.all_steps() == [2, 5] and checkpoints.best_step(reopened) == 2
  assert checkpoints.best_step(checkpoints.manager(str(tmp_path / "empty"))) is None


def test_divergence_stops_the_run_within_two_rounds_and_keeps_the_best_checkpoint(dataset, healthy, tmp_path):
  out = tmp_path / "stop"
  diverging, accuracies = healthy_then_diverging(out, healthy)
  with pytest.raises(DivergenceError) as info:
    run_experiment(diverging, dataset, log=lambda _: None)
  assert info.value.round in (4, 5), str(info.value)
  manager = checkpoints.manager(str(out))
  assert checkpoints.best_step(manager) == best_round(accuracies)
  assert best_round(accuracies) in manager.all_steps()
  assert f"the best checkpoint (round {best_round(accuracies)}) is kept" in str(info.value)
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert summary["stopped_by_divergence"]["round"] == info.value.round
  assert summary["stopped_by_divergence"]["best_checkpoint"] == best_round(accuracies)
  assert summary["stopped_by_divergence"]["group"] in diverging.groups, "the group whose loss showed it"


def test_rollback_restores_the_best_checkpoint_with_a_lower_learning_rate(dataset, healthy, tmp_path):
  out = tmp_path / "rollback"
  diverging, accuracies = healthy_then_diverging(out, healthy, on_divergence="rollback",
                                                 divergence_rollback_lr_factor=1e-9)
  logs = []
  summary = run_experiment(diverging, dataset, log=logs.append)
  best = best_round(accuracies)
  assert summary["final_round"] == 8
  assert [r["round"] for r in read_rows(out)] == list(range(1, 9)), "the diverged round is trained again"
  [rollback] = summary["rollbacks"]
  assert rollback["to_round"] == best and rollback["diverged_round"] == 4
  assert rollback["learning_rate"] == [1e6, pytest.approx(1e-3)]
  assert any(line.startswith(f"diverged: rollback to round {best}") for line in logs), logs
  assert [s["rounds"] for s in summary["segments"]] == [[1, best], [best + 1, 8]], "the diverged segment is gone"
  assert summary["segments"][-1]["settings"]["client.learning_rate"] == pytest.approx(1e-3)
  with open(out / "config.json") as f:
    assert json.load(f)["client"]["learning_rate"] == pytest.approx(1e-3)
  # Resumed later with the command that started it, the run keeps the lowered rate.
  logs = []
  run_experiment(diverging.replace(rounds=9), dataset, log=logs.append)
  assert any(line.startswith("keeping --lr 0.001, the last rollback's (--lr ") for line in logs), logs
  with open(out / "config.json") as f:
    assert json.load(f)["client"]["learning_rate"] == pytest.approx(1e-3)


def test_rollback_gives_up_after_its_limit_and_advises_a_lower_learning_rate(dataset, healthy, tmp_path):
  out = tmp_path / "limit"
  diverging, _ = healthy_then_diverging(out, healthy, on_divergence="rollback", divergence_max_rollbacks=1)
  with pytest.raises(DivergenceError) as info:
    run_experiment(diverging, dataset, log=lambda _: None)
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert len(summary["rollbacks"]) == 1 and summary["rollbacks"][0]["learning_rate"] == [1e6, 5e5]
  assert summary["stopped_by_divergence"] is not None
  message = str(info.value)
  assert "after 1 rollback in this run (--divergence-max-rollbacks 1), the last to learning rate 500000" in message, \
      message
  assert "--lr 250000" in message and "--on-divergence rollback" not in message, message


# ------------------------------------------------------------------------------------------ damaged files


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
  config = base_config(tmp_path_factory.mktemp("straight"), checkpoint_every=1)
  run_experiment(config, dataset, log=lambda _: None)
  return config


@pytest.fixture(scope="module")
def two_rounds(dataset, tmp_path_factory):
  """The results folder of the first two rounds of `straight`'s run (checkpointed each round), trained once;
  each test below resumes a copy of it (`copy_of`)."""
  out = tmp_path_factory.mktemp("two_rounds") / "run"
  run_experiment(base_config(out, rounds=2, checkpoint_every=1), dataset, log=lambda _: None)
  assert [r["round"] for r in read_rows(out)] == [1, 2]
  return out


def copy_of(two_rounds, out, **changes):
  """A copy of the `two_rounds` folder at ``out``, and the config that resumes it (4 rounds, as `straight`)."""
  shutil.copytree(two_rounds, out)
  return base_config(out, checkpoint_every=1, resume=True, **changes)


def damage(directory):
  """Truncates every file of a checkpoint to half its size (a write cut short)."""
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_an_older_checkpoint_deleted_partway_is_set_aside_with_a_line_of_ours(dataset, straight, two_rounds, tmp_path,
                                                                             capfd):
  """(Held-out probe: a signal while orbax deleted an old checkpoint left it without its metadata, and every resume
  printed absl's "Metadata file does not exist" about it.)"""
  config = copy_of(two_rounds, tmp_path / "partly")
  os.remove(tmp_path / "partly" / "checkpoints" / "1" / "_CHECKPOINT_METADATA")
  logs = []
  run_experiment(config, dataset, log=logs.append)
  [warning] = [line for line in logs if "cannot be restored" in line]
  assert "_CHECKPOINT_METADATA: deleted partway?" in warning and "resumed from round 2" in warning, warning
  assert os.path.isdir(tmp_path / "partly" / "damaged_checkpoints" / "1")
  assert "Metadata file does not exist" not in capfd.readouterr().err
  assert [r["train_loss"] for r in read_rows(config.output.dir)] == [r["train_loss"] for r in
                                                                    read_rows(straight.output.dir)]


def test_resume_skips_a_damaged_newest_checkpoint_and_matches_an_uninterrupted_run(dataset, straight, two_rounds,
                                                                                    tmp_path):
  config = copy_of(two_rounds, tmp_path / "damaged")
  damage(tmp_path / "damaged" / "checkpoints" / "2")
  logs = []
  run_experiment(config, dataset, log=logs.append)
  [warning] = [line for line in logs if "cannot be restored" in line]
  assert os.path.join("checkpoints", "2") in warning and "damaged_checkpoints" in warning
  assert "resumed from round 1" in logs
  assert any("removed the metrics of rounds 2-2" in line for line in logs), logs
  rows, want = read_rows(config.output.dir), read_rows(straight.output.dir)
  assert [r["round"] for r in rows] == [1, 2, 3, 4]
  assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in want]
  assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in want]
  chex.assert_trees_all_equal(restore(config, dataset)[0].models, restore(straight, dataset)[0].models)


def test_a_half_written_last_metrics_line_is_cut_with_a_warning(dataset, straight, two_rounds, tmp_path):
  config = copy_of(two_rounds, tmp_path / "half")
  with open(tmp_path / "half" / "metrics.jsonl", "a") as f:
    f.write('{"round": 3, "train_lo')
  logs = []
  run_experiment(config, dataset, log=logs.append)
  assert any("its last line is half-written" in line for line in logs), logs
  assert [r["train_loss"] for r in read_rows(config.output.dir)] == [r["train_loss"] for r in read_rows(
      straight.output.dir)]


def test_a_damaged_metrics_line_before_the_last_is_an_error_naming_it(dataset, two_rounds, tmp_path):
  config = copy_of(two_rounds, tmp_path / "bad", rounds=3)
  path = tmp_path / "bad" / "metrics.jsonl"
  lines = path.read_text().splitlines()
  assert len(lines) == 2
  path.write_text("\n".join(["{not json", *lines[1:]]) + "\n")
  with pytest.raises(ValueError, match=r"metrics.jsonl, line 1, is not valid JSON"):
    run_experiment(config, dataset, log=lambda _: None)


# ---------------------------------------------------------------------------------------------- segments


def test_a_resume_with_another_learning_rate_starts_a_segment(dataset, two_rounds, tmp_path):
  first = base_config(two_rounds).client.learning_rate  # the rate the two rounds were trained with
  assert first != 0.01
  summary = run_experiment(copy_of(two_rounds, tmp_path / "segments", learning_rate=0.01), dataset,
                           log=lambda _: None)
  with open(tmp_path / "segments" / "config.json") as f:
    saved = json.load(f)
  assert saved["client"]["learning_rate"] == 0.01
  assert [s["settings"]["client.learning_rate"] for s in saved["segments"]] == [first, 0.01]
  assert [s["rounds"] for s in summary["segments"]] == [[1, 2], [3, 4]]
  assert f"client.learning_rate: {first!r} -> 0.01" in summary["segments"][1]["reason"]


def test_when_no_checkpoint_restores_resume_stops_and_moves_nothing(dataset, two_rounds, tmp_path):
  config = copy_of(two_rounds, tmp_path / "all", rounds=3)
  steps = sorted(os.listdir(tmp_path / "all" / "checkpoints"))
  assert steps
  for step in steps:
    damage(tmp_path / "all" / "checkpoints" / step)
  with pytest.raises(ValueError, match=r"no checkpoint in .*checkpoints can be restored .*nothing was moved"):
    run_experiment(config, dataset, log=lambda _: None)
  assert sorted(os.listdir(tmp_path / "all" / "checkpoints")) == steps
  assert not os.path.exists(tmp_path / "all" / "damaged_checkpoints")


class KilledBeforeItsSettings(Exception):
  pass


def test_resume_starts_a_run_in_the_empty_folder_a_signal_during_the_imports_left(dataset, straight, tmp_path):
  """(Held-out probe: SIGTERM while the command imported left an empty folder, and --resume refused it for good.)"""
  out = tmp_path / "run"
  os.makedirs(out)
  with open(os.path.join(out, results_folder.LOCK_FILE), "w") as f:
    f.write("4242")
  logs = []
  run_experiment(base_config(out, checkpoint_every=1, resume=True), dataset, log=logs.append)
  assert f"{out}: empty (a run stopped before it wrote anything?); starting it" in logs
  assert [r["train_loss"] for r in read_rows(out)] == [r["train_loss"] for r in read_rows(straight.output.dir)]


def killed_before_its_settings(config, dataset, monkeypatch) -> None:
  """What kill -9 in a run's first compilation leaves: the files written before config.json, and the lock file
  (unlocked: the kernel drops the lock with the process)."""
  def killed(*_):
    raise KilledBeforeItsSettings
  with monkeypatch.context() as patch:
    patch.setattr(runner._Run, "begin", killed)
    with pytest.raises(KilledBeforeItsSettings):
      run_experiment(config, dataset, log=lambda _: None)
  with open(os.path.join(config.output.dir, results_folder.LOCK_FILE), "w") as f:
    f.write("4242")
  assert sorted(os.listdir(config.output.dir)) == sorted([results_folder.LOCK_FILE, *results_folder.BEFORE_SETTINGS])


@pytest.mark.parametrize("way", [{}, {"resume_or_start": True}, {"resume": True}],
                         ids=["start", "resume-or-start", "resume"])
def test_a_run_killed_before_it_saved_its_settings_restarts_every_way(way, dataset, straight, tmp_path,
                                                                      monkeypatch):
  out = tmp_path / "run"
  killed_before_its_settings(base_config(out, checkpoint_every=1), dataset, monkeypatch)
  run_experiment(base_config(out, checkpoint_every=1, **way), dataset, log=lambda _: None)
  rows, want = read_rows(out), read_rows(straight.output.dir)
  assert [(r["round"], r["train_loss"], r["test_accuracy"]) for r in rows] == [
      (r["round"], r["train_loss"], r["test_accuracy"]) for r in want]
  assert results_folder.LOCK_FILE not in os.listdir(out), "an ended run leaves no lock file"


def poisoned(from_round: int) -> Method:
  """FedAvg with a user's last server step gone wrong: it turns the model to NaN from round ``from_round`` on."""
  def poison(carry, state, inputs, plan):
    factor = jnp.where(inputs.round + 1 >= from_round, jnp.nan, 1.0)
    return carry._replace(model=jax.tree.map(lambda x: x * factor, carry.model)), state
  return Method("Poisoned", "", "", server=(mean_delta(), apply_delta(), ServerStep("poison", poison)))


@pytest.mark.parametrize("from_round", [1, 3])
def test_a_model_turned_non_finite_by_a_server_step_is_never_evaluated_saved_or_kept_as_best(dataset, from_round,
                                                                                             tmp_path):
  config = base_config(tmp_path / "run", method="Poisoned", checkpoint_every=1, eval_every=1,
                       on_divergence="stop")
  with pytest.raises(DivergenceError, match=rf"round {from_round}: the model of group\(s\) .* has non-finite weights "
                                            "after Poisoned's server step"):
    run_experiment(config, dataset, log=lambda _: None, method=poisoned(from_round))
  assert [r["round"] for r in read_rows(config.output.dir)] == list(range(1, from_round))
  root = os.path.join(config.output.dir, "checkpoints")
  steps = sorted(int(name) for name in os.listdir(root) if name.isdigit()) if os.path.isdir(root) else []
  assert steps == list(range(1, from_round)), "the round whose model is NaN is not saved (nor kept as best)"


@pytest.mark.parametrize("sign", ["model", "loss"])
def test_a_run_stopped_by_a_non_finite_value_with_the_guard_off_writes_its_summary_and_plot(sign, dataset, healthy,
                                                                                           tmp_path):
  out = tmp_path / "off"
  if sign == "model":  # a library user's server step: NonFiniteModelError in round 3
    config, method, first_bad = base_config(out, method="Poisoned", checkpoint_every=1, on_divergence="off"), \
        poisoned(3), 3
  else:  # a learning rate that overflows the loss in round 4 (after the healthy three)
    config, method, first_bad = healthy_then_diverging(out, healthy)[0].replace(
        on_divergence="off", optimizer="sgd", learning_rate=1e30), None, 4
    for name in ("summary.json", "accuracy.png"):  # the healthy run's
      os.remove(out / name)
  with pytest.raises(NonFiniteLossError, match=rf"^round {first_bad}: .*results of rounds 1-{first_bad - 1} in "):
    run_experiment(config, dataset, log=lambda _: None, method=method)
  with open(out / "summary.json") as f:
    summary = json.load(f)
  stopped = summary["stopped_by_divergence"]
  assert stopped["round"] == first_bad and stopped["reason"].startswith(f"round {first_bad}: "), stopped
  assert summary["final_round"] == first_bad - 1 and summary["best_mean_accuracy"] is not None
  assert (out / "accuracy.png").stat().st_size > 0


def resumed_with_nothing_to_train(config, dataset) -> tuple[dict, list[str]]:
  logs = []
  summary = run_experiment(config, dataset, log=logs.append)
  [said] = [line for line in logs if "nothing to train" in line]
  return summary, said


def test_a_resume_with_nothing_left_evaluates_a_last_round_the_schedule_left_out_then_keeps_the_summary(dataset,
                                                                                                         tmp_path):
  out = tmp_path / "stopped"
  run_experiment(base_config(out, rounds=4, checkpoint_every=1, stop_after=1e-9), dataset, log=lambda _: None)
  assert [r["test_accuracy"] for r in read_rows(out)] == [None], "stopped after round 1, which eval_every 2 skips"
  stopped = json.loads((out / "summary.json").read_text())
  assert stopped["final_round"] == 1 and stopped["final_accuracy"] is None and stopped["final_accuracy_round"] is None
  summary, said = resumed_with_nothing_to_train(base_config(out, rounds=1, checkpoint_every=1, resume=True), dataset)
  assert "evaluated its last round" in said, said
  [row] = read_rows(out)
  assert summary["final_accuracy"] == row["test_accuracy"] and set(row["test_accuracy"]) == {*GROUPS, "mean"}
  assert summary["best_round"] == 1 and summary["stopped_after"] is None
  kept = (out / "summary.json").read_text()
  again, said = resumed_with_nothing_to_train(base_config(out, rounds=1, checkpoint_every=1, resume=True), dataset)
  assert "evaluated" not in said and (out / "summary.json").read_text() == kept, "a finished run's summary stays"
  assert again == json.loads(kept)


@pytest.mark.parametrize("lost", [("accuracy.png",), ("summary.json",), ("summary.json", "accuracy.png")])
def test_a_resume_with_nothing_to_train_redoes_the_outputs_a_kill_left_unwritten(lost, dataset, two_rounds, tmp_path):
  """Held-out probe S4: killed after its last round and summary.json but before accuracy.png, a run resumed with
  nothing to train kept its summary and never drew its plot."""
  config = copy_of(two_rounds, tmp_path / "killed", rounds=2)
  kept = (tmp_path / "killed" / "summary.json").read_text()
  for name in lost:
    os.remove(tmp_path / "killed" / name)
  summary, _ = resumed_with_nothing_to_train(config, dataset)
  assert (tmp_path / "killed" / "accuracy.png").stat().st_size > 0
  written = json.loads((tmp_path / "killed" / "summary.json").read_text())
  assert json.loads(json.dumps(summary)) == written and written["final_round"] == 2
  if "summary.json" not in lost:
    assert (tmp_path / "killed" / "summary.json").read_text() == kept, "a finished run's summary stays"


def test_a_resume_that_would_do_nothing_or_cannot_restore_says_so_before_training(dataset, two_rounds, tmp_path):
  with pytest.raises(ValueError, match=r"--rounds 1: the run in .* has trained 2 rounds already; pass --rounds above 2"):
    run_experiment(copy_of(two_rounds, tmp_path / "fewer", rounds=1), dataset, log=lambda _: None)
  logs = []
  run_experiment(copy_of(two_rounds, tmp_path / "same", rounds=2), dataset, log=logs.append)
  assert any("has its 2 rounds already; nothing to train" in line for line in logs), logs
  # The tracked dissimilarity adds a term and a server step, so a checkpoint's state: refused by name, not in orbax.
  with pytest.raises(ValueError, match=r"cannot resume .* with different settings \(dissimilarity: False -> True\)"):
    run_experiment(copy_of(two_rounds, tmp_path / "tracked", dissimilarity=True), dataset, log=lambda _: None)
