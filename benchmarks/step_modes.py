"""Compile time and steady speed of one group's local-step program, by model and steps per call.

    python -m benchmarks.step_modes [MODEL WIDTH BATCH STEPS_PER_CALL]     (default: resnet18 0.25 64 1)

Compiles `LocalTrainer.run_steps` for STEPS_PER_CALL unrolled steps (Adam, 28x28x1 uint8 inputs) and
times a first and then three more runs of 48 steps; prints one JSON line (set XLA_FLAGS to try
XLA:CPU options).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.models import build_model

STEPS = 48


class StepInputs(NamedTuple):
  trainer: LocalTrainer
  variables: Any
  images: jax.Array  # [4096, 28, 28, 1] uint8
  labels: jax.Array
  ids: jax.Array  # [steps, batch]
  mask: jax.Array


def step_inputs(name: str, width: float, batch: int, steps: int, per_call: int = 1) -> StepInputs:
  """A model's Adam trainer, its initial variables and a synthetic 28x28x1 schedule of ``steps`` full batches."""
  model = build_model(name, 10, width=width)
  trainer = LocalTrainer(model, LocalConfig(batch_size=batch, steps_per_call=per_call), (0.28,), (0.35,))
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 255, (4096, 28, 28, 1), dtype=np.uint8))
  labels = jnp.asarray(rng.integers(0, 10, (4096,)), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  ids = jnp.asarray(rng.integers(0, 4096, (steps, batch)), jnp.int32)
  return StepInputs(trainer, variables, images, labels, ids, jnp.ones((steps, batch), bool))


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("model", nargs="?", default="resnet18", help="a model name (default: resnet18)")
  p.add_argument("width", nargs="?", type=float, default=0.25, help="(default: 0.25)")
  p.add_argument("batch", nargs="?", type=int, default=64, help="(default: 64)")
  p.add_argument("steps_per_call", nargs="?", type=int, default=1, help="unrolled steps a call (default: 1)")
  args = p.parse_args(argv)
  name, width, batch, per_call = args.model, args.width, args.batch, args.steps_per_call
  trainer, variables, images, labels, ids, mask = step_inputs(name, width, batch, STEPS, per_call)
  init = jax.jit(trainer.init_state)
  t0 = time.perf_counter()
  run = jax.jit(trainer.run_steps, donate_argnums=0, static_argnums=6).lower(
      init(variables), images, labels, ids, mask, np.int32(0), per_call).compile()
  compile_s = time.perf_counter() - t0

  def train():
    state = init(variables)
    for offset in range(0, STEPS, per_call):
      state = run(state, images, labels, ids, mask, np.int32(offset))
    return jax.block_until_ready(state)

  t0 = time.perf_counter()
  state = train()  # the first run includes kernel set-up that XLA defers to the first call
  first_s = time.perf_counter() - t0
  rates = []
  for _ in range(3):
    t0 = time.perf_counter()
    train()
    rates.append(round(STEPS * batch / (time.perf_counter() - t0)))
  params_l1 = float(sum(jnp.abs(x).sum() for x in jax.tree.leaves(state.variables["params"])))  # shows a numeric change
  row = {"model": f"{name}@{width}", "batch": batch, "steps_per_call": per_call, "compile_s": round(compile_s, 1),
         "first_run_s": round(first_s, 2), "params_l1": params_l1, "samples_per_s": rates,
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
  print(json.dumps(row), flush=True)
  return row


if __name__ == "__main__":
  main()
