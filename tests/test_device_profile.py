"""benchmarks.device_profile: a profiler trace's device events summed per kernel."""

import pytest

from benchmarks import device_profile


def trace(*events):
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
          {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  return {"traceEvents": meta + list(events)}


def kernel(name, ts, dur, tid=7, pid=1):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_device_kernels_are_kept_and_xla_summary_lines_and_the_host_left_out():
  events, threads = device_profile.device_events(trace(
      kernel("conv_fprop", 0, 10), kernel("fusion.1", 5, 10), kernel("fusion.1", 0, 30, tid=8),
      kernel("PjitFunction", 0, 99, tid=3, pid=2)))
  assert [e["name"] for e in events] == ["conv_fprop", "fusion.1"]
  assert threads == {"Stream #14(Compute)": 2, "XLA Ops": 1}


def test_busy_time_counts_overlaps_once():
  assert device_profile.busy_us([kernel("a", 0, 10), kernel("b", 5, 10), kernel("c", 30, 5)]) == 20


def test_summary_per_round_and_per_step():
  events = [kernel("sm90_xmma_fprop_implicit_gemm", 10 * i, 4) for i in range(4)] + [kernel("loop_add_fusion", 100, 2)]
  row = device_profile.summarize(events, rounds=2, steps=4, top=5)
  assert row["kernels_per_round"] == 2.5 and row["kernels_per_step"] == 1.25
  assert row["by_kind"] == {"convolution": pytest.approx(0.008), "other": pytest.approx(0.001)}
  assert row["top"][0] == {"kernel": "sm90_xmma_fprop_implicit_gemm", "per_step": 1.0, "ms_per_round": 0.008,
                           "us_each": 4.0}
  assert row["busy_ms_per_round"] == pytest.approx(0.009)


def test_an_unknown_workload_is_refused():
  with pytest.raises(SystemExit, match="unknown workload"):
    device_profile.workload_config("peer", smoke=True, round_program="union")
