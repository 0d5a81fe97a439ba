"""A job's folders (`fedjax_hetero.run.jobs`): its runs write, resume and compare as they would alone, and a job that
is interrupted, stopped after a time, or has a run go wrong ends each run as that run alone would end."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from fedjax_hetero.config import RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.rounds.many import ManyRuns
from fedjax_hetero.run.interruption import Interrupted
from fedjax_hetero.run.jobs import run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from tests.test_many_runs import rows_of, same_rows, tiny_config

pytestmark = pytest.mark.xdist_group("many_runs_folders")  # (one worker sets up the module's fixture)


@pytest.mark.slow
def test_a_batched_job_writes_resumes_and_compares_as_its_runs_alone(tmp_path):
  from fedjax_hetero.cli import compare
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", groups=("mlp",), rounds=2)  # (one group: see `seeds_job`)
  runs = runs_of(config, [0, 1], [("client.learning_rate", (1e-3, 3e-3))])
  run_together(runs, dataset, log=lambda _: None, max_runs_per_program=2)  # two chunks of 2
  logs = []
  resumed = [r.replace(rounds=4, resume=True) for r in runs]
  summaries = run_together(resumed, dataset, log=logs.append, max_runs_per_program=2)  # (the same program)
  assert any("4 runs, at most 2 per program, swept per run: client.learning_rate" in line for line in logs), logs
  assert [s["final_round"] for s in summaries] == [4] * 4
  alone = resumed[3].replace(output_dir=str(tmp_path / "alone"), resume=False)  # lr 3e-3, seed 1
  run_experiment(alone, dataset, log=lambda _: None)
  same_rows(rows_of(resumed[3].output.dir), rows_of(alone.output.dir))
  table = compare.main([r.output.dir for r in resumed])  # reads the folders as they are
  assert all(os.path.basename(r.output.dir) in table for r in resumed), table


# ------------------------------------------------------------------------------- a run of the job goes wrong


def summary_of(folder) -> dict:
  with open(os.path.join(folder, "summary.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_a_run_that_diverges_in_a_job_rolls_back_as_it_would_alone_and_the_others_go_on(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", groups=("mlp",), rounds=2, eval_every=1,  # (one group: see `seeds_job`)
                       checkpoint_every=1)
  runs = runs_of(config, None, [("client.learning_rate", (1e-3, 2e-3))])
  run_together(runs, dataset, log=lambda _: None)
  shutil.copytree(runs[1].output.dir, tmp_path / "alone")
  guard = dict(rounds=4, resume=True, on_divergence="rollback", divergence_rollback_lr_factor=1e-9)
  resumed = [runs[0].replace(**guard), runs[1].replace(**guard, learning_rate=1e6)]  # run 1 diverges in round 3
  logs = []
  summaries = run_together(resumed, dataset, log=logs.append)
  assert [s["final_round"] for s in summaries] == [4, 4]
  assert summaries[0]["rollbacks"] == [], "the healthy run goes on"
  [rollback] = summaries[1]["rollbacks"]
  assert rollback["diverged_round"] == 3 and rollback["learning_rate"] == [1e6, pytest.approx(1e-3)]
  assert not any("continues alone" in line for line in logs), "the rolled-back run stays in the program"
  alone = resumed[1].replace(output_dir=str(tmp_path / "alone"))
  summary = run_experiment(alone, dataset, log=lambda _: None)
  assert [(r["diverged_round"], r["to_round"]) for r in summary["rollbacks"]] == [(3, rollback["to_round"])]
  same_rows(rows_of(resumed[1].output.dir), rows_of(alone.output.dir))


def seeds_job(output_dir, **changes) -> list[RunConfig]:
  """The runs of ``--seeds 0,1`` over 3 rounds, a call and an evaluation per round (one group: what the tests below
  check of a job does not depend on its groups, and one group compiles fewer programs)."""
  config = tiny_config(output_dir, groups=("mlp",), rounds=3, rounds_per_call=1, eval_every=1, **changes)
  return runs_of(config, [0, 1])


@pytest.fixture(scope="module")
def straight_seeds_job(tmp_path_factory) -> list[list[dict]]:
  """The rows of `seeds_job`'s runs trained uninterrupted, once for the tests that stop and resume it."""
  runs = seeds_job(tmp_path_factory.mktemp("straight") / "job")
  run_together(runs, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  return [rows_of(run.output.dir) for run in runs]


@pytest.mark.slow
def test_ctrl_c_in_a_job_stops_every_run_after_the_call_and_resume_reaches_the_uninterrupted_rows(
    tmp_path, monkeypatch, straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job")
  train_one_call = ManyRuns.run

  def ctrl_c_after_the_first_call(self, *args, **kwargs):
    results = train_one_call(self, *args, **kwargs)
    signal.raise_signal(signal.SIGINT)  # what the terminal sends the process on Ctrl-C
    return results

  monkeypatch.setattr(ManyRuns, "run", ctrl_c_after_the_first_call)
  logs = []
  with pytest.raises(Interrupted) as info:
    run_together(runs, dataset, log=logs.append)
  monkeypatch.undo()
  assert info.value.completed_round == 1 and info.value.exit_status == 130
  assert "SIGINT: stopping after round 1 (Ctrl-C again to stop at once)" in logs, logs
  for run in runs:
    assert summary_of(run.output.dir)["interrupted"] == {"signal": "SIGINT", "completed_round": 1}
    assert [r["round"] for r in rows_of(run.output.dir)] == [1]
  summaries = run_together([r.replace(resume=True) for r in runs], dataset, log=lambda _: None)
  assert [s["final_round"] for s in summaries] == [3, 3]
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_ctrl_c_while_a_jobs_program_compiles_stops_its_runs_before_the_call(tmp_path, monkeypatch,
                                                                              straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job")
  compiled, sent = ManyRuns._compiled, []

  def ctrl_c_while_compiling(self, *args, **kwargs):
    if not sent:
      sent.append(signal.raise_signal(signal.SIGINT))  # (its handler records it; the call sees it once compiled)
    return compiled(self, *args, **kwargs)

  monkeypatch.setattr(ManyRuns, "_compiled", ctrl_c_while_compiling)
  with pytest.raises(Interrupted) as info:
    run_together(runs, dataset, log=lambda _: None)
  monkeypatch.undo()
  assert info.value.completed_round == 0
  for run in runs:
    assert summary_of(run.output.dir)["interrupted"] == {"signal": "SIGINT", "completed_round": 0}
    assert rows_of(run.output.dir) == []
  run_together([r.replace(resume=True) for r in runs], dataset, log=lambda _: None)
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_stop_after_ends_every_run_of_a_job_at_the_call_and_resume_reaches_the_uninterrupted_rows(
    tmp_path, straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job", stop_after=1e-6)
  summaries = run_together(runs, dataset, log=lambda _: None)
  assert [s["stopped_after"] for s in summaries] == [{"seconds": 1e-6, "completed_round": 1}] * 2
  for run in runs:
    assert [r["round"] for r in rows_of(run.output.dir)] == [1]
  summaries = run_together([r.replace(resume=True, stop_after=None) for r in runs], dataset, log=lambda _: None)
  assert [s["final_round"] for s in summaries] == [3, 3]
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_a_job_cuts_its_calls_where_a_server_step_changes_stage_as_a_run_alone_does(tmp_path):
  """FedCross's warmup ends after round 1: one call of three rounds would train rounds 2 and 3 as warmup."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", method="FedCross", groups=("mlp",), rounds=3, eval_every=1,
                       checkpoint_every=3, fedcross_warmup_rounds=1)
  runs = runs_of(config, [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  alone = runs[1].replace(output_dir=str(tmp_path / "alone"))
  run_experiment(alone, dataset, log=lambda _: None)
  same_rows(rows_of(runs[1].output.dir), rows_of(alone.output.dir))


@pytest.mark.slow
def test_fedgen_runs_of_a_job_read_their_own_partitions_label_counts(tmp_path):
  """FedGen's generator and its clients' label priors come from the run's partition (seeds split differently)."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(tiny_config(tmp_path / "job", method="FedGen", groups=("mlp",), rounds=1, eval_every=1,
                             fedgen_noise_dim=4, fedgen_hidden_dim=16, fedgen_ensemble_epochs=2,
                             fedgen_n_teacher_iters=1, fedgen_gen_batch_size=8), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  alone = runs[1].replace(output_dir=str(tmp_path / "alone"))
  run_experiment(alone, dataset, log=lambda _: None)
  have, want = rows_of(runs[1].output.dir), rows_of(alone.output.dir)
  same_rows(have, want)
  for a, b in zip(have, want):
    for name, losses in b["fedgen_generator"].items():  # (per federation: the generator's losses)
      assert a["fedgen_generator"][name] == pytest.approx(losses, rel=1e-5), (a["round"], name)


def test_an_error_about_one_run_of_a_job_names_that_run(tmp_path, capsys):
  """(Second held-out survey: a job's divergence or partition error did not say which run it was about.)"""
  from fedjax_hetero.cli import run as cli
  out = str(tmp_path / "job")
  with pytest.raises(SystemExit):
    cli.main("synthetic", ["--groups", "mlp", "--num-clients", "8", "--clients-per-round", "2", "--rounds", "2",
                           "--no-progress", "--output-dir", out, "--seeds", "0,2", "--alpha", "0.1",
                           "--client-eval-fraction", "0.92", "--batch-size", "4"])
  assert capsys.readouterr().err.startswith(f"error: {out}_s2: --client-eval-fraction 0.92: client 4 holds 10 ")


def test_a_run_the_guard_stops_in_a_job_of_runs_one_after_another_leaves_the_others_to_run(tmp_path, capsys):
  """(Fourth probe survey: the first run's divergence ended a job of --sweep runs on the host loop; its later runs
  never started, where runs in one program finish.) The job still ends as the stopped run alone would."""
  from fedjax_hetero.cli import run as cli
  out = str(tmp_path / "job")
  with pytest.raises(SystemExit) as stopped:
    cli.main("synthetic", ["--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                           "--no-progress", "--output-dir", out, "--round-program", "host", "--optimizer", "sgd",
                           "--sweep", "client.learning_rate=1e6,0.01"])
  assert stopped.value.code == 2
  captured = capsys.readouterr()
  assert captured.err.startswith(f"error: {out}_client.learning_rate=1e+06: round 1: ")
  assert "the job goes on with its other runs" in captured.out
  with open(f"{out}_client.learning_rate=0.01/summary.json") as f:
    summary = json.load(f)
  assert summary["final_round"] == 2 and summary["stopped_by_divergence"] is None
