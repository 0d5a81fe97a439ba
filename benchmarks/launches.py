"""Device programs launched per round, by round program: the structure an accelerator needs, counted anywhere.

    python -m benchmarks.launches --groups resnet10@0.125,resnet14@0.125,resnet18@0.125,resnet22@0.125,resnet26@0.125

Builds the run of the given flags (the peer workload's by default: HeteroAvg, 100 clients, 10 per round, one
epoch of Adam at batch 64, on Fashion-MNIST), runs one round to compile, then counts with jax's profiler
(`compilation.LaunchCount`) the programs launched by ``--rounds`` more rounds, evaluation included, on the host
loop and on the round program (one call). Prints one JSON line per round program.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import jax

from fedjax_hetero.compilation import LaunchCount
from fedjax_hetero.config import RunConfig
from fedjax_hetero.rounds import make_backend
from fedjax_hetero.run.build import build_simulation
from benchmarks.common import emit_json_lines


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--groups", default="resnet10@0.125,resnet18@0.125")
  p.add_argument("--num-clients", type=int, default=100)
  p.add_argument("--clients-per-round", type=int, default=10)
  p.add_argument("--epochs", type=int, default=1)
  p.add_argument("--rounds", type=int, default=3, help="counted rounds, after one that compiles")
  p.add_argument("--max-train-samples", type=int, default=None)
  p.add_argument("--dataset", default="fashion_mnist")
  p.add_argument("--backend", default="auto", help="the host loop's backend (the round program maps clients as it)")
  args = p.parse_args(argv)
  rows = []
  for program in ("host", "fused"):
    config = RunConfig.from_flags(
        dataset=args.dataset, groups=tuple(args.groups.split(",")), method="HeteroAvg", num_clients=args.num_clients,
        clients_per_round=args.clients_per_round, epochs=args.epochs, batch_size=64, rounds=args.rounds + 1,
        round_program=program, rounds_per_call=args.rounds, max_train_samples=args.max_train_samples,
        max_test_samples=1000, backend=args.backend, progress=False, dissimilarity=False)
    sim, _ = build_simulation(config, log=lambda m: print(m, file=sys.stderr))
    state, _ = sim.run_rounds(sim.init_state(), 1, evaluate={1}, consume=True)
    with LaunchCount() as launches:
      _, done = sim.run_rounds(state, args.rounds, evaluate={args.rounds + 1}, consume=True)
    steps = sum(r["examples"] for r in done) / config.client.batch_size
    # The backend of the flags (the round program maps the clients as it would, without training through it).
    backend = make_backend(config.backend).name if sim.cohorts.in_program else sim.cohorts.backend.name
    rows.append({"round_program": program, "backend": backend, "launches": launches.count, "rounds": args.rounds,
                 "launches_per_round": launches.count / args.rounds, "groups": args.groups,
                 "clients_per_round": args.clients_per_round, "client_batches_per_round": round(steps / args.rounds),
                 "platform": jax.default_backend()})
    emit_json_lines(rows[-1:])
  return rows


if __name__ == "__main__":
  main()
