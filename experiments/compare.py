"""Compare finished runs: a markdown table and one plot of mean test accuracy vs round.

    python -m experiments.compare runs/a runs/b --labels A,B --output compare.png

Each RUN_DIR is a results folder of ``python -m experiments.<dataset>``
(``summary.json`` + ``metrics.jsonl``). The table lists, per run, the method,
rounds, final and best mean accuracy, the accuracy averaged over the last few
evaluations (less noisy than the final one), and the training wall time (sum
of the rounds' wall times, the first round's compilation included).
``--up-to-round R`` cuts every run at round R, to compare runs of different
lengths at equal rounds.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence


def load_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  summary_path, metrics_path = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "metrics.jsonl")
  for path in (summary_path, metrics_path):
    if not os.path.exists(path):
      raise SystemExit(f"error: {path} not found; is {run_dir!r} a finished results folder?")
  with open(summary_path) as f:
    summary = json.load(f)
  with open(metrics_path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return summary, rows


def evaluated(rows: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
  return [(r["round"], r["test_accuracy"]["mean"]) for r in rows if r.get("test_accuracy")]


def up_to_round(rows: Sequence[dict[str, Any]], last_round: int | None) -> list[dict[str, Any]]:
  return [r for r in rows if last_round is None or r["round"] <= last_round]


def table(runs: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]], last: int) -> str:
  lines = [f"| run | method | rounds | final mean acc (%) | best (%) | mean of last {last} evals (%) | train time (s) |",
           "|---|---|---|---|---|---|---|"]
  for label, summary, rows in runs:
    accs = [a for _, a in evaluated(rows)]
    if not accs:
      raise SystemExit(f"error: run {label!r} has no evaluation in the rounds compared")
    tail = accs[-last:]
    method = summary.get("method") or summary["config"]["method"]  # older summaries: only the flat config's
    lines.append(f"| {label} | {method} | {rows[-1]['round']} | "
                 f"{100 * accs[-1]:.2f} | {100 * max(accs):.2f} | {100 * sum(tail) / len(tail):.2f} | "
                 f"{sum(r['round_seconds'] for r in rows):.0f} |")
  return "\n".join(lines)


def plot(runs, path: str, title: str) -> str:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for label, _, rows in runs:
    points = evaluated(rows)
    ax.plot([r for r, _ in points], [100 * a for _, a in points], marker=".", lw=1.5, label=label)
  ax.set_xlabel("round")
  ax.set_ylabel("mean test accuracy (%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("run_dirs", nargs="+")
  p.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
  p.add_argument("--output", default=None, help="write the accuracy plot here")
  p.add_argument("--title", default="mean test accuracy")
  p.add_argument("--last", type=int, default=3, help="evaluations averaged in the 'last' column")
  p.add_argument("--up-to-round", type=int, default=None, help="cut every run at this round (default: no cut)")
  args = p.parse_args(argv)
  labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]
  if len(labels) != len(args.run_dirs):
    raise SystemExit(f"error: {len(labels)} labels for {len(args.run_dirs)} runs")
  runs = []
  for label, run_dir in zip(labels, args.run_dirs):
    summary, rows = load_run(run_dir)
    runs.append((label, summary, up_to_round(rows, args.up_to_round)))
  text = table(runs, args.last)
  print(text)
  if args.output:
    print(f"wrote {plot(runs, args.output, args.title)}")
  return text


if __name__ == "__main__":
  main()
