"""How much a group's accuracy moves with the round's cohort, and what unpaired comparisons look like.

Usage: python scripts/inco_cohort_effect.py RUN_DIR... [--group resnet10@0.125] [--skip 5] [--baseline HeteroAvg]

For every run (a results folder of ``python -m experiments.<dataset>`` evaluated every round), regresses the
group's test accuracy at round r on the number of that group's clients in round r's cohort (the clients whose
BatchNorm statistics the group's shared layers now hold). Then, for the baseline method's runs against every other
method's runs, gives the group's mean difference over the rounds both evaluated, for the pairs of the same seed
and cohorts (paired, as our comparisons are) and for the pairs of different seeds (unpaired: other cohorts,
initialization and shuffling, as two unseeded runs of the authors' code are). The first ``--skip`` rounds are left
out (the warm-up, where every model gains tens of points).
"""

from __future__ import annotations

import argparse
import itertools
import os

import numpy as np

from fedjax_hetero.rounds import assign_groups
from experiments.compare import base_method_of, evaluated, load_run, paired_points, seed_of


def read_run(run_dir: str, group: str, skip: int) -> dict:
  summary, rows = load_run(run_dir)
  config = summary["config"]
  groups = config["groups"]
  if group != "mean" and group not in groups:
    raise SystemExit(f"{run_dir}: no group {group!r}; its groups: {', '.join(groups)}, or mean")
  num_clients = config["data"]["num_clients"]
  members = (set(range(num_clients)) if group == "mean"
             else set(assign_groups(num_clients, len(groups))[groups.index(group)].tolist()))
  rows = [r for r in rows if r["round"] > skip]
  clients = {r["round"]: r["clients"] for r in rows}
  accuracy = {r: 100 * a for r, a in evaluated(rows, group)}
  count = {r: sum(c in members for c in clients[r]) for r in accuracy}
  sample_seed = config["federation"]["sample_seed"]
  return dict(name=os.path.basename(run_dir.rstrip("/")), method=base_method_of(summary), seed=seed_of(summary),
              cohorts=seed_of(summary) if sample_seed is None else sample_seed, rows=rows, accuracy=accuracy,
              count=count)


def mean_difference(a: dict, b: dict, group: str) -> tuple[float, float, int]:
  _, run, base = paired_points(a["rows"], b["rows"], group)
  diff = 100 * (run - base)
  return float(diff.mean()), float(np.mean(diff > 0)), len(diff)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_dirs", nargs="+")
  parser.add_argument("--group", default="resnet10@0.125", help="a group's name, or mean (the mean accuracy)")
  parser.add_argument("--skip", type=int, default=5, help="leave out the first rounds (default 5)")
  parser.add_argument("--baseline", default="HeteroAvg")
  args = parser.parse_args()
  runs = [read_run(d, args.group, args.skip) for d in args.run_dirs]
  print(f"{args.group}: accuracy against the number of its clients in the round's cohort (rounds > {args.skip})\n")
  print("| run | rounds | mean accuracy | correlation | points per client (slope) |\n|---|---|---|---|---|")
  for run in runs if args.group != "mean" else ():
    rounds = sorted(run["accuracy"])
    accuracy = np.array([run["accuracy"][r] for r in rounds])
    count = np.array([run["count"][r] for r in rounds])
    slope = np.polyfit(count, accuracy, 1)[0]
    print(f"| {run['name']} | {len(rounds)} | {accuracy.mean():.2f} | {np.corrcoef(count, accuracy)[0, 1]:+.2f} | "
          f"{slope:+.2f} |")
  base = [r for r in runs if r["method"] == args.baseline]
  other = [r for r in runs if r["method"] != args.baseline]
  print(f"\n{args.group}: other method minus {args.baseline}, mean over the rounds both evaluated\n")
  print("| pair | cohorts | mean difference | rounds ahead |\n|---|---|---|---|")
  for o, b in itertools.product(other, base):
    paired = o["seed"] == b["seed"] and o["cohorts"] == b["cohorts"]
    difference, ahead, n = mean_difference(o, b, args.group)
    print(f"| {o['name']} - {b['name']} | {'same (paired)' if paired else 'different (unpaired)'} | "
          f"{difference:+.2f} | {ahead:.0%} of {n} |")


if __name__ == "__main__":
  main()
