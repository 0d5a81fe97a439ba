"""FL round throughput of each backend against the centralized limit, in one process.

For one model and round config, each backend (and each round program: the host
loop, or one device program per call of rounds) runs a FedAvg simulation with a
single architecture group: one warm-up round (compilation), then ``--rounds``
timed rounds. Throughput is real training examples per second over the timed
rounds; ``compile_s`` is the warm-up round's time minus the median timed round.

The centralized limit trains the same model with the same optimizer on the same
number of samples per round, in ordinary mini-batches, with the same strategy: a
jitted chunk of ``steps_per_call`` unrolled ``LocalTrainer.train_step`` calls
gathering its batches from the device-resident uint8 images, a host loop over
chunks; and, since an accelerator prefers it, all steps as one device loop. Its batches are always full (no partial or masked slot) and its samples
are drawn from ordinary epochs over the whole training set. It is the best of
three batch sizes (the local batch, twice it, and the whole cohort's batch
``clients_per_round * batch_size``) in both loops (on a CPU in the host loop only, where a device loop over
convolutions is several times slower: ``--centralized-loops`` says), since no one configuration is fastest
everywhere. The limit is measured first, so that each backend's line is printed as soon as it is measured.

Prints one JSON line per backend, e.g.::

  python -m benchmarks.throughput --backends auto,sequential,vmap
  python -m benchmarks.throughput --backends vmap --round-programs host,fused   # on an accelerator
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import models
from fedjax_hetero import data as fdata
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.config import OPTIMIZERS, RunConfig
from fedjax_hetero.rounds import BACKENDS, Simulation, make_backend, make_simulation
from fedjax_hetero.run.build import build_simulation
from benchmarks.common import emit_json_lines

REQUIRED_KEYS = ("backend", "round_program", "fl_samples_per_s", "centralized_samples_per_s", "ratio", "compile_s", "model",
                 "clients_per_round", "batch_size", "platform", "devices")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--dataset", default="fashion_mnist", choices=fdata.DATASETS)
  p.add_argument("--data-dir", default=None, help="directory holding the dataset files")
  p.add_argument("--model", default="cnn", help=f"NAME or NAME@WIDTH; names: {', '.join(models.MODEL_NAMES)}")
  p.add_argument("--clients-per-round", type=int, default=10)
  p.add_argument("--num-clients", type=int, default=100)
  p.add_argument("--partition", default="iid", choices=fdata.SCHEMES)
  p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (partition=dirichlet)")
  p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
  p.add_argument("--batch-size", type=int, default=64, help="local batch size")
  p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
  p.add_argument("--backends", default="auto,sequential,vmap",
                 help=f"comma-separated backends out of {', '.join(BACKENDS)}")
  p.add_argument("--round-programs", default="host",
                 help="comma-separated round programs out of fused, host (each backend runs each)")
  p.add_argument("--rounds-per-call", type=int, default=None, help="rounds per device program (fused)")
  p.add_argument("--steps-per-call", type=int, default=1, help="local steps unrolled in one jitted call")
  p.add_argument("--max-train-samples", type=int, default=None, help="class-balanced training subset")
  p.add_argument("--centralized-loops", default=None,
                 help="comma-separated, out of host, device: the centralized limit's loops (default: host on a CPU, "
                      "both elsewhere)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  return p


def _config(args: argparse.Namespace) -> RunConfig:
  return RunConfig.from_flags(
      dataset=args.dataset, data_dir=args.data_dir, method="FedAvg", groups=(args.model,),
      num_clients=args.num_clients, clients_per_round=args.clients_per_round, partition=args.partition,
      alpha=args.alpha, epochs=args.epochs, batch_size=args.batch_size, optimizer=args.optimizer,
      learning_rate=args.lr, rounds=args.rounds + 1, seed=args.seed, backend="auto",
      steps_per_call=args.steps_per_call, max_train_samples=args.max_train_samples,
      max_test_samples=min(args.max_train_samples or 100, 100), progress=False)


def measure_fl(sim: Simulation, backend_name: str, rounds: int, round_program: str = "host",
               rounds_per_call: int | None = None) -> dict[str, Any]:
  """One warm-up and ``rounds`` timed rounds of ``sim``'s groups on a fresh backend."""
  backend = make_backend(backend_name)
  # A fresh spec (`RoundSpec.with_values`, no value changed) makes fresh trainers, so every backend compiles its
  # own programs.
  fl = make_simulation(sim.spec.with_values(), backend, round_program, rounds_per_call)
  state, (warm,) = fl.run_rounds(fl.init_state(), 1, consume=True)
  state, timed = fl.run_rounds(state, rounds, consume=True)
  seconds = [m["round_seconds"] for m in timed]
  examples = sum(m["examples"] for m in timed)
  label = backend_name if backend_name != "auto" else f"auto->{backend.name}"
  return {"backend": label, "round_program": round_program, "fl_samples_per_s": examples / sum(seconds),
          "compile_s": max(0.0, warm["round_seconds"] - statistics.median(seconds)),
          "examples_per_round": examples / rounds, "round_s": statistics.median(seconds),
          "warmup_round_s": warm["round_seconds"], "timed_round_s": seconds}


def _centralized_batches(store, total_steps: int, batch: int, seed: int) -> jax.Array:
  """Batch ids of ``total_steps`` steps of ordinary epochs: a fresh permutation of all samples after another."""
  rng = np.random.default_rng(seed)
  n = int(store.labels.shape[0])
  epochs = math.ceil(total_steps * batch / n)
  ids = np.concatenate([rng.permutation(n) for _ in range(epochs)])[:total_steps * batch]
  return jnp.asarray(ids.reshape(total_steps, batch), jnp.int32)


def measure_centralized(sim: Simulation, samples_per_round: float, rounds: int, batch: int, seed: int = 0,
                        device_loop: bool = False) -> dict[str, float]:
  """Full batches of ``batch`` samples on the same data and model: a host loop over jitted chunks of
  ``steps_per_call`` unrolled steps (the backends' strategy), or all steps as one device loop.

  Runs at least ``rounds * samples_per_round`` samples, in whole chunks, after one warm-up chunk (the device
  loop: after one warm-up run of the same program); every batch slot is real.
  """
  store, local = sim.spec.store, sim.spec.local
  config = dataclasses.replace(local, batch_size=batch)
  trainer = LocalTrainer(sim.spec.groups[0].model, config, store.mean, store.std)
  k = config.steps_per_call
  chunks = max(1, math.ceil(rounds * samples_per_round / (batch * k)))
  total_steps = (chunks + 1) * k  # one warm-up chunk first
  ids = _centralized_batches(store, total_steps, batch, seed)
  full = jnp.ones((batch,), bool)
  step = lambda state, images, labels, row: trainer.train_step(state, images[row], labels[row], full)

  @functools.partial(jax.jit, donate_argnums=0)
  def run_chunk(state, images, labels, ids, chunk):
    ids = jax.lax.dynamic_slice_in_dim(ids, chunk * k, k)
    for i in range(k):  # unrolled, as the backends' chunks
      state = step(state, images, labels, ids[i])
    return state

  @functools.partial(jax.jit, donate_argnums=0)
  def run_loop(state, images, labels, ids):
    return jax.lax.fori_loop(k, total_steps, lambda i, s: step(s, images, labels, ids[i]), state)

  # Jitted so the state's leaves are distinct buffers (init_state reuses one zero; the programs donate).
  init = jax.jit(trainer.init_state)
  state = init(sim.init_state().models[0])
  t0 = time.perf_counter()
  state = jax.block_until_ready(run_chunk(state, store.images, store.labels, ids, 0))
  warm_s = time.perf_counter() - t0
  if device_loop:
    jax.block_until_ready(run_loop(init(sim.init_state().models[0]), store.images, store.labels, ids))
  t0 = time.perf_counter()
  if device_loop:
    state = run_loop(state, store.images, store.labels, ids)
  else:
    for i in range(1, chunks + 1):
      state = run_chunk(state, store.images, store.labels, ids, i)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - t0
  processed = chunks * k * batch
  seen = float(state.num_examples)
  if seen != (chunks + 1) * k * batch:
    raise RuntimeError(f"centralized run saw {seen} examples, expected {(chunks + 1) * k * batch}")
  step_s = seconds / (chunks * k)
  return {"centralized_samples_per_s": processed / seconds, "centralized_compile_s": max(0.0, warm_s - k * step_s),
          "centralized_batch": batch, "centralized_loop": "device" if device_loop else "host"}


def centralized_limit(sim: Simulation, samples_per_round: float, rounds: int, seed: int = 0,
                      loops: Sequence[str] = ("host", "device")) -> dict[str, Any]:
  """The fastest centralized configuration: the local batch, twice it and the whole cohort's batch, each in
  ``loops`` (a host loop of chunks, one device loop).

  No configuration is the fastest everywhere (on XLA:CPU a batch of 640 is slower than one of 64, and a device
  loop over convolutions is slow), so the limit the FL loop is measured against is the best of them; every one
  is reported.
  """
  local = sim.spec.local.batch_size
  batches = sorted({local, 2 * local, sim.spec.config.clients_per_round * local})
  tried = [measure_centralized(sim, samples_per_round, rounds, b, seed, loop == "device") for b in batches
           for loop in loops]
  best = max(tried, key=lambda t: t["centralized_samples_per_s"])
  # String keys, so that the row survives a JSON round trip unchanged.
  return {**best, "centralized_by_batch": {f"{t['centralized_batch']}/{t['centralized_loop']}":
                                           t["centralized_samples_per_s"] for t in tried}}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Runs the benchmark; prints (and returns) one JSON-able dict per backend."""
  args = build_parser().parse_args(argv)
  names = [b.strip().lower() for b in args.backends.split(",") if b.strip()]
  bad = [b for b in names if b not in BACKENDS]
  if bad or not names:
    raise SystemExit(f"error: unknown backends {bad}; accepted: {', '.join(BACKENDS)}")
  if args.rounds < 1:
    raise SystemExit("error: --rounds must be >= 1")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  try:
    sim, _ = build_simulation(_config(args), log=log)
  except (ValueError, fdata.DataNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None

  context = {"model": args.model, "clients_per_round": args.clients_per_round, "batch_size": args.batch_size,
             "steps_per_call": args.steps_per_call, "epochs": args.epochs, "dataset": args.dataset,
             "platform": jax.default_backend(), "devices": jax.device_count()}
  programs = [p.strip().lower() for p in args.round_programs.split(",") if p.strip()]
  if not programs or set(programs) - {"fused", "host"}:
    raise SystemExit(f"error: --round-programs takes fused and/or host, got {args.round_programs!r}")
  loops = [l.strip() for l in (args.centralized_loops or
                                ("host" if jax.default_backend() == "cpu" else "host,device")).split(",")]
  if not loops or set(loops) - {"host", "device"}:
    raise SystemExit(f"error: --centralized-loops takes host and/or device, got {args.centralized_loops!r}")
  # One centralized measurement, shared by every backend's line, on the samples a round trains on average.
  store = sim.spec.store
  samples_per_round = float(np.mean(store.sizes)) * args.clients_per_round * args.epochs
  central = centralized_limit(sim, samples_per_round, args.rounds, args.seed, loops)
  log(f"centralized limit (best of {', '.join(central['centralized_by_batch'])}: batch "
      f"{central['centralized_batch']}): {central['centralized_samples_per_s']:.0f} samples/s")
  rows = []
  for name in names:
    for program in programs:
      result = measure_fl(sim, name, args.rounds, program, args.rounds_per_call)
      log(f"{result['backend']} ({program}): {result['fl_samples_per_s']:.0f} samples/s, "
          f"{result['round_s']:.3f} s/round, compile {result['compile_s']:.1f} s")
      row = {**result, **central, "ratio": result["fl_samples_per_s"] / central["centralized_samples_per_s"],
             **context}
      rows.append({k: row[k] for k in REQUIRED_KEYS + tuple(k for k in row if k not in REQUIRED_KEYS)})
      emit_json_lines(rows[-1:])
  if args.output:
    emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
