"""The survey's second batch: probes of the same six families written after the fixes, to see whether the
fixes hold for the family and not only for the first batch's examples. Run on the code before and after.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from scripts import reliability_probes_library as lib
from scripts.reliability_probes_cli import (HOLD, LONG, CliProbe, Env, _resume_keeping_immutable,
                                            _resume_with_immutable, _wait_for_rows)
from scripts.reliability_probes_readback import _compare, _lines, _resume_after, _write
from scripts.survey_common import (BASE_ARGS, REPO, Error, Result, Works, call, finish, rounds_are, start_cli,
                                   without)


def two_resumes_at_once(env: Env) -> Result:
  out = env.copy()
  started = time.perf_counter()
  procs = [start_cli(out, "--resume", "--rounds", "30", cache=env.cache) for _ in range(2)]
  results = [finish(p, started, 180) for p in procs]
  loser = next((r for r in results if r.status != 0), results[1])
  return dataclasses.replace(loser, correct=rounds_are(out, 30) and sum(r.status == 0 for r in results) == 1)


def two_folders_at_once(env: Env) -> Result:
  started = time.perf_counter()
  procs = [start_cli(env.out(name), "--rounds", "6", cache=env.cache) for name in ("a", "b")]
  results = [finish(p, started, 180) for p in procs]
  bad = next((r for r in results if r.status != 0), results[0])
  return dataclasses.replace(bad, correct=all(rounds_are(env.out(n), 6) for n in ("a", "b")))


def symlink_to_a_live_run(env: Env) -> Result:
  out, link = env.out(), env.out("link")
  started = time.perf_counter()
  live = start_cli(out, *HOLD, cache=env.cache)
  _wait_for_rows(out, 2, live)
  os.symlink(out, link)
  second = env.cli(link, "--resume", *LONG)
  live.kill()
  finish(live, started, 60)
  return second


def compare_on_a_live_run(env: Env) -> Result:
  out = env.copy()
  started = time.perf_counter()
  live = start_cli(out, "--resume", *HOLD, cache=env.cache)
  _wait_for_rows(out, 5, live)
  proc = subprocess.Popen([sys.executable, "-m", "experiments.compare", out], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  compared = finish(proc, time.perf_counter(), 60)
  live.kill()
  finish(live, started, 60)
  return compared


def _immutable(name: str) -> Callable[[Env], Result | None]:
  return lambda env: _resume_with_immutable(env, name, rounds=3)


def _replace_checkpoints_by_a_file(out: str) -> None:
  import shutil
  shutil.rmtree(os.path.join(out, "checkpoints"))
  _write("checkpoints", "not a folder")(out)


def _make_dir(name: str) -> Callable[[str], None]:
  def apply(out: str) -> None:
    os.remove(os.path.join(out, name))
    os.makedirs(os.path.join(out, name))
  return apply


def _overwrite_the_repository(env: Env) -> Result:
  """--overwrite on a folder of source files (a scratch copy standing in for the repository)."""
  out = env.out("repo")
  os.makedirs(os.path.join(out, "src"))
  _write("README.md", "# project")(out)
  result = env.cli(out, "--overwrite")
  return dataclasses.replace(result, harmed=sorted(os.listdir(out)) != ["README.md", "src"])


def _fresh(*args: str) -> Callable[[Env], Result]:
  return lambda env: env.cli(env.out(), *args)


CLI = [
    CliProbe("concurrency", "two --resume at once on one folder", two_resumes_at_once, Error(("in use", "pid"))),
    CliProbe("concurrency", "two runs at once on two folders", two_folders_at_once, Works()),
    CliProbe("concurrency", "a run through a symlink to a live run's folder", symlink_to_a_live_run,
             Error(("in use", "pid"))),
    CliProbe("concurrency", "compare on a live run", compare_on_a_live_run, Works()),
    CliProbe("failed writes", "immutable summary.json on --resume", _immutable("summary.json"), Error(("summary.json",))),
    CliProbe("failed writes", "immutable accuracy.png on --resume", _immutable("accuracy.png"), Error(("accuracy.png",))),
    CliProbe("failed writes", "immutable partition.txt on --resume (which keeps it)",
             lambda env: _resume_keeping_immutable(env, "partition.txt", rounds=3), Works()),
    CliProbe("read-back corruption", "metrics.jsonl row of round 0",
             _resume_after(_lines(lambda l: [l[0].replace('"round": 1', '"round": 0'), *l[1:]])),
             Error(("metrics.jsonl", "line 1"))),
    CliProbe("read-back corruption", "metrics.jsonl row with test_accuracy 5",
             _resume_after(_lines(lambda l: [*l[:-1], l[-1].replace('"test_accuracy": {', '"test_accuracy": 5, "x": {')])),
             Error(("metrics.jsonl", "line 2"))),
    CliProbe("read-back corruption", "metrics.jsonl is a folder", _resume_after(_make_dir("metrics.jsonl")),
             Error(("metrics.jsonl",))),
    CliProbe("read-back corruption", "config.json is a folder", _resume_after(_make_dir("config.json")),
             Error(("config.json",))),
    CliProbe("read-back corruption", "config.json with client []", _resume_after(_write("config.json", '{"client": []}')),
             Error(("config.json",))),
    CliProbe("read-back corruption", "checkpoints/ replaced by a file", _resume_after(_replace_checkpoints_by_a_file),
             Error(("checkpoints",))),
    CliProbe("read-back corruption", "summary.json is [] (config.json intact)", _resume_after(_write("summary.json", "[]")),
             Works()),
    CliProbe("read-back corruption", "compare on an empty metrics.jsonl", _compare(_write("metrics.jsonl", "")),
             Error(("no evaluation",))),
    CliProbe("OS errors", "--overwrite on a folder of source files", _overwrite_the_repository, Error(("holds no run",))),
    CliProbe("OS errors", "--data-dir /proc", _fresh("--data-dir", "/proc"), Error(("--data-dir",))),
    CliProbe("OS errors", "--partition-file /proc/self/status",
             lambda env: env.cli(env.out(), "--partition-file", "/proc/self/status",
                                 base=without(BASE_ARGS, "--max-train-samples")),
             Error(("--partition-file",))),
    CliProbe("no-op", "--momentum 0.9 with Adam", _fresh("--momentum", "0.9"), Error(("--momentum",))),
    CliProbe("no-op", "--alpha 0.1 with --partition iid", _fresh("--alpha", "0.1", "--partition", "iid"),
             Error(("--alpha",))),
    CliProbe("no-op", "--classes-per-client 5 with the Dirichlet partition", _fresh("--classes-per-client", "5"),
             Error(("--classes-per-client",))),
    CliProbe("no-op", "--backdoor-scale 5 without malicious clients", _fresh("--backdoor-scale", "5"),
             Error(("--backdoor-scale",))),
    CliProbe("no-op", "--divergence-max-rollbacks 5 with --on-divergence stop", _fresh("--divergence-max-rollbacks", "5"),
             Error(("--divergence-max-rollbacks",))),
    CliProbe("no-op", "--moon-temperature 0.1 with HeteroAvg", _fresh("--moon-temperature", "0.1"),
             Error(("--moon-temperature",))),
    CliProbe("no-op", "--fedcross-alpha 0.5 with HeteroAvg", _fresh("--fedcross-alpha", "0.5"),
             Error(("--fedcross-alpha",))),
    CliProbe("no-op", "--batch-size equal to the largest client is accepted", _fresh("--batch-size", "60"), Works()),
]


def _simulation_with(**changes) -> object:
  return lib.simulation(**changes)


def probe(name: str, fn: Callable[[], object], *fragments: str) -> lib.LibraryProbe:
  return lib.LibraryProbe("library misuse", name, lambda: call(fn), Error(fragments))


LIBRARY = [
    probe("store: images as a nested list", lambda: lib.in_a_run(images=lib.DATA.train_images.tolist()), "images"),
    probe("store: parts as one 2-D array", lambda: lib.in_a_run(parts=np.stack([p[:20] for p in lib.PARTS])), "parts"),
    probe("store: labels of another length", lambda: lib.in_a_run(labels=lib.DATA.train_labels[:10]), "labels"),
    probe("Simulation: groups as a dict", lambda: lib.simulation(groups={"a": None}), "groups"),
    probe("Simulation: the method by name", lambda: _simulation_with(method_object="FedAvg"), "method"),
    probe("Simulation: local as a dict", lambda: _simulation_with(local={"learning_rate": 0.1}), "local"),
    probe("Simulation: the backend by name", lambda: _simulation_with(backend="vmap"), "backend"),
    probe("Simulation: test labels as floats", lambda: lib.simulation(test_labels=lib.DATA.test_labels * 1.0),
          "test_labels"),
    probe("fedavg: weights of shape (2,)", lambda: lib.A.fedavg({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, jnp.ones(2)),
          "weight"),
    probe("hetero_avg: weights of text in an array", lambda: lib._hetero_avg(np.array(["1", "2"])), "group_weights"),
    probe("build_model: width as text", lambda: lib.build_model("cnn", 10, "0.5"), "width"),
]

PROBES = [*CLI, *LIBRARY]
