"""Many runs in one program: samples/s of the whole job against the number of runs R (`fedjax_hetero.rounds.many`).

R runs of one workload, seeds 0..R-1, advance together on the round program (one vmapped program per call).
Per R: a first call of ``--rounds`` rounds compiles and runs; a second call of as many rounds is timed, and
the job's samples/s is every run's examples over that call's wall time. ``R=1 alone`` is the same workload's
plain round program (`Simulation.run_rounds`, no runs axis), the number a single run gets today.

Workloads (``--workload``):
  * ``inco``: the InCo @0.25 workload of `benchmarks.peer_torch` (HeteroAvg over ResNet10...26 at width 0.25 on
    Fashion-MNIST, Dirichlet 0.5, one epoch of Adam 1e-3 at batch 64, weights by sample count);
  * ``cnn``: the demo's CNNs (``python -m experiments.fmnist``'s defaults: HeteroAvg over cnn@1, cnn@0.5,
    cnn@0.25, one epoch of Adam 1e-3 at batch 32);
  * ``--smoke``: two tiny MLP groups on synthetic data (checks the script on any machine).

    python -m benchmarks.many_runs --workload cnn --runs 1,2,4,8 --num-clients 20 --clients-per-round 4
    python -m benchmarks.many_runs --workload inco --runs 1,2,4,8,16      # on a GPU
    python -m benchmarks.many_runs --smoke

Unset sizes take the accelerator's defaults (R up to 16, 100 clients, 10 per round, all of Fashion-MNIST, 3 rounds
a call) or, on a CPU, those of docs/performance.md's CPU table (R = 1, 2, 20 clients, 4 per round, 3,000 samples,
1 round a call), which finish there in about a minute. One JSON line per point, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Sequence

INCO_GROUPS = ("resnet10@0.25", "resnet14@0.25", "resnet18@0.25", "resnet22@0.25", "resnet26@0.25")
WORKLOADS = {
    "inco": dict(dataset="fashion_mnist", groups=INCO_GROUPS, batch_size=64, weighting="num_samples"),
    "cnn": dict(dataset="fashion_mnist", groups=("cnn@1", "cnn@0.5", "cnn@0.25"), batch_size=32),
    "smoke": dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), batch_size=16),
}
# The size of a run when not given. On a CPU the setting of docs/performance.md's table: the runs go one after
# another there and the full setting's first calls take 30-50 s each, past a default run's 5 minutes.
ACCELERATOR = dict(runs="1,2,4,8,16", rounds=3, num_clients=100, clients_per_round=10, max_train_samples=None)
CPU = dict(runs="1,2", rounds=1, num_clients=20, clients_per_round=4, max_train_samples=3000)
SMOKE = dict(runs="1,2", rounds=2, num_clients=4, clients_per_round=2, max_train_samples=None)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="cnn", choices=("inco", "cnn"), help="(default: cnn)")
  p.add_argument("--runs", default=None, help="the numbers of runs R measured (default: "
                 f"{ACCELERATOR['runs']}; on a CPU {CPU['runs']})")
  p.add_argument("--rounds", type=int, default=None, help="rounds per call: one compiling call, one timed call "
                 f"(default: {ACCELERATOR['rounds']}; on a CPU {CPU['rounds']})")
  p.add_argument("--num-clients", type=int, default=None,
                 help=f"(default: {ACCELERATOR['num_clients']}; on a CPU {CPU['num_clients']})")
  p.add_argument("--clients-per-round", type=int, default=None,
                 help=f"(default: {ACCELERATOR['clients_per_round']}; on a CPU {CPU['clients_per_round']})")
  p.add_argument("--max-train-samples", type=int, default=None,
                 help=f"class-balanced training subset, 0 for all (default: all; on a CPU "
                 f"{CPU['max_train_samples']})")
  p.add_argument("--data-dir", default=None, help="directory holding the Fashion-MNIST IDX files")
  p.add_argument("--no-alone", action="store_true", help="skip the R=1 run without the runs axis")
  p.add_argument("--smoke", action="store_true", help="tiny MLPs on synthetic data, R = 1, 2")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  return p


def config_of(args: argparse.Namespace, seed: int):
  from fedjax_hetero.config import RunConfig
  workload = WORKLOADS["smoke" if args.smoke else args.workload]
  return RunConfig.from_flags(
      **workload, data_dir=args.data_dir, method="HeteroAvg", num_clients=args.num_clients,
      clients_per_round=args.clients_per_round, partition="dirichlet", alpha=0.5, epochs=1, optimizer="adam",
      learning_rate=1e-3, rounds=2 * args.rounds, seed=seed, round_program="fused", rounds_per_call=args.rounds,
      max_train_samples=args.max_train_samples, progress=False, dissimilarity=False)


def measure(args: argparse.Namespace, dataset: Any, runs: int, alone: bool = False) -> dict[str, Any]:
  """One point: R runs in one program (or, with ``alone``, one run on the plain round program)."""
  import jax
  from fedjax_hetero.compilation import release_programs
  from fedjax_hetero.rounds.many import ManyRuns, memory_estimate
  from fedjax_hetero.run.build import build_simulation
  sims = [build_simulation(config_of(args, seed), dataset, log=lambda _: None)[0] for seed in range(runs)]
  states = [s.init_state() for s in sims]
  if alone:
    (sim,), (state,) = sims, states
    t0 = time.perf_counter()
    state, rows = sim.run_rounds(state, args.rounds, consume=True)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, rows = sim.run_rounds(state, args.rounds, consume=True)
    jax.block_until_ready(state.models)
    seconds, examples, estimate = time.perf_counter() - t0, sum(r["examples"] for r in rows), None
  else:
    batch = ManyRuns(sims, log=lambda _: None)
    t0 = time.perf_counter()
    results = batch.run(list(range(runs)), states, args.rounds, set())
    first = time.perf_counter() - t0
    estimate = max(memory_estimate(p) for p in batch._programs.values())
    t0 = time.perf_counter()
    results = batch.run(list(range(runs)), [s for s, _ in results], args.rounds, set())
    jax.block_until_ready([s.models for s, _ in results])
    seconds = time.perf_counter() - t0
    examples = sum(r["examples"] for _, rows in results for r in rows)
  release_programs()
  return {"workload": "smoke" if args.smoke else args.workload, "runs": runs, "alone": alone,
          "rounds_timed": args.rounds, "samples_per_s": examples / seconds, "timed_s": seconds,
          "first_call_s": first, "memory_estimate_mib": None if estimate is None else estimate / 2**20,
          "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
          "num_clients": args.num_clients, "clients_per_round": args.clients_per_round}


def table(rows: Sequence[dict[str, Any]]) -> str:
  base = lambda alone: next((r["samples_per_s"] for r in rows if r["runs"] == 1 and r["alone"] == alone), None)
  ratio = lambda value, of: f"{value / of:.2f}" if of else "—"
  lines = ["| R | samples/s (whole job) | x one run alone | x R=1 in the program | timed call (s) | first call (s) | "
           "memory estimate (MiB) |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    memory = "—" if r["memory_estimate_mib"] is None else f"{r['memory_estimate_mib']:.0f}"
    lines.append(f"| {'1 alone' if r['alone'] else r['runs']} | {r['samples_per_s']:,.0f} | "
                 f"{ratio(r['samples_per_s'], base(True))} | {ratio(r['samples_per_s'], base(False))} | "
                 f"{r['timed_s']:.2f} | {r['first_call_s']:.1f} | {memory} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  import jax
  args = build_parser().parse_args(argv)
  sizes = SMOKE if args.smoke else CPU if jax.default_backend() == "cpu" else ACCELERATOR
  for name, value in sizes.items():
    if getattr(args, name) is None or (args.smoke and name not in ("runs", "max_train_samples")):
      setattr(args, name, value)
  args.max_train_samples = args.max_train_samples or None  # (0: all)
  from fedjax_hetero import data as fdata
  dataset = (fdata.synthetic_dataset(num_train=160, num_test=32, seed=0) if args.smoke
             else fdata.load_dataset("fashion_mnist", args.data_dir))
  points = [(1, True)] * (not args.no_alone) + [(int(r), False) for r in args.runs.split(",")]
  rows = []
  for runs, alone in points:  # each row as soon as it is measured
    rows.append(measure(args, dataset, runs, alone))
    print(json.dumps(rows[-1]), flush=True)
  if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
  print(table(rows), flush=True)
  return rows


if __name__ == "__main__":
  main()
