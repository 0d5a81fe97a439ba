"""Linear CKA between the activations of (heterogeneous) models (InCo spec Sec. 5.1).

Linear CKA (Kornblith et al. 2019, Eq. 5 with a linear kernel) of column-centred
X [n, p1] and Y [n, p2] is ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F). It only
needs the n x n centred Gram matrices K = X X^T, L = Y Y^T, since
||Y^T X||_F^2 = <K, L>_F, which is what lets models of different widths (and
hence different feature sizes) be compared.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import program_cache
from fedjax_hetero.data.store import normalize
from fedjax_hetero.hetero.maps import Variables

Array = jax.Array

_HIGHEST = jax.lax.Precision.HIGHEST


def _centred_features(x: Array) -> Array:
  x = jnp.asarray(x, jnp.float32)
  x = x.reshape(x.shape[0], -1)
  return x - jnp.mean(x, axis=0, keepdims=True)


@jax.jit
def _centred_gram(x: Array) -> Array:
  x = _centred_features(x)
  return jnp.matmul(x, x.T, precision=_HIGHEST)


def _safe_ratio(num: Array, den: Array) -> Array:
  # CKA is undefined for constant features (zero Gram matrix); report 0 there.
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def linear_cka(x: Array, y: Array) -> Array:
  """Linear CKA of x [n, ...] and y [n, ...] (Kornblith et al. 2019), a scalar in [0, 1].

  Trailing dims are flattened and columns centred. Uses the feature-space form
  when the features are few and the Gram form (n x n) otherwise; both are equal.
  """
  if x.shape[0] != y.shape[0]:
    raise ValueError(f"x and y need the same number of examples, got {x.shape[0]} and {y.shape[0]}")
  x, y = _centred_features(x), _centred_features(y)
  n, p1, p2 = x.shape[0], x.shape[1], y.shape[1]
  if p1 * p2 <= n * n:
    cross = jnp.sum(jnp.square(jnp.matmul(y.T, x, precision=_HIGHEST)))
    xx = jnp.linalg.norm(jnp.matmul(x.T, x, precision=_HIGHEST))
    yy = jnp.linalg.norm(jnp.matmul(y.T, y, precision=_HIGHEST))
  else:
    k = jnp.matmul(x, x.T, precision=_HIGHEST)
    l = jnp.matmul(y, y.T, precision=_HIGHEST)
    cross, xx, yy = jnp.vdot(k, l), jnp.linalg.norm(k), jnp.linalg.norm(l)
  return _safe_ratio(cross, xx * yy)


def _ordered_cuts(model: nn.Module, cut_points: Sequence[str]) -> tuple[str, ...]:
  order = tuple(model.cut_points)
  unknown = [c for c in cut_points if c not in order]
  if unknown:
    raise ValueError(f"unknown cut points {unknown}; {type(model).__name__} has {order}")
  return tuple(sorted(set(cut_points), key=order.index))


@program_cache
def _chained(model: nn.Module, cuts: tuple[str, ...], mean: tuple[float, ...], std: tuple[float, ...]):
  """One jitted eval-mode pass that returns the activation at every cut in `cuts` (model order)."""

  @jax.jit
  def run(variables, images):
    h, start, outs = normalize(images, mean, std), "input", []
    for cut in cuts:
      h = model.apply(variables, h, train=False, start=start, stop=cut)
      start = cut
      outs.append(h)
    return tuple(outs)

  return run


def stage_outputs(model: nn.Module, variables: Variables, images_uint8: Array, mean: Sequence[float],
                  std: Sequence[float], cut_points: Sequence[str],
                  batch_size: int | None = None) -> dict[str, Array]:
  """Eval-mode activations [n, ...] of `model` at each cut point, from one chained pass.

  The network runs once: each cut continues from the previous one via
  `start`/`stop`. `batch_size` splits the images (None: all at once).
  """
  cuts = _ordered_cuts(model, cut_points)
  run = _chained(model, cuts, tuple(float(m) for m in mean), tuple(float(s) for s in std))
  n = images_uint8.shape[0]
  batch_size = n if batch_size is None else max(1, min(batch_size, n))
  pieces = [run(variables, images_uint8[i:i + batch_size]) for i in range(0, n, batch_size)]
  outs = pieces[0] if len(pieces) == 1 else tuple(jnp.concatenate(p, axis=0) for p in zip(*pieces))
  by_cut = dict(zip(cuts, outs))
  return {cut: by_cut[cut] for cut in cut_points}


@jax.jit
def _cka_from_grams(grams: Array) -> Array:
  """[G, G] linear CKA from stacked centred Gram matrices [G, n, n]."""
  inner = jnp.einsum("gij,hij->gh", grams, grams, precision=_HIGHEST)
  norms = jnp.sqrt(jnp.diagonal(inner))
  return _safe_ratio(inner, norms[:, None] * norms[None, :])


def _shared_cuts(models: Sequence[nn.Module]) -> tuple[str, ...]:
  """Cut points of the first model that every model has, without "input" and "logits"."""
  shared = [c for c in models[0].cut_points if all(c in m.cut_points for m in models)]
  return tuple(c for c in shared if c not in ("input", "logits"))


def cka_matrix(models_and_variables: Sequence[tuple[nn.Module, Variables]], images: Array,
               mean: Sequence[float], std: Sequence[float], cut_points: Sequence[str] | None = None,
               batch_size: int | None = None) -> dict[str, np.ndarray]:
  """cut -> [G, G] linear CKA between the G models' activations on the same images.

  Models may differ in width and depth as long as they share the cut names
  (None: every cut all models have, except "input" and "logits"). Each model's
  centred Gram matrix is computed once per cut, so the cost is G passes plus
  G^2 inner products of n x n matrices.
  """
  if not models_and_variables:
    raise ValueError("need at least one (model, variables) pair")
  models = [m for m, _ in models_and_variables]
  cuts = tuple(cut_points) if cut_points is not None else _shared_cuts(models)
  grams: dict[str, list[Array]] = {cut: [] for cut in cuts}
  for model, variables in models_and_variables:
    outs = stage_outputs(model, variables, images, mean, std, cuts, batch_size)
    for cut in cuts:
      grams[cut].append(_centred_gram(outs[cut]))
    del outs  # activations can be large; only the n x n Grams are kept
  return {cut: np.asarray(_cka_from_grams(jnp.stack(grams[cut]))) for cut in cuts}


def layer_similarity(matrix: np.ndarray | Array) -> float:
  """Mean off-diagonal entry of a [G, G] CKA matrix (InCo's "layer similarity", App. E)."""
  matrix = np.asarray(matrix, np.float64)
  if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 2:
    raise ValueError(f"need a square [G, G] matrix with G >= 2, got shape {matrix.shape}")
  off_diagonal = ~np.eye(matrix.shape[0], dtype=bool)
  return float(matrix[off_diagonal].mean())


def plot_cka(matrices: Mapping[str, np.ndarray | Array], path: str,
             group_names: Sequence[str] | None = None, title: str | None = None) -> str:
  """Saves one CKA heatmap per cut (shared 0..1 colour scale) side by side as PNG; returns `path`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  if not matrices:
    raise ValueError("no CKA matrices to plot")
  cuts = list(matrices)
  size = np.asarray(matrices[cuts[0]]).shape[0]
  names = list(group_names) if group_names is not None else [str(i) for i in range(size)]
  if len(names) != size:
    raise ValueError(f"{len(names)} group names for {size}x{size} matrices")
  panel = min(max(2.5, 0.45 * size + 1.5), 8.0)
  fig = Figure(figsize=(panel * len(cuts) + 1.0, panel + 0.6), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(cuts), squeeze=False)[0]
  image = None
  for index, (ax, cut) in enumerate(zip(axes, cuts)):
    matrix = np.asarray(matrices[cut], np.float64)
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis")
    label = f"{cut}\nmean off-diag {layer_similarity(matrix):.3f}" if size > 1 else cut
    ax.set_title(label, fontsize=9)
    ticks = np.arange(size)
    ax.set_xticks(ticks, names, rotation=90, fontsize=7)
    ax.set_yticks(ticks, names if index == 0 else [], fontsize=7)
    if size <= 10:
      for i in range(size):
        for j in range(size):
          ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=6,
                  color="black" if matrix[i, j] > 0.6 else "white")
  fig.colorbar(image, ax=list(axes), shrink=0.8, label="linear CKA")
  if title:
    fig.suptitle(title)
  fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
  return path
