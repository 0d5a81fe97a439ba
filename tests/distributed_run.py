"""One process of the multi-process tests (`tests/test_distributed.py`): several experiment runs, each through
the command line of ``experiments.fmnist``, in one process (so the runs share its start-up and the programs
they have in common).

    python -m tests.distributed_run RUNS.json [--coordinator HOST:PORT --num-processes N --process-id I]

RUNS.json holds ``{"runs": [[flag, ...], ...]}``, each run's flags (the coordinator flags given here, as
`experiments.launch` adds them, are appended to every run), and optionally ``"die": {"run": K, "process": I,
"round": R, "after": DIR, "stamp": PATH}``: in run K, process I kills itself (SIGKILL, as a crash or an
out-of-memory kill would) when it is about to train round R, once DIR exists (the previous round's checkpoint,
which the processes finish saving in the background), after writing the time to PATH; and ``"signal": {"run": K,
"process": I, "round": R, "name": "SIGTERM"}``: in run K, process I sends itself that signal as it is about to
train round R (a scheduler stopping one host of the job).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax

from fedjax_hetero.cli import run as cli
from fedjax_hetero.rounds import Simulation


def _die_before(process: int, round_number: int, after: str, stamp: str) -> None:
  train = Simulation.run_call

  def run_call(self, state, count, evaluate, *rest):
    if jax.process_index() == process and state.round + 1 == round_number:
      deadline = time.monotonic() + 120
      while not os.path.isdir(after) and time.monotonic() < deadline:
        time.sleep(0.05)
      with open(stamp, "w") as f:
        f.write(repr(time.time()))
      os.kill(os.getpid(), signal.SIGKILL)
    return train(self, state, count, evaluate, *rest)

  Simulation.run_call = run_call


def _signal_before(process: int, round_number: int, name: str) -> None:
  train = Simulation.run_call

  def run_call(self, state, count, evaluate, *rest):
    if jax.process_index() == process and state.round + 1 == round_number:
      os.kill(os.getpid(), getattr(signal, name))
    return train(self, state, count, evaluate, *rest)

  Simulation.run_call = run_call


def main(argv: list[str]) -> None:
  with open(argv[0]) as f:
    spec = json.load(f)
  die, signalled = spec.get("die"), spec.get("signal")
  for index, flags in enumerate(spec["runs"]):
    if die and die["run"] == index:
      _die_before(die["process"], die["round"], die["after"], die["stamp"])
    if signalled and signalled["run"] == index:
      _signal_before(signalled["process"], signalled["round"], signalled["name"])
    cli.main("fashion_mnist", [*flags, *argv[1:]])


if __name__ == "__main__":
  main(sys.argv[1:])
