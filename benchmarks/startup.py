"""Where a run's time goes before its rounds run at speed: the library's import, the setup and the first calls.

    python -m benchmarks.startup                                          # the InCo depths, union, on a subset
    python -m benchmarks.startup --groups cnn@1,cnn@0.5,cnn@0.25 --batch-size 32   # the demo's CNN widths

A run of the experiment driver (`run.runner`, as ``python -m experiments.fmnist`` runs it), in this process and timed
by phase, one JSON line:

* ``import_s``: importing the library (jax included) in this process;
* ``setup_s``: `runner.prepare` until the initial state is ready: data, checks, the simulation, the initialization
  (the results folder's partition plot goes on beside it);
* ``first_call_s``: the first call of ``--rounds-per-call`` rounds, with its program's tracing, lowering and
  compilation (and the run's cost accounting started while it compiles, `costs.InBackground`); a device
  program's run starts them during the setup (`Simulation.compile_first_call_beside`), and its first call waits
  for what is left;
* ``costs_wait_s``: how long the cost accounting then still took;
* ``second_call_s``: the next call, compiled: what a call costs at speed.

``compile_cache`` is jax's persistent compilation cache (off by default here, so that every program compiles): a
directory makes a second run of the same command load its programs (``first_call_s`` then shows tracing, lowering
and loading). The absolute seconds are this machine's; the phases' shares carry over to another.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402 (after the clock starts)
import json  # noqa: E402
import tempfile  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from benchmarks.program_size import INCO  # noqa: E402


def measure(config: Any, import_s: float) -> dict[str, Any]:
  import jax

  from fedjax_hetero.garbage import deferred_full_collections
  from fedjax_hetero.run import runner

  with deferred_full_collections():  # (as `runner.run_checked` runs a run)
    seconds = time.perf_counter()
    run = runner.prepare(config, None, lambda _: None, runner.run_method(config))
    jax.block_until_ready(run.state)
    setup_s, seconds = time.perf_counter() - seconds, time.perf_counter()
    state, _ = runner.advance(run.sim, run.state, run.config, run.static_costs.start)
    jax.block_until_ready(state.models)
    first_s, seconds = time.perf_counter() - seconds, time.perf_counter()
    dict(run.static_costs)
    costs_s, seconds = time.perf_counter() - seconds, time.perf_counter()
    state, _ = runner.advance(run.sim, state, run.config)
    jax.block_until_ready(state.models)
    second_s = time.perf_counter() - seconds
  run.partition.result()
  return {"groups": ",".join(config.groups), "driver": run.sim.cohorts.name, "import_s": round(import_s, 2),
          "setup_s": round(setup_s, 2), "first_call_s": round(first_s, 2), "costs_wait_s": round(costs_s, 2),
          "second_call_s": round(second_s, 2), "rounds_per_call": run.sim.rounds_per_call,
          "platform": jax.default_backend()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--groups", default=INCO)
  p.add_argument("--method", default="HeteroAvg")
  p.add_argument("--round-program", default="auto", choices=("auto", "union", "fused", "host"))
  p.add_argument("--rounds-per-call", type=int, default=1)
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--max-train-samples", type=int, default=6000, help="class-balanced training subset (0: all)")
  p.add_argument("--compile-cache", default="off", help="jax's persistent compilation cache: a directory, or off")
  args = p.parse_args(argv)

  from fedjax_hetero import compilation
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run import runner  # noqa: F401 (imported as the driver imports it, and timed)
  import_s = time.perf_counter() - _START

  if args.compile_cache != "off":
    compilation.enable_persistent_cache(args.compile_cache)
  per_call = None if args.round_program == "host" else args.rounds_per_call
  with tempfile.TemporaryDirectory() as out:
    config = RunConfig.from_flags(
        dataset="fashion_mnist", groups=tuple(args.groups.split(",")), method=args.method, num_clients=100,
        clients_per_round=10, partition="dirichlet", alpha=0.5, epochs=1, batch_size=args.batch_size,
        optimizer="adam", learning_rate=1e-3, rounds=2 * args.rounds_per_call, eval_every=1000, progress=False,
        round_program=args.round_program, rounds_per_call=per_call,
        max_train_samples=args.max_train_samples or None, output_dir=out)
    row = measure(config, import_s)
  print(json.dumps(row), flush=True)
  return row


if __name__ == "__main__":
  main()
