"""Tests for the static group maps: extract/embed/coverage, sub-model checks, pick_global."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero.hetero import build_group_map, coverage, embed, extract, identity_map, pick_global
from fedjax_hetero.hetero.maps import flatten
from fedjax_hetero.models import build_model

NUM_CLASSES = 4
CNN_INPUT = jnp.zeros((1, 8, 8, 1), jnp.float32)
RESNET_INPUT = jnp.zeros((1, 16, 16, 3), jnp.float32)


def cnn(width):
  return build_model("cnn", NUM_CLASSES, width, channels=(4, 8), hidden=8)


def resnet(name, width=1.0):
  return build_model(name, NUM_CLASSES, width, base_channels=4)


def shapes(model, x):
  """Variable shapes of `model.init` (ShapeDtypeStruct leaves), without running it."""
  return jax.eval_shape(model.init, jax.random.key(0), x)


def filled(shape_tree, seed):
  """numpy-random float32 arrays shaped like `shape_tree` (no PRNG compiles)."""
  rng = np.random.default_rng(seed)
  out = {path: rng.normal(size=leaf.shape).astype(np.float32) for path, leaf in flatten(shape_tree).items()}
  return traverse_util.unflatten_dict(out)


# (global model, group model, input, name); each group is a sub-model of its global one.
CASES = {
    "width": (lambda: cnn(1.0), lambda: cnn(0.5), CNN_INPUT),
    "depth": (lambda: resnet("resnet26"), lambda: resnet("resnet10"), RESNET_INPUT),
    "depth_and_width": (lambda: resnet("resnet26"), lambda: resnet("resnet14", 0.5), RESNET_INPUT),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
  make_global, make_group, x = CASES[request.param]
  global_shapes, group_shapes = shapes(make_global(), x), shapes(make_group(), x)
  group_map = build_group_map(global_shapes, group_shapes, request.param)
  return request.param, global_shapes, group_shapes, group_map


def test_the_cases_are_real_width_and_depth_groups():
  """Guards the fixtures: the width group has narrower leaves, the depth group lacks blocks."""
  global_flat, group_flat = flatten(shapes(cnn(1.0), CNN_INPUT)), flatten(shapes(cnn(0.5), CNN_INPUT))
  assert set(global_flat) == set(group_flat)
  assert group_flat[("params", "conv1", "kernel")].shape == (3, 3, 1, 2)
  assert global_flat[("params", "conv1", "kernel")].shape == (3, 3, 1, 4)
  # fc1 input is the channel-major flattening: 8 channels * 2 * 2 vs 4 * 2 * 2.
  assert global_flat[("params", "fc1", "kernel")].shape == (32, 8)
  assert group_flat[("params", "fc1", "kernel")].shape == (16, 4)
  deep, shallow = flatten(shapes(resnet("resnet26"), RESNET_INPUT)), flatten(shapes(resnet("resnet10"), RESNET_INPUT))
  assert set(shallow) < set(deep)
  assert ("params", "stage3_block2", "conv1", "kernel") in deep
  assert not any(p[1] == "stage3_block2" for p in shallow)
  assert any(p[0] == "batch_stats" for p in shallow)


def test_map_records_owned_shapes(case):
  _, global_shapes, group_shapes, group_map = case
  group_flat = flatten(group_shapes)
  assert set(group_map.owned) == set(flatten(global_shapes))
  for path, owned in group_map.owned.items():
    if path in group_flat:
      assert owned == tuple(group_flat[path].shape)
    else:
      assert owned is None
  assert {link.client for link in group_map.pull} == set(group_flat)
  assert group_map.num_owned() == sum(int(np.prod(leaf.shape)) for leaf in group_flat.values())


def jitted_ops(group_map, global_shapes):
  """embed/extract/coverage of one map, each compiled once (eager runs compile a pad per leaf shape)."""
  embed_fn = jax.jit(lambda group_vars, like: embed(group_vars, group_map, like))
  extract_fn = jax.jit(lambda global_vars: extract(global_vars, group_map))
  coverage_fn = jax.jit(lambda: coverage(group_map, global_shapes))
  return embed_fn, extract_fn, coverage_fn


def check_embedded(name, embedded, group_vars):
  group_flat = flatten(group_vars)
  for path, leaf in flatten(embedded).items():
    leaf = np.asarray(leaf)
    if path not in group_flat:  # a layer the group does not have: all zeros
      np.testing.assert_array_equal(leaf, 0.0, err_msg=f"{name}: {path}")
      continue
    owned = tuple(slice(0, d) for d in group_flat[path].shape)
    np.testing.assert_array_equal(leaf[owned], group_flat[path], err_msg=f"{name}: {path}")
    outside = leaf.copy()
    outside[owned] = 0.0
    np.testing.assert_array_equal(outside, 0.0, err_msg=f"{name}: {path} is not zero outside the owned slice")


def check_coverage(mask, group_shapes):
  group_flat = flatten(group_shapes)
  for path, leaf in flatten(mask).items():
    expected = np.zeros(leaf.shape, np.float32)
    if path in group_flat:
      expected[tuple(slice(0, d) for d in group_flat[path].shape)] = 1.0
    assert leaf.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=str(path))


def test_extract_embed_round_trip(case):
  """extract(embed(g)) == g, embed is zero outside the owned slice; under jit."""
  name, global_shapes, group_shapes, group_map = case
  embed_fn, extract_fn, _ = jitted_ops(group_map, global_shapes)
  group_vars = filled(group_shapes, seed=1)
  global_like = filled(global_shapes, seed=2)
  embedded = embed_fn(group_vars, global_like)
  chex.assert_trees_all_equal_shapes(embedded, global_like)
  chex.assert_trees_all_equal(extract_fn(embedded), group_vars)
  check_embedded(name, embedded, group_vars)


def test_extract_takes_the_leading_slice(case):
  _, global_shapes, group_shapes, group_map = case
  _, extract_fn, _ = jitted_ops(group_map, global_shapes)
  global_vars = filled(global_shapes, seed=3)
  got = extract_fn(global_vars)
  chex.assert_trees_all_equal_shapes(got, group_shapes)
  global_flat = flatten(global_vars)
  for path, leaf in flatten(got).items():
    expected = global_flat[path][tuple(slice(0, d) for d in leaf.shape)]
    np.testing.assert_array_equal(np.asarray(leaf), expected)


def test_coverage_is_one_exactly_on_the_owned_slice(case):
  _, global_shapes, group_shapes, group_map = case
  _, _, coverage_fn = jitted_ops(group_map, global_shapes)
  check_coverage(coverage_fn(), group_shapes)


def test_map_operations_eagerly():
  """The same operations outside jit (width group only; eager pads compile per leaf shape)."""
  global_shapes, group_shapes = shapes(cnn(1.0), CNN_INPUT), shapes(cnn(0.5), CNN_INPUT)
  group_map = build_group_map(global_shapes, group_shapes)
  group_vars = filled(group_shapes, seed=4)
  embedded = embed(group_vars, group_map, filled(global_shapes, seed=5))
  check_embedded("eager", embedded, group_vars)
  chex.assert_trees_all_equal(extract(embedded, group_map), group_vars)
  check_coverage(coverage(group_map, global_shapes), group_shapes)


def test_identity_map_extracts_everything():
  global_vars = filled(shapes(cnn(1.0), CNN_INPUT), seed=6)
  ident = identity_map(global_vars)
  chex.assert_trees_all_equal(extract(global_vars, ident), global_vars)
  chex.assert_trees_all_equal(embed(global_vars, ident, global_vars), global_vars)
  chex.assert_trees_all_equal(coverage(ident, global_vars), jax.tree.map(jnp.ones_like, global_vars))


def test_embed_casts_to_the_global_dtype():
  global_shapes, group_shapes = shapes(cnn(1.0), CNN_INPUT), shapes(cnn(0.5), CNN_INPUT)
  group_map = build_group_map(global_shapes, group_shapes)
  group16 = jax.tree.map(lambda x: x.astype(np.float16), filled(group_shapes, seed=7))
  embedded = embed(group16, group_map, global_shapes)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(embedded))


def test_wider_group_is_rejected_naming_the_layer():
  narrow, wide = shapes(cnn(0.5), CNN_INPUT), shapes(cnn(1.0), CNN_INPUT)
  with pytest.raises(ValueError, match=r"^cnn@1: layer params/conv1/(kernel|bias) has shape .* not a leading slice"):
    build_group_map(narrow, wide, "cnn@1")


def test_deeper_group_is_rejected_naming_the_missing_layer():
  shallow, deep = shapes(resnet("resnet10"), RESNET_INPUT), shapes(resnet("resnet26"), RESNET_INPUT)
  with pytest.raises(ValueError, match=r"^resnet26: layer (params|batch_stats)/stage\d_block[12]/\S+ does not exist"):
    build_group_map(shallow, deep, "resnet26")


def test_rank_mismatch_is_rejected():
  global_shapes = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct((4, 4), jnp.float32)}}}
  group_shapes = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct((4,), jnp.float32)}}}
  with pytest.raises(ValueError, match="layer params/dense/kernel"):
    build_group_map(global_shapes, group_shapes, "g")


def test_pick_global_picks_the_largest():
  widths = [0.25, 1.0, 0.5]
  trees = [shapes(cnn(w), CNN_INPUT) for w in widths]
  assert pick_global(trees, [f"cnn@{w}" for w in widths]) == 1
  depths = ["resnet10", "resnet14", "resnet26", "resnet18"]
  trees = [shapes(resnet(n), RESNET_INPUT) for n in depths]
  assert pick_global(trees, depths) == 2
  assert pick_global(trees[:1], depths[:1]) == 0


def test_pick_global_rejects_groups_that_do_not_nest():
  trees = [shapes(cnn(1.0), CNN_INPUT), shapes(build_model("mlp", NUM_CLASSES, 1.0, hidden=(16,)), CNN_INPUT)]
  # The MLP is the larger model here, so the CNN is the group that does not embed.
  with pytest.raises(ValueError, match=r"^cnn: layer params/conv1/\w+ does not exist in the global model"):
    pick_global(trees, ["cnn", "mlp"])
