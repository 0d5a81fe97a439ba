"""Where a ResNet training step's time goes, layer by layer, in XLA:CPU and in PyTorch.

    python -m benchmarks.layer_profile [--model resnet18] [--width 0.25] [--batch 64] [--repeats 30]

For every convolution of the model (found by intercepting the Flax model's `nn.Conv` calls on a batch of
28x28x1 inputs), times its forward and backward pass alone: in jax (one jitted program, NHWC), both as
XLA's convolution (`lax.conv_general_dilated`, `xla_conv_ms`) and as the model runs it
(`models.common.convolution`, `jax_ms`: one matrix product on tiny maps), and in PyTorch (`F.conv2d` and
`backward`, NCHW, oneDNN), back to back per layer so that the shared machine's speed changes hit both sides
alike. Then times one whole Adam
training step of the same model in both (ours: `LocalTrainer.run_steps`, theirs: the peer benchmark's
torch ResNet). The step time minus the convolutions' sum is what the rest costs (BatchNorm, ReLU,
pooling, the optimizer, dispatch). Prints one JSON line per layer and a summary line.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit_json_lines
from benchmarks.torch_resnet import TORCH_RESNETS, torch_resnet_class
from benchmarks.step_modes import step_inputs
from fedjax_hetero.models import build_model
from fedjax_hetero.models.common import convolution

STEPS = 16  # steps per timed call of the whole-step programs


def convolutions(model: nn.Module, batch: int) -> list[dict[str, Any]]:
  """Every `nn.Conv` call of ``model`` on a (batch, 28, 28, 1) input: its input shape and settings."""
  layers = []

  def record(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, nn.Conv) and context.method_name == "__call__":
      layers.append({"name": "/".join(module.scope.path), "input": tuple(args[0].shape),
                     "features": module.features, "kernel": tuple(module.kernel_size),
                     "strides": _pair(module.strides or 1), "padding": module.padding})
    return next_fun(*args, **kwargs)

  x = jnp.zeros((batch, 28, 28, 1))
  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init_with_output(jax.random.key(0), x, train=True, mutable=True))
  return layers


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
  return (value, value) if isinstance(value, int) else tuple(value)


def _padding(layer: dict[str, Any]) -> list[tuple[int, int]]:
  pad = layer["padding"]
  if pad == "VALID":
    return [(0, 0), (0, 0)]
  return [tuple(p) for p in pad]


def median_ms(call: Callable[[], Any], sync: Callable[[Any], Any], repeats: int) -> float:
  sync(call())  # warm-up: kernel set-up happens on the first call
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    sync(call())
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def jax_conv_ms(layer: dict[str, Any], first: bool, repeats: int, conv_fn: Callable = jax.lax.conv_general_dilated
                ) -> float:
  """Forward + backward of one convolution in jax; the input's gradient is skipped for the first layer."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(layer["input"]), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal(layer["kernel"] + (layer["input"][-1], layer["features"])), jnp.float32)
  conv = lambda x, k: conv_fn(x, k, layer["strides"], _padding(layer), dimension_numbers=("NHWC", "HWIO", "NHWC"))

  @jax.jit
  def forward_backward(x, k):
    if first:
      y, pull = jax.vjp(lambda k: conv(x, k), k)
    else:
      y, pull = jax.vjp(conv, x, k)
    return pull(jnp.ones_like(y))

  return median_ms(lambda: forward_backward(x, kernel), jax.block_until_ready, repeats)


def torch_conv_ms(layer: dict[str, Any], first: bool, repeats: int) -> float:
  import torch
  import torch.nn.functional as F
  n, h, w, c = layer["input"]
  x = torch.randn(n, c, h, w, requires_grad=not first)
  kernel = torch.randn(layer["features"], c, *layer["kernel"], requires_grad=True)
  (pt, pb), (pl, pr) = _padding(layer)
  if pt != pb or pl != pr:
    raise ValueError(f"{layer['name']}: asymmetric padding has no F.conv2d equivalent")

  def forward_backward():
    x.grad = kernel.grad = None
    y = F.conv2d(x, kernel, stride=layer["strides"], padding=(pt, pl))
    y.backward(torch.ones_like(y))
    return kernel.grad

  return median_ms(forward_backward, lambda _: None, repeats)


def jax_step_ms(name: str, width: float, batch: int, repeats: int) -> float:
  trainer, variables, images, labels, ids, mask = step_inputs(name, width, batch, STEPS)
  state = jax.jit(trainer.init_state)(variables)
  run = jax.jit(trainer.run_steps, static_argnums=6)

  def steps():
    s = state
    for offset in range(STEPS):
      s = run(s, images, labels, ids, mask, np.int32(offset), 1)
    return s

  return median_ms(steps, jax.block_until_ready, max(3, repeats // 10)) / STEPS


def torch_step_ms(name: str, width: float, batch: int, repeats: int) -> float:
  import torch
  import torch.nn.functional as F
  torch.manual_seed(0)
  model = torch_resnet_class()(TORCH_RESNETS[name], 10, width, 1)
  model.train()
  opt = torch.optim.Adam(model.parameters(), lr=1e-3)
  images = torch.rand(4096, 1, 28, 28)
  labels = torch.randint(0, 10, (4096,))
  rng = np.random.default_rng(0)
  ids = [torch.from_numpy(rng.integers(0, 4096, batch)) for _ in range(STEPS)]

  def steps():
    for batch_ids in ids:
      loss = F.cross_entropy(model(images[batch_ids]), labels[batch_ids])
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()

  return median_ms(steps, lambda _: None, max(3, repeats // 10)) / STEPS


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet18", choices=sorted(TORCH_RESNETS))
  parser.add_argument("--width", type=float, default=0.25)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=30, help="timed calls per layer (median reported)")
  parser.add_argument("--output", help="also write the JSON lines here")
  args = parser.parse_args(argv)
  try:
    import torch
  except ImportError:
    raise SystemExit("error: the layer profile needs PyTorch: pip install -e '.[peer]'") from None

  rows = []
  for i, layer in enumerate(convolutions(build_model(args.model, 10, width=args.width), args.batch)):
    xla = jax_conv_ms(layer, i == 0, args.repeats)
    ours = jax_conv_ms(layer, i == 0, args.repeats, convolution)
    theirs = torch_conv_ms(layer, i == 0, args.repeats)
    n, h, w, c = layer["input"]
    rows.append({"layer": layer["name"], "input_nhwc": [n, h, w, c], "out_channels": layer["features"],
                 "kernel": list(layer["kernel"]), "strides": list(layer["strides"]), "xla_conv_ms": round(xla, 3),
                 "jax_ms": round(ours, 3), "torch_ms": round(theirs, 3), "torch_over_jax": round(theirs / ours, 2)})
    emit_json_lines(rows[-1:])
  step_jax = jax_step_ms(args.model, args.width, args.batch, args.repeats)
  step_torch = torch_step_ms(args.model, args.width, args.batch, args.repeats)
  conv_jax = sum(r["jax_ms"] for r in rows)
  conv_torch = sum(r["torch_ms"] for r in rows)
  rows.append({"summary": f"{args.model}@{args.width}, batch {args.batch}", "convolutions": len(rows),
               "conv_fwd_bwd_ms": {"xla_conv": round(sum(r["xla_conv_ms"] for r in rows), 2), "jax": round(conv_jax, 2),
                                   "torch": round(conv_torch, 2)},
               "step_ms": {"jax": round(step_jax, 2), "torch": round(step_torch, 2)},
               "rest_of_step_ms": {"jax": round(step_jax - conv_jax, 2), "torch": round(step_torch - conv_torch, 2)},
               "step_ratio_torch_over_jax": round(step_torch / step_jax, 2),
               "torch": torch.__version__, "jax": jax.__version__, "torch_threads": torch.get_num_threads()})
  emit_json_lines(rows[-1:])
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
