"""The accelerator suite: every speed target of the round program measured in one run, printed as one table.

    bash benchmarks/gpu_suite.sh [OUT_DIR]          # on one GPU, about 8 minutes
    python -m benchmarks.gpu_suite --smoke OUT_DIR  # the same steps at toy size, to check the script on a CPU

Steps (each a subprocess, so each whole-process time is real; each capped so that no step takes another's time;
a step that fails or passes its cap is reported as such, never dropped silently; the table is printed from
whatever finished):

1. the decision probes (about two minutes): per-client convolutions and their kernel gradients' two forms
   (`benchmarks.client_conv`, 10 clients, @0.25), the InCo depths' one local step as a masked union against
   per-group steps (`benchmarks.depth_union`), and how a cohort of 10 clients shares the GPU
   (`benchmarks.client_mapping`); with ``--with-flags`` first XLA's GPU options (`FLAG_SETS`) on the union step,
   the chosen set then used by every later step (measured on an H200: none helps, so it is off by default);
2. the peer workload (`benchmarks.peer_torch`: HeteroAvg, ResNet10...26, 100 clients, 10 per round, one epoch
   of Adam at batch 64) at width 0.25, 4 rounds: the PyTorch loop and our ``--round-program`` (default union)
   side by side; then ours again for 2 rounds, its first round from the persistent cache the first run filled;
3. the demo (``python -m experiments.fmnist`` with its defaults), whole-process wall time, then where its time
   goes (`benchmarks.startup` on its settings: import, setup, first and second call); with ``--with-threefry``
   the demo once more under jax's ``JAX_THREEFRY_GPU_KERNEL_LOWERING=1`` (a random-bit hash as one GPU kernel
   rather than unrolled into the module: the same bits, so the same accuracy, and less to compile), from a
   compilation cache of its own;
4. FedAvg throughput against the centralized limit (`benchmarks.throughput`, the CNN);
5. the peer workload at width 1, ours alone, 3 rounds;
6. many runs in one program (`benchmarks.many_runs`): 8 seeds of the InCo @0.25 workload against one run;
7. the InCo preset's full protocol at the paper's widths (500 rounds of 5 local epochs) for the time left, with
   the whole run's projected time.

Writes every step's JSON lines and logs into OUT_DIR and the table to OUT_DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCO = "resnet10@{w},resnet14@{w},resnet18@{w},resnet22@{w},resnet26@{w}"
SMOKE_GROUPS = "resnet10@0.125,resnet14@0.125"  # --smoke: two small groups, so that a CPU gets through
SMOKE_SLOWER = 4  # --smoke: step time limits multiplied by this (a CPU compiles ResNets' device loops slowly)
# XLA's GPU options tried by the flags probe (step 1): loops and conditionals captured in CUDA graphs beside the
# default command buffer types, no convolution autotuning, and a module's kernels compiled on 16 threads (the H200
# machine's cores; a set XLA refuses is left out). (--xla_gpu_enable_llvm_module_compilation_parallelism is gone
# from jax 0.11.2's XLA: "Unknown flag in XLA_FLAGS", measured on an H200.)
FLAG_SETS = {
    "default": "",
    "command_buffers": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "no_autotune": "--xla_gpu_autotune_level=0",
    "compile_threads": "--xla_gpu_force_compilation_parallelism=16",
}
STEP_SLACK = 1.05  # the flags probe keeps the sets within 5% of the fastest step, then takes the quickest compile
# The per-client convolution forms an accelerator chooses between (the CPU's canonical and sequential ones left out).
ACCELERATOR_CONV_FORMS = "grouped,client_gradients,client_gradients_batch_groups,patches,batch"
TARGETS = {"peer@0.25": 25.0, "peer@1": 10.0, "first_round_s": 15.0, "throughput": 0.6, "demo_s": 12.0,
           "inco_projected_min": 5.0, "many_runs_8": 5.0}


class Suite:
  def __init__(self, out: str, budget_s: float, smoke: bool):
    self.out, self.budget_s, self.smoke, self.start = out, budget_s, smoke, time.perf_counter()
    self.notes: list[str] = []
    self.env: dict[str, str] = {}  # for every later step (the flags probe's XLA_FLAGS)

  def left(self) -> float:
    return self.budget_s - (time.perf_counter() - self.start)

  def run(self, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None,
          reserve_s: float = 0.0) -> tuple[int, str]:
    """Runs ``argv`` (logs to OUT/name.log); its exit status (124 on timeout) and stdout. ``reserve_s``: seconds
    of the budget kept for the steps after it."""
    timeout = max(1.0, min(timeout * (SMOKE_SLOWER if self.smoke else 1), self.left() - reserve_s))
    t0 = time.perf_counter()
    with open(os.path.join(self.out, f"{name}.log"), "w") as log:
      # A session of its own, killed whole on timeout: a step's own subprocesses (peer_torch's sides) would
      # otherwise outlive it and hold the GPU's memory through the next steps.
      process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": ROOT, **self.env, **(env or {})})
      try:
        stdout, _ = process.communicate(timeout=timeout)
        status = process.returncode
      except subprocess.TimeoutExpired:
        _kill_session(process)
        stdout, _ = process.communicate()
        status = 124
    print(f"[suite] {name}: exit {status} after {time.perf_counter() - t0:.0f} s ({self.left():.0f} s left)",
          file=sys.stderr, flush=True)
    with open(os.path.join(self.out, f"{name}.jsonl"), "w") as f:
      f.write(stdout)
    if status:
      self.notes.append(f"{name}: exit {status}" + (" (time budget)" if status == 124 else "") + f", see {name}.log")
    return status, stdout


def _kill_session(process: subprocess.Popen) -> None:
  """SIGKILL to ``process`` and every process it started (its session, `start_new_session`)."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def json_rows(stdout: str) -> list[dict[str, Any]]:
  return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def probes(suite: Suite, skip: set[str]) -> dict[str, Any]:
  """The decision probes: which per-client convolution, union or per-group steps, and which cohort mapping."""
  small, conv = suite.smoke, ""
  if "client_conv" not in skip:
    _, conv = suite.run("client_conv", [sys.executable, "-m", "benchmarks.client_conv", "--widths", "0.25",
                                        "--forms", ACCELERATOR_CONV_FORMS, "--steps", "20",
                                        *(["--batch", "8", "--steps", "2"] if small else [])], 40)
  size = ["--width", "0.125", "--clients-per-group", "1", "--batch", "16", "--steps", "2"] if small else []
  _, union = suite.run("depth_union", [sys.executable, "-m", "benchmarks.depth_union", "--variants",
                                       "union,groups", *size], 90)
  model, clients = ("cnn@0.25", "4") if small else ("resnet18@0.25", "10")
  _, mapping = suite.run("client_mapping", [sys.executable, "-m", "benchmarks.client_mapping", "--models", model,
                                            "--clients", clients, "--steps", "4" if small else "10"], 60)
  return {"client_conv": json_rows(conv), "depth_union": json_rows(union), "client_mapping": json_rows(mapping)}


def xla_flags(suite: Suite) -> dict[str, Any]:
  """The InCo depths' union step (`benchmarks.depth_union --variants union`) under each of `FLAG_SETS`, each in a
  process of its own (XLA reads its options once); the chosen set goes to every later step through XLA_FLAGS."""
  size = ["--width", "0.125", "--clients-per-group", "1", "--batch", "16", "--steps", "2"] if suite.smoke else []
  rows = {}
  for name, flags in FLAG_SETS.items():
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    status, out = suite.run(f"flags_{name}", [sys.executable, "-m", "benchmarks.depth_union", "--variants", "union",
                                              *size], 60, env)
    row = next(iter(json_rows(out)), None)
    if status == 0 and row:
      rows[name] = {"flags": flags, "compile_s": row["compile_s"], "ms_per_step": row["ms_per_step"]}
  fastest = min((r["ms_per_step"] for r in rows.values()), default=None)
  kept = {n: r for n, r in rows.items() if r["ms_per_step"] <= STEP_SLACK * fastest} if rows else {}
  chosen = min(kept, key=lambda n: kept[n]["compile_s"]) if kept else "default"
  suite.env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG_SETS[chosen]}".strip()
  print(f"[suite] XLA flags for the later steps: {chosen} ({FLAG_SETS[chosen] or 'none'})", file=sys.stderr)
  return {"rows": rows, "chosen": chosen}


def peer(suite: Suite, width: str, program: str, rounds: int, sides: str, cap: float, tag: str = "",
         reserve_s: float = 0.0) -> dict[str, Any]:
  size = (["--num-clients", "8", "--clients-per-round", "4", "--rounds", "3", "--max-train-samples", "2000",
           "--eval-samples", "200"] if suite.smoke else ["--num-clients", "100", "--clients-per-round", "10",
                                                           "--rounds", str(rounds)])
  device = "cpu" if suite.smoke else "cuda"
  groups = SMOKE_GROUPS if suite.smoke else INCO.format(w=width)
  argv = [sys.executable, "-m", "benchmarks.peer_torch", "--groups", groups, "--device", device, *size,
          "--round-program", program, "--sides", sides]
  _, out = suite.run(f"peer_{width}_{program}{tag}", argv, cap, reserve_s=reserve_s)
  side = lambda s: next((r for r in json_rows(out) if r.get("side") == s), {})
  return {"ours": side("jax"), "torch": side("torch"), "program": program}


def throughput(suite: Suite) -> list[dict[str, Any]]:
  size = (["--model", "mlp", "--num-clients", "8", "--clients-per-round", "4", "--max-train-samples", "2000"]
          if suite.smoke else [])
  _, out = suite.run("throughput", [sys.executable, "-m", "benchmarks.throughput", "--backends", "vmap",
                                    "--round-programs", "fused", "--rounds", "3", *size], 90)
  return json_rows(out)


def demo(suite: Suite, name: str = "demo", env: dict[str, str] | None = None) -> dict[str, Any]:
  size = ["--rounds", "3", "--num-clients", "8", "--clients-per-round", "4", "--max-train-samples", "2000",
          "--max-test-samples", "500"] if suite.smoke else []
  out = os.path.join(suite.out, f"{name}_run")
  t0 = time.perf_counter()
  status, _ = suite.run(name, [sys.executable, "-m", "experiments.fmnist", "--output-dir", out, "--overwrite",
                               "--no-progress", *size], 60, env)
  wall = time.perf_counter() - t0
  summary = _read_json(os.path.join(out, "summary.json"))
  return {"wall_s": wall if status == 0 else None, "accuracy": (summary or {}).get("best_mean_accuracy")}


def demo_threefry(suite: Suite) -> dict[str, Any]:
  """The demo under ``JAX_THREEFRY_GPU_KERNEL_LOWERING=1``, from a fresh compilation cache of its own."""
  cache = tempfile.mkdtemp(prefix="threefry_cache_")
  return demo(suite, "demo_threefry", {"JAX_THREEFRY_GPU_KERNEL_LOWERING": "1", "FEDJAX_HETERO_CACHE_DIR": cache})


def demo_phases(suite: Suite) -> dict[str, Any]:
  """Where the demo's process time goes (`benchmarks.startup` on its groups and batch, calls of 10 rounds, no
  compilation cache): the library's import, the setup, the first call (compiled) and the second."""
  size = ["--max-train-samples", "2000", "--rounds-per-call", "2"] if suite.smoke else \
      ["--max-train-samples", "0", "--rounds-per-call", "10"]
  _, out = suite.run("demo_phases", [sys.executable, "-m", "benchmarks.startup", "--groups", "cnn@1,cnn@0.5,cnn@0.25",
                                     "--batch-size", "32", "--round-program", "union", *size], 40)
  return next(iter(json_rows(out)), {})


def many_runs(suite: Suite) -> dict[str, Any]:
  """R = 8 seeds of the InCo @0.25 workload in one program against one run alone (`benchmarks.many_runs`)."""
  size = ["--smoke", "--runs", "8"] if suite.smoke else ["--workload", "inco", "--runs", "8", "--rounds", "3"]
  _, out = suite.run("many_runs", [sys.executable, "-m", "benchmarks.many_runs", *size], 90,
                     reserve_s=0 if suite.smoke else 100)  # (the InCo protocol's two calls, as peer @1 keeps)
  rows = json_rows(out)
  alone = next((r["samples_per_s"] for r in rows if r.get("alone")), None)
  eight = next((r["samples_per_s"] for r in rows if r.get("runs") == 8 and not r.get("alone")), None)
  return {"alone": alone, "runs_8": eight, "ratio": eight / alone if alone and eight else None}


def inco_protocol(suite: Suite, seconds: float) -> dict[str, Any]:
  """The InCo preset at the paper's widths, stopped after ``seconds``; the whole run's projected wall time from
  when its metrics rows appeared: the first call's (start-up and compilation included), then the wall time per
  round of the later calls (evaluations and checkpoints included)."""
  size = (["--groups", SMOKE_GROUPS, "--num-clients", "10", "--clients-per-round", "4", "--epochs", "1",
           "--max-train-samples", "2000", "--max-test-samples", "500"] if suite.smoke else [])
  out = os.path.join(suite.out, "inco_run")
  metrics = os.path.join(out, "metrics.jsonl")
  argv = [sys.executable, "-m", "experiments.fmnist", "--preset", "inco", "--output-dir", out, "--overwrite",
          "--no-progress", *size]
  seen: list[tuple[float, int]] = []  # (seconds since start, rows written) at every change
  t0 = time.perf_counter()
  with open(os.path.join(suite.out, "inco_protocol.log"), "w") as log:
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": ROOT, **suite.env})
    limit = min(seconds * (SMOKE_SLOWER if suite.smoke else 1), suite.left())
    while process.poll() is None and time.perf_counter() - t0 < limit:
      time.sleep(0.5)
      rows = len(_metrics(metrics)) if os.path.exists(metrics) else 0
      if rows and (not seen or rows > seen[-1][1]):
        seen.append((time.perf_counter() - t0, rows))
    if process.poll() is None:
      process.terminate()  # (the run stops at the end of its call, which can be minutes away: then it is killed)
      try:
        process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        _kill_session(process)
        process.wait()
  rows = _metrics(metrics)
  print(f"[suite] inco_protocol: {len(rows)} rounds in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
  if len(seen) < 2:
    suite.notes.append(f"inco_protocol: {len(seen)} call(s) finished in the budget: no projection")
    return {"rounds_done": len(rows), "projected_min": None}
  (t_first, n_first), (t_last, n_last) = seen[0], seen[-1]
  per_round = (t_last - t_first) / (n_last - n_first)
  return {"rounds_done": len(rows), "first_call_s": t_first, "first_call_rounds": n_first,
          "wall_s_per_round_after": per_round, "projected_min": (t_first + (500 - n_first) * per_round) / 60,
          "accuracy_so_far": max((r["test_accuracy"]["mean"] for r in rows if r.get("test_accuracy")), default=None)}


def _read_json(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _metrics(path: str) -> list[dict[str, Any]]:
  try:
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError):
    return []


def table(results: dict[str, Any], notes: list[str], smoke: bool = False) -> str:
  def fmt(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"

  def verdict(value: Any, target: float, at_most: bool = False) -> str:
    if value is None:
      return "not measured"
    return "yes" if (value <= target if at_most else value >= target) else "no"

  lines = ["| measure | ours | PyTorch loop | ratio or value | target | met |", "|---|---|---|---|---|---|"]
  for width, key in (("0.25", "peer@0.25"), ("1", "peer@1")):
    p = results["peer"].get(width)
    if p is None:
      continue
    speed = lambda side: p[side].get("samples_per_s_after_first")
    ratio = speed("ours") / speed("torch") if speed("ours") and speed("torch") else None
    lines.append(f"| peer workload @{width} ({p['program']}), samples/s after round 1 | {fmt(speed('ours'), 0)} | "
                 f"{fmt(speed('torch'), 0)} | {fmt(ratio)}x | >= {TARGETS[key]:g}x | {verdict(ratio, TARGETS[key])} |")
    first = p["ours"].get("first_round_s")
    lines.append(f"| peer workload @{width} ({p['program']}), first round (s) | {fmt(first)} | "
                 f"{fmt(p['torch'].get('first_round_s'))} | {fmt(first)} s | <= {TARGETS['first_round_s']:g} s | "
                 f"{verdict(first, TARGETS['first_round_s'], True)} |")
    phases = (p["ours"].get("compile_s") or {}).get("round_1")
    if phases:
      lines.append(f"| peer workload @{width}: by the end of round 1, seconds of tracing / lowering / XLA compile | "
                   f"{phases['trace']} / {phases['lower']} / {phases['backend_compile']} | — | — | — | — |")
  warm = results.get("peer_warm", {}).get("ours", {}).get("first_round_s")
  lines.append(f"| peer workload @0.25, first round from a warm persistent cache (s) | {fmt(warm)} | — | "
               f"{fmt(warm)} s | <= 3 s | {verdict(warm, 3.0, True)} |")
  by_program = {r["round_program"]: r for r in results["throughput"]}
  ratio = by_program.get("fused", {}).get("ratio")
  lines.append(f"| FedAvg CNN throughput / centralized limit | {fmt(ratio, 2)} | — | {fmt(ratio, 2)} | >= 0.6 | "
               f"{verdict(ratio, TARGETS['throughput'])} |")
  d = results["demo"]
  lines.append(f"| demo, whole process (s), best accuracy {fmt(d['accuracy'], 4)} | {fmt(d['wall_s'])} | — | "
               f"{fmt(d['wall_s'])} s | <= 12 s | {verdict(d['wall_s'], TARGETS['demo_s'], True)} |")
  t = results.get("demo_threefry")
  if t:
    same = "the same" if t["accuracy"] == d["accuracy"] else "NOT the same"
    lines.append(f"| demo under JAX_THREEFRY_GPU_KERNEL_LOWERING=1, whole process (s), best accuracy "
                 f"{fmt(t['accuracy'], 4)} ({same}) | {fmt(t['wall_s'])} | — | {fmt(t['wall_s'])} s | <= 12 s | "
                 f"{verdict(t['wall_s'], TARGETS['demo_s'], True)} |")
  phases = d.get("phases") or {}
  if phases:
    lines.append(f"| demo's phases ({phases['driver']}, no cache), seconds of import / setup / first call of "
                 f"{phases['rounds_per_call']} rounds / second call | {phases['import_s']} / {phases['setup_s']} / "
                 f"{phases['first_call_s']} / {phases['second_call_s']} | — | — | — | — |")
  m = results.get("many_runs", {})
  lines.append(f"| InCo @0.25, 8 seeds in one program / one run alone ({fmt(m.get('alone'), 0)}), samples/s | "
               f"{fmt(m.get('runs_8'), 0)} | — | {fmt(m.get('ratio'))}x | >= 5x | "
               f"{verdict(m.get('ratio'), TARGETS['many_runs_8'])} |")
  inco = results["inco"]
  lines.append(f"| InCo protocol (500 rounds x 5 epochs, widths 1), projected minutes ({inco['rounds_done']} rounds "
               f"run) | {fmt(inco['projected_min'])} | — | {fmt(inco['projected_min'])} min | <= 5 min | "
               f"{verdict(inco['projected_min'], TARGETS['inco_projected_min'], True)} |")
  flags = results.get("flags", {})
  for name, row in flags.get("rows", {}).items():
    lines.append(f"| XLA flags {name}{' (chosen)' if name == flags['chosen'] else ''}: InCo union step @0.25, "
                 f"ms/step (compile s) | {row['ms_per_step']} ({row['compile_s']}) | — | — | — | — |")
  probe = results.get("probes", {})
  for row in probe.get("client_conv", []):
    lines.append(f"| per-client 3x3 conv, {row['clients']} clients, {row['side']}x{row['side']}x{row['channels']}: "
                 f"{row['form']} ms per forward+backward (of one batch) | {row['ms_per_pass']} ({row['over_batch']}x) "
                 "| — | — | — | — |")
  for row in probe.get("depth_union", []):
    lines.append(f"| InCo depths, {row['clients']} clients @{row['width']:g}, one step: {row['variant']} ms/step "
                 f"(compile s) | {row['ms_per_step']} ({row['compile_s']}) | — | — | — | — |")
  for row in probe.get("client_mapping", []):
    lines.append(f"| client mapping {row['model']}, {row['clients']} clients, {row['variant']}: ms/step "
                 f"(of the batch limit) | {row['ms_per_step']} ({row['of_batch_limit']}) | — | — | — | — |")
  if smoke:
    lines.insert(0, "**--smoke: toy sizes (two ResNet groups @0.125, small subsets), not the targets' settings.**\n")
  return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main(argv: list[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out", help="folder for the logs, JSON lines and table.md")
  p.add_argument("--budget-s", type=float, default=480.0, help="the whole suite's time budget (seconds)")
  p.add_argument("--with-flags", action="store_true", help="first the XLA flags probe (3 processes, up to 3 minutes)")
  p.add_argument("--with-threefry", action="store_true", help="the demo once more under "
                 "JAX_THREEFRY_GPU_KERNEL_LOWERING=1 (about 20 s on an H200)")
  p.add_argument("--smoke", action="store_true", help="toy sizes on any platform (checks the script)")
  p.add_argument("--round-program", default="union", help="our driver in the peer rows (union, fused, host)")
  p.add_argument("--skip", default="",
                 help="comma-separated steps to leave out: probes (or one of them: client_conv), throughput, peer1, "
                      "many_runs")
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  suite, skip = Suite(args.out, args.budget_s, args.smoke), set(args.skip.split(","))
  results: dict[str, Any] = {"flags": xla_flags(suite) if args.with_flags else {}}
  results.update({"probes": {} if "probes" in skip else probes(suite, skip), "peer": {}})
  results["peer"]["0.25"] = peer(suite, "0.25", args.round_program, 4, "both", 150)
  # The same program again, from the persistent cache the first run filled (gpu_suite.sh's fresh directory).
  results["peer_warm"] = peer(suite, "0.25", args.round_program, 2, "jax", 45, "_warm")
  results["demo"] = {**demo(suite), "phases": demo_phases(suite)}
  if args.with_threefry:
    results["demo_threefry"] = demo_threefry(suite)
  results["throughput"] = [] if "throughput" in skip else throughput(suite)
  if "peer1" not in skip:
    # (its first round: 27 s on an H200, 114 s before), leaving the InCo protocol enough for two calls (the first
    # 91 s, then ~8 s)
    results["peer"]["1"] = peer(suite, "1", args.round_program, 3, "jax", 150, reserve_s=0 if args.smoke else 100)
  results["many_runs"] = {} if "many_runs" in skip else many_runs(suite)
  results["inco"] = inco_protocol(suite, 30.0 if args.smoke else max(20.0, suite.left() - 5))
  text = table(results, suite.notes, args.smoke)
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(text)
  return text


if __name__ == "__main__":
  main()
