"""The survey's read-back probes: a finished run's files damaged, then resumed (or compared).

See `scripts/reliability_probes_cli.py` for the probes' environment.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Callable

from scripts.reliability_probes_cli import CliProbe, Env
from scripts.survey_common import REPO, Error, Result, Works, finish, rounds_are


# ------------------------------------------------------------------------------------ read-back corruption


def _resume_after(edit: Callable[[str], None], *args: str) -> Callable[[Env], Result]:
  def run(env: Env) -> Result:
    out = env.copy()
    edit(out)
    result = env.cli(out, "--resume", "--rounds", "3", *args)
    return dataclasses.replace(result, correct=rounds_are(out, 3))
  return run


def _lines(edit: Callable[[list[str]], list[str]]) -> Callable[[str], None]:
  def apply(out: str) -> None:
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
      lines = f.read().splitlines()
    with open(path, "w") as f:
      f.write("".join(line + "\n" for line in edit(lines)))
  return apply


def _write(name: str, text: str | None) -> Callable[[str], None]:
  def apply(out: str) -> None:
    path = os.path.join(out, name)
    if text is None:
      os.remove(path)
    else:
      with open(path, "w") as f:
        f.write(text)
  return apply


def _both(*edits: Callable[[str], None]) -> Callable[[str], None]:
  return lambda out: [edit(out) for edit in edits] and None


def _rename_checkpoint(out: str) -> None:
  os.rename(os.path.join(out, "checkpoints", "2"), os.path.join(out, "checkpoints", "5"))


def _half(name: str) -> Callable[[str], None]:
  def apply(out: str) -> None:
    path = os.path.join(out, name)
    with open(path) as f:
      text = f.read()
    with open(path, "w") as f:
      f.write(text[:len(text) // 2])
  return apply


def _compare(edit: Callable[[str], None]) -> Callable[[Env], Result]:
  def run(env: Env) -> Result:
    out = env.copy()
    edit(out)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.compare", out, "--output", env.out("c.png")],
                            cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish(proc, started, 60)
  return run


NO_CONFIG = _both(_write("config.json", None), _write("summary.json", None))
CORRUPTION = [
    CliProbe("read-back corruption", "metrics.jsonl deleted", _resume_after(_write("metrics.jsonl", None)),
             Error(("metrics.jsonl",))),
    CliProbe("read-back corruption", "metrics.jsonl emptied", _resume_after(_write("metrics.jsonl", "")),
             Error(("metrics.jsonl",))),
    CliProbe("read-back corruption", "metrics.jsonl missing its first row", _resume_after(_lines(lambda l: l[1:])),
             Error(("metrics.jsonl", "line 1"))),
    CliProbe("read-back corruption", "metrics.jsonl missing its last row", _resume_after(_lines(lambda l: l[:-1])),
             Error(("metrics.jsonl",))),
    CliProbe("read-back corruption", "metrics.jsonl with a duplicated row",
             _resume_after(_lines(lambda l: [l[0], l[0], *l[1:]])), Error(("metrics.jsonl", "line 2"))),
    CliProbe("read-back corruption", "metrics.jsonl with a line 42", _resume_after(_lines(lambda l: [l[0], "42", *l[1:]])),
             Error(("metrics.jsonl", "line 2"))),
    CliProbe("read-back corruption", "metrics.jsonl with a line {}", _resume_after(_lines(lambda l: [*l, "{}"])),
             Error(("metrics.jsonl", "line 3"))),
    CliProbe("read-back corruption", "metrics.jsonl rows out of order", _resume_after(_lines(lambda l: l[::-1])),
             Error(("metrics.jsonl", "line 1"))),
    CliProbe("read-back corruption", "--repair-metrics after a duplicated row",
             _resume_after(_lines(lambda l: [l[0], l[0], *l[1:]]), "--repair-metrics"), Works()),
    CliProbe("read-back corruption", "--repair-metrics after metrics.jsonl was deleted",
             _resume_after(_write("metrics.jsonl", None), "--repair-metrics"), Works()),
    CliProbe("read-back corruption", "config.json empty", _resume_after(_write("config.json", "")),
             Error(("config.json",))),
    CliProbe("read-back corruption", "config.json half-written", _resume_after(_half("config.json")),
             Error(("config.json",))),
    CliProbe("read-back corruption", "config.json is []", _resume_after(_write("config.json", "[]")),
             Error(("config.json",))),
    CliProbe("read-back corruption", "config.json is {\"data\": 5}", _resume_after(_write("config.json", '{"data": 5}')),
             Error(("config.json",))),
    CliProbe("read-back corruption", "config.json and summary.json gone, --resume --seed 1",
             _resume_after(NO_CONFIG, "--seed", "1"), Error(("config.json", "--resume-unchecked"))),
    CliProbe("read-back corruption", "config.json and summary.json gone, --resume-unchecked",
             _resume_after(NO_CONFIG, "--resume-unchecked"), Works()),
    CliProbe("read-back corruption", "summary.json half-written (config.json intact)",
             _resume_after(_half("summary.json")), Works()),
    CliProbe("read-back corruption", "checkpoint folder 2 renamed to 5 (skipped like damage)",
             _resume_after(_rename_checkpoint), Works()),
    CliProbe("read-back corruption", "resume with --data-dir of swapped train/test files",
             lambda env: _resume_after(lambda out: None, "--data-dir", env.data["swapped"])(env), Error(("data",))),
    CliProbe("read-back corruption", "resume with --data-dir of other images",
             lambda env: _resume_after(lambda out: None, "--data-dir", env.data["other"])(env), Error(("data",))),
    CliProbe("read-back corruption", "resume with --data-dir of the same files elsewhere",
             lambda env: _resume_after(lambda out: None, "--data-dir", env.data["same"])(env), Works()),
    CliProbe("read-back corruption", "a fresh run on swapped train/test files",
             lambda env: env.cli(env.out(), "--data-dir", env.data["swapped"]), Error(("swapped",))),
    CliProbe("read-back corruption", "a fresh run on labels of 5 classes",
             lambda env: env.cli(env.out(), "--data-dir", env.data["five_classes"]), Error(("class",))),
    CliProbe("read-back corruption", "compare on metrics.jsonl with a line 42",
             _compare(_lines(lambda l: [l[0], "42", *l[1:]])), Error(("metrics.jsonl", "line 2"))),
    CliProbe("read-back corruption", "compare on metrics.jsonl with a duplicated row",
             _compare(_lines(lambda l: [l[0], *l])), Error(("metrics.jsonl", "line 2"))),
    CliProbe("read-back corruption", "compare on a half-written summary.json", _compare(_half("summary.json")),
             Error(("summary.json",))),
]

PROBES = CORRUPTION
