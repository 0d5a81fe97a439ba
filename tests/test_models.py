"""Tests for the model zoo: presets, cut points, nesting of variable trees, BN masks."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import compilation, models
from fedjax_hetero.models import MODEL_NAMES, build_model, parse_group_spec
from fedjax_hetero.hetero.maps import flatten
from fedjax_hetero.models.common import SMALL_MAP_POSITIONS, convolution, max_pool

BATCH = 4
TINY_RESNET = dict(base_channels=4)


def tiny(name: str, width: float = 1.0, num_classes: int = 10):
  """A fast configuration of model `name` (ResNets with 4 base channels)."""
  overrides = TINY_RESNET if name.startswith("resnet") and name != "resnet20_preact" else {}
  if name == "vgg16":  # 33.6M parameters at full width
    width = width / 16
  return build_model(name, num_classes, width, **overrides)


def images(seed: int = 0, batch: int = BATCH, size: int = 16, channels: int = 3) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, size, size, channels)), jnp.float32)


def shapes_of(model, x: jax.Array) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Flat variable shapes of `model.init`, without running it."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)
  return {path: tuple(leaf.shape) for path, leaf in flatten(shapes).items()}


def init(model, x: jax.Array, seed: int = 1):
  """Random variables shaped like `model.init`'s, drawn with numpy.

  `model.init` itself is slow here: XLA compiles the PRNG once per leaf shape
  (about a second each on a small CPU), which would dominate the file's runtime.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for path, shape in shapes_of(model, x).items():
    if path[-1] == "var":
      leaf = rng.uniform(0.5, 1.5, shape)
    elif path[-1] == "scale":
      leaf = 1.0 + 0.1 * rng.normal(size=shape)
    elif path[-1] in ("bias", "mean"):
      leaf = 0.1 * rng.normal(size=shape)
    else:  # kernels: unit-variance outputs
      leaf = rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))
    out[path] = jnp.asarray(leaf, jnp.float32)
  return traverse_util.unflatten_dict(out)


@pytest.mark.parametrize("name, count", [
    ("resnet10", 4_910_922),
    ("resnet14", 10_812_234),
    ("resnet18", 11_181_642),
    ("resnet22", 17_082_954),
    ("resnet26", 17_452_362),
])
def test_inco_param_counts(name, count):
  shapes = jax.eval_shape(build_model(name, 10).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
  assert sum(leaf.size for leaf in jax.tree.leaves(shapes["params"])) == count


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_cut_points_compose(name):
  model = tiny(name)
  x = images()
  variables = init(model, x)
  assert model.cut_points[0] == "input" and model.cut_points[-2:] == ("features", "logits")
  logits = model.apply(variables, x)
  chex.assert_shape(logits, (BATCH, 10))
  chex.assert_rank(model.apply(variables, x, stop="features"), 2)

  activations = {"input": x}
  for prev, cut in zip(model.cut_points[:-1], model.cut_points[1:]):
    activations[cut] = model.apply(variables, activations[prev], start=prev, stop=cut)
    head = model.apply(variables, x, stop=cut)
    tail = model.apply(variables, head, start=cut)
    chex.assert_trees_all_close(head, activations[cut], atol=1e-5)
    chex.assert_trees_all_close(tail, logits, atol=1e-5)


def test_cut_point_errors():
  model = tiny("cnn")
  x = images()
  variables = init(model, x)
  with pytest.raises(ValueError, match="nope"):
    model.apply(variables, x, stop="nope")
  with pytest.raises(ValueError, match="comes after"):
    model.apply(variables, x, start="features", stop="conv1")
  chex.assert_trees_all_equal(model.apply(variables, x, start="conv2", stop="conv2"), x)


def test_resnet_stems():
  x = images(size=32)
  for name, spatial in (("resnet18", 8), ("resnet18_cifar", 32)):
    model = tiny(name)
    stem = model.apply(init(model, x), x, stop="stem")
    chex.assert_shape(stem, (BATCH, spatial, spatial, 4))


@pytest.mark.parametrize("smaller, larger", [
    ("resnet10", "resnet14"), ("resnet14", "resnet18"), ("resnet18", "resnet22"), ("resnet22", "resnet26"),
    ("resnet10", "resnet26"),
])
def test_depth_subtree(smaller, larger):
  x = images()
  small, large = shapes_of(tiny(smaller), x), shapes_of(tiny(larger), x)
  assert set(small) < set(large)
  for path, shape in small.items():
    assert large[path] == shape, path
  assert ("params", "stage4_block0", "conv1", "kernel") in small
  if smaller == "resnet10":
    assert not any("block1" in "/".join(path) for path in small)


@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet10", "resnet18_cifar"])
def test_width_subtree(name):
  x = images()
  small, large = shapes_of(tiny(name, 0.5), x), shapes_of(tiny(name), x)
  assert set(small) == set(large)
  for path, shape in small.items():
    assert len(shape) == len(large[path]) and all(s <= g for s, g in zip(shape, large[path])), path
  assert any(small[p] != large[p] for p in small)
  if name == "cnn":
    assert small[("params", "conv1", "kernel")] == (3, 3, 3, 16)
    assert large[("params", "conv1", "kernel")] == (3, 3, 3, 32)
  # num_classes never scales
  assert small[("params", "head", "bias")] == large[("params", "head", "bias")] == (10,)


def embed(small, large_shapes):
  """Zero-pads every leaf of `small` to the large model's shape (new leaves are zero)."""
  small_flat = traverse_util.flatten_dict(dict(small))
  out = {}
  for path, shape in large_shapes.items():
    leaf = jnp.zeros(shape)
    if path in small_flat:
      leaf = leaf.at[tuple(slice(0, d) for d in small_flat[path].shape)].set(small_flat[path])
    out[path] = leaf
  return traverse_util.unflatten_dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("smaller, larger", [
    (("cnn", 0.5), ("cnn", 1.0)),
    (("mlp", 0.25), ("mlp", 1.0)),
    (("resnet18_cifar", 0.5), ("resnet18_cifar", 1.0)),
    (("resnet10", 0.5), ("resnet26", 1.0)),
])
def test_submodel_is_leading_slice(smaller, larger):
  """A small model equals the large one with the small weights and zeros elsewhere.

  This is the semantics the hetero maps rely on: the sub-model is the leading
  channel slice and the leading blocks of the large model.
  """
  x = images()
  small_model, large_model = tiny(*smaller), tiny(*larger)
  small_vars = init(small_model, x)
  large_vars = embed(small_vars, shapes_of(large_model, x))
  for train in (False, True):
    small_out = small_model.apply(small_vars, x, train=train, mutable=["batch_stats"])[0]
    large_out = large_model.apply(large_vars, x, train=train, mutable=["batch_stats"])[0]
    chex.assert_trees_all_close(small_out, large_out, atol=1e-5)


@pytest.mark.slow
def test_bn_mask_ignores_padded_rows():
  model = tiny("resnet10")
  clean = images(size=32)
  garbage = 100.0 * images(seed=7, batch=3, size=32) + 50.0
  padded = jnp.concatenate([clean[:2], garbage[:2], clean[2:], garbage[2:]])
  mask = jnp.array([1, 1, 0, 0, 1, 1, 0], dtype=bool)
  variables = init(model, clean)

  clean_logits, clean_state = model.apply(variables, clean, train=True, mutable=["batch_stats"])
  padded_logits, padded_state = model.apply(variables, padded, train=True, mask=mask,
                                            mutable=["batch_stats"])
  chex.assert_trees_all_close(padded_state, clean_state, rtol=1e-4, atol=1e-5)
  chex.assert_trees_all_close(padded_logits[np.asarray(mask)], clean_logits, rtol=1e-4, atol=1e-5)

  # Sanity check: without the mask the garbage does change the statistics.
  _, unmasked_state = model.apply(variables, padded, train=True, mutable=["batch_stats"])
  stem_mean = ("batch_stats", "stem_bn", "mean")
  assert not np.allclose(flatten(unmasked_state)[stem_mean], flatten(clean_state)[stem_mean], atol=1e-3)


def test_float_mask_accepted():
  model = tiny("resnet10")
  x = images()
  variables = init(model, x)
  _, bool_state = model.apply(variables, x, train=True, mask=jnp.array([1, 1, 1, 0], bool),
                              mutable=["batch_stats"])
  _, float_state = model.apply(variables, x, train=True, mask=jnp.array([1.0, 1.0, 1.0, 0.0]),
                               mutable=["batch_stats"])
  chex.assert_trees_all_close(bool_state, float_state)


def test_train_updates_batch_stats():
  model = tiny("resnet18_cifar")
  x = images() + 3.0
  variables = init(model, x)
  assert set(variables) == {"params", "batch_stats"}
  logits, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
  chex.assert_shape(logits, (BATCH, 10))
  old, new = flatten(variables["batch_stats"]), flatten(state["batch_stats"])
  assert old.keys() == new.keys()
  assert all(not np.allclose(old[k], new[k]) for k in old)
  # Momentum 0.9: the new running mean is 0.9 * old + 0.1 * the batch mean.
  conv = nn.Conv(4, (3, 3), padding=((1, 1), (1, 1)), use_bias=False)
  batch_mean = conv.apply({"params": variables["params"]["stem_conv"]}, x).mean(axis=(0, 1, 2))
  chex.assert_trees_all_close(new[("stem_bn", "mean")], 0.9 * old[("stem_bn", "mean")] + 0.1 * batch_mean,
                              atol=1e-5)
  # Eval mode reads the running averages and needs no mutable collection.
  chex.assert_shape(model.apply(variables, x), (BATCH, 10))


def test_models_without_bn_have_only_params():
  for name in ("cnn", "mlp"):
    assert {path[0] for path in shapes_of(tiny(name), images())} == {"params"}


def test_conv_init_is_untruncated_kaiming_fan_out():
  block = models.BasicBlock(channels=64)
  variables = block.init(jax.random.key(0), jnp.zeros((1, 4, 4, 64)))
  kernel = np.asarray(variables["params"]["conv1"]["kernel"])
  std = np.sqrt(2.0 / (3 * 3 * 64))
  assert abs(kernel.std() / std - 1) < 0.03
  assert np.abs(kernel).max() > 3 * std  # a truncated normal would stop near 2.3 std


@pytest.mark.slow
def test_bfloat16_resnet_returns_float32_logits():
  model = build_model("resnet10", 10, dtype=jnp.bfloat16, **TINY_RESNET)
  x = images()
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)
  assert {leaf.dtype for leaf in jax.tree.leaves(shapes)} == {jnp.dtype(jnp.float32)}
  assert model.apply(init(model, x), x).dtype == jnp.float32


def test_mlp_depth_cut_points():
  model = build_model("mlp", 3, hidden=(8, 6))
  assert model.cut_points == ("input", "hidden1", "hidden2", "features", "logits")
  x = images(size=4)
  variables = init(model, x)
  chex.assert_shape(model.apply(variables, x, stop="features"), (BATCH, 6))
  chex.assert_shape(model.apply(variables, x), (BATCH, 3))


def test_build_model_names_and_errors():
  assert isinstance(build_model("ResNet18", 10), models.ResNet)
  assert build_model("resnet18_cifar", 10).stem == "cifar"
  assert build_model("resnet26", 100).stage_sizes == (3, 3, 3, 3)
  with pytest.raises(ValueError, match="resnet99") as err:
    build_model("resnet99", 10)
  assert "resnet18_cifar" in str(err.value)
  for bad in (0, -0.5, float("nan")):
    with pytest.raises(ValueError, match=str(bad)):
      build_model("cnn", 10, width=bad)


def test_parse_group_spec():
  assert parse_group_spec("resnet18") == ("resnet18", 1.0)
  assert parse_group_spec("cnn@0.5") == ("cnn", 0.5)
  assert parse_group_spec("ResNet10@0.25") == ("resnet10", 0.25)
  for spec, bad in (("cnn@abc", "abc"), ("cnn@", "cnn@"), ("cnn@0", "0"), ("cnn@-1", "-1"),
                    ("vgg@0.5", "vgg")):
    with pytest.raises(ValueError, match=bad):
      parse_group_spec(spec)


@pytest.mark.slow
@pytest.mark.parametrize("window,strides,padding", [((2, 2), (2, 2), "VALID"), ((3, 3), (2, 2), "SAME"),
                                                    ((3, 3), (1, 1), "SAME"), ((3, 2), (2, 1), "VALID"),
                                                    ((2, 2), (2, 2), "SAME"), ((2, 2), (1, 1), ((1, 0), (0, 1)))])
def test_max_pool_matches_flax_in_value_and_gradient(window, strides, padding):
  x = jax.random.normal(jax.random.key(0), (3, 14, 15, 4))  # no ties, so one gradient
  ours = lambda x: max_pool(x, window, strides, padding)
  flax_pool = lambda x: nn.max_pool(x, window, strides, padding)
  chex.assert_trees_all_equal(ours(x), flax_pool(x))
  cotangent = jax.random.normal(jax.random.key(1), ours(x).shape)
  grad = lambda pool: jax.grad(lambda x: (pool(x) * cotangent).sum())(x)
  # An input that is the maximum of overlapping windows sums their cotangents in another order.
  chex.assert_trees_all_close(grad(ours), grad(flax_pool), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("size,window,strides,padding", [
    ((2, 2), (3, 3), (1, 1), ((1, 1), (1, 1))),  # a ResNet's 2x2 stage: every tap reads input
    ((1, 1), (3, 3), (1, 1), ((1, 1), (1, 1))),  # 1x1 map: only the centre tap reads input
    ((4, 4), (3, 3), (2, 2), ((1, 1), (1, 1))),  # strided into a 2x2 map
    ((2, 2), (3, 3), (2, 2), "SAME"),  # 1x1 map from a padding string
    ((3, 2), (2, 3), (2, 1), ((0, 1), (1, 1))),  # uneven kernel, strides and padding
    ((8, 8), (3, 3), (1, 1), ((1, 1), (1, 1))),  # too large a map: lax's convolution
    ((2, 2), (1, 1), (1, 1), "VALID"),  # 1x1 kernel: lax's convolution
    ((2, 2), (3, 3), (1, 1), "VALID"),  # an empty output map: lax's convolution
    ((1, 1), (3, 3), (2, 2), ((3, 0), (0, 3))),  # every tap reads padding: lax's convolution
])
def test_convolution_matches_lax_in_value_and_gradient(size, window, strides, padding):
  x = jax.random.normal(jax.random.key(0), (5, *size, 6))
  kernel = jax.random.normal(jax.random.key(1), (*window, 6, 7))
  ours = lambda x, k: convolution(x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
  theirs = lambda x, k: jax.lax.conv_general_dilated(x, k, strides, padding,
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  y = ours(x, kernel)
  chex.assert_shape(y, theirs(x, kernel).shape)
  chex.assert_trees_all_close(y, theirs(x, kernel), rtol=1e-5, atol=1e-5)
  cotangent = jax.random.normal(jax.random.key(2), y.shape)
  grads = lambda conv: jax.grad(lambda x, k: (conv(x, k) * cotangent).sum(), argnums=(0, 1))(x, kernel)
  chex.assert_trees_all_close(grads(ours), grads(theirs), rtol=1e-5, atol=1e-5)


def primitive_names(jaxpr) -> list[str]:
  """The primitives of ``jaxpr``'s equations, those inside a custom gradient's forward pass included (a CPU's
  convolutions carry their gradient's layout, `models.client_conv.canonical_convolution`)."""
  names = []
  for eqn in jaxpr.eqns:
    inner = [getattr(v, "jaxpr", v) for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    names += sum((primitive_names(j) for j in inner), []) if inner else [eqn.primitive.name]
  return names


def test_convolution_is_one_product_only_on_tiny_maps():
  def primitives(size):
    x = jnp.zeros((2, size, size, 3))
    kernel = jnp.zeros((3, 3, 3, 4))
    jaxpr = jax.make_jaxpr(lambda x, k: convolution(x, k, (1, 1), ((1, 1), (1, 1)),
                                                    dimension_numbers=("NHWC", "HWIO", "NHWC")))(x, kernel)
    return set(primitive_names(jaxpr.jaxpr))

  assert SMALL_MAP_POSITIONS == 4
  assert "conv_general_dilated" not in primitives(2) and "dot_general" in primitives(2)
  assert "conv_general_dilated" in primitives(3)  # a 3x3 output map has 9 positions


def test_resnet_uses_the_tiny_map_convolution():
  model = build_model("resnet18", 10, width=0.25)
  x = jnp.zeros((2, 28, 28, 1))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
  # 20 convolutions: the stem, stages 1-2 (7x7 and 4x4 maps) and the two 1x1 downsamples of stages 3-4
  # convolve; the other 8 of stages 3-4 (2x2 and 1x1 maps) multiply, as does the head.
  names = primitive_names(jaxpr.jaxpr)
  assert names.count("conv_general_dilated") == 12 and names.count("dot_general") == 8 + 1


def test_building_a_simulation_traces_each_model_once_for_its_shapes():
  """The checks, the choice of the global model, the union's layout and the initialization share one trace of a
  model's shapes (`models.variable_shapes`): building a simulation and its initial state traces a group's model
  once for them and twice for the dissimilarity's low and high parts (the initialization's program adds one for the
  global model)."""
  from tests.helpers import simulation, tiny_resnet

  compilation.release_programs()
  models.common._cached_shapes.cache_clear()
  traced = []

  def count(next_fun, args, kwargs, context):
    if isinstance(context.module, models.ResNet) and context.method_name == "__call__":
      traced.append(context.module.width)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(count):
    sim = simulation("HeteroAvg", [("r@1", tiny_resnet()), ("r@0.5", tiny_resnet(width=0.5))],
                     track_dissimilarity=True)
    sim.init_state()
  assert traced.count(0.5) == 3 and traced.count(1.0) <= 4, traced
