"""What the reliability survey's probes share: a probe's result, its classification, and running the CLI.

Every probe stands for one thing a careful user could do wrong (or one fault the machine could throw at a
run) and says what the right answer is: a clear error naming given facts (`Error`), or a run that goes on
and leaves a correct results folder (`Works`). `classify` maps what happened onto the survey's outcomes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTCOMES = ("clear error", "handled correctly", "silent-wrong", "traceback", "unhelpful", "hang")
# A clear error prints at most this many non-empty stderr lines (the error, and a warning or two).
MAX_ERROR_LINES = 4
BASE_ARGS = ("--groups", "mlp@0.5,mlp@0.25", "--num-clients", "6", "--clients-per-round", "2", "--rounds", "2",
             "--max-train-samples", "300", "--max-test-samples", "60", "--no-progress", "--checkpoint-every", "1",
             "--eval-every", "1")


@dataclasses.dataclass
class Result:
  """What a probe saw: a process's exit status and output, or a library call's exception."""
  status: int | None = 0  # None: the process did not end in time
  out: str = ""
  err: str = ""
  seconds: float = 0.0
  exception: BaseException | None = None  # in-process probes
  correct: bool = True  # the probe's own check of the results folder (Works)
  in_process: bool = False  # a library call, not a process
  harmed: bool = False  # the probe's check that an error left things as they were failed (Error)


@dataclasses.dataclass(frozen=True)
class Error:
  """The right answer is an error naming every fragment (case-insensitive)."""
  fragments: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Works:
  """The right answer is a run that ends well; `Result.correct` says whether its results were right."""


@dataclasses.dataclass(frozen=True)
class Probe:
  family: str
  name: str
  run: Callable[[str], Result]  # given a fresh scratch folder
  expect: Error | Works


def _names_all(text: str, fragments: Sequence[str]) -> bool:
  return all(f.lower() in text.lower() for f in fragments)


def _classify_process(result: Result, expect: Error | Works) -> str:
  text = result.out + result.err
  if "Traceback (most recent call last)" in text:
    return "traceback"
  if isinstance(expect, Works):
    if result.status != 0:
      return "unhelpful"  # refused (or failed on) something that should work
    return "handled correctly" if result.correct else "silent-wrong"
  if result.status == 0 or result.harmed:  # (an error that still changed what it should not have)
    return "silent-wrong"
  lines = [line for line in result.err.splitlines() if line.strip()]
  errors = [line for line in lines if "error:" in line]
  if errors and _names_all(errors[-1], expect.fragments) and len(lines) <= MAX_ERROR_LINES:
    return "clear error"
  return "unhelpful"


def _classify_call(result: Result, expect: Error | Works) -> str:
  error = result.exception
  if isinstance(expect, Works):
    if error is not None:
      return "unhelpful" if isinstance(error, ValueError) else "traceback"
    return "handled correctly" if result.correct else "silent-wrong"
  if error is None:
    return "silent-wrong"
  if not isinstance(error, (ValueError, TypeError)) or type(error).__module__.startswith("numpy"):
    return "traceback"
  if _names_all(str(error), expect.fragments) and len(str(error).splitlines()) <= 2:
    return "clear error"
  return "unhelpful"


def classify(result: Result, expect: Error | Works) -> str:
  if result.status is None:
    return "hang"
  return _classify_call(result, expect) if result.in_process else _classify_process(result, expect)


def call(fn: Callable[[], object], check: Callable[[object], bool] | None = None) -> Result:
  """A library call in this process: its exception, or (with ``check``) whether its result is right."""
  try:
    value = fn()
  except Exception as e:  # noqa: BLE001 - the probe classifies every kind
    return Result(exception=e, in_process=True)
  return Result(correct=check(value) if check else True, in_process=True)


def start_cli(output_dir: str, *args: str, cache: str, base: Sequence[str] = BASE_ARGS) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  argv = [sys.executable, "-m", "experiments.fmnist", *base, "--compile-cache", cache, "--output-dir",
          output_dir, *args]
  return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, started: float, timeout: float) -> Result:
  try:
    out, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - started)))
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    return Result(status=None, out=out, err=err, seconds=time.perf_counter() - started)
  return Result(proc.returncode, out, err, time.perf_counter() - started)


def cli(output_dir: str, *args: str, cache: str, timeout: float = 90.0, base: Sequence[str] = BASE_ARGS) -> Result:
  """``python -m experiments.fmnist BASE_ARGS --output-dir OUTPUT_DIR ARGS``; a hang is killed at ``timeout``."""
  started = time.perf_counter()
  return finish(start_cli(output_dir, *args, cache=cache, base=base), started, timeout)


def without(args: Sequence[str], flag: str) -> tuple[str, ...]:
  """``args`` without ``flag`` and its value."""
  at = list(args).index(flag)
  return (*args[:at], *args[at + 2:])


def rounds_of(output_dir: str) -> list[int] | None:
  """The rounds of a results folder's metrics.jsonl, in file order (None if it cannot be read as rows)."""
  import json
  try:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
      return [json.loads(line)["round"] for line in f if line.strip()]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def rounds_are(output_dir: str, last: int) -> bool:
  return rounds_of(output_dir) == list(range(1, last + 1))


@contextlib.contextmanager
def immutable(*paths: str) -> Iterator[bool]:
  """``chattr +i`` on each path for the block; yields False (nothing set) where chattr cannot be used."""
  done = []
  try:
    for path in paths:
      if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        yield False
        return
      done.append(path)
    yield True
  finally:
    for path in done:
      subprocess.run(["chattr", "-i", path], capture_output=True)


@contextlib.contextmanager
def tmpfs(path: str, size: str, read_only: bool = False) -> Iterator[bool]:
  """A tmpfs of ``size`` mounted at ``path`` for the block; yields False where mounting is not allowed."""
  os.makedirs(path, exist_ok=True)
  options = f"size={size}" + (",ro" if read_only else "")
  if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True).returncode != 0:
    yield False
    return
  try:
    yield True
  finally:
    subprocess.run(["umount", "-l", path], capture_output=True)


def scratch() -> str:
  return tempfile.mkdtemp(prefix="fedjax_hetero_survey_")


def copy_run(source: str, target: str) -> str:
  shutil.copytree(source, target)
  return target
