"""The size of a round's device program, per driver: ops per local step and compile seconds, on any platform.

    python -m benchmarks.program_size                                   # the InCo depths (ResNet10..26 @0.125)
    python -m benchmarks.program_size --groups cnn@1,cnn@0.5,cnn@0.25   # the demo's CNN widths

For each ``--drivers`` entry (``fused``: every group's cohort vmapped on its own model, the groups one after
another in each local step; ``union``: every sampled client a masked member of the largest model), the program
of one round (`rounds.simulation.Simulation.program`, ``--rounds-per-call 1``) of the configured run is lowered
and compiled, and its optimized HLO read:

* ``ops_per_step``: instructions of the local-step loop's body (the while loop whose body holds the most
  convolutions and matrix products), counting through conditionals and calls, a fusion as one instruction:
  what a GPU launches per local step, roughly;
* ``convolutions_per_step``: convolutions and matrix products among them (inside fusions too);
* ``fusions`` and ``distinct_kernels``: the module's fusions, and how many distinct bodies they have: XLA compiles
  each distinct kernel once, so compile time follows the second (docs/performance.md);
* ``trace_s`` and ``lower_s``: seconds of jax's tracing and lowering of the program (with the load of the
  executable, what a first round costs on a warm compilation cache);
* ``compile_s`` and ``compile_cpu_s``: wall and CPU seconds of XLA's compilation (the second counts every
  thread XLA used);
* ``evaluation_compile_s`` and ``evaluation_compile_cpu_s``: the same of the evaluation's program (every group's
  test accuracy, `rounds.simulation.Simulation.evaluation`), which a run compiles at its first evaluated round.

The counts and their ratios between drivers carry over from a CPU to an accelerator (the same program is
compiled, though each backend fuses differently); absolute compile times do not. Prints one JSON line per
driver, then the ratios to the first driver. ``--cut PART,...`` compiles the round without some of its parts
(``server``: the server steps keep the model; ``local-steps``: no client steps), so
that the difference to the whole round is what those parts cost to compile. ``--by-source N`` first prints, per
driver, the N lines of the library under which the most ops were traced (before XLA's optimization): where a
program's size comes from.

``--lowered-for PLATFORM`` (``cuda``, ``rocm``, ``tpu``) adds the round's and the initialization's module as jax
lowers it for that platform, before any compiler sees it, measurable without it: ``lowered_ops`` (each function's
ops counted once per call) and ``lowered_threefry_ops`` (those of jax's random-bit hash; a CPU's lowering is a
loop, an accelerator's unrolls it), ``init_lowered_ops`` and ``init_lowered_threefry_ops``. Run under
``JAX_THREEFRY_GPU_KERNEL_LOWERING=1`` it shows what that jax option (one GPU kernel per hash) takes out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import re
import time
from typing import Any, Sequence

from benchmarks.common import emit_json_lines

INCO = "resnet10@0.125,resnet14@0.125,resnet18@0.125,resnet22@0.125,resnet26@0.125"
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*?\b([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(body|condition|true_computation|false_computation|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
HEAVY = ("convolution", "dot")  # (a module with convolutions counts those alone: its products are mostly sums)


def parse_hlo(text: str) -> dict[str, list[tuple[str, str]]]:
  """Every computation of an HLO module's text: its instructions as (opcode, line)."""
  computations: dict[str, list[tuple[str, str]]] = {}
  current = None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head and "=" not in line.split("{")[0].split("(")[0]:
      current = computations.setdefault(head.group(1), [])
      continue
    op = _INSTRUCTION.match(line)
    if op and current is not None:
      current.append((op.group(1), line))
  return computations


def _callees(line: str, kinds: Sequence[str]) -> list[str]:
  names = [name for kind, name in _CALLED.findall(line) if kind in kinds]
  for group in _BRANCHES.findall(line):
    names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
  return names


def count(computations: dict, name: str, heavy_ops: Sequence[str] = HEAVY) -> tuple[int, int]:
  """(instructions, heavy ops) of computation ``name``, through conditionals and calls; a nested while loop and a
  fusion count as one instruction (a fusion's heavy ops are counted)."""
  ops = heavy = 0
  for opcode, line in computations.get(name, ()):
    ops += 1
    heavy += opcode in heavy_ops
    if opcode == "fusion":
      heavy += sum(op in heavy_ops for callee in _callees(line, ("calls",)) for op, _ in computations.get(callee, ()))
    elif opcode in ("conditional", "call"):
      for callee in _callees(line, ("true_computation", "false_computation", "to_apply")):
        sub_ops, sub_heavy = count(computations, callee, heavy_ops)
        ops, heavy = ops + sub_ops - (opcode == "call"), heavy + sub_heavy
  return ops, heavy


def step_loop(text: str) -> tuple[int, int, int]:
  """(ops per local step, heavy ops per local step, ops of the whole module) of an optimized HLO module."""
  computations = parse_hlo(text)
  bodies = [name for instructions in computations.values() for opcode, line in instructions if opcode == "while"
            for name in _callees(line, ("body",))]
  sizes = [count(computations, body) for body in bodies]
  convolutions = [count(computations, body, ("convolution",))[1] for body in bodies]
  if any(convolutions):  # the step loop: the most convolutions (reductions over clients are matrix products)
    return (*max(zip(sizes, convolutions), key=lambda s: (s[1], s[0][0]))[0][:1], max(convolutions),
            sum(len(v) for v in computations.values()))
  ops, heavy = max(sizes, key=lambda s: (s[1], s[0])) if sizes else (0, 0)
  return ops, heavy, sum(len(v) for v in computations.values())


def distinct_kernels(text: str) -> tuple[int, int]:
  """(fusions, distinct fused computations) of an optimized HLO module: XLA compiles each distinct kernel once,
  so its compile time follows the second (names and metadata aside, two fusions of one body are one kernel)."""
  computations = parse_hlo(text)
  called = [name for instructions in computations.values() for opcode, line in instructions if opcode == "fusion"
            for name in _callees(line, ("calls",))]
  body = lambda name: "\n".join(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line))
                                 for _, line in computations.get(name, ()))
  return len(called), len({body(name) for name in called})


def ops_by_source(mlir: str) -> collections.Counter:
  """Ops of a lowered module (before XLA's optimization; constants left out) under each line of the library:
  an op counts for every fedjax_hetero line on its call stack, so a line's count includes what it calls."""
  definitions = dict(re.findall(r"^#(loc\d+) = loc\((.*)\)\s*$", mlir, re.M))
  frames: dict[str, list[str]] = {}

  def stack(ref: str) -> list[str]:
    if ref not in frames:
      frames[ref] = []  # (a cycle guard while it resolves)
      body = definitions.get(ref, "")
      at = re.match(r'^"([^"]+)":(\d+)', body)
      frames[ref] = ([f"fedjax_hetero/{at.group(1).split('fedjax_hetero/', 1)[1]}:{at.group(2)}"]
                     if at and "fedjax_hetero/" in at.group(1) else [] if at else
                     [f for sub in re.findall(r"#(loc\d+)", body) for f in stack(sub)])
    return frames[ref]

  counts: collections.Counter = collections.Counter()
  for op in re.finditer(r"= (?:stablehlo|chlo)\.(\w+).*loc\(#(loc\d+)\)\s*$", mlir, re.M):
    if op.group(1) != "constant":
      counts.update(set(stack(op.group(2))))
  return counts


def lowered_ops(mlir: str) -> tuple[int, int]:
  """(ops, threefry ops) of a lowered module's ``main``: a function's ops counted once per call, those under a
  function of jax's threefry hash counted apart too."""
  bodies = {re.match(r"(?:\w+ )*@([^(]+)\(", f).group(1): f for f in re.split(r"\n  func\.func ", mlir)[1:]}

  @functools.cache
  def size(name: str) -> tuple[int, int]:
    body = bodies.get(name, "")
    ops = len(re.findall(r"= (?:stablehlo|chlo)\.", body))
    calls = [size(callee) for callee in re.findall(r"call @([^(]+)\(", body)]
    ops += sum(c for c, _ in calls)
    return ops, ops if "threefry" in name else sum(t for _, t in calls)

  return size("main")


CUTS = ("server", "local-steps")


@contextlib.contextmanager
def without(parts: Sequence[str]):
  """The round's program built without ``parts`` (`CUTS`) while the context is open: the library's pieces that
  compute them are replaced, and restored on exit."""
  from fedjax_hetero.rounds import body, cohort

  unknown = set(parts) - set(CUTS)
  if unknown:
    raise ValueError(f"unknown parts {sorted(unknown)}; accepted: {', '.join(CUTS)}")
  replaced = []

  def replace(owner, name, value):
    replaced.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)

  if "server" in parts:
    replace(body, "server_round",
            lambda spec, f, state, starts, results, x, mapped=None: (state.models[f], state.steps[f], {}))
  if "local-steps" in parts:
    replace(cohort, "steps", lambda trainer, states, *args, **kwargs: states)
  try:
    yield
  finally:
    for owner, name, value in reversed(replaced):
      setattr(owner, name, value)


def lowered_elsewhere(sim: Any, traced: Any, platform: str) -> dict[str, int]:
  """The round's (``traced``) and the initialization's module sizes as jax lowers them for ``platform``."""
  import jax
  import numpy as np

  from fedjax_hetero.rounds.spec import initialization

  spec = sim.spec
  model = spec.groups[spec.global_index].model
  sample = np.zeros((1,) + tuple(spec.store.images.shape[1:]), np.float32)
  initialize = jax.jit(initialization(model)).trace(np.uint32(0), sample)
  (ops, threefry), (init_ops, init_threefry) = (
      lowered_ops(t.lower(lowering_platforms=(platform,)).as_text()) for t in (traced, initialize))
  return {"lowered_for": platform, "lowered_ops": ops, "lowered_threefry_ops": threefry,
          "init_lowered_ops": init_ops, "init_lowered_threefry_ops": init_threefry}


def measure(config: Any, driver: str, by_source: int = 0, cut: Sequence[str] = (),
            lowered_for: str | None = None) -> dict[str, Any]:
  from fedjax_hetero.run.build import build_simulation

  sim, _ = build_simulation(config.replace(round_program=driver, rounds_per_call=1), log=lambda _: None)
  if sim.cohorts.name != driver and not (driver == "fused" and sim.cohorts.in_program):
    raise SystemExit(f"error: the {driver} driver was not built (got {sim.cohorts.name})")
  return measure_simulation(sim, driver, by_source, cut, lowered_for)


def measure_simulation(sim: Any, driver: str, by_source: int = 0, cut: Sequence[str] = (),
                       lowered_for: str | None = None) -> dict[str, Any]:
  """The row of ``sim``'s one-round program (a device program's `Simulation`), without the parts ``cut``."""
  import jax
  import numpy as np

  from fedjax_hetero.garbage import deferred_full_collections
  from fedjax_hetero.rounds.body import RoundData
  from fedjax_hetero.rounds.inputs import plan_call
  from fedjax_hetero.rounds.simulation import program_call

  spec, state = sim.spec, sim.init_state()
  slots = [sim.cohorts.slots(spec, g) for g in range(len(spec.groups))]
  call = plan_call(spec, state, 1, (), slots, 1)
  data = RoundData.of(spec, sim.cohorts.arguments())
  args = ((state.models, state.steps), state.memory, call.inputs, np.int32(1), data)
  seconds = time.perf_counter()
  # As `sim.program`'s, but traced anew (the cut pieces are read while it is traced), under the deferral that
  # `Simulation.run_call` traces it under.
  program = jax.jit(program_call(spec, sim.cohorts, call.statics, 1), donate_argnums=1)
  with without(cut), deferred_full_collections():
    traced = program.trace(*args)
    trace_s, seconds = time.perf_counter() - seconds, time.perf_counter()
    lowered = traced.lower()
    lower_s = time.perf_counter() - seconds
  elsewhere = lowered_elsewhere(sim, traced, lowered_for) if lowered_for else {}
  if by_source:
    for frame, ops in ops_by_source(lowered.as_text(debug_info=True)).most_common(by_source):
      print(f"{driver}: {ops:7,d} ops under {frame}", flush=True)
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  text = compiled.as_text()
  (ops, heavy, total), (fusions, kernels) = step_loop(text), distinct_kernels(text)
  evaluation = sim.evaluation.lower(np.int32(1), (state.models, state.steps), data)
  evaluation_wall, evaluation_cpu = time.perf_counter(), time.process_time()
  evaluation.compile()
  evaluation_wall, evaluation_cpu = time.perf_counter() - evaluation_wall, time.process_time() - evaluation_cpu
  return {"driver": driver, "groups": ",".join(g.name for g in spec.groups), "cut": ",".join(cut),
          "ops_per_step": ops, "convolutions_per_step": heavy, "module_ops": total, "fusions": fusions,
          "distinct_kernels": kernels, "trace_s": round(trace_s, 2),
          "lower_s": round(lower_s, 2), "compile_s": round(wall, 2), "compile_cpu_s": round(cpu, 2),
          "evaluation_compile_s": round(evaluation_wall, 2), "evaluation_compile_cpu_s": round(evaluation_cpu, 2),
          "platform": jax.default_backend(), **elsewhere}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--groups", default=INCO)
  p.add_argument("--method", default="HeteroAvg")
  p.add_argument("--num-clients", type=int, default=100)
  p.add_argument("--clients-per-round", type=int, default=10)
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--max-train-samples", type=int, default=None, help="class-balanced training subset")
  p.add_argument("--drivers", default="fused,union", help="comma-separated: fused, union")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  p.add_argument("--dissimilarity", action="store_true", help="with the gradient-dissimilarity metric, as the "
                 "experiment driver runs by default (off here: the rows measure the method alone)")
  p.add_argument("--by-source", type=int, default=0, metavar="N", help="also print the N library source lines "
                 "under which the most ops of each program were traced (before XLA's optimization)")
  p.add_argument("--lowered-for", default=None, metavar="PLATFORM", help="also count the round's and the "
                 "initialization's ops as jax lowers them for this platform (cuda, rocm, tpu), before compiling")
  p.add_argument("--cut", default="", metavar="PART,...", help=f"compile the round without these parts "
                 f"(comma-separated: {', '.join(CUTS)}), to see what they cost to compile")
  args = p.parse_args(argv)
  cut = tuple(part for part in args.cut.split(",") if part)
  if set(cut) - set(CUTS):
    p.error(f"--cut takes {', '.join(CUTS)}, got {args.cut!r}")

  from fedjax_hetero.config import RunConfig

  config = RunConfig.from_flags(
      dataset="fashion_mnist", groups=tuple(args.groups.split(",")), method=args.method,
      num_clients=args.num_clients, clients_per_round=args.clients_per_round, partition="dirichlet", alpha=0.5,
      epochs=1, batch_size=args.batch_size, optimizer="adam", learning_rate=1e-3, rounds=1,
      max_train_samples=args.max_train_samples, progress=False, dissimilarity=args.dissimilarity, backend="vmap")
  rows = []
  for driver in args.drivers.split(","):
    rows.append(measure(config, driver, args.by_source, cut, args.lowered_for))
    emit_json_lines(rows[-1:])
  for row in rows[1:]:
    ratios = {f"{k}_ratio": round(row[k] / rows[0][k], 3)
              for k in ("ops_per_step", "distinct_kernels", "trace_s", "lower_s", "compile_s", "compile_cpu_s",
                        "evaluation_compile_cpu_s") if rows[0][k]}
    print(json.dumps({"driver": row["driver"], "over": rows[0]["driver"], **ratios}), flush=True)
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
