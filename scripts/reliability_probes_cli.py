"""The survey's command-line probes: concurrency, failed writes, read-back corruption, OS errors, no-ops.

Each probe gets a fresh scratch folder, the two-round base results folder (copy it before changing it) and the
prepared data folders, and returns what the CLI did (`survey_common.Result`), or None when the machine cannot
stage it (no chattr or mount: not root).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

import numpy as np

from scripts.survey_common import (BASE_ARGS, REPO, Error, Result, Works, cli, copy_run, finish, immutable, rounds_are, rounds_of,
                                   start_cli, tmpfs)

FMNIST = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS = (
    f"{n}.gz" for n in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                        "t10k-labels-idx1-ubyte"))


@dataclasses.dataclass(frozen=True)
class Env:
  root: str
  base: str  # a finished two-round run (checkpoints 1 and 2)
  cache: str
  data: dict[str, str]

  def fresh(self, name: str) -> "Env":
    folder = os.path.join(self.root, "".join(c if c.isalnum() else "_" for c in name))
    os.makedirs(folder)
    return dataclasses.replace(self, root=folder)

  def out(self, name: str = "out") -> str:
    return os.path.join(self.root, name)

  def copy(self) -> str:
    return copy_run(self.base, self.out())

  def cli(self, output_dir: str, *args: str, timeout: float = 90.0, base: Sequence[str] = BASE_ARGS) -> Result:
    return cli(output_dir, *args, cache=self.cache, timeout=timeout, base=base)


@dataclasses.dataclass(frozen=True)
class CliProbe:
  family: str
  name: str
  run: Callable[[Env], Result | None]
  expect: Error | Works


def _idx(array: np.ndarray) -> bytes:
  header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
  return gzip.compress(header + array.astype(np.uint8).tobytes(), compresslevel=1)


def _write_lookalike(folder: str, labels: Callable[[int], np.ndarray]) -> str:
  rng = np.random.default_rng(0)
  os.makedirs(folder)
  for name, array in ((TRAIN_IMAGES, rng.integers(0, 256, (1000, 28, 28))), (TRAIN_LABELS, labels(1000)),
                      (TEST_IMAGES, rng.integers(0, 256, (200, 28, 28))), (TEST_LABELS, labels(200))):
    with open(os.path.join(folder, name), "wb") as f:
      f.write(_idx(array))
  return folder


def data_folders(root: str) -> dict[str, str]:
  """``same``: links to the installed files; ``swapped``: train and test swapped; ``other``: random images;
  ``five_classes``: labels 0-4 only."""
  folders = {}
  for name, mapping in (("same", {n: n for n in (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)}),
                        ("swapped", {TRAIN_IMAGES: TEST_IMAGES, TRAIN_LABELS: TEST_LABELS, TEST_IMAGES: TRAIN_IMAGES,
                                     TEST_LABELS: TRAIN_LABELS})):
    folders[name] = os.path.join(root, name)
    os.makedirs(folders[name])
    for link, target in mapping.items():
      os.symlink(os.path.join(FMNIST, target), os.path.join(folders[name], link))
  folders["other"] = _write_lookalike(os.path.join(root, "other"), lambda n: np.arange(n) % 10)
  folders["five_classes"] = _write_lookalike(os.path.join(root, "five"), lambda n: np.arange(n) % 5)
  return folders


def _wait_for_rows(output_dir: str, rows: int, proc, limit: float = 120.0) -> bool:
  started = time.perf_counter()
  while time.perf_counter() - started < limit and proc.poll() is None:
    if len(rounds_of(output_dir) or []) >= rows:
      return True
    time.sleep(0.1)
  return False


LONG = ("--rounds", "40", "--eval-every", "20", "--checkpoint-every", "5")
# A holder that outlives any probe (killed at its end), so a second run always meets it alive.
HOLD = ("--rounds", "1000000", "--eval-every", "500000", "--checkpoint-every", "500000")


# ---------------------------------------------------------------------------------------------- concurrency


def two_runs_at_once(env: Env) -> Result:
  out = env.out()
  started = time.perf_counter()
  first, second = (start_cli(out, *LONG, cache=env.cache) for _ in range(2))
  results = [finish(p, started, 180) for p in (first, second)]
  loser = next((r for r in results if r.status != 0), results[1])
  return dataclasses.replace(loser, correct=rounds_are(out, 40) and sum(r.status == 0 for r in results) == 1)


def _beside_a_live_run(env: Env, *args: str) -> Result:
  """A second run (``args``, 40 rounds) on the folder of a live one; it must leave the live run unharmed."""
  out = env.out()
  started = time.perf_counter()
  live = start_cli(out, *HOLD, cache=env.cache)
  _wait_for_rows(out, 2, live)
  second = env.cli(out, *args, *LONG)
  alive = live.poll() is None
  live.kill()
  finish(live, started, 60)
  rows = rounds_of(out) or []
  harmed = not alive or rows != list(range(1, len(rows) + 1))
  return dataclasses.replace(second, harmed=harmed)


def resume_beside_a_live_run(env: Env) -> Result:
  return _beside_a_live_run(env, "--resume")


def overwrite_beside_a_live_run(env: Env) -> Result:
  return _beside_a_live_run(env, "--overwrite")


def kill_9_then_resume(env: Env) -> Result:
  """A run killed mid-way; its resume must end with the rows of an uninterrupted run."""
  out = env.out()
  started = time.perf_counter()
  live = start_cli(out, *LONG, cache=env.cache)
  _wait_for_rows(out, 7, live)
  os.kill(live.pid, signal.SIGKILL)
  finish(live, started, 30)
  resumed = env.cli(out, *LONG, "--resume")
  straight = env.cli(env.out("straight"), *LONG)
  same = _losses(out) == _losses(env.out("straight")) and rounds_are(out, 40)
  return dataclasses.replace(resumed, correct=same and straight.status == 0)


def _losses(output_dir: str) -> list[float] | None:
  try:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
      return [json.loads(line)["train_loss"] for line in f if line.strip()]
  except (OSError, ValueError, KeyError):
    return None


def _import_seconds() -> float:
  """How long the CLI's imports take here (python, jax, the package): the floor of any CLI run's time."""
  started = time.perf_counter()
  subprocess.run([sys.executable, "-c", "import fedjax_hetero.cli.run"], cwd=REPO, capture_output=True)
  return time.perf_counter() - started


def locked_folder_fails_fast(env: Env) -> Result:
  """The second run must fail within 2 s of its imports (the lock is taken before any data is read)."""
  out = env.out()
  started = time.perf_counter()
  live = start_cli(out, *HOLD, cache=env.cache)
  _wait_for_rows(out, 1, live)
  floor = _import_seconds()
  second = env.cli(out, "--resume", *LONG)
  live.kill()
  finish(live, started, 30)
  if second.status != 0 and second.seconds - floor >= 2.0:  # an error, but not at once: counted unhelpful
    return dataclasses.replace(second, err=second.err + f"\nslow: {second.seconds - floor:.1f} s after imports\n" * 4)
  return second


CONCURRENCY = [
    CliProbe("concurrency", "two runs started at once on one folder", two_runs_at_once,
             Error(("--output-dir", "in use", "pid"))),
    CliProbe("concurrency", "--resume beside a live run", resume_beside_a_live_run, Error(("in use", "pid"))),
    CliProbe("concurrency", "--overwrite beside a live run", overwrite_beside_a_live_run, Error(("in use", "pid"))),
    CliProbe("concurrency", "a second run on a locked folder fails in < 2 s", locked_folder_fails_fast,
             Error(("in use", "pid"))),
    CliProbe("concurrency", "kill -9 mid-run, then --resume equals an uninterrupted run", kill_9_then_resume, Works()),
]


# -------------------------------------------------------------------------------------------- failed writes


def _resume_with_immutable(env: Env, *names: str, rounds: int = 4) -> Result | None:
  out = env.copy()
  with immutable(*(os.path.join(out, n) for n in names)) as done:
    return env.cli(out, "--resume", "--rounds", str(rounds), timeout=60) if done else None


def _resume_keeping_immutable(env: Env, name: str, rounds: int = 4) -> Result | None:
  """A resume with ``name`` immutable, where the resume has no reason to write it (it keeps the partition report
  and plot its run wrote): the right answer is a run that finishes and leaves the file as it was."""
  result = _resume_with_immutable(env, name, rounds=rounds)  # (on a copy of the base run, in env.out())
  if result is None:
    return None
  with open(os.path.join(env.base, name), "rb") as before, open(os.path.join(env.out(), name), "rb") as after:
    return dataclasses.replace(result, correct=rounds_are(env.out(), rounds) and after.read() == before.read())


def _fresh_run_on_tmpfs(env: Env, size: str, read_only: bool = False) -> Result | None:
  mount = env.out("disk")
  with tmpfs(mount, size, read_only) as done:
    return env.cli(os.path.join(mount, "run") if not read_only else mount, "--rounds", "3", timeout=60) \
        if done else None


FAILED_WRITES = [
    CliProbe("failed writes", "immutable checkpoints/ on --resume (exits in < 30 s)",
             lambda env: _resume_with_immutable(env, "checkpoints"), Error(("checkpoints",))),
    CliProbe("failed writes", "immutable metrics.jsonl on --resume",
             lambda env: _resume_with_immutable(env, "metrics.jsonl"), Error(("metrics.jsonl",))),
    CliProbe("failed writes", "immutable config.json on --resume",
             lambda env: _resume_with_immutable(env, "config.json"), Error(("config.json",))),
    CliProbe("failed writes", "immutable partition.png on --resume (which keeps it)",
             lambda env: _resume_keeping_immutable(env, "partition.png"), Works()),
    CliProbe("failed writes", "immutable results folder on --resume",
             lambda env: _resume_with_immutable(env, "."), Error(("out",))),
    CliProbe("failed writes", "disk full (400 KB tmpfs) during the third checkpoint",
             lambda env: _fresh_run_on_tmpfs(env, "400k"), Error(("no space",))),
    CliProbe("failed writes", "disk full (16 KB tmpfs) while writing the partition plot",
             lambda env: _fresh_run_on_tmpfs(env, "16k"), Error(("no space",))),
    CliProbe("failed writes", "read-only file system as the results folder",
             lambda env: _fresh_run_on_tmpfs(env, "1m", read_only=True), Error(("disk",))),
]

PROBES = [*CONCURRENCY, *FAILED_WRITES]
