"""Tests of fedjax_hetero.analysis: linear CKA, loss landscapes and the figures."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from fedjax_hetero import analysis
from fedjax_hetero.data.store import normalize
from fedjax_hetero.models import build_model
from tests.helpers import model_variables, tiny_resnet

MEAN, STD = (0.5,), (0.25,)


def numpy_linear_cka(x: np.ndarray, y: np.ndarray) -> float:
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  y = np.asarray(y, np.float64).reshape(len(y), -1)
  x, y = x - x.mean(0), y - y.mean(0)
  return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def tiny_images(n: int, size: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (n, size, size, 1)), jnp.uint8)


def small_preset(name: str = "resnet10", width: float = 1.0):
  """A ResNet preset by name (ImageNet stem, 10 classes) at base width 4."""
  return build_model(name, 10, width=width, base_channels=4)


def is_png(path) -> bool:
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---- linear CKA ----


@pytest.mark.parametrize("shapes", [((40, 5), (40, 7)), ((12, 30), (12, 45)), ((16, 3, 2, 4), (16, 9))])
def test_linear_cka_matches_numpy(shapes):
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=shapes[0]), rng.normal(size=shapes[1])
  y[:, :3] += x.reshape(len(x), -1)[:, :3]  # some shared signal, so CKA is not near 0
  got = jax.jit(analysis.linear_cka)(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
  chex.assert_shape(got, ())
  chex.assert_trees_all_close(got, jnp.float32(numpy_linear_cka(x, y)), rtol=1e-4)
  assert 0.0 <= float(got) <= 1.0


def test_linear_cka_invariances():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(30, 6))
  y = x @ rng.normal(size=(6, 8)) + 0.5 * rng.normal(size=(30, 8))
  q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
  base = analysis.linear_cka(jnp.asarray(x), jnp.asarray(y))
  chex.assert_trees_all_close(analysis.linear_cka(jnp.asarray(x), jnp.asarray(y @ q)), base, rtol=1e-4)
  chex.assert_trees_all_close(analysis.linear_cka(jnp.asarray(3.7 * x), jnp.asarray(0.01 * y)), base, rtol=1e-4)
  # Column centring makes it invariant to translations too.
  chex.assert_trees_all_close(analysis.linear_cka(jnp.asarray(x + 5.0), jnp.asarray(y)), base, rtol=1e-4)
  for features in (x, rng.normal(size=(10, 50))):  # feature and Gram forms
    chex.assert_trees_all_close(analysis.linear_cka(jnp.asarray(features), jnp.asarray(features)),
                                jnp.float32(1.0), atol=1e-5)


def test_linear_cka_constant_features_is_zero_not_nan():
  x = jnp.ones((8, 3))
  assert float(analysis.linear_cka(x, jnp.arange(24.0).reshape(8, 3))) == 0.0


# ---- stage outputs and CKA matrices ----


@pytest.mark.slow
def test_stage_outputs_match_direct_calls():
  model = small_preset()
  images = tiny_images(6, 16)
  variables = model_variables(model, images.astype(jnp.float32), seed=0)
  cuts = ("stage3", "stem", "features")  # out of model order on purpose
  outs = analysis.stage_outputs(model, variables, images, MEAN, STD, cuts, batch_size=4)
  assert tuple(outs) == cuts
  direct = jax.jit(lambda v, x: [model.apply(v, x, train=False, stop=cut) for cut in cuts])
  chex.assert_trees_all_close(list(outs.values()), direct(variables, normalize(images, MEAN, STD)),
                              rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cka_matrix_heterogeneous_groups():
  images = tiny_images(12, 16, seed=1)
  sample = images.astype(jnp.float32)
  models = [small_preset("resnet10", 1.0), small_preset("resnet10", 0.5), small_preset("resnet14", 1.0)]
  pairs = [(m, model_variables(m, sample, seed=i)) for i, m in enumerate(models)]
  pairs.append((models[0], pairs[0][1]))  # a copy of group 0: CKA 1 with it
  matrices = analysis.cka_matrix(pairs, images, MEAN, STD)
  assert tuple(matrices) == ("stem", "stage1", "stage2", "stage3", "stage4", "features")
  for cut, matrix in matrices.items():
    chex.assert_shape(matrix, (4, 4))
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-6)
    np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-5)
    np.testing.assert_allclose(matrix[0, 3], 1.0, atol=1e-5)
    assert np.all(matrix >= -1e-6) and np.all(matrix <= 1 + 1e-6), cut
  # Entries agree with linear_cka on the raw activations.
  outs = [analysis.stage_outputs(m, v, images, MEAN, STD, tuple(matrices))["stage2"] for m, v in pairs[:2]]
  np.testing.assert_allclose(matrices["stage2"][0, 1], float(analysis.linear_cka(*outs)), rtol=1e-4)


def test_cka_matrix_cnn_widths_and_layer_similarity(tmp_path):
  images = tiny_images(10, 8, seed=2)
  sample = images.astype(jnp.float32)
  models = [build_model("cnn", 10, width=w) for w in (0.125, 0.25)]
  pairs = [(m, model_variables(m, sample, seed=i)) for i, m in enumerate(models)]
  matrices = analysis.cka_matrix(pairs, images, MEAN, STD, ("conv1", "conv2", "features"))
  chex.assert_shape(list(matrices.values()), (2, 2))
  assert analysis.layer_similarity(matrices["conv2"]) == pytest.approx(float(matrices["conv2"][0, 1]))
  assert analysis.layer_similarity(np.array([[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]])) == pytest.approx(0.4)
  path = analysis.plot_cka(matrices, str(tmp_path / "cka.png"), group_names=["cnn@0.125", "cnn@0.25"])
  assert is_png(path)


# ---- loss landscape ----


@pytest.fixture(scope="module")
def resnet_and_directions():
  """A two-stage tiny ResNet with non-trivial BN statistics and two directions over all its variables."""
  model = tiny_resnet((1, 1), num_classes=10)
  variables = model_variables(model, tiny_images(2, 16).astype(jnp.float32), seed=3)
  direction = jax.jit(analysis.filter_normalized_direction)
  return model, variables, direction(variables, jax.random.key(1)), direction(variables, jax.random.key(2))


def test_filter_normalized_direction(resnet_and_directions):
  _, variables, direction, other = resnet_and_directions
  chex.assert_trees_all_equal_shapes_and_dtypes(direction, variables)
  flat_w = traverse_util.flatten_dict(jax.device_get(variables))
  flat_d = traverse_util.flatten_dict(jax.device_get(direction))
  kernels = 0
  for path, w in flat_w.items():
    d = flat_d[path]
    if w.ndim <= 1:  # biases, BN scale/bias and running statistics
      np.testing.assert_array_equal(d, np.zeros_like(w))
      continue
    kernels += 1
    axes = tuple(range(w.ndim - 1))
    np.testing.assert_allclose(np.sqrt(np.sum(d**2, axis=axes)), np.sqrt(np.sum(w**2, axis=axes)), rtol=1e-5)
    assert not np.allclose(d, w)  # random, not the weights
  assert kernels == 1 + 2 * 2 + 1 + 1  # stem, 2 convs per block, stage 2's downsample, head
  assert not np.allclose(np.asarray(other["params"]["head"]["kernel"]), flat_d[("params", "head", "kernel")])


def test_loss_surface_origin_and_grid_point(resnet_and_directions):
  model, variables, direction, other = resnet_and_directions
  d1, d2 = direction["params"], other["params"]
  images = tiny_images(10, 16, seed=4)
  labels = jnp.asarray(np.random.default_rng(4).integers(0, 10, 10), jnp.int32)
  alphas, betas = [0.0, 0.5], [-1.0, 0.0, 0.25]
  surface = analysis.loss_surface(model, variables, images, labels, MEAN, STD, (d1, d2), alphas, betas,
                                  batch_size=4)  # 4 + 4 + a remainder of 2
  chex.assert_shape([surface.loss, surface.accuracy], (2, 3))

  @jax.jit
  def plain(params):
    logits = model.apply({**variables, "params": params}, normalize(images, MEAN, STD), train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), (logits.argmax(-1) == labels).mean()

  loss, acc = plain(variables["params"])
  assert surface.loss[0, 1] == pytest.approx(float(loss), rel=1e-5)
  assert surface.accuracy[0, 1] == pytest.approx(float(acc))
  loss, acc = plain(jax.tree.map(lambda w, u, v: w + 0.5 * u - 1.0 * v, variables["params"], d1, d2))
  assert surface.loss[1, 0] == pytest.approx(float(loss), rel=1e-4)
  assert surface.accuracy[1, 0] == pytest.approx(float(acc))
  assert not np.isclose(surface.loss[1, 0], surface.loss[0, 1])


def test_plot_loss_landscapes(tmp_path):
  alphas, betas = np.linspace(-1, 1, 7), np.linspace(-1, 1, 5)
  a, b = np.meshgrid(alphas, betas, indexing="ij")
  surfaces = {"FedAvg": (alphas, betas, 1 + 3 * a**2 + b**2),
              "FedCross": (alphas, betas, 1 + a**2 + 0.5 * b**2)}
  path = analysis.plot_loss_landscapes(surfaces, str(tmp_path / "landscape.png"))
  assert is_png(path)
  assert is_png(analysis.plot_loss_landscapes(surfaces, str(tmp_path / "log.png"), log_scale=True))
  with pytest.raises(ValueError, match="loss shape"):
    analysis.plot_loss_landscapes({"bad": (alphas, betas, a.T)}, str(tmp_path / "bad.png"))


# ---- figures ----


def test_plot_update_histograms(tmp_path):
  rng = np.random.default_rng(6)
  deltas = {r: {"stage3.conv0": rng.normal(0, 0.01, (3, 3, 8, 8)), "stage3.conv1": rng.laplace(0, 0.01 * r, 64)}
            for r in range(40, 51)}
  deltas[51] = {"stage3.conv0": np.zeros(10)}  # a layer missing in a round, constant values
  path = analysis.plot_update_histograms(deltas, str(tmp_path / "hist.png"), bins=30)
  assert is_png(path)


def test_plot_client_bubbles(tmp_path):
  counts = np.random.default_rng(7).integers(0, 50, (20, 10))
  counts[3] = 0  # an empty client
  assert is_png(analysis.plot_client_bubbles(counts, str(tmp_path / "bubbles.png")))
  panels = {"beta=0.1": counts, "beta=1.0": counts[::-1]}
  path = analysis.plot_client_bubbles(panels, str(tmp_path / "panels.png"), clients=[0, 5, 3, 17])
  assert is_png(path)


def test_plot_similarity_tracking(tmp_path):
  rows = [{"round": r, "train_loss": 1.0} for r in range(1, 4)]
  rows += [{"round": r, "middleware_similarity": {"mean_cosine": 0.9 + 0.01 * r, "mean_l2": 1.0 / r}}
           for r in range(4, 10)]
  rows.append({"round": 10, "middleware_similarity": {"mean_cosine": 0.99, "mean_l2_distance": 0.05}})
  assert is_png(analysis.plot_similarity_tracking(rows, str(tmp_path / "sim.png")))
  assert is_png(analysis.plot_similarity_tracking(rows[:2], str(tmp_path / "empty.png")))


class DenseBatchNorm(nn.Module):
  """x -> Dense -> BatchNorm(momentum) -> Dense: the BatchNorm's input is ``x @ kernel`` (no bias)."""

  momentum: float

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.Dense(3, use_bias=False, name="dense")(x.reshape(len(x), -1))
    h = nn.BatchNorm(use_running_average=not train, momentum=self.momentum, name="bn")(h)
    return nn.Dense(2)(h)


@pytest.mark.parametrize("momentum", [0.9, 0.99])
def test_recalibrate_batch_stats_matches_numpy(momentum):
  model = DenseBatchNorm(momentum)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.normal(i, 1.0 + i, (16, 5)), jnp.float32) for i in range(3)]
  variables = model.init(jax.random.key(0), batches[0])
  variables = {**variables, "batch_stats": {"bn": {"mean": jnp.full(3, 7.0), "var": jnp.full(3, 9.0)}}}
  assert analysis.batch_norm_momenta(model, variables, batches[0]) == [momentum]

  got = analysis.recalibrate_batch_stats(model, variables, iter(batches))

  kernel = np.asarray(variables["params"]["dense"]["kernel"], np.float64)
  hidden = [np.asarray(x, np.float64) @ kernel for x in batches]
  expected = {"mean": np.mean([h.mean(0) for h in hidden], 0), "var": np.mean([h.var(0) for h in hidden], 0)}
  chex.assert_trees_all_close(got["batch_stats"]["bn"], expected, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_equal(got["params"], variables["params"])


def test_recalibrate_batch_stats_restores_training_statistics():
  """Statistics estimated on the data a ResNet is evaluated on reproduce its training-mode outputs."""
  model = tiny_resnet((1, 1), num_classes=10)
  images = normalize(tiny_images(32, 16), MEAN, STD)
  variables = model_variables(model, images[:1], seed=0)
  variables = {**variables, "batch_stats": jax.tree.map(lambda s: s + 3.0, variables["batch_stats"])}
  train_logits, _ = model.apply(variables, images, train=True, mutable=["batch_stats"])
  assert not np.allclose(model.apply(variables, images), train_logits, atol=1e-3)
  recalibrated = analysis.recalibrate_batch_stats(model, variables, [images])
  chex.assert_trees_all_close(model.apply(recalibrated, images), train_logits, rtol=1e-3, atol=1e-3)


def test_recalibrate_batch_stats_errors():
  model = DenseBatchNorm(0.9)
  x = jnp.ones((4, 5))
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="at least one batch"):
    analysis.recalibrate_batch_stats(model, variables, [])
  with pytest.raises(ValueError, match="no BatchNorm"):
    analysis.recalibrate_batch_stats(model, {"params": variables["params"]}, [x])
