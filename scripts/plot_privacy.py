"""Plots test accuracy per round of results folders, each labelled with its privacy (clip, z, final epsilon).

    python scripts/plot_privacy.py OUT.png RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os

from fedjax_hetero.run.plot import figure


def label(summary: dict) -> str:
  privacy = summary.get("privacy")
  if not privacy:
    return "no privacy"
  eps = privacy["epsilon"]
  bound = "no bound" if eps is None else f"ε = {eps:.1f} at δ = {privacy['delta']:g}"
  return f"C = {privacy['clip']:g}, z = {privacy['noise_multiplier']:g}: {bound}"


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("runs", nargs="+")
  args = parser.parse_args(argv)
  fig = figure(7.0, 4.2)
  ax = fig.subplots()
  for run in args.runs:
    with open(os.path.join(run, "summary.json")) as f:
      summary = json.load(f)
    with open(os.path.join(run, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    evaluated = [r for r in rows if r.get("test_accuracy")]
    ax.plot([r["round"] for r in evaluated], [r["test_accuracy"]["mean"] for r in evaluated], marker="o",
            markersize=3, label=label(summary))
  ax.set_xlabel("round")
  ax.set_ylabel("test accuracy")
  ax.set_title("FedAvg, Fashion-MNIST subset: 500 clients, 100 per round (ε: sampling without replacement)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.savefig(args.out, dpi=120, bbox_inches="tight")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
