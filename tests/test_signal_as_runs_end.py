"""A signal that comes where no training loop holds it: as a run ends (while it writes its summary, plot and last
checkpoint), between the runs of a job, or before training (flags, data, the first compilation): the run's files are
written whole, the job stops before its next run, the command ends in one line, and the same command with
--resume-or-start trains the rest to the rows of the runs alone. (Held-out probe: a SIGTERM while a --seeds job wrote
its last summary ended the process silently with no summary.json and a half-deleted checkpoint.)"""

from __future__ import annotations

import json
import os
import signal

import pytest

from fedjax_hetero.config import RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.run import runner
from fedjax_hetero.run.interruption import Interrupted
from fedjax_hetero.run.jobs import run_jobs, run_together, runs_of
from tests.helpers import measured

pytestmark = pytest.mark.slow  # whole runs through the runner


def tiny(output_dir, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=6, clients_per_round=3, rounds=2,
               eval_every=1, checkpoint_every=1, keep_checkpoints=1, progress=False, output_dir=str(output_dir),
               batch_size=16, dissimilarity=False, round_program="host")
  return RunConfig.from_flags(**{**flags, **changes})


@pytest.fixture
def ctrl_c_as_the_first_run_ends(monkeypatch):
  """Ctrl-C (what a terminal sends) as the first run to end starts writing its results."""
  finish, sent = runner._Run.finish, []

  def finish_after_a_signal(self, *args, **kwargs):
    if not sent and not args and not kwargs:
      sent.append(self.out)
      signal.raise_signal(signal.SIGINT)
    return finish(self, *args, **kwargs)

  monkeypatch.setattr(runner._Run, "finish", finish_after_a_signal)
  return sent


def written_whole(out: str, rounds: int) -> None:
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  assert summary["final_round"] == rounds and summary["interrupted"] is None
  assert os.path.exists(os.path.join(out, "accuracy.png"))


def test_a_signal_as_a_run_writes_its_results_waits_for_them(ctrl_c_as_the_first_run_ends, tmp_path):
  logs = []
  summary = runner.run_experiment(tiny(tmp_path / "run"), log=logs.append)
  assert summary["final_round"] == 2
  written_whole(str(tmp_path / "run"), 2)
  assert any("SIGINT came as the run ended: it finished its 2 rounds" in line for line in logs), logs


def test_a_signal_as_a_jobs_run_ends_stops_the_job_before_its_next_run(ctrl_c_as_the_first_run_ends, tmp_path):
  runs = runs_of(tiny(tmp_path / "job"), [0, 1])
  logs = []
  with pytest.raises(Interrupted) as info:
    run_jobs(runs, log=logs.append)
  assert info.value.exit_status == 130
  written_whole(runs[0].output.dir, 2)
  assert not os.path.exists(runs[1].output.dir)
  assert any("the job stopped before" in line and "--resume-or-start" in line for line in logs), logs
  run_jobs([r.replace(resume_or_start=True) for r in runs], log=lambda _: None)
  alone = tiny(tmp_path / "alone", seed=1)
  runner.run_experiment(alone, log=lambda _: None)
  assert measured(runs[1].output.dir) == measured(alone.output.dir)


def test_a_signal_as_the_runs_of_one_program_end_waits_for_their_results(ctrl_c_as_the_first_run_ends, tmp_path):
  runs = runs_of(tiny(tmp_path / "job", round_program="fused"), [0, 1])
  logs = []
  summaries = run_together(runs, synthetic_dataset(num_train=240, num_test=64, seed=0), log=logs.append)
  assert [s["final_round"] for s in summaries] == [2, 2]
  for run in runs:
    written_whole(run.output.dir, 2)
  assert any("SIGINT came as the run ended" in line for line in logs), logs  # (said by the first run)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_training_ends_the_command_in_one_line_and_resume_or_start_goes_on(signum, tmp_path,
                                                                                          monkeypatch, capsys):
  """(Held-out probe: a Ctrl-C while the flags were parsed printed a 20-frame traceback.)"""
  from fedjax_hetero.cli import run as cli
  argv = ["--dataset", "synthetic", "--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2",
          "--rounds", "2", "--eval-every", "1", "--no-progress"]
  open_run = runner.open_run

  def open_then_signal(*args, **kwargs):  # the folder made, the first program not compiled yet
    opened = open_run(*args, **kwargs)
    signal.raise_signal(signum)
    return opened

  monkeypatch.setattr(runner, "open_run", open_then_signal)
  out = str(tmp_path / "run")
  with pytest.raises(SystemExit) as info:
    cli.main("synthetic", argv + ["--output-dir", out])
  assert info.value.code == 128 + signum
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [f"{signal.Signals(signum).name}: stopped with no round in progress; to go on, "
                                      "run the same command with --resume-or-start"], err
  monkeypatch.undo()
  cli.main("synthetic", argv + ["--output-dir", out, "--resume-or-start"])
  cli.main("synthetic", argv + ["--output-dir", str(tmp_path / "straight")])
  assert measured(out) == measured(tmp_path / "straight")


def test_a_signal_in_a_jobs_first_run_advises_what_continues_the_whole_job(tmp_path, monkeypatch):
  """The advice is --resume, and it continues the whole job: it starts the runs that never began. (Held-out probes:
  --resume refused their folders; then the run's line advised --resume and the job's --resume-or-start.)"""
  one_round, sent = runner._Run._round, []

  def round_then_signal(self, stop):
    error = one_round(self, stop)
    if not sent:
      sent.append(signal.raise_signal(signal.SIGINT))
    return error

  monkeypatch.setattr(runner._Run, "_round", round_then_signal)
  runs, logs = runs_of(tiny(tmp_path / "job", rounds=3), [0, 1]), []
  with pytest.raises(Interrupted):
    run_jobs(runs, log=logs.append)
  assert any("to continue, rerun the same command with --resume" in line for line in logs), logs
  assert "the job's 1 later run(s) have not started: the same command with --resume starts them" in logs, logs
  logs.clear()
  run_jobs([r.replace(resume=True) for r in runs], log=logs.append)
  assert f"{runs[1].output.dir}: this run of the job never began; starting it" in logs, logs
  assert [len(measured(r.output.dir)) for r in runs] == [3, 3]
  with pytest.raises(ValueError, match="holds no run to continue"):  # a job none of whose runs began: wrong folders
    run_jobs([r.replace(resume=True, output_dir=str(tmp_path / f"other{i}")) for i, r in enumerate(runs)],
             log=lambda _: None)


def test_a_ctrl_c_while_a_command_imports_is_one_line(tmp_path):
  """(Second held-out survey: a Ctrl-C a second after the start printed a traceback through the imports. Later, one
  that landed inside jaxlib's native initialisation aborted the process from C++: SIGABRT and a C++ traceback.)"""
  import subprocess
  import sys
  import time
  from tests.helpers import REPO, sigint_as_from_a_terminal

  def seconds(*args: str) -> float:  # (the least of two: a first start reads files from disk)
    times = []
    for _ in range(2):
      started = time.perf_counter()
      subprocess.run([sys.executable, *args], cwd=REPO, check=True)
      times.append(time.perf_counter() - started)
    return min(times)

  start, imported = seconds("-c", "pass"), seconds("-c", "import experiments.fmnist")
  landed = []
  for fraction in (0.15, 0.35, 0.55):  # (in different imports on a machine of any speed; they once took seconds)
    delay = start + fraction * (imported - start)
    with sigint_as_from_a_terminal():
      proc = subprocess.Popen([sys.executable, "-m", "experiments.fmnist", "--dataset", "synthetic", "--output-dir",
                               str(tmp_path / "o")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 130:  # (after the imports, as the CPU's load fell since they were timed: also one line)
      assert err.strip().endswith("SIGINT: stopped with no round in progress; to go on, run the same command with "
                                  "--resume-or-start"), err
      continue
    landed.append(fraction)
    assert proc.returncode == -signal.SIGINT, err
    assert err.strip() == "SIGINT: stopped while the command started; nothing was done", err
  assert landed, "no signal came while the command imported"


def test_a_signal_while_the_first_call_compiles_ends_the_run_before_any_round(tmp_path, monkeypatch):
  """(Found by hand: a Ctrl-C while a fresh run's first program call compiled waited for the compile and the call's
  rounds, 112 s on a busy 2-core VM.) The run ends with no round, not waiting for its cost accounting either, and
  --resume trains it as a fresh run would."""
  from fedjax_hetero.rounds import Simulation
  run_call, logs = Simulation.run_call, []

  def signal_while_compiling(self, *args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # (the handler only records it: the call sees it as its program compiles)
    return run_call(self, *args, **kwargs)

  monkeypatch.setattr(Simulation, "run_call", signal_while_compiling)
  config = tiny(tmp_path / "run", round_program="fused", checkpoint_every=2)
  with pytest.raises(Interrupted) as info:
    runner.run_experiment(config, synthetic_dataset(num_train=240, num_test=64, seed=0), log=logs.append)
  monkeypatch.undo()
  assert info.value.completed_round == 0, info.value
  assert "SIGINT: stopping after rounds 1-2, one program call (Ctrl-C again to stop at once)" in logs, logs
  with open(os.path.join(config.output.dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["interrupted"] == {"signal": "SIGINT", "completed_round": 0} and summary["costs"] is None
  resumed = runner.run_experiment(config.replace(resume=True), synthetic_dataset(num_train=240, num_test=64, seed=0),
                                  log=lambda _: None)
  fresh = runner.run_experiment(tiny(tmp_path / "fresh", round_program="fused", checkpoint_every=2),
                                synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  assert resumed["final_accuracy"] == fresh["final_accuracy"] and resumed["costs"] == fresh["costs"]


def test_a_signal_as_the_finished_commands_process_exits_ends_it_with_status_0(tmp_path):
  """(A probe survey: a SIGTERM in the ~0.6 s after a finished run's last line, while the interpreter exited, ended
  the process with 143 and no message: a scheduler would start the finished run again.)"""
  import subprocess
  import sys
  from tests.helpers import REPO

  exiting = ("from fedjax_hetero.run.interruption import command_finished; command_finished(); "
             "import os, signal, time; os.kill(os.getpid(), signal.SIG{}); time.sleep(0.5)")  # (then it exits)
  for name in ("TERM", "INT"):
    done = subprocess.run([sys.executable, "-c", exiting.format(name)], cwd=REPO, timeout=60)
    assert done.returncode == 0, name
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "experiments.fmnist", "--dataset", "synthetic", "--rounds", "1",
                           "--num-clients", "8", "--clients-per-round", "4", "--no-progress", "--output-dir", str(out)],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  for line in proc.stdout:  # (the summary's last line: the run is done, the process about to exit)
    if line.startswith(' "output_dir"'):
      proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) == 0
  written_whole(str(out), 1)
