"""A convolution's gradients in the form each platform runs fast: on an accelerator the clients' kernel
gradients as one grouped backward-filter convolution, on a CPU in the layout XLA:CPU runs fast inside a loop.

Clients train side by side as a `jax.vmap` of one client's training step, so a convolution's kernel gradient
is first derived for one client, then batched over the clients. For one client, jax's transpose writes it as
a convolution of the input with the output's cotangent, the batch acting as the channels summed over; batched
over C clients (each with its own kernel) that becomes a convolution with ``feature_group_count = C`` over a
[C * batch]-channel input. A GPU's cuDNN runs that form as C separate convolutions, each a poor fit for its
kernels: on an H200, the kernel gradients of the InCo union's stage-1 3x3 convolutions (7x7 maps) took 63 of a
round's 87 ms that way, the stem's 9 more (`benchmarks.device_profile`, peer @0.25).

Differentiating the already batched convolution instead (C clients' kernels as one grouped convolution) gives
jax's other form of the same sum, ``batch_group_count = C``, which XLA hands to cuDNN as one grouped
backward-filter convolution. `client_convolution` computes its kernel gradient that way under `jax.vmap`
(`jax.custom_batching.custom_vmap`), and as jax does otherwise. The input's gradient and the forward pass are
jax's own.

XLA:CPU runs the ``batch_group_count`` form slower than the other (1.2-1.4x a layer's pass at the InCo @0.25
shapes, `python -m benchmarks.client_conv --widths 0.25`), so a CPU takes `canonical_convolution` instead: jax's
gradients with their operands laid out as XLA:CPU's fast convolution reads them. XLA:CPU lays them out so itself
outside a loop, but not in a while loop's body (a device program's local steps), where the kernel gradient then
ran 17x slower and the input's 2.7x (`KERNEL_GRADIENT_BY_BATCH_GROUPS` says where each form is used). The
environment variable ``FEDJAX_HETERO_KERNEL_GRADIENT`` (``batch_groups``, ``canonical`` or ``jax``; default
``auto``) chooses one form on every platform, to compare them on one machine.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array
# Platforms whose clients' kernel gradients are computed as one grouped backward-filter convolution.
KERNEL_GRADIENT_BY_BATCH_GROUPS = ("gpu", "cuda", "rocm", "tpu")
KERNEL_GRADIENT_VARIABLE = "FEDJAX_HETERO_KERNEL_GRADIENT"
KERNEL_GRADIENT_FORMS = ("batch_groups", "canonical", "jax")
NHWC = ("NHWC", "HWIO", "NHWC")  # images, kernels, outputs


def kernel_gradient_form() -> str:
  """The kernel gradient's form `models.common.lax_convolution` uses: ``batch_groups`` (`client_convolution`) on
  an accelerator, ``canonical`` (`canonical_convolution`) elsewhere, unless ``FEDJAX_HETERO_KERNEL_GRADIENT``
  says (read while a program is traced)."""
  choice = os.environ.get(KERNEL_GRADIENT_VARIABLE, "auto")
  if choice not in ("auto",) + KERNEL_GRADIENT_FORMS:
    raise ValueError(f"{KERNEL_GRADIENT_VARIABLE}={choice!r}: use auto, {', '.join(KERNEL_GRADIENT_FORMS)}")
  if choice == "auto":
    return "batch_groups" if jax.default_backend() in KERNEL_GRADIENT_BY_BATCH_GROUPS else "canonical"
  return choice


def _conv(lhs: Array, rhs: Array, params: tuple) -> Array:
  strides, padding, lhs_dilation, rhs_dilation, dimension_numbers, precision = params
  return jax.lax.conv_general_dilated(lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                                      precision=precision)


def _kernel_gradient(params: tuple, kernel_shape: tuple[int, ...]) -> Callable[[Array, Array], Array]:
  """(input, output cotangent) -> the kernel's cotangent; under `jax.vmap`, the batched convolution's."""

  @jax.custom_batching.custom_vmap
  def gradient(lhs: Array, cotangent: Array) -> Array:
    kernel = jax.ShapeDtypeStruct(kernel_shape, cotangent.dtype)
    return jax.linear_transpose(lambda kernel: _conv(lhs, kernel, params), kernel)(cotangent)[0]

  @gradient.def_vmap
  def batched(size: int, in_batched: tuple[bool, bool], lhs: Array, cotangent: Array) -> tuple[Array, bool]:
    lhs, cotangent = (x if b else jnp.broadcast_to(x, (size,) + x.shape)
                      for x, b in zip((lhs, cotangent), in_batched))
    kernels = jax.ShapeDtypeStruct((size,) + kernel_shape, cotangent.dtype)
    each = jax.vmap(lambda x, kernel: _conv(x, kernel, params))
    return jax.linear_transpose(lambda kernels: each(lhs, kernels), kernels)(cotangent)[0], True

  return gradient


Backward = Callable[[tuple, tuple[Array, Array], Array], tuple[Array, Array]]


def _with_gradients(backward: Backward) -> Callable[[Array, Array, tuple], Array]:
  """`_conv` (its static ``params`` last) whose gradients ``backward(params, (lhs, rhs), cotangent)`` computes."""
  convolution = jax.custom_vjp(_conv, nondiff_argnums=(2,))
  convolution.defvjp(lambda lhs, rhs, params: (_conv(lhs, rhs, params), (lhs, rhs)), backward)
  return convolution


def _client_backward(params: tuple, residuals: tuple[Array, Array], cotangent: Array) -> tuple[Array, Array]:
  lhs, rhs = residuals
  input_gradient = jax.linear_transpose(lambda x: _conv(x, rhs, params), lhs)(cotangent)[0]
  return input_gradient, _kernel_gradient(params, rhs.shape)(lhs, cotangent)


_client_convolution = _with_gradients(_client_backward)


def client_convolution(lhs: Array, rhs: Array, window_strides: Any, padding: Any, lhs_dilation: Any = None,
                       rhs_dilation: Any = None, dimension_numbers: Any = None, precision: Any = None) -> Array:
  """``lax.conv_general_dilated`` (one group, no preferred element type), its kernel gradient batched as the
  module docstring says."""
  params = (_hashable(window_strides), _hashable(padding), _hashable(lhs_dilation), _hashable(rhs_dilation),
            _hashable(dimension_numbers), _hashable(precision))
  return _client_convolution(lhs, rhs, params)


def _hashable(value: Any) -> Any:
  """``value`` with its lists as tuples (the static arguments of a ``custom_vjp`` are hashed)."""
  return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def canonical_convolution(lhs: Array, rhs: Array, window_strides: Any, padding: Any,
                          precision: Any = None) -> Array:
  """``lax.conv_general_dilated`` over NHWC maps and HWIO kernels (no dilation, one group), its kernel gradient
  computed with the input's channels as the batch and its batch as the channels:

      dK[i, j, c, o] = sum_{b, p, q} x_pad[b, p*s + i, q*s + j, c] * dy[b, p, q, o],

  a convolution of ``x`` transposed to [C, H, W, B] by ``dy`` transposed to [P, Q, B, O] as the kernel, dilated by
  the strides. The same sum as jax's (to the bit where XLA lays out jax's form so itself), in the layout XLA:CPU
  runs fast inside a loop too; so is the input's gradient (``dy`` dilated by the strides, convolved with the
  kernel flipped and its channels swapped, as jax writes it)."""
  size, window = lhs.shape[1:3], rhs.shape[:2]
  pads = jax.lax.padtype_to_pads(size, window, window_strides, padding) if isinstance(padding, str) else padding
  if any(n + low + high < k for n, (low, high), k in zip(size, pads, window)):  # an empty output: jax's own
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, pads, dimension_numbers=NHWC, precision=precision)
  return _canonical_convolution(lhs, rhs, (_hashable(window_strides), tuple(map(tuple, pads)), None, None, NHWC,
                                           _hashable(precision)))


def _canonical_backward(params: tuple, residuals: tuple[Array, Array], cotangent: Array) -> tuple[Array, Array]:
  lhs, rhs = residuals
  strides, pads, _, _, _, precision = params
  extents = list(zip(rhs.shape[:2], cotangent.shape[1:3], strides, lhs.shape[1:3], pads))
  # dx: dy dilated by the strides, convolved with the kernel flipped and its channels swapped (jax's padding).
  before = [k - 1 - low for k, _, _, _, (low, _) in extents]
  after = [n + k - 1 - ((out - 1) * s + 1) - b for (k, out, s, n, _), b in zip(extents, before)]
  input_gradient = jax.lax.conv_general_dilated(
      cotangent, jnp.transpose(rhs[::-1, ::-1], (0, 1, 3, 2)), (1, 1), list(zip(before, after)),
      lhs_dilation=strides, dimension_numbers=NHWC, precision=precision)
  # dK: the high padding makes the output exactly the kernel's window (rows the strides never reach dropped).
  high = [k + (out - 1) * s - n - low for k, out, s, n, (low, _) in extents]
  kernel_gradient = jax.lax.conv_general_dilated(
      jnp.transpose(lhs, (3, 1, 2, 0)), jnp.transpose(cotangent, (1, 2, 0, 3)), (1, 1),
      [(low, h) for (_, _, _, _, (low, _)), h in zip(extents, high)], rhs_dilation=strides,
      dimension_numbers=NHWC, precision=precision)
  return input_gradient, jnp.transpose(kernel_gradient, (1, 2, 0, 3))


_canonical_convolution = _with_gradients(_canonical_backward)
