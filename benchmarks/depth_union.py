"""Depth groups stepping together: one vmapped step per group, or each block once over every client holding it.

    python -m benchmarks.depth_union --width 0.25 --clients-per-group 2

ResNet10, 14, 18, 22 and 26 (the InCo family) differ only in how many blocks each stage holds, and a shallower
model's blocks are the first ones of a deeper model's stages, with the same shapes. A round of the InCo setting
trains ~2 clients of each. Two ways to run one local step of all of them in one program (Adam, batch
``--batch``, 28x28x1 inputs, ``--steps`` steps in a device loop, train-mode BatchNorm):

* ``groups``: what the round program does: every group's cohort vmapped on its own model, the five side by side;
* ``union``: the clients ordered deepest first, each in the deepest model's layout; the stem, every block and the
  head run once, vmapped over the clients that hold them (a prefix of that order), so a step launches the
  deepest model's kernels once instead of every group's. Blocks a client lacks get no gradient, so Adam leaves
  them as they are.

Both compute the same per-client losses and updates (checked: the summed training loss of the whole loop is the
same to float tolerance, or the benchmark fails); the question is only which runs faster on a platform. Prints
one JSON line per variant.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_hetero import models
from fedjax_hetero.client.local import LocalTrainer, masked_cross_entropy
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.data.store import normalize
from fedjax_hetero.models import resnet
from fedjax_hetero.models.common import convolution, scale_channels
from fedjax_hetero.models.resnet import BasicBlock, block_name
from benchmarks.common import emit_json_lines
from fedjax_hetero.rounds import cohort

DEPTHS = ("resnet26", "resnet22", "resnet18", "resnet14", "resnet10")  # deepest first
MEAN, STD = (0.28,), (0.35,)


def _inputs(clients: int, batch: int, steps: int):
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 255, (4096, 28, 28, 1), dtype=np.uint8))
  labels = jnp.asarray(rng.integers(0, 10, (4096,)), jnp.int32)
  ids = jnp.asarray(rng.integers(0, 4096, (clients, steps, batch)), jnp.int32)
  return images, labels, ids


def deepest_variables(width: float):
  deepest = models.build_model(DEPTHS[0], 10, width)
  return deepest, jax.jit(deepest.init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))


def groups_program(width: float, per_group: int, batch: int, steps: int):
  """Every group's cohort vmapped on its own model (`rounds.cohort`), the groups side by side in one loop; each
  group starts from its blocks of the deepest model's variables, as the union does."""
  trainers, starts = [], []
  _, variables = deepest_variables(width)
  for name in DEPTHS:
    model = models.build_model(name, 10, width)
    trainers.append(LocalTrainer(model, LocalConfig(batch_size=batch), MEAN, STD))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    starts.append({col: {k: variables[col][k] for k in tree} for col, tree in shapes.items()})
  images, labels, ids = _inputs(per_group * len(DEPTHS), batch, steps)
  mask = jnp.ones((per_group, steps, batch), bool)

  def run(starts, images, labels, ids):
    states = [jax.vmap(t.init_state, in_axes=(None,), axis_size=per_group)(s) for t, s in zip(trainers, starts)]
    own = [ids[g * per_group:(g + 1) * per_group] for g in range(len(DEPTHS))]
    loop = lambda i, states: [cohort.steps(t, s, images, labels, own[g], mask, i, 1)
                              for g, (t, s) in enumerate(zip(trainers, states))]
    states = jax.lax.fori_loop(0, steps, loop, states)
    return sum(s.loss_sum.sum() for s in states)

  return jax.jit(run), (starts, images, labels, ids)


def union_program(width: float, per_group: int, batch: int, steps: int):
  """Each block once per step, vmapped over the clients (deepest first) whose model holds it."""
  deepest, variables = deepest_variables(width)
  stage_sizes = [models.build_model(name, 10, width).stage_sizes for name in DEPTHS]
  clients = per_group * len(DEPTHS)
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (clients,) + x.shape), variables)
  images, labels, ids = _inputs(clients, batch, steps)
  tx = optax.adam(1e-3)
  mutable = dict(mutable=["batch_stats"])

  def forward(params, stats, x):
    """Logits of every client [C, B, classes] and the new batch statistics."""
    apply = lambda module, name, h, **kw: jax.vmap(lambda p, s, hh: module.apply(
        {"params": p[name] if name else p, "batch_stats": s[name] if name else s}, hh, train=True, **mutable, **kw))
    h, new = apply(deepest, None, None, stop="stem")(params, stats, x)
    stats = {**stats, **new["batch_stats"]}
    for stage, blocks in enumerate(deepest.stage_sizes):
      channels = scale_channels(deepest.base_channels * 2 ** stage, width)
      for b in range(blocks):
        holders = per_group * sum(sizes[stage] > b for sizes in stage_sizes)  # a prefix: deepest first
        name = block_name(stage, b, blocks)
        block = BasicBlock(channels, 2 if stage > 0 and b == 0 else 1)
        held = jax.tree.map(lambda t: t[:holders], (params, stats))
        out, new = apply(block, name, None)(*held, h[:holders])
        h = out if holders == clients else h.at[:holders].set(out)  # (every client holds a stage's first block)
        stats = {**stats, name: jax.tree.map(lambda s, n: s.at[:holders].set(n), stats[name], new["batch_stats"])}
    logits = jax.vmap(lambda p, hh: deepest.apply({"params": p}, hh, start=f"stage{len(deepest.stage_sizes)}"))(
        params, h)
    return logits, stats

  def run(stacked, images, labels, ids):
    params, stats = stacked["params"], stacked["batch_stats"]
    opt = jax.vmap(tx.init)(params)

    def step(i, carry):
      params, stats, opt, total = carry
      x = normalize(images[ids[:, i]], MEAN, STD)
      y = labels[ids[:, i]]

      def loss(params):
        logits, new_stats = forward(params, stats, x)
        mean, summed = jax.vmap(lambda lg, yy: masked_cross_entropy(lg, yy, jnp.ones(yy.shape)))(logits, y)
        return mean.sum(), (new_stats, summed.sum())

      (_, (stats, summed)), grads = jax.value_and_grad(loss, has_aux=True)(params)
      updates, opt = jax.vmap(tx.update)(grads, opt, params)
      return optax.apply_updates(params, updates), stats, opt, total + summed

    return jax.lax.fori_loop(0, steps, step, (params, stats, opt, jnp.zeros(())))[3]

  return jax.jit(run), (stacked, images, labels, ids)


def measure(variant: str, width: float, per_group: int, batch: int, steps: int) -> dict[str, Any]:
  build = groups_program if variant.startswith("groups") else union_program
  if variant.endswith("-patches"):  # every convolution as patches x kernel: a batched matmul under vmap
    from benchmarks.client_conv import patches_convolution
    resnet.convolution = patches_convolution
  try:
    run, args = build(width, per_group, batch, steps)
    return _timed(variant, run, args, width, per_group, batch, steps)
  finally:
    resnet.convolution = convolution


def _timed(variant, run, args, width, per_group, batch, steps) -> dict[str, Any]:
  t0 = time.perf_counter()
  compiled = run.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  first = float(jax.block_until_ready(compiled(*args)))
  seconds = []
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds.append(time.perf_counter() - t0)
  clients = per_group * len(DEPTHS)
  return {"variant": variant, "width": width, "clients": clients, "batch": batch, "steps": steps,
          "compile_s": round(compile_s, 2), "ms_per_step": round(1e3 * min(seconds) / steps, 3),
          "samples_per_s": round(clients * batch * steps / min(seconds)), "loss_sum": first,
          "platform": jax.default_backend()}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=float, default=0.25)
  p.add_argument("--clients-per-group", type=int, default=2)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--variants", default="groups,union",
                 help="comma-separated, out of groups, union, groups-patches, union-patches (-patches: every "
                      "convolution as a matrix product of patches, `benchmarks.client_conv`)")
  p.add_argument("--output", default=None)
  args = p.parse_args(argv)
  rows = []
  for variant in args.variants.split(","):
    rows.append(measure(variant, args.width, args.clients_per_group, args.batch, args.steps))
    emit_json_lines(rows[-1:])
    # (TF32 products on a GPU: the patches form's sums differ from a convolution's in the fourth digit)
    if not np.isclose(rows[0]["loss_sum"], rows[-1]["loss_sum"], rtol=3e-3):
      raise SystemExit(f"error: {variant}'s training loss {rows[-1]['loss_sum']} differs from {rows[0]['variant']}'s "
                       f"{rows[0]['loss_sum']}: not the same computation")
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
