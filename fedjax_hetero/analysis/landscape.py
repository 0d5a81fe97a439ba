"""2-D loss landscapes along filter-normalized random directions (Li et al. 2018).

Used for the FedCross paper's Fig. 4 (FedAvg vs FedCross global models; FedCross
spec Sec. 5.1): L(w + a d1 + b d2) on a grid, with d1, d2 Gaussian directions
whose every filter has the norm of the matching weight filter (Li et al. 2018,
Sec. 4, "filter normalization"), and bias/BN directions zeroed ("ignore biasbn").
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_hetero.compilation import program_cache
from fedjax_hetero.data.store import normalize
from fedjax_hetero.hetero.maps import Variables

Array = jax.Array
Params = Any


def _filter_normalize(direction: Array, weight: Array) -> Array:
  axes = tuple(range(weight.ndim - 1))  # every axis but the output channel
  weight_norm = jnp.sqrt(jnp.sum(jnp.square(weight.astype(jnp.float32)), axis=axes, keepdims=True))
  direction_norm = jnp.sqrt(jnp.sum(jnp.square(direction), axis=axes, keepdims=True))
  return (direction * weight_norm / (direction_norm + 1e-10)).astype(weight.dtype)


def filter_normalized_direction(params: Params, key: Array) -> Params:
  """Random Gaussian direction shaped like `params`, filter-normalized (Li et al. 2018, Sec. 4).

  For conv and dense kernels every filter (slice along the last, output axis)
  is rescaled to the norm of the same filter of `params`. As in Li et al.'s
  "ignore biasbn" setting, leaves with at most one axis (biases, BatchNorm
  scales/offsets/statistics) get a zero direction.
  """
  leaves, treedef = jax.tree.flatten(params)
  sizes = [w.size if w.ndim > 1 else 0 for w in leaves]
  # One draw for all kernels, cut into pieces: a draw per leaf adds a threefry
  # computation per leaf, which made compiling a ResNet's direction take ~25 s on CPU.
  noise = jax.random.normal(key, (sum(sizes),), jnp.float32)
  offsets = np.cumsum([0] + sizes)
  out = []
  for w, start, size in zip(leaves, offsets, sizes):
    if size == 0:
      out.append(jnp.zeros_like(w))
    else:
      out.append(_filter_normalize(noise[start:start + size].reshape(w.shape), w))
  return jax.tree.unflatten(treedef, out)


class LossSurface(NamedTuple):
  """Mean cross-entropy and top-1 accuracy on the grid, both [len(alphas), len(betas)]."""

  loss: np.ndarray
  accuracy: np.ndarray


@program_cache
def _point_batch(model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...], batch_size: int):
  """Jitted (summed loss, correct count) of one batch at grid point (a, b)."""

  @jax.jit
  def evaluate(variables, d1, d2, a, b, images, labels, start):
    params = jax.tree.map(lambda w, u, v: w + a * u + b * v, variables["params"], d1, d2)
    batch = jax.lax.dynamic_slice_in_dim(images, start, batch_size)
    target = jax.lax.dynamic_slice_in_dim(labels, start, batch_size)
    logits = model.apply({**variables, "params": params}, normalize(batch, mean, std), train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), target).sum()
    return loss, (logits.argmax(-1) == target).sum()

  return evaluate


def loss_surface(model: nn.Module, variables: Variables, images: Array, labels: Array, mean: Sequence[float],
                 std: Sequence[float], directions: tuple[Params, Params], alphas: Sequence[float],
                 betas: Sequence[float], batch_size: int = 1000) -> LossSurface:
  """Loss and accuracy of params w + a d1 + b d2 for every (a, b) in alphas x betas (Li et al. 2018).

  `directions` are shaped like `variables["params"]`; other collections (BN
  statistics) stay as they are and the model runs in eval mode. One jitted
  program per batch size evaluates a batch at a grid point, driven by a host
  loop (XLA:CPU runs convolutions inside while loops slowly); results stay on
  the device until the end, so the loop does not synchronise.
  """
  d1, d2 = directions
  images, labels = jnp.asarray(images), jnp.asarray(labels)
  n = int(labels.shape[0])
  if n == 0:
    raise ValueError("need at least one example")
  batch_size = min(batch_size, n)
  full = n - n % batch_size
  mean_t, std_t = tuple(float(m) for m in mean), tuple(float(s) for s in std)
  chunks = [(_point_batch(model, mean_t, std_t, batch_size), s) for s in range(0, full, batch_size)]
  if full < n:
    chunks.append((_point_batch(model, mean_t, std_t, n - full), full))
  alphas_np = np.asarray(alphas, np.float32)
  betas_np = np.asarray(betas, np.float32)
  losses, correct = [], []
  for a in alphas_np:
    for b in betas_np:
      loss_sum, count = jnp.zeros(()), jnp.zeros((), jnp.int32)
      for evaluate, start in chunks:
        l, c = evaluate(variables, d1, d2, a, b, images, labels, start)
        loss_sum, count = loss_sum + l, count + c
      losses.append(loss_sum)
      correct.append(count)
  shape = (len(alphas_np), len(betas_np))
  loss = np.asarray(jax.device_get(jnp.stack(losses)), np.float64).reshape(shape) / n
  accuracy = np.asarray(jax.device_get(jnp.stack(correct)), np.float64).reshape(shape) / n
  return LossSurface(loss, accuracy)


def plot_loss_landscapes(surfaces: Mapping[str, tuple[Sequence[float], Sequence[float], np.ndarray]], path: str,
                         levels: int | Sequence[float] = 20, log_scale: bool = False, title: str | None = None) -> str:
  """Side-by-side 2-D contour plots (e.g. FedAvg vs FedCross) with the same contour levels; returns `path`.

  `surfaces` maps a name to (alphas, betas, loss [len(alphas), len(betas)]);
  `log_scale` contours log(loss), which keeps the minimum's basin readable.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  if not surfaces:
    raise ValueError("no surfaces to plot")
  prepared = {}
  for name, surface in surfaces.items():
    alphas, betas, loss = (np.asarray(v, np.float64) for v in tuple(surface)[:3])
    if loss.shape != (alphas.size, betas.size):
      raise ValueError(f"{name}: loss shape {loss.shape} != (len(alphas), len(betas)) = "
                       f"{(alphas.size, betas.size)}")
    values = np.log(np.maximum(loss, 1e-12)) if log_scale else loss
    prepared[name] = (alphas, betas, values)
  if np.ndim(levels) == 0:
    finite = np.concatenate([v[np.isfinite(v)] for _, _, v in prepared.values()])
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    levels = np.linspace(low, high if high > low else low + 1.0, int(levels))
  levels = np.asarray(levels, np.float64)

  fig = Figure(figsize=(4.6 * len(prepared) + 0.8, 4.4), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(prepared), squeeze=False)[0]
  contour = None
  for index, (ax, (name, (alphas, betas, values))) in enumerate(zip(axes, prepared.items())):
    # loss[i, j] is at (alpha_i, beta_j): alpha on x, beta on y.
    contour = ax.contourf(alphas, betas, values.T, levels=levels, cmap="viridis", extend="both")
    ax.contour(alphas, betas, values.T, levels=levels, colors="k", linewidths=0.3)
    ax.plot([0.0], [0.0], "r+", markersize=8)
    ax.set_title(name)
    ax.set_xlabel(r"$\alpha$ (direction 1)")
    if index == 0:
      ax.set_ylabel(r"$\beta$ (direction 2)")
    ax.set_aspect("equal", adjustable="box")
  fig.colorbar(contour, ax=list(axes), shrink=0.85, label="log loss" if log_scale else "loss",
               format="%.3g")
  if title:
    fig.suptitle(title)
  fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
  return path
