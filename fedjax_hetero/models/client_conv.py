"""A convolution whose kernel gradient, vmapped over clients, is one grouped backward-filter convolution.

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
shapes, `python -m benchmarks.client_conv --widths 0.25`), so on a CPU `models.common.lax_convolution` keeps
jax's own gradient (`KERNEL_GRADIENT_BY_BATCH_GROUPS` says where this one is used). The environment variable
``FEDJAX_HETERO_KERNEL_GRADIENT`` (``batch_groups`` or ``jax``; default ``auto``) chooses one form on every
platform, to compare them on one machine.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array
# Platforms whose clients' kernel gradients are computed as one grouped backward-filter convolution.
KERNEL_GRADIENT_BY_BATCH_GROUPS = ("gpu", "cuda", "rocm", "tpu")
KERNEL_GRADIENT_VARIABLE = "FEDJAX_HETERO_KERNEL_GRADIENT"


def by_batch_groups() -> bool:
  """Whether `models.common.lax_convolution` uses `client_convolution`: on the default backend, unless
  ``FEDJAX_HETERO_KERNEL_GRADIENT`` says (read while a program is traced)."""
  choice = os.environ.get(KERNEL_GRADIENT_VARIABLE, "auto")
  if choice not in ("auto", "batch_groups", "jax"):
    raise ValueError(f"{KERNEL_GRADIENT_VARIABLE}={choice!r}: use auto, batch_groups or jax")
  return jax.default_backend() in KERNEL_GRADIENT_BY_BATCH_GROUPS if choice == "auto" else choice == "batch_groups"


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _client_convolution(lhs: Array, rhs: Array, params: tuple) -> Array:
  return _conv(lhs, rhs, params)


def _forward(lhs: Array, rhs: Array, params: tuple) -> tuple[Array, tuple[Array, Array]]:
  return _conv(lhs, rhs, params), (lhs, rhs)


def _backward(params: tuple, residuals: tuple[Array, Array], cotangent: Array) -> tuple[Array, Array]:
  lhs, rhs = residuals
  input_gradient = jax.linear_transpose(lambda x: _conv(x, rhs, params), lhs)(cotangent)[0]
  return input_gradient, _kernel_gradient(params, rhs.shape)(lhs, cotangent)


_client_convolution.defvjp(_forward, _backward)


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
