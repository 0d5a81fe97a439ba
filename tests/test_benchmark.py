"""Smoke tests of the benchmarks on tiny synthetic settings."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import throughput
from fedjax_hetero.models import build_model

NUMERIC_KEYS = ("fl_samples_per_s", "centralized_samples_per_s", "ratio", "compile_s", "clients_per_round",
                "batch_size", "devices")


def test_throughput_prints_one_json_line_per_backend(capsys, tmp_path):
  output = tmp_path / "throughput.jsonl"
  argv = ["--dataset", "synthetic", "--model", "mlp", "--num-clients", "4", "--clients-per-round", "2",
          "--rounds", "1", "--backends", "auto,sequential,vmap", "--steps-per-call", "2",
          "--output", str(output)]
  rows = throughput.main(argv)
  lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert len(lines) == 3
  parsed = [json.loads(line) for line in lines]
  assert parsed == rows
  assert [json.loads(line) for line in output.read_text().splitlines()] == parsed
  assert parsed[0]["backend"].startswith("auto->")
  assert [p["backend"] for p in parsed[1:]] == ["sequential", "vmap"]
  for row in parsed:
    assert set(throughput.REQUIRED_KEYS) <= row.keys()
    for key in NUMERIC_KEYS:
      assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["ratio"] == row["fl_samples_per_s"] / row["centralized_samples_per_s"]
    assert row["model"] == "mlp" and row["clients_per_round"] == 2 and row["batch_size"] == 64
    assert isinstance(row["platform"], str) and row["platform"]
    assert row["examples_per_round"] == 256  # 2 clients x 128 samples, one epoch


def test_unknown_backend_is_rejected():
  with pytest.raises(SystemExit, match="bogus"):
    throughput.main(["--dataset", "synthetic", "--backends", "sequential,bogus"])


def test_method_overhead_prints_one_line_per_method(capsys):
  from benchmarks import method_overhead
  rows = method_overhead.main(["--dataset", "synthetic", "--preset", "fedcross-cpu", "--groups", "mlp",
                               "--methods", "FedAvg,FedCross", "--rounds", "1", "--epochs", "1", "--num-clients", "20",
                               "--clients-per-round", "4"])
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
  assert [r["method"] for r in lines] == ["FedAvg", "FedCross"] == [r["method"] for r in rows]
  assert lines[0]["round_ratio"] == 1.0
  for row in lines:
    assert row["round_s"] > 0 and 0 < row["server_step_s"] < row["round_s"] and row["baseline"] == "FedAvg"


def test_step_modes_prints_compile_time_rates_and_a_checksum(capsys):
  from benchmarks import step_modes
  row = step_modes.main(["mlp", "1", "8", "2"])
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == row
  assert row["model"] == "mlp@1.0" and row["steps_per_call"] == 2 and row["compile_s"] >= 0
  assert len(row["samples_per_s"]) == 3 and all(rate > 0 for rate in row["samples_per_s"])
  assert math.isfinite(row["params_l1"]) and row["params_l1"] > 0


def test_layer_profile_finds_every_convolution_with_its_input():
  from benchmarks.layer_profile import convolutions
  layers = convolutions(build_model("resnet10", 10, width=0.25), batch=4)
  assert [layer["name"] for layer in layers][:3] == ["stem_conv", "stage1_block0/conv1", "stage1_block0/conv2"]
  assert len(layers) == 1 + 4 * 2 + 3  # the stem, two per block, a downsample in stages 2-4
  by_name = {layer["name"]: layer for layer in layers}
  assert by_name["stem_conv"]["input"] == (4, 28, 28, 1) and by_name["stem_conv"]["strides"] == (2, 2)
  assert by_name["stage4_block0/conv2"]["input"] == (4, 1, 1, 128) and by_name["stage4_block0/conv2"]["features"] == 128
