"""What a method's server step adds to a round, against a baseline method on the same clients.

Issue acceptance targets: the InCo step must add under 5% to a HeteroAvg round
at the InCo paper's setting, and a FedCross round must cost at most 1.1x a
FedAvg round with the same clients. For each method of ``--methods`` (the first
is the baseline) this builds the run of ``--preset`` (plus overrides), runs one
warm-up round (compilation) and ``--rounds`` timed rounds, and times the
server step inside each round (everything after the clients' training:
aggregation, InCo, FedCross's similarity and cross-aggregation) by wrapping the
simulation's jitted server programs with a device sync on both sides (the
rounds run on the host loop, where each server program is its own call).

Prints one JSON line per method: ``round_s`` (median timed round),
``server_step_s`` (median), ``round_ratio`` (round_s / baseline's round_s) and
``server_step_share`` (server_step_s / baseline's round_s). Sampled clients and
their data are identical across methods (same seed), so the rounds differ only
by the method. E.g.::

  python -m benchmarks.method_overhead --preset inco --methods HeteroAvg,InCoAvg --rounds 2
  python -m benchmarks.method_overhead --preset fedcross-cpu --methods FedAvg,FedCross --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from typing import Any, Sequence

import jax

from fedjax_hetero.config import RunConfig
from fedjax_hetero.rounds import RoundSpec, make_simulation
from fedjax_hetero.run.build import build_simulation
from benchmarks.common import emit_json_lines
from experiments.presets import PRESETS, get_preset


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--preset", default="inco", choices=tuple(PRESETS))
  p.add_argument("--methods", default="HeteroAvg,InCoAvg", help="comma-separated; the first is the baseline")
  p.add_argument("--dataset", default="fashion_mnist")
  p.add_argument("--groups", default=None, help="override the preset's groups (comma-separated)")
  p.add_argument("--num-clients", type=int, default=None)
  p.add_argument("--clients-per-round", type=int, default=None)
  p.add_argument("--epochs", type=int, default=None, help="local epochs: the preset's when unset, 1 on a CPU (where "
                 "the InCo preset's 5 take 80 s a round on 2 cores; a shorter round only raises the server's share)")
  p.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up round")
  p.add_argument("--backend", default="auto")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  return p


def _timed(fn, record: list[float]):
  def wrapper(*args, **kwargs):
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    record.append(time.perf_counter() - t0)
    return out
  return wrapper


def timed_spec(spec: RoundSpec, record: list[float]) -> RoundSpec:
  """``spec`` with its jitted server programs (`RoundSpec.server_programs`, one per federation) wrapped by
  `_timed`, each call's time appended to ``record``; ``spec`` itself is left as it is."""

  class TimedServerPrograms(type(spec)):
    @functools.cached_property
    def server_programs(self) -> tuple[Any, ...]:
      return tuple(_timed(f, record) for f in RoundSpec.server_programs.func(self))

  return TimedServerPrograms(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})


def measure(config: RunConfig, rounds: int, log) -> dict[str, Any]:
  built, _ = build_simulation(config, log=log)
  server_times: list[float] = []
  sim = make_simulation(timed_spec(built.spec, server_times), built.cohorts.backend, "host")
  state = sim.init_state()
  state, (warm,) = sim.run_rounds(state, 1, consume=True)
  per_round, rows = [], []
  for _ in range(rounds):
    server_times.clear()
    state, (m,) = sim.run_rounds(state, 1, consume=True)
    per_round.append(sum(server_times))
    rows.append(m)
  seconds = [m["round_seconds"] for m in rows]
  return {"method": sim.spec.method.name, "round_s": statistics.median(seconds), "timed_round_s": seconds,
          "server_step_s": statistics.median(per_round), "warmup_round_s": warm["round_seconds"],
          "examples_per_round": statistics.mean(m["examples"] for m in rows)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = build_parser().parse_args(argv)
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  if len(methods) < 2:
    raise SystemExit("error: --methods needs a baseline and at least one method")
  if args.epochs is None and jax.default_backend() == "cpu":
    args.epochs = 1
  preset = get_preset(args.preset)
  values = dict(preset.values)
  if args.groups:
    values["groups"] = tuple(g.strip() for g in args.groups.split(","))
  for name in ("num_clients", "clients_per_round", "epochs"):
    if getattr(args, name) is not None:
      values[name] = getattr(args, name)
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  context = {"preset": preset.name, "groups": list(values["groups"]), "clients_per_round": values["clients_per_round"],
             "epochs": values["epochs"], "platform": jax.default_backend()}
  rows = []
  for method in methods:  # the baseline first, so that each row is printed with its ratios as soon as it is measured
    config = RunConfig.from_flags(**{**values, "dataset": args.dataset, "method": method, "rounds": args.rounds + 1,
                                     "backend": args.backend, "round_program": "host", "progress": False,
                                     "dissimilarity": False})
    row = measure(config, args.rounds, log)
    base = rows[0] if rows else row
    rows.append({**row, "round_ratio": row["round_s"] / base["round_s"],
                 "server_step_share": row["server_step_s"] / base["round_s"], "baseline": base["method"], **context})
    emit_json_lines(rows[-1:])
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
