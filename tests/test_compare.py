"""`python -m experiments.compare`: the table and plot over finished runs."""

from __future__ import annotations

import os

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
