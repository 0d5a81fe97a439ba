"""`python -m experiments.compare`: the table and plot over finished runs."""

from __future__ import annotations

import os

import numpy as np
import pytest

from experiments import compare
from fedjax_hetero.config import RunConfig
from fedjax_hetero.runner import run_experiment


def test_compare_tables_and_plots_two_runs(tmp_path):
  dirs = []
  for method in ("FedAvg", "HeteroAvg"):
    out = str(tmp_path / method)
    run_experiment(RunConfig.from_flags(dataset="synthetic", method=method, groups=("mlp@0.5", "mlp"), num_clients=4,
                                        clients_per_round=2, rounds=2, eval_every=1, output_dir=out, progress=False),
                   log=lambda m: None)
    dirs.append(out)
  plot = str(tmp_path / "cmp.png")
  text = compare.main(dirs + ["--labels", "a,b", "--output", plot, "--last", "2"])
  rows = text.splitlines()
  assert len(rows) == 4 and rows[2].startswith("| a | FedAvg | 2 |") and rows[3].startswith("| b | HeteroAvg | 2 |")
  assert os.path.getsize(plot) > 1000
  cut = compare.main(dirs + ["--up-to-round", "1"]).splitlines()
  assert cut[2].startswith(f"| {os.path.basename(dirs[0])} | FedAvg | 1 |")
  with pytest.raises(SystemExit, match="no evaluation"):
    compare.main(dirs + ["--up-to-round", "0"])
  with pytest.raises(SystemExit, match="2 labels for 1 runs"):
    compare.main(dirs[:1] + ["--labels", "a,b"])
  with pytest.raises(SystemExit, match="not found"):
    compare.main([str(tmp_path)])


def fake_run(method, seed, accuracies, dissimilarity=None):
  rows = [{"round": r, "round_seconds": 1.0, "test_accuracy": None if a is None else {"mean": a},
           **({"dissimilarity": {"g": {"low": dissimilarity, "high": 2 * dissimilarity}}} if dissimilarity else {})}
          for r, a in enumerate(accuracies, start=1)]
  return f"{method}_s{seed}", {"method": method, "config": {"federation": {"seed": seed}}}, rows


def test_paired_statistics_rounds_to_target_and_dissimilarity_columns():
  runs = [fake_run("A", 0, [0.5, 0.6, 0.7]), fake_run("A", 1, [0.5, None, 0.75]),
          fake_run("B", 0, [0.6, 0.6, 0.9], dissimilarity=0.5), fake_run("B", 1, [0.25, 0.9, 1.0], dissimilarity=1.5)]
  lines = compare.paired_table(runs, "A").splitlines()
  # Pairs at rounds both evaluated: seed 0: +10, 0, +20; seed 1: -25, +25 (round 2 of A_s1 has no evaluation).
  diffs = np.array([10, 0, 20, -25, 25])
  half = 1.96 * diffs.std(ddof=1) / np.sqrt(5)
  assert lines[2] == (f"| B | 2 | +6.00 [{6 - half:+.2f}, {6 + half:+.2f}] | 60% of 5 | s0: +10.00, s1: +0.00 |")
  assert len(lines) == 3  # no row for the baseline itself
  with pytest.raises(SystemExit, match="no run of the baseline 'C'"):
    compare.paired_table(runs, "C")
  rows = compare.table(runs, last=2, target=0.8).splitlines()
  assert "rounds to 80% |" in rows[0] and "dissimilarity low / high" in rows[0]
  assert rows[2].endswith("| not reached | nan / nan | 3 |") and rows[5].endswith("| 2 | 1.50 / 3.00 | 3 |")


def test_runs_that_would_be_merged_in_a_paired_table_are_an_error():
  from experiments.compare import check_unique
  summary = {"method": "FedFA", "config": {"federation": {"seed": 0, "malicious_fraction": 0.2, "backdoor_scale": 1}}}
  check_unique([("a", summary, []), ("b", {**summary, "method": "FlexiFed"}, [])])
  with pytest.raises(ValueError, match=r"a and b are both FedFA \[backdoor 20% x1\] with seed 0"):
    check_unique([("a", summary, []), ("b", summary, [])])
