"""How a round's time and memory grow with the cohort, the number of clients and the model width.

Nothing in a round should grow faster than its work (clients trained x steps x parameters). Three sweeps,
each from one base setting (``--clients``, ``--cohort``, ``--width``), every point its own `Simulation`
built in this process, for every method of ``--methods`` on every backend of ``--backends``:

- ``cohort``: clients per round (``--cohorts``, default 10, 50, 100, 500) at ``--clients`` clients;
- ``clients``: total clients (``--client-counts``, default 100 to 100,000) at ``--cohort`` per round. The
  work is the same at every point, so neither time nor memory should grow. SCAFFOLD (``Scaffold``)
  keeps a params-shaped control variate per client, the worst case among the catalog's methods (MOON's
  previous model is of the same size); ``FedAvg`` keeps nothing;
- ``width``: the MLP's width (``--widths``; hidden size ``--hidden`` x width) at ``--clients`` and ``--cohort``.

The data are synthetic, since only the cost matters: ``--pool`` random 8x8 images of 4 classes, each client
holding ``--samples`` of them drawn at random, so 100,000 clients need no large dataset; one epoch of SGD at
batch ``--batch-size`` (one local step by default). Every point runs a warm-up round (compilation), then
``--rounds`` timed rounds; ``round_ms`` is their median ``round_seconds``, the simulation's own timing (sampling,
training, aggregation, until the new state is ready).

Memory. On CPU, ``peak_mb`` is the growth of the process's peak resident set over the timed rounds: after
the warm-up the C heap's free pages go back to the system (glibc's ``malloc_trim``) and the peak is reset
(Linux: ``/proc/self/clear_refs``), then ``VmHWM`` is read after the rounds, minus the resident set at the
reset. On GPU and TPU it is the device's ``memory_stats()["peak_bytes_in_use"]`` minus its ``bytes_in_use``
before the timed rounds, with every point in its own process (``--isolate``, the default there, since that
peak cannot be reset). ``state_mb`` is the size of the per-client state the simulation holds and ``copy_ms``
the time of one jitted copy of it: what a round that copies that state pays on top of its work.

Prints one JSON line per point and, with ``--table``, a Markdown table per sweep; ``--plot`` draws them::

  python -m benchmarks.scaling --table --plot docs/scaling.png
  python -m benchmarks.scaling --sweeps clients --methods Scaffold --backends vmap
  python -m benchmarks.scaling --backends vmap --hidden 1024 --samples 256 --client-counts 100,1000,10000  # GPU, TPU
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.config import FederationConfig, LocalConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.methods import MethodConfig, build_method
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import ArchGroup, RoundSpec, Simulation, make_simulation
from fedjax_hetero.rounds.backends import BACKENDS, copy_tree, make_backend
from benchmarks.common import emit_json_lines

SWEEPS = ("cohort", "clients", "width")


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(v) for v in text.split(",") if v.strip())


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
  return tuple(v.strip() for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--sweeps", type=_names, default=SWEEPS, help=f"comma-separated, out of {', '.join(SWEEPS)}")
  p.add_argument("--methods", type=_names, default=("Scaffold", "FedAvg"),
                 help="comma-separated method names (Scaffold keeps per-client state; FedAvg keeps none)")
  p.add_argument("--backends", type=_names, default=("sequential", "vmap"),
                 help=f"comma-separated, out of {', '.join(BACKENDS)}")
  p.add_argument("--clients", type=int, default=1000, help="total clients of the cohort and width sweeps")
  p.add_argument("--cohort", type=int, default=10, help="clients per round of the clients and width sweeps")
  p.add_argument("--width", type=float, default=0.5, help="MLP width of the cohort and clients sweeps")
  p.add_argument("--cohorts", type=_ints, default=(10, 50, 100, 500))
  p.add_argument("--client-counts", type=_ints, default=(100, 1000, 10_000, 100_000))
  p.add_argument("--widths", type=_floats, default=(0.25, 0.5, 1.0, 2.0, 4.0))
  p.add_argument("--hidden", type=int, default=64, help="the MLP's hidden size at width 1 (one hidden layer)")
  p.add_argument("--samples", type=int, default=16, help="training samples per client")
  p.add_argument("--pool", type=int, default=4096, help="synthetic images the clients' samples are drawn from")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--epochs", type=int, default=1)
  p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
  p.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                 help="every point in its own process (auto: on GPU and TPU, where the device's peak memory "
                      "cannot be reset)")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  p.add_argument("--table", action="store_true", help="print a Markdown table per sweep after the JSON lines")
  p.add_argument("--plot", default=None, help="draw the sweeps into this PNG")
  p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # one point, as JSON (--isolate's children)
  return p


def points(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Every (sweep, method, backend, clients, cohort, width) to measure, smallest first within a sweep."""
  for sweep in args.sweeps:
    if sweep not in SWEEPS:
      raise SystemExit(f"error: unknown sweep {sweep!r}; accepted: {', '.join(SWEEPS)}")
  for backend in args.backends:
    if backend not in BACKENDS:
      raise SystemExit(f"error: unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
  grid = {"cohort": [(args.clients, c, args.width) for c in args.cohorts],
          "clients": [(n, args.cohort, args.width) for n in args.client_counts],
          "width": [(args.clients, args.cohort, w) for w in args.widths]}
  out = []
  for sweep in args.sweeps:
    for method in args.methods:
      for backend in args.backends:
        for clients, cohort, width in grid[sweep]:
          if cohort > clients:
            raise SystemExit(f"error: {sweep} sweep: {cohort} clients per round of {clients} clients")
          out.append(dict(sweep=sweep, method=method, backend=backend, clients=clients, cohort=cohort, width=width))
  return out


def simulation(point: dict[str, Any], args: argparse.Namespace) -> Simulation:
  """One architecture group of ``point["clients"]`` clients, each holding ``args.samples`` synthetic images."""
  data = synthetic_dataset(num_train=args.pool, num_test=32, seed=0)
  rng = np.random.default_rng(0)
  parts = list(rng.integers(0, args.pool, (point["clients"], args.samples)))
  store = FederatedStore.build(data.train_images, data.train_labels, parts, data.num_classes, data.mean, data.std)
  model = build_model("mlp", data.num_classes, point["width"], hidden=(args.hidden,))
  group = ArchGroup(f"mlp@{point['width']:g}", model, np.arange(point["clients"]))
  local = LocalConfig(epochs=args.epochs, batch_size=args.batch_size, optimizer="sgd", learning_rate=0.05)
  method = build_method(point["method"], MethodConfig(), local)
  federation = FederationConfig(clients_per_round=point["cohort"], seed=0)
  spec = RoundSpec.build([group], store, local, method, federation, jnp.asarray(data.test_images),
                         jnp.asarray(data.test_labels))
  # The host loop, one round per call: every round's time is its own (`run_rounds` of one round).
  return make_simulation(spec, make_backend(point["backend"]), round_program="host")


def _proc_status_kb(*keys: str) -> dict[str, int]:
  values = {}
  with open("/proc/self/status") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name in keys:
        values[name] = int(rest.split()[0])
  return values


def _release_free_heap() -> None:
  """Returns the C heap's free pages to the system (glibc), so that memory allocated next raises the resident
  set instead of reusing pages freed earlier (which would hide it from the peak)."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    pass


class PeakMemory:
  """The peak memory growth over a stretch of work: the device's on GPU/TPU, the process's resident set on CPU."""

  def __init__(self):
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    self.device = device if stats and "peak_bytes_in_use" in stats else None
    self.source = ("device peak_bytes_in_use" if self.device else "process peak RSS (VmHWM)")

  def start(self) -> None:
    if self.device:
      self._base = self.device.memory_stats()["bytes_in_use"]
      return
    _release_free_heap()
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    except OSError as e:
      raise RuntimeError(f"cannot reset the peak resident set ({e}); peak memory needs Linux >= 4.0") from None
    self._base = _proc_status_kb("VmRSS")["VmRSS"] * 1024

  def growth_bytes(self) -> int:
    if self.device:
      return self.device.memory_stats()["peak_bytes_in_use"] - self._base
    return _proc_status_kb("VmHWM")["VmHWM"] * 1024 - self._base


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def copy_seconds(tree, repeats: int = 3) -> float:
  """The median time of one jitted copy of ``tree`` (what an O(state) step per round would cost)."""
  if not jax.tree.leaves(tree):
    return 0.0
  jax.block_until_ready(copy_tree(tree))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(copy_tree(tree))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure(point: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
  """One warm-up and ``args.rounds`` timed rounds of the point's simulation."""
  sim = simulation(point, args)
  state = sim.init_state()
  state, (_,) = sim.run_rounds(state, 1, consume=True)
  memory = PeakMemory()
  jax.block_until_ready(state)
  memory.start()
  seconds = []
  for _ in range(args.rounds):
    state, (m,) = sim.run_rounds(state, 1, consume=True)
    seconds.append(m["round_seconds"])
  peak = memory.growth_bytes()
  copy_s = copy_seconds(state.memory)  # after the peak: on a device, its copy would count in it
  params = sum(x.size for x in jax.tree.leaves(state.models[0]["params"]))
  round_s = statistics.median(seconds)
  backend = sim.cohorts.backend.name
  return {**point, "backend": backend if point["backend"] != "auto" else f"auto->{backend}",
          "params": int(params), "round_ms": 1e3 * round_s, "ms_per_client": 1e3 * round_s / point["cohort"],
          "timed_round_ms": [1e3 * s for s in seconds], "state_mb": _nbytes(state.memory) / 2**20,
          "copy_ms": 1e3 * copy_s, "peak_mb": peak / 2**20, "memory_source": memory.source,
          "platform": jax.default_backend(), "samples": args.samples, "batch_size": args.batch_size,
          "epochs": args.epochs}


def _measure_isolated(point: dict[str, Any], argv: Sequence[str]) -> dict[str, Any]:
  """``measure`` in a fresh process (the same flags, this one point)."""
  out = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *argv, "--point", json.dumps(point)],
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"point {point} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def markdown_tables(rows: Sequence[dict[str, Any]]) -> str:
  """One Markdown table per sweep: a row per point, a column per (method, backend) holding the median round
  time and the peak memory growth, and, for each method that keeps per-client state, its size and the time of
  one copy of it."""
  x_of = {"cohort": ("cohort", "clients per round"), "clients": ("clients", "total clients"),
          "width": ("width", "width")}
  ms = lambda v: f"{v:.1f}" if v < 100 else f"{v:,.0f}"
  out = []
  for sweep in SWEEPS:
    part = [r for r in rows if r["sweep"] == sweep]
    if not part:
      continue
    key, label = x_of[sweep]
    lines = list(dict.fromkeys((r["method"], r["backend"]) for r in part))
    stateful = list(dict.fromkeys(r["method"] for r in part if r["state_mb"] > 0))
    first = part[0]
    fixed = {"cohort": f"{first['clients']:,} clients, width {first['width']:g}",
             "clients": f"{first['cohort']} per round, width {first['width']:g} ({first['params']:,} parameters)",
             "width": f"{first['clients']:,} clients, {first['cohort']} per round"}[sweep]
    header = [label] + (["parameters"] if sweep == "width" else [])
    header += [f"{m} state (MB) / one copy (ms)" for m in stateful] + [f"{m}, {b}" for m, b in lines]
    caption = f"{sweep} sweep ({fixed}); per method and backend: median round (ms) / peak memory growth (MB):"
    table = [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for x in dict.fromkeys(r[key] for r in part):
      at = {(r["method"], r["backend"]): r for r in part if r[key] == x}
      cells = [f"{x:,}" if isinstance(x, int) else f"{x:g}"]
      if sweep == "width":
        cells.append(f"{next(iter(at.values()))['params']:,}")
      for m in stateful:
        r = next(r for (method, _), r in at.items() if method == m)
        cells.append(f"{r['state_mb']:.1f} / {ms(r['copy_ms'])}")
      for line in lines:
        r = at.get(line)
        cells.append(f"{ms(r['round_ms'])} / {r['peak_mb']:+.1f}" if r else "")
      table.append("| " + " | ".join(cells) + " |")
    out.append("\n".join(table))
  return "\n\n".join(out)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """A column per sweep: round time (top) and peak memory growth (bottom) per method and backend, with a
  dotted line growing as the work does (clients trained x parameters) from the first point."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  sweeps = [s for s in SWEEPS if any(r["sweep"] == s for r in rows)]
  fig = Figure(figsize=(4.5 * len(sweeps), 7))
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, len(sweeps), squeeze=False, sharex="col")
  x_of = {"cohort": ("cohort", "clients per round"), "clients": ("clients", "total clients"),
          "width": ("params", "model parameters (width)")}
  lines = sorted({(r["method"], r["backend"]) for r in rows})
  floor = 0.1  # MB: what the plot shows for no growth (log axis)
  for column, sweep in enumerate(sweeps):
    key, label = x_of[sweep]
    time_ax, memory_ax = axes[0, column], axes[1, column]
    part = [r for r in rows if r["sweep"] == sweep]
    for i, line in enumerate(lines):
      points = sorted((r for r in part if (r["method"], r["backend"]) == line), key=lambda r: r[key])
      if points:
        xs = [r[key] for r in points]
        time_ax.plot(xs, [r["round_ms"] for r in points], "-o", color=f"C{i}", ms=4, label=", ".join(line))
        memory_ax.plot(xs, [max(r["peak_mb"], floor) for r in points], "-s", color=f"C{i}", ms=4)
    xs = sorted({r[key] for r in part})
    work = lambda r: r["cohort"] * r["params"]
    base = min(part, key=lambda r: r[key])
    start_ms = statistics.median(r["round_ms"] for r in part if r[key] == base[key])
    per_x = {r[key]: work(r) for r in part}
    time_ax.plot(xs, [start_ms * per_x[x] / work(base) for x in xs], ":", color="gray", label="as the work grows")
    first = part[0]
    fixed = {"cohort": f"{first['clients']:,} clients, width {first['width']:g}",
             "clients": f"{first['cohort']} per round, width {first['width']:g}",
             "width": f"{first['clients']:,} clients, {first['cohort']} per round"}[sweep]
    time_ax.set(xscale="log", yscale="log", ylabel="round time (ms, median)", title=f"{sweep} sweep ({fixed})")
    memory_ax.set(xscale="log", yscale="log", xlabel=label, ylabel=f"peak memory growth (MB; {floor:g}: none)")
    for ax in (time_ax, memory_ax):
      ax.grid(alpha=0.3, which="both")
  axes[0, 0].legend(fontsize=8)
  fig.suptitle(f"benchmarks/scaling.py on {rows[0]['platform']}; memory: {rows[0]['memory_source']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if args.point:
    row = measure(json.loads(args.point), args)
    print(json.dumps(row), flush=True)
    return [row]
  isolate = args.isolate == "on" or (args.isolate == "auto" and jax.default_backend() != "cpu")
  rows = []
  for point in points(args):
    rows.append(_measure_isolated(point, argv) if isolate else measure(point, args))
    print(f"{point['sweep']}: {point['method']} on {rows[-1]['backend']}, {point['clients']:,} clients, "
          f"{point['cohort']} per round, width {point['width']:g}: {rows[-1]['round_ms']:.1f} ms per round, "
          f"peak +{rows[-1]['peak_mb']:.1f} MB", file=sys.stderr, flush=True)
  emit_json_lines(rows, args.output)
  if args.table:
    print(markdown_tables(rows))
  if args.plot:
    plot(rows, args.plot)
  return rows


if __name__ == "__main__":
  main()
