"""End to end on real Fashion-MNIST: the CLI learns and writes its results folder."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_fmnist_cli

pytestmark = pytest.mark.slow  # end to end (`pytest -m "not slow"` leaves it out)


@pytest.mark.slow
def test_fmnist_cli_learns_and_writes_results(tmp_path):
  out = tmp_path / "run"
  proc = run_fmnist_cli("--groups", "cnn@0.5,cnn@0.25", "--max-train-samples", "4000", "--max-test-samples", "1000",
                        "--num-clients", "8", "--clients-per-round", "4", "--alpha", "1.0", "--epochs", "2", "--rounds",
                        "4", "--eval-every", "2", "--output-dir", str(out), "--no-progress",
                        trains_long=True)
  assert proc.returncode == 0, proc.stderr[-3000:]

  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["round"] for r in rows] == [1, 2, 3, 4]
  for r in rows:
    assert r["train_loss"] > 0 and r["round_seconds"] > 0 and r["samples_per_s"] > 0
  assert rows[0]["test_accuracy"] is None and set(rows[1]["test_accuracy"]) == {"cnn@0.5", "cnn@0.25", "mean"}
  assert rows[-1]["train_loss"] < rows[0]["train_loss"]
  summary = json.loads((out / "summary.json").read_text())
  # 4 rounds on 4000 samples: far above the 10% of chance, well below what a full run reaches.
  assert summary["final_accuracy"]["mean"] > 0.55, summary["final_accuracy"]
  assert summary["config"]["groups"] == ["cnn@0.5", "cnn@0.25"]
  for name in ("accuracy.png", "partition.png", "partition.txt"):
    assert (out / name).stat().st_size > 0


def test_fmnist_cli_rejects_missing_data_dir(tmp_path):
  missing = tmp_path / "nowhere"
  proc = subprocess.run([sys.executable, "-m", "experiments.fmnist", "--data-dir", str(missing), "--output-dir",
                         str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert str(missing) in proc.stderr
