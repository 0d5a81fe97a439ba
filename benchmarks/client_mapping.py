"""How a cohort's clients share the hardware inside one program, by model and cohort size.

    python -m benchmarks.client_mapping --models resnet18@0.25,resnet18@1 --clients 2,10,50

Each variant runs ``--steps`` local steps (Adam, batch ``--batch``, 28x28x1 uint8 inputs) of C clients as one
device loop, compiled ahead, and is timed over three runs after a first:

* ``vmap``: the clients side by side (`rounds.cohort`'s "vmap": convolutions with per-client kernels become
  grouped convolutions), what the round program does with the vmap backend;
* ``map``: one client after another inside the program (`jax.lax.map`; the sequential backend's mapping);
* ``batch``: the limit, not a federated computation: one model trained on the C clients' batches at once
  (C x batch samples a step).

Prints one JSON line per (model, C, variant) as it is measured (``batch`` first): compile seconds, milliseconds
per step, samples per second and the variant's speed as a fraction of ``batch``'s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import models
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.rounds import cohort
from benchmarks.common import emit_json_lines

VARIANTS = ("vmap", "map", "batch")
IMAGES = 4096


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--models", default="resnet18@0.25", help="comma-separated NAME@WIDTH")
  p.add_argument("--clients", default=None, help="comma-separated cohort sizes (default: 2,10,50 on an accelerator; "
                 "2,10 on a CPU, where the 50-client rows alone take about 4 minutes on 2 cores)")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, out of {', '.join(VARIANTS)}")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--steps", type=int, default=20, help="local steps in the device loop")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  return p


def _program(trainer: LocalTrainer, variables: Any, clients: int, steps: int, mapping: str | None):
  """``(run, args)``: a jitted device loop of ``steps`` steps of ``clients`` clients (``mapping`` None: one
  model on the clients' joint batches), and the arguments it runs on."""
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 255, (IMAGES, 28, 28, 1), dtype=np.uint8))
  labels = jnp.asarray(rng.integers(0, 10, (IMAGES,)), jnp.int32)
  batch = trainer.config.batch_size
  rows = 1 if mapping is None else clients
  index_rows = jnp.asarray(rng.integers(0, IMAGES, (rows, steps * batch)), jnp.int32)
  sizes = jnp.full((rows,), steps * batch, jnp.int32)
  ids = jnp.arange(rows, dtype=jnp.int32)
  key = jax.random.key(0)

  def run(variables, images, labels, index_rows, sizes):
    states, schedule, mask = cohort.start(trainer, steps, variables, index_rows, sizes, key, ids, {}, {}, (),
                                          per_client_start=False, mapping=mapping or "vmap")
    loop = lambda i, s: cohort.steps(trainer, s, images, labels, schedule, mask, i, 1, mapping or "vmap")
    states = jax.lax.fori_loop(0, steps, loop, states)
    return jax.tree.map(lambda x: x.sum(0), states.variables["params"]), states.num_examples.sum()

  return jax.jit(run), (variables, images, labels, index_rows, sizes)


def measure(spec: str, clients: int, variant: str, batch: int, steps: int) -> dict[str, Any]:
  name, width = models.parse_group_spec(spec)
  model = models.build_model(name, 10, width)
  mapping = None if variant == "batch" else variant
  trainer = LocalTrainer(model, LocalConfig(batch_size=batch * clients if mapping is None else batch),
                         (0.28,), (0.35,))
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  run, args = _program(trainer, variables, clients, steps, mapping)
  t0 = time.perf_counter()
  compiled = run.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  _, seen = jax.block_until_ready(compiled(*args))
  if int(seen) != clients * batch * steps:
    raise RuntimeError(f"{variant}: {int(seen)} examples trained, expected {clients * batch * steps}")
  seconds = []
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds.append(time.perf_counter() - t0)
  best = min(seconds)
  return {"model": spec, "clients": clients, "variant": variant, "batch": batch, "steps": steps,
          "compile_s": round(compile_s, 2), "ms_per_step": round(1e3 * best / steps, 3),
          "samples_per_s": round(clients * batch * steps / best), "platform": jax.default_backend()}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = build_parser().parse_args(argv)
  variants = [v for v in args.variants.split(",") if v]
  if set(variants) - set(VARIANTS) or not variants:
    raise SystemExit(f"error: --variants takes {', '.join(VARIANTS)}, got {args.variants!r}")
  cohorts = args.clients or ("2,10" if jax.default_backend() == "cpu" else "2,10,50")
  rows = []
  for spec in args.models.split(","):
    for clients in (int(c) for c in cohorts.split(",")):
      limit = None  # (the limit first, so that each row is printed as soon as it is measured)
      for variant in sorted(variants, key=lambda v: v != "batch"):
        row = measure(spec, clients, variant, args.batch, args.steps)
        limit = row["samples_per_s"] if variant == "batch" else limit
        rows.append({**row, "of_batch_limit": round(row["samples_per_s"] / limit, 3) if limit else None})
        emit_json_lines(rows[-1:])
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
