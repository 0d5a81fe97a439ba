"""Convolutions with a kernel per client: the forms of one layer's forward and backward pass, by shape.

    python -m benchmarks.client_conv --clients 10 --widths 0.25,1

C clients, each with its own 3x3 kernel and its own batch of B maps, one layer of the InCo ResNets on 28x28
inputs (stage 1 at 7x7 ... stage 4 at 1x1, channels 64, 128, 256, 512 times the width). Each form runs
``--steps`` forward + backward passes (gradients of the input and the kernels) in one device loop:

* ``grouped``: the gradient of ``vmap`` of the convolution over clients, which XLA turns into one grouped
  convolution (``feature_group_count = C``), its kernel gradient one with ``batch_group_count = C``;
* ``client_gradients``: ``vmap`` over clients of each client's gradient, as a vmapped client step computes it
  with jax's own convolution: the kernel gradient becomes a convolution with ``feature_group_count = C`` over
  the clients' batches, which cuDNN runs as C convolutions;
* ``client_gradients_batch_groups``: the same through `models.client_conv.client_convolution`, whose kernel
  gradient under ``vmap`` is ``grouped``'s (what the library runs on an accelerator);
* ``client_gradients_canonical``: the same through `models.client_conv.canonical_convolution`, its gradients in
  the layout XLA:CPU runs fast inside a loop (what the library runs on a CPU);
* ``sequential``, ``sequential_canonical``: each client's gradient, one client after another (``lax.map``, the
  ``sequential`` backend in a device program), with jax's gradient or the canonical one;
* ``patches``: the maps' 3x3 patches (``lax.conv_general_dilated_patches``) times each client's kernel
  reshaped to (9 * in, out), one batched matrix product over clients;
* ``batch``, ``batch_canonical``: the limit, not per-client: one kernel over all C x B maps (one plain
  convolution), with jax's gradient or the canonical one.

Prints one JSON line per (width, stage, form): milliseconds per forward + backward and the form's time
over ``batch``'s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from benchmarks.common import emit_json_lines
from fedjax_hetero.models.client_conv import NHWC as _NHWC, canonical_convolution, client_convolution

FORMS = ("grouped", "client_gradients", "client_gradients_batch_groups", "client_gradients_canonical", "sequential",
         "sequential_canonical", "patches", "batch", "batch_canonical")
STAGES = ((7, 64), (4, 128), (2, 256), (1, 512))  # (map side, channels at width 1) after the ImageNet stem


def conv(x, kernel):
  return jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=_NHWC)


def patches_convolution(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                        dimension_numbers=None, feature_group_count=1, precision=None,
                        preferred_element_type=None):
  """An NHWC/HWIO ``lax.conv_general_dilated`` as one matrix product: the input's patches (in-major,
  ``lax.conv_general_dilated_patches``) times the kernel reshaped to (in * kh * kw, out). Under ``vmap``
  with a kernel per client it is a batched matrix product instead of a grouped convolution."""
  del lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count, preferred_element_type  # unused here
  patches = jax.lax.conv_general_dilated_patches(lhs, rhs.shape[:2], window_strides, padding,
                                                 dimension_numbers=_NHWC, precision=precision)
  kernel = jnp.transpose(rhs, (2, 0, 1, 3)).reshape(-1, rhs.shape[-1])  # (in, kh, kw, out) -> (in*kh*kw, out)
  return jax.lax.dot_general(patches, kernel, (((3,), (0,)), ((), ())), precision=precision)


def client_conv(x, kernel):
  return client_convolution(x, kernel, (1, 1), ((1, 1), (1, 1)), dimension_numbers=_NHWC)


def canonical_conv(x, kernel):
  return canonical_convolution(x, kernel, (1, 1), ((1, 1), (1, 1)))


def patches_conv(x, kernel):
  return patches_convolution(x, kernel, (1, 1), ((1, 1), (1, 1)))


def layer(form: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A layer over client-stacked maps [C, B, H, W, in] and kernels [C, 3, 3, in, out] (``batch``: one kernel)."""
  if form == "grouped":
    return jax.vmap(conv)
  if form == "patches":
    return jax.vmap(patches_conv)
  one = canonical_conv if form.endswith("canonical") else conv
  return lambda x, k: one(x.reshape((-1,) + x.shape[2:]), k[0]).reshape(x.shape[:-1] + k.shape[-1:])


def loss(apply: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[[jax.Array, jax.Array], jax.Array]:
  return lambda x, k: jnp.sum(jnp.tanh(apply(x, k)))


def gradients(form: str) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """(maps, kernels) -> their gradients: of the whole layer's loss, or (``client_gradients*``, ``sequential*``)
  each client's gradient of its own layer, vmapped over the clients or one after another."""
  one = client_conv if form.endswith("batch_groups") else canonical_conv if form.endswith("canonical") else conv
  if form.startswith("client_gradients"):
    return jax.vmap(jax.grad(loss(one), argnums=(0, 1)))
  if form.startswith("sequential"):
    return lambda x, k: jax.lax.map(lambda xk: jax.grad(loss(one), argnums=(0, 1))(*xk), (x, k))
  return jax.grad(loss(layer(form)), argnums=(0, 1))


def program(form: str, steps: int):
  gradient = gradients(form)

  def run(x, kernels):
    def step(_, carry):
      x, kernels = carry
      gx, gk = gradient(x, kernels)
      return x - 1e-3 * gx, kernels - 1e-3 * gk
    return jax.lax.fori_loop(0, steps, step, (x, kernels))

  return jax.jit(run)


def measure(form: str, clients: int, batch: int, side: int, channels: int, steps: int) -> dict[str, Any]:
  kx, kk = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (clients, batch, side, side, channels))
  kernels = 0.05 * jax.random.normal(kk, (clients, 3, 3, channels, channels))
  run = program(form, steps)
  t0 = time.perf_counter()
  compiled = run.lower(x, kernels).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(x, kernels))
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(x, kernels))
    best = min(best, time.perf_counter() - t0)
  return {"form": form, "clients": clients, "batch": batch, "side": side, "channels": channels,
          "compile_s": round(compile_s, 2), "ms_per_pass": round(1e3 * best / steps, 4),
          "platform": jax.default_backend()}


def check_forms_agree() -> None:
  """The forms compute the same layer (``batch`` with every client holding the first kernel), in float32
  products (a GPU's default TF32 ones differ in the fourth digit)."""
  with jax.default_matmul_precision("float32"):
    _check_forms_agree()


def _check_forms_agree() -> None:
  x = jax.random.normal(jax.random.key(1), (3, 2, 5, 5, 4))
  k = jax.random.normal(jax.random.key(2), (3, 3, 3, 4, 6))
  grouped, patches = layer("grouped")(x, k), layer("patches")(x, k)
  if not jnp.allclose(grouped, patches, rtol=1e-4, atol=1e-4):
    raise SystemExit("error: the patches form differs from the grouped convolution")
  strided = jax.lax.conv_general_dilated(x[0], k[0, :2], (2, 2), ((0, 1), (1, 0)), dimension_numbers=_NHWC)
  if not jnp.allclose(strided, patches_convolution(x[0], k[0, :2], (2, 2), ((0, 1), (1, 0))), rtol=1e-4,
                      atol=1e-4):
    raise SystemExit("error: the patches form of a strided, unevenly padded convolution differs")
  same = jnp.broadcast_to(k[:1], k.shape)
  for form in ("batch", "batch_canonical"):
    if not jnp.allclose(layer(form)(x, same), layer("grouped")(x, same), rtol=1e-4, atol=1e-4):
      raise SystemExit(f"error: the {form} form differs from the grouped convolution")
  whole = gradients("grouped")(x, k)
  for form in ("client_gradients", "client_gradients_batch_groups", "client_gradients_canonical", "sequential",
               "sequential_canonical"):
    if not all(jnp.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(whole, gradients(form)(x, k))):
      raise SystemExit(f"error: the {form} form's gradients differ from the grouped form's")


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--clients", type=int, default=10)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--widths", default="0.25", help="comma-separated channel multipliers (the papers': 1)")
  p.add_argument("--steps", type=int, default=10, help="forward + backward passes in the device loop")
  p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)} (batch is "
                 "always measured: the rows' unit)")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  args = p.parse_args(argv)
  forms = [f for f in FORMS if f in args.forms.split(",") or f == "batch"]
  if set(args.forms.split(",")) - set(FORMS):
    p.error(f"--forms takes {', '.join(FORMS)}; got {args.forms!r}")
  check_forms_agree()
  rows = []
  for width in (float(w) for w in args.widths.split(",")):
    for side, base in STAGES:
      channels = max(1, int(base * width))
      measured = {f: measure(f, args.clients, args.batch, side, channels, args.steps) for f in forms}
      for row in measured.values():
        row = {**row, "width": width, "over_batch": round(row["ms_per_pass"] / measured["batch"]["ms_per_pass"], 2)}
        rows.append(row)
        emit_json_lines([row])
  emit_json_lines(rows, args.output, echo=False)
  return rows


if __name__ == "__main__":
  main()
