"""The results folder a run owns: its lock (one run at a time, freed by kill -9), what --overwrite may delete,
failed writes that end in one line within seconds (never a hang), and one line for every OS error.

Immutable files (chattr +i) and full disks (a small tmpfs) need root; where they cannot be staged the test is
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.run import metrics_log, results_folder
from fedjax_hetero.run.results_folder import FolderInUseError
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.cli import run as cli
from tests.helpers import REPO, run_fmnist_cli, skip_without_fashion_mnist
from tests.test_runner import base_config

# A tiny Fashion-MNIST run for the command-line tests (MLPs compile in about a second).
TINY = ("--groups", "mlp@0.5,mlp@0.25", "--num-clients", "6", "--clients-per-round", "2", "--max-train-samples", "300",
        "--max-test-samples", "60", "--no-progress", "--eval-every", "5", "--checkpoint-every", "5")


@pytest.fixture(scope="module")
def dataset():
  return synthetic_dataset(num_train=240, num_test=64, seed=0)


def start_fmnist(*args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "experiments.fmnist", *TINY, *args], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def fmnist_in_process(*args: str) -> dict:
  """``python -m experiments.fmnist ARGS`` run in this process (no interpreter and imports to start, and the programs
  this process built already), for a run whose process is not what a test watches; its summary."""
  skip_without_fashion_mnist()
  return cli.main("fashion_mnist", list(args))


def read_rows(out) -> list[dict]:
  """The rows of a live or killed run (a half-written last line left out)."""
  return metrics_log.read_rows(str(out / "metrics.jsonl"))


def wait_for_rows(out, count: int, proc: subprocess.Popen, limit: float = 180.0) -> None:
  started = time.monotonic()
  while time.monotonic() - started < limit:
    if proc.poll() is not None:
      raise AssertionError(f"the run ended early: {proc.communicate()[1][-2000:]}")
    if os.path.exists(out / "metrics.jsonl") and len(read_rows(out)) >= count:
      return
    time.sleep(0.05)
  raise AssertionError(f"no {count} rows after {limit} s")


def error_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.strip()]


@contextlib.contextmanager
def immutable(path):
  if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
    pytest.skip("chattr +i is not available here (needs root on a file system with attributes)")
  try:
    yield
  finally:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@contextlib.contextmanager
def small_disk(path, size: str):
  path.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
    pytest.skip("mount -t tmpfs is not allowed here (needs root)")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ------------------------------------------------------------------------------------------------------ lock


def test_a_locked_folder_names_its_holder_and_a_folder_left_empty_is_removed(tmp_path):
  out = tmp_path / "run"
  with results_folder.lock(str(out)):
    assert (out / results_folder.LOCK_FILE).read_text() == str(os.getpid())
    with pytest.raises(FolderInUseError, match=rf"--output-dir '{out}' is in use by another run \(pid {os.getpid()}"):
      with results_folder.lock(str(out)):
        pass
  assert not out.exists(), "a folder the lock made and nothing filled is removed again"
  out.mkdir()
  with results_folder.lock(str(out)):
    pass
  assert out.is_dir(), "a folder that was there stays"


def test_a_run_whose_folder_another_run_makes_first_is_told_the_folder_is_in_use(tmp_path, monkeypatch):
  """Two runs started at once on a new folder both find it missing; the one whose mkdir comes second waits on the
  lock like any other. (Survey probe: it said "--output-dir ... cannot be created: File exists".)"""
  out, isdir, looked = tmp_path / "run", os.path.isdir, []

  def missing_when_first_looked_at(path):  # (the other run makes it right after)
    looked.append(path)
    return isdir(path) and looked.count(str(out)) > 1

  with results_folder.lock(str(out)):  # (the other run, holding the folder it made)
    monkeypatch.setattr(os.path, "isdir", missing_when_first_looked_at)
    with pytest.raises(FolderInUseError, match=rf"--output-dir '{out}' is in use by another run \(pid {os.getpid()}"):
      with results_folder.lock(str(out)):
        pass


@pytest.mark.slow
def test_a_second_run_on_a_locked_folder_fails_at_once_and_kill_9_frees_the_folder(dataset, tmp_path):
  """The acceptance: the holder is a CLI run; a second run (the library's, timed, and the CLI's) fails naming
  its pid; kill -9 frees the folder, and --resume then ends the run (that a resume after kill -9 equals an
  uninterrupted run is tests/test_recovery.py's and test_distributed.py's, and the survey's). The holder is
  stopped (SIGSTOP) while the others try: it holds the lock all the same, without training on a shared CPU."""
  out = tmp_path / "held"
  holder = start_fmnist("--output-dir", str(out), "--rounds", "400")
  try:
    wait_for_rows(out, 2, holder)
    os.kill(holder.pid, signal.SIGSTOP)
    started = time.perf_counter()
    with pytest.raises(FolderInUseError, match=rf"in use by another run \(pid {holder.pid},"):
      run_experiment(base_config(out, resume=True), dataset, log=lambda _: None)
    assert time.perf_counter() - started < 2.0
    second = run_fmnist_cli(*TINY, "--output-dir", str(out), "--resume", "--rounds", "400")
    assert second.returncode == 2 and error_lines(second.stderr) == [
        f"error: --output-dir '{out}' is in use by another run (pid {holder.pid}, which holds "
        f"{out / results_folder.LOCK_FILE}); wait for it to end, or choose another folder"], second.stderr
  finally:
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate()
  done = len(read_rows(out))
  assert fmnist_in_process(*TINY, "--output-dir", str(out), "--resume", "--rounds", str(done + 2))["final_round"] == \
      done + 2
  assert [r["round"] for r in read_rows(out)] == list(range(1, done + 3))


def kill_9_when(proc: subprocess.Popen, ready, limit: float = 180.0) -> None:
  """SIGKILL to ``proc`` as soon as ``ready()`` holds (polled every 10 ms)."""
  deadline = time.monotonic() + limit
  while not ready():
    if proc.poll() is not None or time.monotonic() > deadline:
      raise AssertionError(f"the run ended or stalled before the moment: {proc.communicate()[1][-2000:]}")
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate()


@pytest.mark.slow
def test_kill_9_at_any_moment_then_the_same_command_with_resume_or_start_reaches_the_uninterrupted_rows(tmp_path):
  """A scheduler's restarts: kill -9 before config.json exists (the run is drawing its partition), and again in
  the middle of a call after a checkpoint; each time the same command plus --resume-or-start goes on, and the
  rows are the uninterrupted run's, bit for bit."""
  command = ("--rounds", "6", "--eval-every", "1", "--checkpoint-every", "2")
  straight, out = tmp_path / "straight", tmp_path / "restarted"
  fmnist_in_process(*TINY, *command, "--output-dir", str(straight))
  again = lambda: start_fmnist(*command, "--output-dir", str(out), "--resume-or-start")
  kill_9_when(again(), lambda: (out / "partition.txt").exists())
  assert not (out / "config.json").exists() and (out / results_folder.LOCK_FILE).exists()
  kill_9_when(again(), lambda: (out / "metrics.jsonl").exists() and len(read_rows(out)) >= 3)
  assert os.listdir(out / "checkpoints")
  last = again()
  _, err = last.communicate(timeout=600)
  assert last.returncode == 0, err[-3000:]
  rows, want = read_rows(out), read_rows(straight)
  assert [r["round"] for r in rows] == list(range(1, 7))
  for a, b in zip(rows, want):
    assert (a["train_loss"], a["test_accuracy"]) == (b["train_loss"], b["test_accuracy"]), a["round"]


# ------------------------------------------------------------------------------------------------ overwrite


def test_overwrite_deletes_only_a_folder_that_holds_a_run(dataset, tmp_path, no_compute):
  foreign = tmp_path / "thesis"
  foreign.mkdir()
  (foreign / "thesis.tex").write_text("years of work")
  (foreign / "figures").mkdir()
  with pytest.raises(ValueError, match=r"--overwrite deletes only a results folder, and '.*thesis' holds no run "
                                       r"\(no config.json, metrics.jsonl, checkpoints/\) but figures, thesis.tex"):
    run_experiment(base_config(foreign, overwrite=True), dataset, log=lambda _: None)
  assert (foreign / "thesis.tex").read_text() == "years of work"
  assert sorted(os.listdir(foreign)) == ["figures", "thesis.tex"], "no lock file is left behind either"


def test_overwrite_clears_a_run_but_keeps_its_lock_file(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "3").mkdir(parents=True)
  (run / "metrics.jsonl").write_text("{}\n")
  with results_folder.lock(str(run)):
    results_folder.check_fresh(str(run), overwrite=True)
    results_folder.clear_for_overwrite(str(run))
    assert os.listdir(run) == [results_folder.LOCK_FILE]


# ------------------------------------------------------------------------------------------- failed writes


@pytest.mark.slow
def test_an_immutable_checkpoints_folder_stops_the_run_in_one_line_within_seconds(tmp_path):
  """A run whose checkpoints folder turns immutable after round 1: the resume's first write fails."""
  out = tmp_path / "frozen"
  assert fmnist_in_process(*TINY, "--output-dir", str(out), "--rounds", "1")["final_round"] == 1
  with immutable(out / "checkpoints"):
    started = time.perf_counter()
    proc = run_fmnist_cli(*TINY, "--output-dir", str(out), "--resume", "--rounds", "2", "--checkpoint-every", "1",
                          timeout=60)
    seconds = time.perf_counter() - started
  assert proc.returncode == 1 and seconds < 30
  assert error_lines(proc.stderr) == [
      f"error: cannot write the checkpoint of round 2 in '{out / 'checkpoints'}': Operation not permitted (EPERM; "
      "check the permissions (and for chattr +i: lsattr))"], proc.stderr


# A save whose write fails inside orbax's own threads (after the run's check of the folder passed).
FAILING_SAVE = """
import os, subprocess, sys, time
import jax.numpy as jnp
from fedjax_hetero.run import checkpoints
from fedjax_hetero.rounds import ServerState
manager = checkpoints.manager(sys.argv[1], every=1)
state = lambda r: ServerState(r, ({"params": {"w": jnp.full(64, float(r))}},), ((),), (), ((),))
checkpoints.save(manager, state(1))
manager.wait_until_finished()
subprocess.run(["chattr", "+i", os.path.join(sys.argv[1], "checkpoints")], check=True)
try:
  for r in (2, 3):
    manager.save(r, args=checkpoints.ocp.args.StandardSave(checkpoints.state_tree(state(r))))
  manager.wait_until_finished()
except checkpoints.CheckpointWriteError as e:
  print("error:", e, file=sys.stderr)
finally:
  subprocess.run(["chattr", "-i", os.path.join(sys.argv[1], "checkpoints")])
"""


def test_a_write_that_fails_in_orbax_threads_raises_one_error_and_the_process_exits(tmp_path):
  with immutable(tmp_path):  # only to learn whether chattr works here
    pass
  proc = subprocess.run([sys.executable, "-c", FAILING_SAVE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  lines = error_lines(proc.stderr)
  assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: cannot write ") and "Operation not permitted (EPERM" in lines[0], lines


def test_a_full_disk_stops_the_run_in_one_line(tmp_path):
  with small_disk(tmp_path / "disk", "400k") as disk:
    proc = run_fmnist_cli(*TINY, "--output-dir", str(disk / "run"), "--rounds", "4", "--checkpoint-every", "1",
                          timeout=120)
  lines = error_lines(proc.stderr)
  assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: ") and "No space left on device (ENOSPC" in lines[0], lines


def test_a_failed_write_task_that_asyncio_collects_later_logs_nothing_but_other_task_errors_still_show():
  """(The full-disk run printed its one error line, then asyncio's traceback of a write task never retrieved.)"""
  import logging
  from fedjax_hetero.run import checkpoints  # noqa: F401 - installs the filter
  shown = []
  handler = logging.Handler()
  handler.emit = shown.append
  asyncio_log = logging.getLogger("asyncio")
  asyncio_log.addHandler(handler)
  task = ("Task exception was never retrieved\nfuture: <Task finished coro=<async_serialize_from_host() done, "
          "defined at /site-packages/orbax/checkpoint/_src/serialization/serialization.py:126>>")
  try:
    for error in (ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0": No space left on device'),
                  ValueError("a shape mismatch")):
      asyncio_log.error(task, exc_info=(type(error), error, None))
  finally:
    asyncio_log.removeHandler(handler)
  assert [r.exc_info[1].args[0] for r in shown] == ["a shape mismatch"]


def test_a_job_checks_every_runs_folder_before_its_first_run_trains(tmp_path, no_compute):
  """(The second seed's occupied folder failed only after the first seed had trained.)"""
  from fedjax_hetero.run.jobs import run_jobs, runs_of
  runs = runs_of(base_config(tmp_path / "job", rounds=1), [0, 1])
  os.makedirs(runs[1].output.dir)
  with open(os.path.join(runs[1].output.dir, "notes.txt"), "w") as f:
    f.write("someone's")
  with pytest.raises(ValueError, match=rf"output directory '{runs[1].output.dir}' holds no run"):
    run_jobs(runs, log=lambda _: None)
  assert not os.path.exists(runs[0].output.dir)
