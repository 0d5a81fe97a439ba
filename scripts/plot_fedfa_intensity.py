"""How the backdoor's intensity lambda breaks FedFA and FlexiFed, attackers all on ResNet26 (docs/reproduction.md).

Each attacked run's test accuracy minus its own method's clean run of the same seed, averaged over the evaluated
rounds, then over the seeds (the bars: the two seeds), at lambda 1, 5 and 20; FedFA with alpha taken to the cohort's
median norm (``--fedfa-center median``) beside the paper's mean, and FedFA's two parts alone (points where they ran:
lambda 1 and 20). The runs are scripts/repro_fedfa.sh's (``_largest1``, ``_largest5``, ``_largest`` for lambda 20).

    python scripts/plot_fedfa_intensity.py runs/repro/fedfa docs/repro/fedfa_intensity.png
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from fedjax_hetero.analysis.runs import load_run, paired_points
from fedjax_hetero.run.plot import figure

RUNS = (("FlexiFed", "FlexiFed", "tab:blue"), ("FedFA", "FedFA", "tab:orange"),
        ("FedFA-median", "FedFA, median alpha", "tab:red"), ("FedFA-graftonly", "FedFA, grafting alone", "tab:green"),
        ("FedFA-scaleonly", "FedFA, scaling alone", "tab:purple"))
INTENSITIES = ((1, "largest1"), (5, "largest5"), (20, "largest"))
SEEDS = (0, 1)


def lost_per_round(folder: str, run: str, attack: str, seed: int) -> float | None:
  """Clean minus attacked mean accuracy in points, averaged over the evaluated rounds; None if a run is missing."""
  clean, attacked = (os.path.join(folder, f"{run}_{kind}_s{seed}") for kind in ("clean", attack))
  if not (os.path.isdir(clean) and os.path.isdir(attacked)):
    return None
  _, have, want = paired_points(load_run(attacked)[1], load_run(clean)[1], "mean")
  return float(np.mean(100 * (want - have)))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("runs", help="scripts/repro_fedfa.sh's folder")
  parser.add_argument("out")
  args = parser.parse_args(argv)
  fig = figure(7.0, 4.2)
  axes = fig.subplots()
  for run, label, color in RUNS:
    points = [(scale, [lost_per_round(args.runs, run, attack, s) for s in SEEDS]) for scale, attack in INTENSITIES]
    points = [(scale, seeds) for scale, seeds in points if None not in seeds]
    if not points:
      continue
    scales = np.array([p[0] for p in points])
    per_seed = np.array([p[1] for p in points])
    axes.errorbar(scales, per_seed.mean(1), yerr=np.ptp(per_seed, 1) / 2, color=color, marker="o", capsize=3,
                  linestyle="-" if len(points) == len(INTENSITIES) else "none", label=label)
    for scale, seeds in zip(scales, per_seed):
      print(f"{label}, lambda {scale}: {seeds.mean():.2f} points a round, seeds {seeds.round(2).tolist()}")
  axes.set_xscale("log")
  axes.set_xticks([s for s, _ in INTENSITIES], [str(s) for s, _ in INTENSITIES])
  axes.set(xlabel="backdoor intensity λ", ylabel="accuracy lost per round (points)",
           title="20% attackers, all on ResNet26: clean minus attacked, 2 seeds")
  axes.legend(fontsize=8)
  axes.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120, bbox_inches="tight")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
