"""Pieces shared by the model zoo: width scaling, BN masks and cut-point runs.

Every model is a sequence of named *parts*; the output of a part is the
activation at the cut point of the same name. `run_parts` executes the parts
strictly after `start` up to and including `stop`, which is what lets callers
split a model anywhere (e.g. features -> logits for a classifier-only update).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from fedjax_hetero.models import client_conv

Array = jax.Array
Part = tuple[str, Callable[[Array], Array]]
Path = tuple[str, ...]


class StagedCuts:
  """The cut points of a network of ``stage_sizes`` stages after a stem: input, stem, stage1..stageN, features,
  logits; FedImpro's default split after stage 2 (for ResNet-18 the paper's "9-th layer"); FedIN's split."""

  @property
  def cut_points(self) -> tuple[str, ...]:
    stages = tuple(f"stage{i + 1}" for i in range(len(self.stage_sizes)))
    return ("input", "stem") + stages + ("features", "logits")

  @property
  def decoupling_cut(self) -> str:
    """FedImpro's default low/high split (`resolve_cut`): after stage 2."""
    return "stage2"

  @property
  def intermediate_split(self) -> tuple[str, str]:
    """FedIN's split: the extractor ends at the stem, the intermediate layers at the last stage; the
    classifier is pooling and the head (as the InCo authors' code splits it)."""
    return "stem", f"stage{len(self.stage_sizes)}"


def scale_channels(channels: int, width: float) -> int:
  """Hidden channel count under a width multiplier (never below 1)."""
  return max(1, int(round(channels * width)))


def scaler(x: Array, rate: float | None, train: bool) -> Array:
  """HeteroFL's Scaler (Diao et al., ICLR 2021, Sec. 3): a hidden layer's output divided by the model's
  width rate in training (its width over the global model's, as the authors' code computes it), the identity at
  evaluation and when ``rate`` is None (the Scaler off)."""
  return x / rate if rate is not None and train else x


def without_scaler(model: nn.Module) -> nn.Module:
  """``model`` with its Scaler off (`scaler`): a training pass that estimates BatchNorm statistics for evaluation
  must see the activations the evaluation sees, and the Scaler acts in training only."""
  if "scaler" in {f.name for f in dataclasses.fields(model)}:
    return model.clone(scaler=False)
  return model


class StepSize(nn.Module):
  """A learnable scalar step size ``s`` (its param ``scale``, initialized to 1) multiplying its input: NeFL's
  residual update x_{j+1} = x_j + s_j F_j(x_j), forward propagation read as an ODE solver (Kang et al.,
  arXiv 2308.07761)."""

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return x * self.param("scale", nn.initializers.ones, ()).astype(x.dtype)


def variable_shapes(model: nn.Module, input_shape: Sequence[int]) -> Any:
  """The shapes (`jax.ShapeDtypeStruct`) of ``model``'s variables for images of ``input_shape`` (one example's).
  Traced once per model and shape (`_shapes`): the checks, the builders and the probes of a run all ask for them,
  and a trace of a deep model takes a good part of a second. Returns a fresh tree (its dicts are the caller's)."""
  return jax.tree.map(lambda leaf: leaf, _shapes(model, tuple(input_shape))[1])


def output_shape(model: nn.Module, input_shape: Sequence[int]) -> Any:
  """The shape of ``model``'s inference output (its logits) for one example of ``input_shape``: the same trace."""
  return _shapes(model, tuple(input_shape))[0]


def _shapes(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[Any, Any]:
  try:
    hash(model)
  except TypeError:  # a model with an unhashable field: traced every time
    return _trace_shapes(model, input_shape)
  return _cached_shapes(model, input_shape)


def _trace_shapes(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[Any, Any]:
  """(output, variables): ``model.init`` runs the inference forward pass (``train`` is False by default). Its key
  and input are made inside the trace: made outside, on the device, each would compile a program."""
  return jax.eval_shape(lambda: model.init_with_output(jax.random.key(0), jnp.zeros((1, *input_shape), jnp.float32)))


_cached_shapes = functools.lru_cache(maxsize=64)(_trace_shapes)


def module_leaves(model: nn.Module, sample_input: Array, kinds: tuple[type, ...]) -> frozenset[Path]:
  """The variable leaves (``(collection, *module path, name)``, every collection) that the submodules of the
  given types own directly, e.g. every BatchNorm's scale, bias, mean and var. Found by tracing a training
  forward pass and recording the path of every module of those types it calls, so no name is matched."""
  paths: set[Path] = set()

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, kinds):
      paths.add(tuple(context.module.path))
    return next_fun(*args, **kwargs)

  variables = variable_shapes(model, sample_input.shape[1:])
  with nn.intercept_methods(record):
    jax.eval_shape(lambda v, x: model.apply(v, x, train=True, mutable=True), variables, sample_input)
  return frozenset(path for path in traverse_util.flatten_dict(dict(variables)) if path[1:-1] in paths)


def bn_mask(mask: Array | None, x: Array) -> Array | None:
  """Reshapes a per-example mask [B] to broadcast against `x` ([B,1,1,1] for NHWC).

  flax's `BatchNorm(mask=...)` takes the mask as a `where=` of its mean
  reductions, so it must broadcast to the full input shape.
  """
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != (x.shape[0],):
    raise ValueError(f"mask must have shape [batch]={(x.shape[0],)}, got {mask.shape}")
  return mask.astype(bool).reshape((x.shape[0],) + (1,) * (x.ndim - 1))


def run_parts(parts: Sequence[Part], x: Array, start: str, stop: str) -> Array:
  """Applies the parts after cut point `start` through `stop` inclusive.

  The cut points are "input" followed by the part names. `start == stop`
  returns `x` unchanged; `start` after `stop` is an error.
  """
  cut_points = ("input",) + tuple(name for name, _ in parts)
  for arg, value in (("start", start), ("stop", stop)):
    if value not in cut_points:
      raise ValueError(f"unknown {arg} cut point {value!r}; expected one of {cut_points}")
  first, last = cut_points.index(start), cut_points.index(stop)
  if first > last:
    raise ValueError(f"start {start!r} comes after stop {stop!r} in {cut_points}")
  for _, fn in parts[first:last]:
    x = fn(x)
  return x


def max_pool(x: Array, window: tuple[int, int], strides: tuple[int, int],
             padding: str | Sequence[tuple[int, int]] = "VALID") -> Array:
  """``flax.linen.max_pool`` over NHWC maps, computed as maxima of the window's strided slices.

  Same values; XLA:CPU differentiates this about five times faster than ``reduce_window``, whose
  gradient is a ``select_and_scatter`` (docs/performance.md). Where two inputs of a window tie for
  the maximum, the gradient is shared between them instead of going to the first one.
  """
  size = x.shape[1:3]
  if tuple(window) == tuple(strides) and padding == "VALID" and all(n % k == 0 for n, k in zip(size, window)):
    return _tiled_max_pool(x, window)
  if isinstance(padding, str):
    if padding == "VALID":
      padding = ((0, 0), (0, 0))
    else:  # SAME, as XLA pads it
      out = [-(-n // s) for n, s in zip(size, strides)]
      total = [max((o - 1) * s + k - n, 0) for o, s, k, n in zip(out, strides, window, size)]
      padding = tuple((t // 2, t - t // 2) for t in total)
  x = jnp.pad(x, ((0, 0), *padding, (0, 0)), constant_values=-jnp.inf)
  out = [(n + lo + hi - k) // s + 1 for n, (lo, hi), k, s in zip(size, padding, window, strides)]
  # Separably: the maxima over the window's rows, then over its columns (k + k slices, not k * k).
  rows = functools.reduce(jnp.maximum, [x[:, i:i + strides[0] * (out[0] - 1) + 1:strides[0]] for i in range(window[0])])
  return functools.reduce(jnp.maximum,
                          [rows[:, :, j:j + strides[1] * (out[1] - 1) + 1:strides[1]] for j in range(window[1])])


# A convolution whose output map has at most this many positions runs as one matrix product over its
# kernel taps (see `convolution`).
SMALL_MAP_POSITIONS = 4
def _plain_nhwc(lhs: Array, rhs: Array, lhs_dilation: Any, rhs_dilation: Any, dimension_numbers: Any) -> bool:
  """Whether a convolution maps NHWC images by an HWIO kernel without dilation."""
  return lhs.ndim == 4 and all(d == 1 for d in tuple(lhs_dilation or (1, 1)) + tuple(rhs_dilation or (1, 1))) and \
      jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == \
      jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, client_conv.NHWC)


def lax_convolution(lhs: Array, rhs: Array, window_strides: Sequence[int], padding: str | Sequence[tuple[int, int]],
                    lhs_dilation: Sequence[int] | None = None, rhs_dilation: Sequence[int] | None = None,
                    dimension_numbers: Any = None, feature_group_count: int = 1, precision: Any = None,
                    preferred_element_type: Any = None) -> Array:
  """``lax.conv_general_dilated``, a drop-in for ``nn.Conv(conv_general_dilated=...)``, with its gradients in
  the platform's fast form (one group, no preferred element type; `models.client_conv`): on an accelerator the
  kernel gradient batched over clients as one grouped backward-filter convolution, on a CPU both gradients in
  the layout XLA:CPU runs fast inside a loop (NHWC maps without dilation)."""
  form = client_conv.kernel_gradient_form() if feature_group_count == 1 and preferred_element_type is None else "jax"
  if form == "batch_groups":
    return client_conv.client_convolution(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                          dimension_numbers, precision)
  if form == "canonical" and _plain_nhwc(lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers):
    return client_conv.canonical_convolution(lhs, rhs, window_strides, padding, precision)
  return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                      dimension_numbers, feature_group_count, precision=precision,
                                      preferred_element_type=preferred_element_type)


def convolution(lhs: Array, rhs: Array, window_strides: Sequence[int], padding: str | Sequence[tuple[int, int]],
                lhs_dilation: Sequence[int] | None = None, rhs_dilation: Sequence[int] | None = None,
                dimension_numbers: Any = None, feature_group_count: int = 1, precision: Any = None,
                preferred_element_type: Any = None) -> Array:
  """``lax.conv_general_dilated``, computed as one matrix product when the output map is tiny.

  A drop-in for ``nn.Conv(conv_general_dilated=...)``. On an output map of at most
  `SMALL_MAP_POSITIONS` positions (a ResNet's last stages on 28x28 or 32x32 images: 2x2, 1x1), the
  elements of the padded input that each kernel tap reads at each position are gathered along channels and
  multiplied by the kernel reshaped to (taps * in, out); taps that read only padding are left out.
  XLA:CPU runs such a layer's forward and backward 1.5-5x faster than its convolution there
  (docs/performance.md, "Convolutions on tiny maps"). The result is the same sum in another order.
  Anything else (larger maps, 1x1 kernels, dilation, groups, other layouts, empty outputs, negative
  padding, taps that all read padding) is `lax_convolution`.
  """
  def lax_conv():
    return lax_convolution(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                           feature_group_count, precision, preferred_element_type)

  if feature_group_count != 1 or preferred_element_type is not None or \
      not _plain_nhwc(lhs, rhs, lhs_dilation, rhs_dilation, dimension_numbers):
    return lax_conv()
  size, window = lhs.shape[1:3], rhs.shape[:2]
  if isinstance(padding, str):
    padding = jax.lax.padtype_to_pads(size, window, window_strides, padding)
  out = [(n + lo + hi - k) // s + 1 for n, (lo, hi), k, s in zip(size, padding, window, window_strides)]
  if window == (1, 1) or out[0] * out[1] > SMALL_MAP_POSITIONS or min(out) <= 0 or \
      any(p < 0 for pair in padding for p in pair):
    return lax_conv()

  def reads_input(tap: int, axis: int) -> bool:
    start = tap - padding[axis][0]
    return any(0 <= start + i * window_strides[axis] < size[axis] for i in range(out[axis]))

  taps = [(i, j) for i in range(window[0]) for j in range(window[1]) if reads_input(i, 0) and reads_input(j, 1)]
  if not taps:  # every tap reads padding only
    return lax_conv()
  # The patches as one gather from the padded map (position-major, then tap: the order of the taps' strided
  # slices concatenated) and the kernel as one reshape: one kernel each, where a slice per tap made one per tap
  # for XLA to compile (and a GPU to launch), in the forward pass and again in the backward.
  padded = jnp.pad(lhs, ((0, 0), *padding, (0, 0)))
  (sh, sw), width = window_strides, padded.shape[2]
  reads = np.asarray([(p * sh + i) * width + q * sw + j for p in range(out[0]) for q in range(out[1]) for i, j in taps])
  patches = padded.reshape(padded.shape[0], -1, padded.shape[3])[:, reads]
  patches = patches.reshape(padded.shape[0], out[0], out[1], len(taps) * padded.shape[3])
  kernel = rhs.reshape((window[0] * window[1],) + rhs.shape[2:])
  if len(taps) < window[0] * window[1]:
    kernel = kernel[np.asarray([i * window[1] + j for i, j in taps])]
  kernel = kernel.reshape(len(taps) * rhs.shape[2], rhs.shape[3])
  y = jax.lax.dot_general(patches, kernel, (((3,), (0,)), ((), ())), precision=precision)
  return y


def _tiled_max_pool(x: Array, window: tuple[int, int]) -> Array:
  """Non-overlapping windows that tile the map: pairwise maxima of the windows' rows, then columns, on a
  reshaped view (no padding, no strided slices: XLA:CPU runs the gradient twice as fast)."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window[0], window[0], w // window[1], window[1], c)
  rows = functools.reduce(jnp.maximum, [x[:, :, i] for i in range(window[0])])
  return functools.reduce(jnp.maximum, [rows[:, :, :, j] for j in range(window[1])])


def resolve_cut(model, cut: str | None = None) -> str:
  """The cut point that splits ``model`` into a low part (input -> cut) and a high part (cut -> logits).

  ``None`` means the model's own ``decoupling_cut`` (CNN: "conv2"; ResNets: "stage2"). Any cut point
  strictly between "input" and "logits" is valid; another name is an error listing the valid ones.
  """
  valid = tuple(model.cut_points)[1:-1]
  chosen = getattr(model, "decoupling_cut", None) if cut is None else cut
  if chosen not in valid:
    raise ValueError(f"{type(model).__name__} has no cut point {chosen!r} to split at; valid cut points: "
                     f"{', '.join(valid)}")
  return chosen


def cut_shape(model, sample_input: Array, cut: str) -> tuple[int, ...]:
  """The shape of one example's activation at ``cut`` (shape-only: nothing is computed)."""
  variables = variable_shapes(model, sample_input.shape[1:])
  return tuple(jax.eval_shape(lambda v, x: model.apply(v, x, stop=cut), variables, sample_input).shape[1:])


def parameter_split(model, sample_input: Array, cut: str):
  """Which ``params`` leaves the low part (input -> ``cut``) and the high part (``cut`` -> logits) use.

  Returns two pytrees of bools shaped like ``params``; a leaf used by neither (MOON's projection head) is
  False in both. Found by tracing each part and looking at which parameters its program reads, so no
  parameter name is matched.
  """
  variables = variable_shapes(model, sample_input.shape[1:])
  leaves, treedef = jax.tree.flatten(variables["params"])
  others = {k: v for k, v in variables.items() if k != "params"}

  def reads(part, inputs):
    """Which leaves ``part`` reads, and its output's shape."""
    closed, out = jax.make_jaxpr(lambda ps, rest, x: part({**rest, "params": treedef.unflatten(ps)}, x),
                                 return_shape=True)(leaves, others, inputs)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
    return treedef.unflatten([id(v) in used for v in closed.jaxpr.invars[:len(leaves)]]), out

  low, features = reads(lambda v, x: model.apply(v, x, stop=cut), sample_input)
  high, _ = reads(lambda v, h: model.apply(v, h, start=cut), features)
  return low, high
