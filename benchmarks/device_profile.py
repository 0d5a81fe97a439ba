"""Where a round program's device time goes: a profiler trace of a few compiled rounds, summed per kernel.

    python -m benchmarks.device_profile OUT_DIR                       # the peer workload @0.25, the CNN FedAvg one
    python -m benchmarks.device_profile OUT_DIR --workloads peer@1
    python -m benchmarks.device_profile OUT_DIR --smoke               # toy sizes, to check it on a CPU

For each workload (``peer@W``: `benchmarks.peer_torch`'s jax side, HeteroAvg over ResNet10...26 @W, 100 clients,
10 a round, Dirichlet 0.5, one epoch of Adam at batch 64, dissimilarity off; ``cnn``: `benchmarks.throughput`'s
FedAvg CNN, IID, the same cohort), the run's round program (``--round-program``, default union) runs its first
round (the compilation), one call of ``--rounds`` rounds timed, then the next ``--rounds`` rounds under
`jax.profiler.trace`. The trace's events on the device (every thread of the process named for a GPU or TPU, or
the XLA threads of a CPU) are summed per kernel name, and the local steps of the profiled rounds (the most
client batches of any client, per round) divide the per-kernel counts: a kernel launched once a local step shows
``per_step`` 1. One JSON line per workload:

* ``wall_ms_per_round``: the timed call's wall time per round; ``busy_ms_per_round``: the union of the device
  events' intervals, per round (the rest of the wall time: launch gaps, host work, transfers);
* ``kernels_per_round`` and ``kernels_per_step``; ``steps_per_round``;
* ``by_kind``: milliseconds per round of convolutions, matrix products, copies and transfers, and other kernels;
* ``top``: the kernels with the most time, each with its count per step and milliseconds per round.

The trace itself (Perfetto's JSON) is kept in OUT_DIR/WORKLOAD/ for https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.common import emit_json_lines

INCO = "resnet10@{w},resnet14@{w},resnet18@{w},resnet22@{w},resnet26@{w}"
KINDS = (("convolution", re.compile(r"conv|cudnn|xmma|implicit|winograd|fprop|dgrad|wgrad", re.I)),
         ("matmul", re.compile(r"gemm|dot|cublas|matmul|cutlass", re.I)),
         ("copy_or_transfer", re.compile(r"memcpy|memset|copy|transpose", re.I)))


def workload_config(name: str, smoke: bool, round_program: str) -> Any:
  from fedjax_hetero.config import RunConfig

  size = dict(num_clients=8, clients_per_round=4, max_train_samples=2000, max_test_samples=100) if smoke else \
      dict(num_clients=100, clients_per_round=10)
  common = dict(dataset="fashion_mnist", epochs=1, batch_size=64, optimizer="adam", learning_rate=1e-3, rounds=100,
                seed=0, backend="vmap", round_program=round_program, progress=False, dissimilarity=False, **size)
  if name == "cnn":  # (one group: no union of groups, so the fused program)
    common["round_program"] = "fused" if round_program == "union" else round_program
    return RunConfig.from_flags(groups=("cnn@0.25",) if smoke else ("cnn",), method="FedAvg", partition="iid",
                                **common)
  width = re.fullmatch(r"peer@([\d.]+)", name)
  if not width:
    raise SystemExit(f"error: unknown workload {name!r} (peer@WIDTH or cnn)")
  groups = "resnet10@0.125,resnet14@0.125" if smoke else INCO.format(w=width.group(1))
  return RunConfig.from_flags(groups=tuple(groups.split(",")), method="HeteroAvg", partition="dirichlet", alpha=0.5,
                              weighting="num_samples", **common)


def most_steps(sim: Any, state: Any, config: Any, rounds: range) -> list[int]:
  """Per round (0-based indices), the most client batches of any sampled client: the round's local steps."""
  batch, steps = config.client.batch_size, []
  for r in rounds:
    sizes = sim.spec.store.sizes[np.concatenate(sim.spec.participants(state.sampler, r)[1])]
    steps.append(config.client.epochs * int((sizes // batch if config.client.drop_last else -(-sizes // batch)).max()))
  return steps


def device_events(trace: dict) -> tuple[list[dict], dict[str, int]]:
  """The complete events ('X') of the trace's device process, or of XLA's CPU threads on a CPU; and every thread
  of the device process with its number of events (to check which were kept)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  devices = {pid for pid, name in names.items() if re.search(r"/device:(GPU|TPU)", name)}
  if devices:
    # XLA's own summary lines ("XLA Modules", "XLA Ops", "Steps") repeat the kernels' time: streams only.
    keep = lambda e: e["pid"] in devices and not re.search(r"XLA (Modules|Ops|TraceMe)|Steps|Framework",
                                                           threads.get((e["pid"], e.get("tid")), ""))
  else:
    keep = lambda e: re.match(r"tf_XLA(PjRtCpuClient|Eigen)", threads.get((e["pid"], e.get("tid")), "")) is not None
  seen = collections.Counter(threads.get((e["pid"], e.get("tid")), "?") for e in events
                             if e.get("ph") == "X" and (e["pid"] in devices or not devices))
  return [e for e in events if e.get("ph") == "X" and keep(e)], dict(seen)


def busy_us(events: list[dict]) -> float:
  """Microseconds covered by at least one event."""
  total, end = 0.0, -1.0
  for start, stop in sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def summarize(events: list[dict], rounds: int, steps: int, top: int) -> dict[str, Any]:
  per_name: dict[str, list[float]] = collections.defaultdict(list)
  for e in events:
    per_name[e["name"]].append(float(e.get("dur", 0)))
  by_kind = collections.Counter()
  for name, durations in per_name.items():
    kind = next((k for k, pattern in KINDS if pattern.search(name)), "other")
    by_kind[kind] += sum(durations) / 1e3 / rounds
  ranked = sorted(per_name.items(), key=lambda item: -sum(item[1]))[:top]
  return {"busy_ms_per_round": round(busy_us(events) / 1e3 / rounds, 3),
          "kernels_per_round": round(len(events) / rounds, 1), "kernels_per_step": round(len(events) / steps, 2),
          "by_kind": {k: round(v, 3) for k, v in by_kind.most_common()},
          "top": [{"kernel": name[:120], "per_step": round(len(d) / steps, 2), "ms_per_round": round(sum(d) / 1e3
                   / rounds, 3), "us_each": round(sum(d) / len(d), 1)} for name, d in ranked]}


def profile(name: str, out: str, rounds: int, smoke: bool, round_program: str, top: int) -> dict[str, Any]:
  import jax

  from fedjax_hetero.run.build import build_simulation

  config = workload_config(name, smoke, round_program)
  sim, _ = build_simulation(config, log=lambda _: None)
  state = sim.init_state()
  seconds = time.perf_counter()
  state, _ = sim.run_rounds(state, 1, consume=True)
  first_s, seconds = time.perf_counter() - seconds, time.perf_counter()
  state, _ = sim.run_rounds(state, rounds, consume=True)
  wall_s = time.perf_counter() - seconds
  steps = most_steps(sim, state, config, range(1 + rounds, 1 + 2 * rounds))
  folder = os.path.join(out, name.replace("@", "_"))
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    state, _ = sim.run_rounds(state, rounds, consume=True)
    jax.block_until_ready(state.models)
  path = max(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
  with gzip.open(path) as f:
    events, threads = device_events(json.load(f))
  return {"workload": name, "round_program": sim.cohorts.name, "platform": jax.default_backend(),
          "first_round_s": round(first_s, 2), "wall_ms_per_round": round(wall_s * 1e3 / rounds, 3),
          "steps_per_round": sum(steps) / rounds, **summarize(events, rounds, sum(steps), top), "threads": threads,
          "trace": path}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out", help="folder for the traces")
  p.add_argument("--workloads", default="peer@0.25,cnn", help="comma-separated: peer@WIDTH, cnn")
  p.add_argument("--rounds", type=int, default=3, help="rounds timed, then as many profiled")
  p.add_argument("--round-program", default="union", help="union, fused or host")
  p.add_argument("--top", type=int, default=25, help="kernels listed per workload")
  p.add_argument("--smoke", action="store_true", help="toy sizes on any platform (checks the script)")
  args = p.parse_args(argv)
  from fedjax_hetero.compilation import enable_persistent_cache

  enable_persistent_cache()
  rows = []
  for name in args.workloads.split(","):
    rows.append(profile(name, args.out, args.rounds, args.smoke, args.round_program, args.top))
    emit_json_lines(rows[-1:])
  return rows


if __name__ == "__main__":
  main()
