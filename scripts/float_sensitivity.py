"""How far apart two float orders of the same local training drift, step by step.

One client trains a group's model on consecutive full batches of the store, three ways from the same start:
alone (`LocalTrainer.train_step` jitted), vmapped over two identical slots (how the round programs and the union
map clients), and alone from weights perturbed by a relative ``--perturbation`` (1e-7: about one float32 ulp).
Each step prints the three losses so far and the largest relative weight difference of a layer (max |a - b| /
max |a|) for alone-vs-perturbed and alone-vs-vmapped. When the vmapped column stays within the perturbed one,
the two mappings differ by float order only (docs/development.md, "Why the drivers drift apart").

  FEDJAX_HETERO_DATA_DIR=/usr/share/datasets python scripts/float_sensitivity.py --group resnet14@0.125
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp

from fedjax_hetero.config import RunConfig
from fedjax_hetero.run.build import build_simulation


def largest_difference(a, b) -> tuple[float, str]:
  """The largest per-layer relative difference of two weight trees, and its layer."""
  rel = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-12)), a, b)
  return max((v, jax.tree_util.keystr(k)) for k, v in jax.tree_util.tree_flatten_with_path(rel)[0])


def perturbed(params, scale: float, key: jax.Array):
  """Every weight times (1 + scale * a standard normal draw)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [x * (1 + scale * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--group", default="resnet14@0.125", help="the client's model (a --groups entry)")
  parser.add_argument("--steps", type=int, default=14)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--optimizer", default="sgd")
  parser.add_argument("--lr", type=float, default=0.05)
  parser.add_argument("--perturbation", type=float, default=1e-7)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    trace(args, folder)


def trace(args: argparse.Namespace, folder: str) -> None:
  """Trains the client the three ways and prints a line per step (see the module docstring)."""
  config = RunConfig.from_flags(dataset="fashion_mnist", groups=(args.group,), num_clients=2, clients_per_round=2,
                                max_train_samples=max(2000, args.batch_size * args.steps), max_test_samples=100,
                                rounds=1, optimizer=args.optimizer, learning_rate=args.lr, batch_size=args.batch_size,
                                output_dir=folder, progress=False, round_program="host")
  simulation, _ = build_simulation(config, log=lambda _: None)
  spec = simulation.spec
  trainer = spec.trainers[0]
  start = trainer.init_state(spec.group_variables(simulation.init_state(), 0), (),
                             tuple(() for _ in trainer.terms), jax.random.PRNGKey(0))
  alone, vmapped = jax.jit(trainer.train_step), jax.jit(jax.vmap(trainer.train_step))
  other = start._replace(variables={**start.variables, "params": perturbed(start.variables["params"],
                                                                           args.perturbation, jax.random.PRNGKey(1))})
  two = lambda x: jnp.stack([x, x])  # noqa: E731 (a client's arrays on two identical slots)
  pair = jax.tree.map(two, start)
  a, mask = start, jnp.ones(args.batch_size, bool)
  print("step  loss: alone  perturbed  vmapped   largest difference: alone-perturbed  alone-vmapped"
        "  this step vmapped from alone's weights")
  for step in range(args.steps):
    rows = slice(step * args.batch_size, (step + 1) * args.batch_size)
    images, labels = jnp.asarray(spec.store.images[rows]), jnp.asarray(spec.store.labels[rows])
    one_step = jax.tree.map(lambda x: x[0], vmapped(jax.tree.map(two, a), two(images), two(labels), two(mask)))
    a, other = alone(a, images, labels, mask), alone(other, images, labels, mask)
    pair = vmapped(pair, two(images), two(labels), two(mask))
    slot = jax.tree.map(lambda x: x[0], pair)
    ds, ls = largest_difference(a.variables["params"], one_step.variables["params"])
    losses = [float(s.loss_sum / s.num_examples) for s in (a, other, slot)]
    (dp, lp), (dv, lv) = (largest_difference(a.variables["params"], s.variables["params"]) for s in (other, slot))
    print(f"{step:4d}  {losses[0]:.6f}  {losses[1]:.6f}  {losses[2]:.6f}   {dp:.1e} {lp}  {dv:.1e} {lv}"
          f"  {ds:.1e} {ls}", flush=True)


if __name__ == "__main__":
  main()
