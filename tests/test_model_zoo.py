"""Tests for the FedCross/InCo models: CNNCifar, pre-activation ResNet-20, VGG-16 and ViT."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import aggregators, hetero, models
from fedjax_hetero.models import build_model, parse_group_spec
from fedjax_hetero.hetero.maps import flatten
from tests.helpers import model_variables

NEW_MODELS = ("cnn_cifar", "resnet20_preact", "vgg16", "vit")
FEATURES = {"cnn_cifar": 84, "resnet20_preact": 256, "vgg16": 4096, "vit": 64}
# Fast configurations for the tests that run the models (tests/test_models.py runs the presets' cut points).
SMALL = {
    "cnn_cifar": (1.0, {}),
    "resnet20_preact": (1.0, {"base_channels": 4, "stage_sizes": (1, 2)}),  # projection and identity blocks
    "vgg16": (1 / 16, {}),  # channels 4..32, hidden 256
    "vit": (1.0, {"embed_dim": 16, "num_heads": 2, "depth": 2}),
}
BATCH = 4


def small(name: str, width: float = 1.0, num_classes: int = 10):
  base_width, overrides = SMALL[name]
  return build_model(name, num_classes, width * base_width, **overrides)


def images(seed: int = 0, batch: int = BATCH, size: int = 16, channels: int = 3) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, size, size, channels)), jnp.float32)


def shapes(model, size: int = 32, channels: int = 3):
  return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, size, size, channels)))


def train_apply(model, variables, x, mask=None, **kwargs):
  """The local trainer's call: training mode, a mask, updated batch_stats and no RNGs."""
  return model.apply(variables, x, train=True, mask=mask, mutable=["batch_stats"], **kwargs)


def num_params(tree) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(tree["params"]))


# ------------------------------------------------------------------------------------ sizes and shapes


@pytest.mark.parametrize("name, num_classes, count", [
    ("cnn_cifar", 10, 62_006),
    ("cnn_cifar", 20, 62_856),
    # The authors' PyTorch model counts 219,482: it also holds a final BN(256) that its forward never uses.
    ("resnet20_preact", 10, 219_482 - 2 * 256),
    ("vgg16", 10, 33_646_666),
])
def test_param_counts(name, num_classes, count):
  assert num_params(shapes(build_model(name, num_classes))) == count


def test_vit_small_matches_timm_count():
  """InCo's ViT-S/16 (timm vit_small_patch16_224) with a 10-class head: 21,665,664 + 3,850 parameters."""
  model = build_model("vit_d12", 10, patch_size=16, embed_dim=384, num_heads=6)
  assert num_params(shapes(model, 224)) == 21_669_514


@pytest.mark.parametrize("name", NEW_MODELS)
@pytest.mark.parametrize("size, channels", [(28, 1), (32, 3)])
def test_output_shapes(name, size, channels):
  model = build_model(name, 10)
  x = jnp.zeros((2, size, size, channels))
  for stop, dim in (("features", FEATURES[name]), ("logits", 10)):
    out, _ = jax.eval_shape(lambda x: model.init_with_output(jax.random.key(0), x, stop=stop), x)
    chex.assert_shape(out, (2, dim))
  assert model.cut_points[0] == "input" and model.cut_points[-2:] == ("features", "logits")


def test_input_size_dependent_shapes():
  vgg28, vgg32 = flatten(shapes(build_model("vgg16", 10), 28, 1)), flatten(shapes(build_model("vgg16", 10), 32, 1))
  assert vgg28[("params", "fc1", "kernel")].shape == vgg32[("params", "fc1", "kernel")].shape == (512, 4096)
  assert flatten(shapes(build_model("cnn_cifar", 10), 28, 1))[("params", "fc1", "kernel")].shape == (256, 120)
  for size, patches in ((28, 49), (32, 64)):
    assert flatten(shapes(build_model("vit", 10), size))[("params", "pos_embed")].shape == (1, patches + 1, 64)


def test_cut_points():
  assert build_model("cnn_cifar", 10).cut_points == ("input", "conv1", "conv2", "fc1", "features", "logits")
  assert build_model("resnet20_preact", 10).cut_points == ("input", "stem", "stage1", "stage2", "stage3",
                                                           "features", "logits")
  assert build_model("vgg16", 10).cut_points == ("input",) + tuple(f"block{i}" for i in range(1, 6)) + (
      "features", "logits")
  assert build_model("vit_d3", 10).cut_points == ("input", "embed", "block1", "block2", "block3", "features",
                                                  "logits")


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_MODELS)
def test_cut_point_chain_composes(name):
  model = small(name)
  x = images()
  variables = model_variables(model, x, seed=1)
  logits = model.apply(variables, x)
  activations = {"input": x}
  for prev, cut in zip(model.cut_points[:-1], model.cut_points[1:]):
    activations[cut] = model.apply(variables, activations[prev], start=prev, stop=cut)
    tail = model.apply(variables, activations[cut], start=cut)
    chex.assert_trees_all_close(tail, logits, atol=1e-5)
  chex.assert_trees_all_close(model.apply(variables, x, stop="features"), activations["features"], atol=1e-5)
  chex.assert_trees_all_close(activations["logits"], logits, atol=1e-5)


# ------------------------------------------------------------------------------------------ BatchNorm


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet20_preact", "vgg16"])
def test_bn_mask_ignores_padded_rows(name):
  model = small(name)
  clean = images()
  garbage = 100.0 * images(seed=7, batch=3) + 50.0
  padded = jnp.concatenate([clean[:2], garbage[:2], clean[2:], garbage[2:]])
  mask = jnp.array([1, 1, 0, 0, 1, 1, 0], dtype=bool)
  variables = model_variables(model, clean, seed=2)

  clean_logits, clean_state = train_apply(model, variables, clean)
  padded_logits, padded_state = train_apply(model, variables, padded, mask)
  chex.assert_trees_all_close(padded_state, clean_state, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(padded_logits[np.asarray(mask)], clean_logits, rtol=1e-4, atol=1e-4)
  _, unmasked_state = train_apply(model, variables, padded, jnp.ones(7, bool))
  assert not all(np.allclose(a, b, atol=1e-3) for a, b in zip(jax.tree.leaves(unmasked_state),
                                                               jax.tree.leaves(clean_state)))


def test_preact_init():
  variables = jax.jit(models.PreActBottleneck(planes=64).init)(jax.random.key(0), jnp.zeros((1, 4, 4, 64)))
  params = flatten(variables["params"])
  for path, leaf in params.items():
    if path[0].startswith("bn"):
      chex.assert_trees_all_equal(leaf, jnp.full_like(leaf, 0.5 if path[-1] == "scale" else 0.0))
  kernel = np.asarray(params[("conv2", "kernel")])
  assert abs(kernel.std() / np.sqrt(2.0 / (3 * 3 * 64)) - 1) < 0.03


@pytest.mark.parametrize("preact_shortcut", [False, True])
def test_preact_projection_shortcut_input(preact_shortcut):
  block = models.PreActBottleneck(planes=4, strides=2, preact_shortcut=preact_shortcut)
  x = images(channels=8)
  variables = model_variables(block, x, seed=3)
  kernel = variables["params"]["downsample_conv"]["kernel"]
  no_shortcut = traverse_util.unflatten_dict({**flatten(variables), ("params", "downsample_conv", "kernel"): 0 * kernel})
  shortcut = block.apply(variables, x) - block.apply(no_shortcut, x)

  bn = variables["batch_stats"]["bn1"]
  pre = jax.nn.relu((x - bn["mean"]) / jnp.sqrt(bn["var"] + 1e-5) * variables["params"]["bn1"]["scale"]
                    + variables["params"]["bn1"]["bias"])
  source = pre if preact_shortcut else x
  want = jax.lax.conv_general_dilated(source, kernel, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  chex.assert_trees_all_close(shortcut, want, atol=1e-4)


# -------------------------------------------------------------------------------------------- dropout


def test_vgg_dropout_needs_train_and_rng():
  model = small("vgg16")
  x = images()
  variables = model_variables(model, x, seed=4)
  no_rng = train_apply(model, variables, x)[0]
  chex.assert_trees_all_equal(no_rng, train_apply(model, variables, x)[0])  # deterministic without a "dropout" RNG
  dropped = train_apply(model, variables, x, rngs={"dropout": jax.random.key(0)})[0]
  assert not np.allclose(dropped, no_rng)
  chex.assert_trees_all_equal(model.apply(variables, x, rngs={"dropout": jax.random.key(0)}), model.apply(variables, x))
  assert build_model("vgg16", 10).dropout_rate == 0.5


# ------------------------------------------------------------------------------------- nesting of trees


@pytest.mark.parametrize("name", NEW_MODELS)
def test_half_width_is_leading_slice(name):
  wide, narrow = shapes(build_model(name, 10)), shapes(build_model(name, 10, 0.5))
  group_map = hetero.build_group_map(wide, narrow, f"{name}@0.5")  # raises unless every leaf is a leading slice
  assert set(flatten(narrow)) == set(flatten(wide))
  assert all(shape is not None for shape in group_map.owned.values())
  assert num_params(narrow) < num_params(wide)
  assert flatten(narrow)[("params", "head", "bias")].shape == (10,)


@pytest.mark.parametrize("name", ["cnn_cifar", "resnet20_preact", "vgg16"])
def test_narrow_conv_net_equals_zero_padded_wide_one(name):
  """The hetero maps' semantics: the narrow model is the wide one restricted to its leading channels."""
  x = images()
  narrow_model, wide_model = small(name, 0.5), small(name)
  wide_shapes = jax.eval_shape(wide_model.init, jax.random.key(0), x)
  narrow_vars = model_variables(narrow_model, x, seed=5)
  group_map = hetero.build_group_map(wide_shapes, narrow_vars)
  wide_vars = hetero.embed(narrow_vars, group_map, wide_shapes)
  chex.assert_trees_all_close(narrow_model.apply(narrow_vars, x), wide_model.apply(wide_vars, x), atol=1e-4)
  chex.assert_trees_all_close(train_apply(narrow_model, narrow_vars, x)[0], train_apply(wide_model, wide_vars, x)[0],
                              atol=1e-4)


def test_vit_depth_nesting():
  deep = shapes(build_model("vit", 10))
  for spec in ("vit_d4", "vit_d4@0.5"):
    name, width = parse_group_spec(spec)
    shallow = shapes(build_model(name, 10, width))
    group_map = hetero.build_group_map(deep, shallow, spec)
    assert set(flatten(shallow)) < set(flatten(deep))
    unowned = {path[1] for path, shape in group_map.owned.items() if shape is None}
    assert unowned == {"block5", "block6"}


def test_vit_depth_names():
  assert build_model("ViT_D8", 10).depth == 8 and build_model("vit", 10).depth == 6
  assert parse_group_spec("vit_d8@0.5") == ("vit_d8", 0.5)
  assert parse_group_spec("vgg16@0.25") == ("vgg16", 0.25)
  for bad in ("vit_d0", "vit_d", "vit_dx", "vit8"):
    with pytest.raises(ValueError, match=bad):
      build_model(bad, 10)
  with pytest.raises(ValueError, match="depth"):
    build_model("vit_d4", 10, depth=6)
  assert build_model("vit", 10, depth=3).depth == 3


# ------------------------------------------------------------------------------------- InCo on the ViT


def np_code_update(gk: np.ndarray, g0: np.ndarray, eps: float = 1e-7) -> np.ndarray:
  """The authors' update on whole vectors, in float64."""
  gk, g0 = gk.astype(np.float64), g0.astype(np.float64)
  a, b = g0 @ g0, g0 @ gk
  theta = min(abs(b) / (a + eps), 5.0)
  nk, n0 = np.linalg.norm(gk), np.linalg.norm(g0)
  return np.clip((gk / (nk + eps) + theta * g0 / (n0 + eps)) * (nk + n0) / 2, -0.1, 0.1)


def test_vit_cross_layer_pairs():
  model = build_model("vit_d3", 10, embed_dim=16, num_heads=2)
  tree = shapes(model)
  pairs = model.cross_layer_pairs()
  aggregators.check_pairs(pairs, tree)
  assert pairs == tuple((("params", f"block{i}", "norm2", "scale"), ("params", f"block{i}", "norm1", "scale"))
                        for i in (1, 2, 3))

  rng = np.random.default_rng(6)
  delta = jax.tree.map(lambda s: jnp.asarray(0.05 * rng.normal(size=s.shape), jnp.float32), tree)
  before = flatten(delta)
  targets = {target for target, _ in pairs}
  for variant in aggregators.INCO_VARIANTS:
    results = {g: flatten(aggregators.inco(delta, pairs, variant, g)[0]) for g in aggregators.INCO_GRANULARITIES}
    chex.assert_trees_all_close(results["kernel"], results["tensor"])  # 1-D leaves are reduced whole either way
    after = results["kernel"]
    for path, leaf in before.items():
      if path in targets:
        assert not np.allclose(after[path], leaf), (variant, path)
      else:
        chex.assert_trees_all_equal(after[path], leaf)
    if variant == "code":
      for target, source in pairs:
        want = np_code_update(np.asarray(before[target]), np.asarray(before[source]))
        np.testing.assert_allclose(after[target], want, rtol=1e-5, atol=1e-7)
