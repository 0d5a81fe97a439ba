"""Smoke tests of the benchmarks on tiny synthetic settings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import throughput
from fedjax_hetero.models import build_model

pytestmark = pytest.mark.slow  # end to end (`pytest -m "not slow"` leaves it out)

NUMERIC_KEYS = ("fl_samples_per_s", "centralized_samples_per_s", "ratio", "compile_s", "clients_per_round",
                "batch_size", "devices")


def test_throughput_prints_one_json_line_per_backend(capsys, tmp_path):
  output = tmp_path / "throughput.jsonl"
  argv = ["--dataset", "synthetic", "--model", "mlp", "--num-clients", "4", "--clients-per-round", "2",
          "--rounds", "2", "--backends", "auto,sequential,vmap", "--round-programs", "host,fused",
          "--rounds-per-call", "2", "--steps-per-call", "2", "--centralized-loops", "host,device", "--output",
          str(output)]
  rows = throughput.main(argv)
  lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert len(lines) == 6
  parsed = [json.loads(line) for line in lines]
  assert parsed == rows
  assert [json.loads(line) for line in output.read_text().splitlines()] == parsed
  assert parsed[0]["backend"].startswith("auto->")
  assert [(p["backend"], p["round_program"]) for p in parsed[2:]] == [
      ("sequential", "host"), ("sequential", "fused"), ("vmap", "host"), ("vmap", "fused")]
  assert set(parsed[0]["centralized_by_batch"]) == {f"{b}/{loop}" for b in (64, 128) for loop in ("host", "device")}
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


def test_cost_overhead_runs_a_side_without_the_accountings_static_costs(tmp_path):
  from benchmarks import cost_overhead
  flags = dict(dataset="synthetic", groups=("mlp",), method="HeteroAvg", num_clients=4, clients_per_round=2,
               rounds=2, eval_every=2, progress=False, dissimilarity=False)
  sides = {side: cost_overhead.one_run(side, str(tmp_path / side), flags) for side in ("without", "with")}
  assert sides["without"]["bytes"] == 0 < sides["with"]["bytes"]
  assert all(row["process_s"] > row["train_s"] > row["later_rounds_s"] > 0 for row in sides.values())


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


def test_scaling_sweeps_print_a_row_per_point_and_a_table(capsys, tmp_path):
  from benchmarks import scaling
  plot = tmp_path / "scaling.png"
  rows = scaling.main(["--sweeps", "clients", "--methods", "Scaffold,FedAvg", "--backends", "sequential",
                       "--client-counts", "20,80", "--cohort", "2", "--pool", "64", "--samples", "4",
                       "--batch-size", "4", "--rounds", "1", "--table", "--plot", str(plot)])
  out = capsys.readouterr().out
  assert [json.loads(line) for line in out.splitlines() if line.startswith("{")] == rows
  assert [(r["method"], r["clients"]) for r in rows] == [("Scaffold", 20), ("Scaffold", 80), ("FedAvg", 20),
                                                          ("FedAvg", 80)]
  for row in rows:
    assert row["round_ms"] > 0 and math.isfinite(row["peak_mb"]) and row["params"] > 0 and row["cohort"] == 2
  scaffold = {r["clients"]: r for r in rows if r["method"] == "Scaffold"}
  # SCAFFOLD keeps one params-shaped control variate per client; FedAvg keeps nothing.
  assert scaffold[80]["state_mb"] == pytest.approx(4 * scaffold[20]["state_mb"])
  assert scaffold[20]["state_mb"] * 2**20 == pytest.approx(20 * 4 * scaffold[20]["params"])
  assert all(r["state_mb"] == 0 for r in rows if r["method"] == "FedAvg")
  assert "clients sweep (2 per round" in out and "| Scaffold, sequential | FedAvg, sequential |" in out
  assert f"| 80 | {scaffold[80]['state_mb']:.1f} / " in out
  assert plot.stat().st_size > 0


def test_scaling_points_cover_each_sweep_from_its_base_setting():
  from benchmarks import scaling
  args = scaling.build_parser().parse_args(["--clients", "100", "--cohort", "5", "--width", "2", "--cohorts", "5,50",
                                            "--client-counts", "10,1000", "--widths", "1,3", "--methods", "FedAvg",
                                            "--backends", "vmap"])
  assert [(p["sweep"], p["clients"], p["cohort"], p["width"]) for p in scaling.points(args)] == [
      ("cohort", 100, 5, 2.0), ("cohort", 100, 50, 2.0), ("clients", 10, 5, 2.0), ("clients", 1000, 5, 2.0),
      ("width", 100, 5, 1.0), ("width", 100, 5, 3.0)]


def test_scaling_rejects_a_cohort_larger_than_the_federation():
  from benchmarks import scaling
  with pytest.raises(SystemExit, match="500 clients per round of 100 clients"):
    scaling.main(["--sweeps", "cohort", "--clients", "100", "--cohorts", "10,500"])


def test_many_runs_prints_a_row_per_number_of_runs_and_a_table(capsys):
  from benchmarks import many_runs
  rows = many_runs.main(["--smoke", "--runs", "2"])
  out = capsys.readouterr().out
  assert [json.loads(line) for line in out.splitlines() if line.startswith("{")] == rows
  assert [(r["runs"], r["alone"]) for r in rows] == [(1, True), (2, False)]
  assert all(r["samples_per_s"] > 0 and r["timed_s"] > 0 for r in rows)
  assert rows[1]["memory_estimate_mib"] > 0
  assert "| 1 alone |" in out and "| 2 |" in out


def test_program_size_counts_each_op_under_every_library_line_on_its_stack():
  import inspect

  import jax.numpy as jnp

  from benchmarks.program_size import ops_by_source
  from fedjax_hetero.rounds import body

  counts = ops_by_source(body.largest_weight.lower([jnp.ones(3), jnp.ones((2, 2)), jnp.ones(4)]).as_text(
      debug_info=True))
  lines, first = inspect.getsourcelines(body.largest_weight.__wrapped__)
  reduction = first + next(i for i, text in enumerate(lines) if "isfinite" in text)
  assert counts[f"fedjax_hetero/rounds/body.py:{reduction}"] >= 4, counts  # isfinite, abs, select, reduce
  in_body = {frame: n for frame, n in counts.items() if frame.startswith("fedjax_hetero/rounds/body.py:")}
  assert len(in_body) >= 3, counts  # the ravel, the concatenation and the reduction
  # An op counts under every library line on its stack: the jit wrapper's line holds them all.
  assert max(counts.values()) == sum(in_body.values()), counts
  assert all(frame.startswith("fedjax_hetero/") for frame in counts)


def test_program_size_counts_a_module_lowered_for_a_gpu_with_its_threefry_apart():
  import jax

  from benchmarks.program_size import lowered_ops

  draw = jax.jit(lambda seed: jax.random.normal(jax.random.key(seed), (3, 5)) * 2.0)
  lowered = lambda: draw.trace(np.uint32(0)).lower(lowering_platforms=("cuda",)).as_text()
  ops, threefry = lowered_ops(lowered())
  assert 100 < threefry < ops, (threefry, ops)  # (twenty rounds unrolled, each a few ops)
  jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  try:
    kernel_ops, kernel_threefry = lowered_ops(lowered())
  finally:
    jax.config.update("jax_threefry_gpu_kernel_lowering", False)
  assert kernel_ops < ops - threefry + 50 and kernel_threefry < 50, (kernel_ops, kernel_threefry)


def test_program_size_compiles_the_round_without_the_parts_cut_and_restores_them():
  from benchmarks.program_size import measure_simulation, without
  from fedjax_hetero.rounds import cohort
  from tests.test_union import width_simulation

  steps = cohort.steps
  whole = measure_simulation(width_simulation(), "union")
  cut = measure_simulation(width_simulation(), "union", cut=("local-steps",))
  assert whole["cut"] == "" and cut["cut"] == "local-steps"
  assert cut["module_ops"] < whole["module_ops"] / 2, (cut, whole)  # (the steps: most of it)
  assert whole["evaluation_compile_cpu_s"] > 0  # (its own program)
  assert cohort.steps is steps
  with pytest.raises(ValueError, match="unknown parts"):
    with without(("server", "clients")):
      pass


@pytest.mark.slow
def test_startup_times_each_phase_of_a_run_through_the_driver(capsys):
  from benchmarks import startup
  from tests.helpers import skip_without_fashion_mnist

  skip_without_fashion_mnist()
  row = startup.main(["--groups", "cnn@0.25,cnn@0.125", "--round-program", "host", "--max-train-samples", "3000",
                      "--batch-size", "32"])
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == row
  assert row["driver"] == "sequential" and row["platform"] == "cpu"
  assert all(row[k] > 0 for k in ("setup_s", "first_call_s", "second_call_s")), row  # (the suite imported it)
  assert row["second_call_s"] < row["first_call_s"], row  # (the first compiles)


def test_gpu_suite_table_compares_the_threefry_demo_with_the_demo():
  from benchmarks import gpu_suite

  results = {"peer": {}, "throughput": [], "inco": {"rounds_done": 3, "projected_min": 7.5},
             "demo": {"wall_s": 19.6, "accuracy": 0.8514}, "demo_threefry": {"wall_s": 15.2, "accuracy": 0.8514}}
  rows = [line for line in gpu_suite.table(results, []).splitlines() if line.startswith("| demo")]
  assert rows[0].startswith("| demo, whole process (s), best accuracy 0.8514 | 19.6 |")
  assert rows[1].startswith("| demo under JAX_THREEFRY_GPU_KERNEL_LOWERING=1, whole process (s), best accuracy "
                            "0.8514 (the same) | 15.2 |")
  results["demo_threefry"]["accuracy"] = 0.8513
  assert "(NOT the same)" in gpu_suite.table(results, [])
  del results["demo_threefry"]
  assert "THREEFRY" not in gpu_suite.table(results, [])


def test_peer_benchmark_still_runs_and_prints_our_side_when_the_torch_side_fails(capsys, monkeypatch):
  from benchmarks import peer_torch

  launched = []

  def launch(args, side):
    launched.append(side)
    if side == "torch":
      raise peer_torch.SideFailed("the torch side exited with status 1")
    return {"side": side, "samples_per_s_after_first": 1000.0, "first_round_s": 2.0, "wall_s": 5.0,
            "test_accuracy": 0.5}

  monkeypatch.setattr(peer_torch, "launch", launch)
  with pytest.raises(SystemExit, match="the torch side failed"):
    peer_torch.main(["--repeats", "2"])
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert launched == ["torch", "jax", "jax"]  # a failed side is not launched again
  assert [r["side"] for r in rows] == ["jax", "jax"] and not any(r.get("summary") for r in rows)
