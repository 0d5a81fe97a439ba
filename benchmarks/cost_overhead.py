"""What cost accounting (`fedjax_hetero.rounds.costs`) adds to a run: the same run through the runner, with the
accounting and with its static costs replaced by none, each in a fresh process, alternated ``--repeats`` times.

The accounting traces and lowers one local step per group when the run starts (on a thread beside the first
round's compilation), and adds a few dictionary operations to every row. Prints one JSON line per process:
``side`` (``with``/``without``), ``process_s`` (the run's wall time in its process, from the runner's summary),
``train_s`` (all rounds), ``later_rounds_s`` (rounds 2 on) and ``bytes`` (the run's communication as counted:
none without), then the medians' ratios. The run is the peer
benchmark's (`benchmarks.peer_torch`): HeteroAvg over ResNet10 and ResNet18 at width 0.25 on Fashion-MNIST,
20 clients, 4 per round, 6 rounds. E.g.::

  python -m benchmarks.cost_overhead --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Sequence

FLAGS = dict(groups=("resnet10@0.25", "resnet18@0.25"), method="HeteroAvg", num_clients=20, clients_per_round=4,
             rounds=6, eval_every=6, weighting="num_samples", progress=False, dissimilarity=False)


def one_run(side: str, output_dir: str, flags: dict[str, Any] = FLAGS) -> dict[str, Any]:
  """The run of ``flags`` in this process, with (``side="with"``) or without the accounting's static costs."""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.rounds import costs
  from fedjax_hetero.run.runner import run_experiment

  traced = costs.static_costs
  if side == "without":
    costs.static_costs = lambda spec: {}  # (no group has costs: every row's are zeros)
  try:
    summary = run_experiment(RunConfig.from_flags(**flags, output_dir=output_dir), log=lambda _: None)
  finally:
    costs.static_costs = traced
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {"side": side, "process_s": summary["wall_seconds_this_run"], "train_s": summary["train_seconds_all_rounds"],
          "later_rounds_s": sum(r["round_seconds"] for r in rows[1:]),
          "bytes": rows[-1]["costs"]["cumulative"]["bytes"]}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeats", type=int, default=2, help="processes per side, alternated")
  p.add_argument("--side", choices=("with", "without"), help=argparse.SUPPRESS)  # (one process's run)
  args = p.parse_args(argv)
  if args.side:
    with tempfile.TemporaryDirectory() as out:
      print(json.dumps(one_run(args.side, os.path.join(out, "run"))))
    return []
  results = []
  for _ in range(args.repeats):
    for side in ("with", "without"):
      done = subprocess.run([sys.executable, "-m", "benchmarks.cost_overhead", "--side", side], check=True,
                            capture_output=True, text=True)
      results.append(json.loads(done.stdout.strip().splitlines()[-1]))
      print(json.dumps(results[-1]), flush=True)
  median = lambda side, key: statistics.median(r[key] for r in results if r["side"] == side)
  ratios = {f"{key}_ratio": median("with", key) / median("without", key)
            for key in ("process_s", "train_s", "later_rounds_s")}
  print(json.dumps(ratios))
  return results


if __name__ == "__main__":
  main()
