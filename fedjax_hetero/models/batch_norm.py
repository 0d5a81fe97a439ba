"""Training-mode BatchNorm as two reductions forward and two backward, for programs where XLA's kernel count matters.

``flax.linen.BatchNorm`` differentiated by JAX makes a dozen or more distinct fused kernels per input shape (masked
means, the variance, the normalization, and their transposes, each fused with its neighbours in its own way); XLA
compiles every distinct kernel once, so they are a large share of a ResNet step's compile (docs/performance.md,
"What a compile costs"). `batch_norm` computes the same forward pass (flax's "fast variance") with its gradient
written out (Ioffe & Szegedy 2015, Sec. 3, the backward pass): per feature, with ``m`` the per-example mask,
``n = sum(m)`` times the positions, ``xhat = (x - mean) * inv`` and ``inv = (var + eps)^(-1/2)``,

    mean = sum(m x) / n,   var = max(sum(m x^2) / n - mean^2, 0),   y = scale * xhat + bias,
    dbias = sum(dy),   dscale = sum(dy xhat),   dx = scale * inv * (dy - m (dbias + xhat dscale) / n).

`fused_batch_norm` routes every ``nn.BatchNorm`` called in training mode inside it to `batch_norm` (found by
module type, as `common.module_leaves` finds them), with the module's own variables and running averages; a call
it cannot serve exactly (another axis, a cross-device axis, no scale or bias, another dtype, a mask that is not
per example) runs flax's. Its gradients equal flax's up to the order of float sums. Every local training step traces
its model inside it (`client.local.LocalTrainer.train_step`), so every program (the host loop's, the per-group and
the union round programs) trains with it, and the static costs count its FLOPs (`rounds.costs`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def batch_norm(x: Array, mask: Array, scale: Array, bias: Array, epsilon: float) -> tuple[Array, Array, Array]:
  """``(y, mean, var)`` of training-mode BatchNorm over every axis of ``x`` but the last, the statistics over the
  examples where ``mask`` ([B, 1, ...], float) is 1 (see the module docstring). Differentiable in ``x``, ``scale``
  and ``bias`` through ``y`` only (reverse mode: it is a ``custom_vjp``): the statistics feed the running averages,
  which take no gradient. Where every example is masked the statistics are zeros (flax's are NaN)."""
  return _forward(x, mask, scale, bias, epsilon)[0]


# Jitted so that a ResNet's many BatchNorms of one shape are traced once (a program's tracing is Python: each
# jnp operation costs it about as much as a convolution; inlined by XLA, the program is the same).
@functools.partial(jax.jit, static_argnums=4)
def _forward(x, mask, scale, bias, epsilon):
  axes = tuple(range(x.ndim - 1))
  # At least 1: a slot with no examples (padding) gets finite numbers, which its discarded step then drops.
  n = jnp.maximum(jnp.sum(mask) * (x.size // (x.shape[0] * x.shape[-1])), 1.0)
  mean = jnp.sum(x * mask, axes) / n
  var = jnp.maximum(jnp.sum(x * x * mask, axes) / n - mean * mean, 0.0)
  inv = jax.lax.rsqrt(var + epsilon)
  a = scale * inv
  return (x * a + (bias - mean * a), mean, var), (x, mask, mean, inv, scale, n)


@functools.partial(jax.jit, static_argnums=0)
def _backward(epsilon, residuals, cotangents):
  x, mask, mean, inv, scale, n = residuals
  dy, axes = cotangents[0], tuple(range(x.ndim - 1))
  xhat = (x - mean) * inv
  dbias, dscale = jnp.sum(dy, axes), jnp.sum(dy * xhat, axes)
  dx = (scale * inv) * (dy - mask * (dbias + xhat * dscale) / n)
  return dx, jnp.zeros_like(mask), dscale, dbias


batch_norm.defvjp(_forward, _backward)


def _served(module: nn.BatchNorm, x: Array, mask: Array | None) -> bool:
  """Whether `batch_norm` computes exactly what ``module`` computes on ``x`` in training mode."""
  float32 = all(d in (None, jnp.float32) for d in (module.dtype, module.param_dtype)) and x.dtype == jnp.float32
  per_example = mask is None or (jnp.ndim(mask) == x.ndim and jnp.shape(mask)[0] in (1, x.shape[0])
                                 and all(d == 1 for d in jnp.shape(mask)[1:]))
  return (float32 and per_example and module.axis in (-1, x.ndim - 1) and x.ndim >= 2
          and module.axis_name is None and module.use_scale and module.use_bias and module.use_fast_variance)


def _route(next_fun, args, kwargs, context):
  module = context.module
  if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__" or module.is_initializing():
    return next_fun(*args, **kwargs)
  x, mask = args[0], kwargs.get("mask")
  running = nn.module.merge_param("use_running_average", module.use_running_average,
                                  kwargs.get("use_running_average", args[1] if len(args) > 1 else None))
  if running or not _served(module, x, mask):
    return next_fun(*args, **kwargs)
  y, mean, var = batch_norm(x, _example_mask(x, mask), module.get_variable("params", "scale"),
                            module.get_variable("params", "bias"), module.epsilon)
  for name, value in (("mean", mean), ("var", var)):
    module.put_variable("batch_stats", name,
                        _moving_average(module.get_variable("batch_stats", name), value, module.momentum))
  return y


@jax.jit
def _example_mask(x: Array, mask: Array | None) -> Array:
  """``mask`` as ``[B, 1, ...]`` floats of ``x``'s dtype, every example where None (any nonzero entry keeps its
  example, as flax's ``where=`` reads it)."""
  shape = (x.shape[0],) + (1,) * (x.ndim - 1)
  return jnp.ones(shape, x.dtype) if mask is None else jnp.broadcast_to(mask, shape).astype(bool).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=2)
def _moving_average(old: Array, new: Array, momentum: float) -> Array:
  return momentum * old + (1 - momentum) * new


@contextlib.contextmanager
def fused_batch_norm() -> Iterator[None]:
  """Inside: every ``nn.BatchNorm`` that `batch_norm` serves runs as `batch_norm` in training mode (at trace time:
  wrap the tracing of the function whose forward passes should use it)."""
  with nn.intercept_methods(_route):
    yield
