"""Aggregation rules against plain-numpy reference implementations, all run under jit."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import aggregators
from fedjax_hetero.hetero import build_group_map, extract, identity_map
from fedjax_hetero.hetero.maps import flatten
from tests.helpers import random_tree

# Global leaf shapes, and three groups' owned shapes (None: the group lacks the layer).
GLOBAL = {
    ("params", "dense", "kernel"): (6, 5),
    ("params", "dense", "bias"): (5,),
    ("params", "conv", "kernel"): (3, 3, 4, 2),
    ("batch_stats", "bn", "mean"): (7,),
}
GROUPS = [
    {("params", "dense", "kernel"): (2, 3), ("params", "dense", "bias"): (3,),
     ("params", "conv", "kernel"): (3, 3, 1, 1), ("batch_stats", "bn", "mean"): (2,)},
    {("params", "dense", "kernel"): (4, 2), ("params", "dense", "bias"): (4,),
     ("batch_stats", "bn", "mean"): (5,)},  # no conv layer
    {("params", "dense", "kernel"): (3, 4), ("params", "dense", "bias"): (2,),
     ("params", "conv", "kernel"): (2, 3, 2, 1)},  # no bn layer
]


def unflat(flat):
  return traverse_util.unflatten_dict(dict(flat))


def shape_tree(shapes):
  return unflat({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()})


@pytest.fixture(scope="module")
def maps():
  return [build_group_map(shape_tree(GLOBAL), shape_tree(g), f"g{i}") for i, g in enumerate(GROUPS)]


def owned_slice(shape):
  return tuple(slice(0, d) for d in shape)


def numpy_sums(group_sums, group_weights):
  """Global-shaped numerator and denominator, accumulated group by group in numpy."""
  num = {p: np.zeros(s, np.float64) for p, s in GLOBAL.items()}
  den = {p: np.zeros(s, np.float64) for p, s in GLOBAL.items()}
  for sums, weight, owned in zip(group_sums, group_weights, GROUPS):
    sums = flatten(sums)
    for path, shape in owned.items():
      num[path][owned_slice(shape)] += sums[path]
      den[path][owned_slice(shape)] += float(weight)
  return num, den


def numpy_hetero_avg(global_vars, group_sums, group_weights):
  num, den = numpy_sums(group_sums, group_weights)
  old = flatten(global_vars)
  out = {}
  for path in GLOBAL:
    delta = np.divide(num[path], den[path], out=np.zeros_like(num[path]), where=den[path] > 0)
    out[path] = old[path] + delta
  return unflat(out)


def numpy_hetero_avg_weights(global_vars, group_sums, group_weights):
  num, den = numpy_sums(group_sums, group_weights)
  old = flatten(global_vars)
  out = {}
  for path in GLOBAL:
    out[path] = np.where(den[path] > 0, num[path] / np.where(den[path] > 0, den[path], 1.0), old[path])
  return unflat(out)


def uncovered(path):
  """Elements of a global leaf that no group owns."""
  mask = np.ones(GLOBAL[path], bool)
  for owned in GROUPS:
    if path in owned:
      mask[owned_slice(owned[path])] = False
  return mask


def test_fixture_has_elements_covered_by_nobody_and_by_several():
  for path in GLOBAL:
    assert uncovered(path).any(), path
  counts = np.zeros(GLOBAL[("params", "dense", "kernel")])
  for owned in GROUPS:
    counts[owned_slice(owned[("params", "dense", "kernel")])] += 1
  assert counts.max() == 3 and (counts == 1).any() and (counts == 2).any()


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  global_vars = random_tree(GLOBAL, rng)
  group_sums = [random_tree(g, rng) for g in GROUPS]
  group_weights = [jnp.float32(w) for w in (2.0, 5.0, 3.0)]
  return global_vars, group_sums, group_weights


def test_masked_mean_matches_numpy():
  rng = np.random.default_rng(1)
  total = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
  weight = {"a": rng.choice([0.0, 0.5, 2.0], size=(4, 3)).astype(np.float32),
            "b": np.array([0, 1, 0, 3, 0], np.float32)}
  fallback = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
  assert (weight["a"] == 0).any() and (weight["a"] > 0).any()
  got = jax.jit(aggregators.masked_mean)(total, weight, fallback)
  for k in total:
    expected = np.where(weight[k] > 0, total[k] / np.where(weight[k] > 0, weight[k], 1.0), fallback[k])
    np.testing.assert_allclose(np.asarray(got[k]), expected, rtol=1e-6, atol=1e-7)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))


def test_hetero_avg_matches_numpy(maps, data):
  global_vars, group_sums, group_weights = data
  got = jax.jit(lambda g, s, w: aggregators.hetero_avg(g, s, w, maps))(global_vars, group_sums, group_weights)
  expected = numpy_hetero_avg(global_vars, group_sums, group_weights)
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  for path, leaf in flatten(got).items():  # nobody covers it: unchanged
    np.testing.assert_array_equal(np.asarray(leaf)[uncovered(path)], flatten(global_vars)[path][uncovered(path)])


def test_hetero_avg_weights_matches_numpy(maps, data):
  global_vars, group_sums, group_weights = data
  fn = jax.jit(lambda g, s, w: aggregators.hetero_avg_weights(g, s, w, maps))
  got = fn(global_vars, group_sums, group_weights)
  expected = numpy_hetero_avg_weights(global_vars, group_sums, group_weights)
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
  for path, leaf in flatten(got).items():
    np.testing.assert_array_equal(np.asarray(leaf)[uncovered(path)], flatten(global_vars)[path][uncovered(path)])


def test_heterogeneous_mean_delta_is_zero_where_uncovered(maps, data):
  global_vars, group_sums, group_weights = data
  delta = jax.jit(lambda s, w, g: aggregators.heterogeneous_mean_delta(s, w, maps, g))(
      group_sums, group_weights, global_vars)
  expected = jax.tree.map(np.subtract, numpy_hetero_avg(global_vars, group_sums, group_weights), global_vars)
  chex.assert_trees_all_close(delta, expected, rtol=1e-5, atol=1e-6)
  for path, leaf in flatten(delta).items():
    np.testing.assert_array_equal(np.asarray(leaf)[uncovered(path)], 0.0)


def test_group_with_zero_weight_changes_nothing_it_alone_owns(maps, data):
  """A group with no sampled clients (W=0, S=0) neither updates nor dilutes."""
  global_vars, group_sums, _ = data
  weights = [jnp.float32(2.0), jnp.float32(0.0), jnp.float32(3.0)]
  sums = [group_sums[0], jax.tree.map(np.zeros_like, group_sums[1]), group_sums[2]]
  got = jax.jit(lambda g, s, w: aggregators.hetero_avg(g, s, w, maps))(global_vars, sums, weights)
  chex.assert_trees_all_close(got, numpy_hetero_avg(global_vars, sums, weights), rtol=1e-5, atol=1e-6)
  # bn/mean[2:5] is owned only by group 1, which took no part.
  bn = ("batch_stats", "bn", "mean")
  np.testing.assert_array_equal(np.asarray(flatten(got)[bn])[2:], flatten(global_vars)[bn][2:])


@pytest.mark.parametrize("fn", ["hetero_avg", "hetero_avg_weights", "scaffold_server_control"])
def test_a_group_of_weight_zero_is_left_out_under_jit_as_eagerly_whatever_its_sums(maps, data, fn):
  """(Fifth probe survey: under jit a weight-0 group's sums were added to the numerator.)"""
  global_vars, group_sums, _ = data
  weights = [jnp.float32(2.0), jnp.float32(0.0), jnp.float32(3.0)]
  sums = [group_sums[0], jax.tree.map(lambda x: np.full_like(x, np.nan), group_sums[1]), group_sums[2]]
  rule = lambda g, s, w: getattr(aggregators, fn)(g, s, w, maps)
  eager = rule(global_vars, sums, weights)
  chex.assert_trees_all_close(jax.jit(rule)(global_vars, sums, weights), eager, rtol=1e-6, atol=1e-7)
  chex.assert_tree_all_finite(eager)


def test_float16_sums_whose_mean_fits_do_not_overflow(maps, data):
  """(Fifth probe survey: two float16 sums of 40,000 averaged to inf: the sum across groups was float16.)"""
  global_vars, group_sums, _ = data
  half = lambda tree, value: jax.tree.map(lambda x: np.full_like(x, value, np.float16), tree)
  got = aggregators.hetero_avg_weights(half(global_vars, 0.0), [half(s, 40_000.0) for s in group_sums],
                                       [jnp.float32(2.0)] * 3, maps)
  assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(got))
  kernel = np.asarray(flatten(got)[("params", "dense", "kernel")], np.float32)
  assert np.isfinite(kernel).all() and kernel.max() == 20_000.0
  fedfa, _ = aggregators.fedfa_aggregate(half(global_vars, 0.0), [half(s, 40_000.0) for s in group_sums],
                                         [1.0] * 3, maps)
  assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves(fedfa))


def test_hetero_avg_on_deltas_equals_average_of_uploaded_weights(maps, data):
  """Uploading w_c = start + delta_c: sum_c w_c * upload_c = S_g + W_g * extract(global)."""
  global_vars, group_sums, group_weights = data
  uploads = [jax.tree.map(lambda s, x, w=w: s + w * x, sums, extract(global_vars, m))
             for sums, w, m in zip(group_sums, group_weights, maps)]
  on_deltas = jax.jit(lambda g, s, w: aggregators.hetero_avg(g, s, w, maps))(global_vars, group_sums, group_weights)
  on_weights = jax.jit(lambda g, s, w: aggregators.hetero_avg_weights(g, s, w, maps))(
      global_vars, uploads, group_weights)
  chex.assert_trees_all_close(on_deltas, on_weights, rtol=1e-5, atol=1e-5)


def test_single_group_identity_map_equals_fedavg():
  rng = np.random.default_rng(2)
  variables = random_tree(GLOBAL, rng)
  delta_sum = random_tree(GLOBAL, rng)
  weight = jnp.float32(4.0)
  ident = identity_map(variables)
  got = jax.jit(lambda v, d, w: aggregators.hetero_avg(v, [d], [w], [ident]))(variables, delta_sum, weight)
  want = jax.jit(aggregators.fedavg)(variables, delta_sum, weight)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(want, jax.tree.map(lambda v, d: v + d / 4.0, variables, delta_sum), rtol=1e-6, atol=1e-6)
  unchanged = jax.jit(aggregators.fedavg)(variables, delta_sum, jnp.float32(0.0))
  chex.assert_trees_all_equal(unchanged, variables)


@pytest.mark.parametrize("weighting", ["uniform", "num_samples"])
def test_per_client_layerwise_mean(maps, weighting):
  """Clients summarised per group give the per-element mean over the clients that own it.

  The reference averages client by client (never summing per group first), with
  weights 1 (uniform) or the client's sample count.
  """
  rng = np.random.default_rng(3)
  global_vars = random_tree(GLOBAL, rng)
  clients = [(g, int(n)) for g, n in [(0, 10), (0, 30), (1, 5), (2, 40), (2, 1), (2, 7)]]
  deltas = [random_tree(GROUPS[g], rng) for g, _ in clients]
  weight_of = (lambda n: 1.0) if weighting == "uniform" else float

  group_sums, group_weights = [], []
  for gi in range(len(GROUPS)):
    members = [(d, weight_of(n)) for (g, n), d in zip(clients, deltas) if g == gi]
    group_sums.append(jax.tree.map(lambda *xs: sum(w * x for x, (_, w) in zip(xs, members)),
                                   *[d for d, _ in members]))
    group_weights.append(jnp.float32(sum(w for _, w in members)))
  got = jax.jit(lambda g, s, w: aggregators.hetero_avg(g, s, w, maps))(global_vars, group_sums, group_weights)

  expected = {}
  for path, shape in GLOBAL.items():
    num, den = np.zeros(shape), np.zeros(shape)
    for (g, n), d in zip(clients, deltas):
      if path in GROUPS[g]:
        num[owned_slice(GROUPS[g][path])] += weight_of(n) * flatten(d)[path]
        den[owned_slice(GROUPS[g][path])] += weight_of(n)
    expected[path] = flatten(global_vars)[path] + np.divide(num, den, out=np.zeros(shape), where=den > 0)
  chex.assert_trees_all_close(got, unflat(expected), rtol=1e-5, atol=1e-5)


def test_uniform_and_sample_weighting_differ(maps):
  """Guards the parametrized test above against weights that happen not to matter."""
  rng = np.random.default_rng(4)
  global_vars = random_tree(GLOBAL, rng)
  a, b = random_tree(GROUPS[0], rng), random_tree(GROUPS[0], rng)
  one = [maps[0]]
  avg = jax.jit(lambda g, s, w: aggregators.hetero_avg(g, s, w, one))
  uniform = avg(global_vars, [jax.tree.map(lambda x, y: x + y, a, b)], [jnp.float32(2.0)])
  weighted = avg(global_vars, [jax.tree.map(lambda x, y: 1 * x + 9 * y, a, b)], [jnp.float32(10.0)])
  kernel = ("params", "dense", "kernel")
  np.testing.assert_allclose(np.asarray(flatten(uniform)[kernel])[:2, :3],
                             flatten(global_vars)[kernel][:2, :3] + (a["params"]["dense"]["kernel"] +
                                                                  b["params"]["dense"]["kernel"]) / 2, rtol=1e-5)
  assert not np.allclose(np.asarray(flatten(uniform)[kernel]), np.asarray(flatten(weighted)[kernel]))


def test_heterogeneous_sums_matches_numpy(maps, data):
  global_vars, group_sums, group_weights = data
  num, den = jax.jit(lambda s, w, g: aggregators.heterogeneous_sums(s, w, maps, g))(
      group_sums, group_weights, global_vars)
  want_num, want_den = numpy_sums(group_sums, group_weights)
  chex.assert_trees_all_close(num, unflat(want_num), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(den, unflat(want_den), rtol=1e-6)
