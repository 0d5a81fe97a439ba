"""Where FedFA's backdoor attackers train decides whether it is more robust than FlexiFed (docs/reproduction.md).

Left: each attacked run's test accuracy minus its own method's clean run of the same seed, per evaluated round, the
mean over the seeds run (each placement's own: every seed whose clean and attacked runs both finished). Right: the
accuracy of each architecture group lost to the attack, averaged over the evaluated rounds and seeds. The runs are
scripts/repro_fedfa.sh's (lambda 1: ``_attack1`` draws the attackers from every client, ``_largest1`` from
ResNet26's).

    python scripts/plot_fedfa_attackers.py runs/repro/fedfa docs/repro/fedfa_attackers.png
"""

from __future__ import annotations

import argparse
import functools
import os

import numpy as np

from fedjax_hetero.analysis.runs import load_run, paired_points
from fedjax_hetero.run.plot import figure

METHODS = ("FlexiFed", "FedFA")
PLACEMENTS = (("attack1", "attackers drawn from every client", "any client"),
              ("largest1", "attackers all on ResNet26", "on ResNet26"))
GROUPS = ("resnet18@0.125", "resnet26@0.125")
SEEDS = range(10)  # (the seeds looked for)


@functools.cache
def rows_of(run_dir: str) -> list:
  return load_run(run_dir)[1]  # (read once: each run is compared for the mean and every group)


def seeds_run(folder: str, method: str, placement: str) -> list[int]:
  """The seeds whose clean and attacked runs of ``method`` both finished."""
  return [s for s in SEEDS if all(os.path.exists(os.path.join(folder, f"{method}_{kind}_s{s}", "summary.json"))
                                  for kind in ("clean", placement))]


def lost(folder: str, method: str, placement: str, part: str) -> tuple[np.ndarray, np.ndarray]:
  """(rounds, clean minus attacked accuracy in points, the mean over `seeds_run`) of ``part`` (a group, or
  "mean")."""
  per_seed = []
  for seed in seeds_run(folder, method, placement):
    clean = rows_of(os.path.join(folder, f"{method}_clean_s{seed}"))
    attacked = rows_of(os.path.join(folder, f"{method}_{placement}_s{seed}"))
    rounds, have, want = paired_points(attacked, clean, part)
    per_seed.append(100 * (want - have))
  return rounds, np.mean(per_seed, axis=0)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("runs", help="scripts/repro_fedfa.sh's folder")
  parser.add_argument("out")
  args = parser.parse_args(argv)
  fig = figure(11.0, 4.0)
  per_round, per_group = fig.subplots(1, 2, width_ratios=(1.6, 1))
  bars, labels = [], []
  for (placement, where, short), style in zip(PLACEMENTS, ("--", "-")):
    for method, color in zip(METHODS, ("tab:blue", "tab:orange")):
      rounds, points = lost(args.runs, method, placement, "mean")
      seeds = len(seeds_run(args.runs, method, placement))
      per_round.plot(rounds, points, style, color=color, marker="o", markersize=3,
                     label=f"{method}, {where} ({seeds} seeds)")
      bars.append([lost(args.runs, method, placement, g)[1].mean() for g in GROUPS])
      labels.append(f"{method}\n{short}")
  per_round.axhline(0, color="gray", linewidth=0.8)
  per_round.set(xlabel="round", ylabel="accuracy lost to the attack (points)",
                title="20% attackers at λ = 1: clean minus attacked, mean over the seeds")
  per_round.legend(fontsize=8)
  per_round.grid(alpha=0.3)
  x = np.arange(len(bars))
  for k, group in enumerate(GROUPS):
    per_group.bar(x + (k - 0.5) * 0.38, [b[k] for b in bars], 0.38, label=group)
  per_group.set_xticks(x, labels, fontsize=7)
  per_group.set(ylabel="points lost, mean over rounds", title="by architecture group")
  per_group.legend(fontsize=8)
  per_group.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(args.out, dpi=120, bbox_inches="tight")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
