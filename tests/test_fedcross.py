"""FedCross building blocks against plain-numpy references, all run under jit."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.aggregators import fedcross

K = 5
# Leaf shapes of one model (a leading K axis is added); nested like flax variables.
SHAPES = {"params": {"conv": {"kernel": (3, 3, 2, 4), "bias": (4,)}, "dense": {"kernel": (6, 3), "bias": (3,)}},
          "batch_stats": {"bn": {"mean": (4,)}}}

similarity_jit = jax.jit(aggregators.similarity_matrix, static_argnames="kind")


def random_stacked(rng, num_models=K, origin_scale=0.0, spread=1.0):
  """K models: a shared origin (scaled) plus independent noise (scaled)."""
  def leaf(shape):
    origin = origin_scale * rng.normal(size=shape)
    return (origin[None] + spread * rng.normal(size=(num_models,) + shape)).astype(np.float32)
  return jax.tree.map(leaf, SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def numpy_leaves(stacked):
  return [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)]


def numpy_cosine(x):
  norms = np.linalg.norm(x, axis=1)
  prod = np.outer(norms, norms)
  return np.divide(x @ x.T, prod, out=np.zeros_like(prod), where=prod > 0)


def numpy_layers(stacked):
  """One [K, size] matrix per module: the leaves under one parent dict, concatenated."""
  layers = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(stacked)[0]:
    layers.setdefault(tuple(path[:-1]), []).append(np.asarray(leaf, np.float64).reshape(leaf.shape[0], -1))
  return [np.concatenate(parts, axis=1) for parts in layers.values()]


def numpy_similarity(stacked, kind):
  leaves = numpy_leaves(stacked)
  if kind == "layerwise":
    return sum(numpy_cosine(x) for x in numpy_layers(stacked))
  x = np.concatenate(leaves, axis=1)
  if kind == "cosine":
    return numpy_cosine(x)
  norms = np.linalg.norm(x, axis=1)
  return (x @ x.T) / (norms[:, None] + norms[None, :])


def numpy_in_order(num_models, r):
  return np.array([(i + r % (num_models - 1) + 1) % num_models for i in range(num_models)])


def authors_lowest(sim):
  """The authors' loop: start at (j+1) % m, move on strictly smaller, skip j."""
  m = len(sim)
  out = []
  for j in range(m):
    tag = (j + 1) % m
    for p in range(m):
      if p != j and sim[j][p] < sim[j][tag]:
        tag = p
    out.append(tag)
  return np.array(out)


def authors_highest(sim):
  """The authors' loop on their table (diagonal 0): start at 0, move on strictly larger."""
  sim = np.array(sim, np.float64)
  np.fill_diagonal(sim, 0.0)
  out = []
  for j in range(len(sim)):
    tag = 0
    for p in range(len(sim)):
      if sim[j][p] > sim[j][tag]:
        tag = p
    out.append(tag)
  return np.array(out)


def numpy_mix(stacked, partners, alpha):
  return jax.tree.map(lambda v: alpha * np.asarray(v, np.float64) + (1 - alpha) * np.asarray(v, np.float64)[partners],
                      stacked)


# --- in-order selection ------------------------------------------------------


def test_in_order_is_a_fixed_point_free_permutation_matching_numpy():
  fn = jax.jit(aggregators.in_order_partners, static_argnums=0)
  for num_models in (2, 3, 4, 7, 10):
    for r in itertools.chain(range(25), (97, 1000, 12345)):
      got = np.asarray(fn(num_models, r))
      assert got.dtype == np.int32 and got.shape == (num_models,)
      np.testing.assert_array_equal(got, numpy_in_order(num_models, r))
      assert sorted(got) == list(range(num_models)), (num_models, r)
      assert (got != np.arange(num_models)).all(), (num_models, r)


@pytest.mark.parametrize("num_models", [2, 3, 5, 10])
def test_in_order_meets_every_other_slot_once_per_k_minus_1_rounds(num_models):
  fn = jax.jit(aggregators.in_order_partners, static_argnums=0)
  for start in (0, 1, num_models + 3, 50):
    met = np.stack([np.asarray(fn(num_models, start + t)) for t in range(num_models - 1)])  # [K-1, K]
    for i in range(num_models):
      assert sorted(met[:, i]) == [j for j in range(num_models) if j != i], (start, i)


def test_in_order_accepts_a_traced_round():
  fn = jax.jit(lambda r: aggregators.in_order_partners(6, r))
  for r in range(12):
    np.testing.assert_array_equal(np.asarray(fn(jnp.int32(r))), numpy_in_order(6, r))


# --- cross-aggregation and the global model ------------------------------------


@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99])
def test_cross_aggregate_matches_numpy(alpha):
  rng = np.random.default_rng(0)
  uploaded = random_stacked(rng)
  partners = np.array([3, 0, 0, 4, 2], np.int32)  # not a permutation, as similarity selection allows
  got = jax.jit(aggregators.cross_aggregate)(uploaded, partners, alpha)
  chex.assert_trees_all_close(got, numpy_mix(uploaded, partners, alpha), rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, uploaded)


def test_in_order_cross_aggregation_preserves_the_mean():
  """Eq. (2): sum_i w_i = sum_i v_i for any alpha when partners are a permutation."""
  rng = np.random.default_rng(1)
  uploaded = random_stacked(rng)
  step = jax.jit(lambda u, r, a: aggregators.fedcross_aggregate(u, aggregators.in_order_partners(K, r), a))
  want = jax.tree.map(lambda v: np.asarray(v, np.float64).mean(0), uploaded)
  for r, alpha in [(0, 0.99), (1, 0.5), (2, 0.8), (7, 0.3)]:
    middleware, glob = step(uploaded, r, alpha)
    chex.assert_trees_all_close(aggregators.global_model(middleware), want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(glob, want, rtol=1e-5, atol=1e-6)


def test_alpha_one_is_no_mixing():
  rng = np.random.default_rng(2)
  uploaded = random_stacked(rng)
  for partners in (aggregators.in_order_partners(K, 3), jnp.array([1, 1, 1, 1, 0], jnp.int32)):
    chex.assert_trees_all_equal(jax.jit(aggregators.cross_aggregate)(uploaded, partners, 1.0), uploaded)


def test_global_model_variants():
  rng = np.random.default_rng(3)
  uploaded = random_stacked(rng)
  partners = jnp.array([1, 0, 0, 0, 1], jnp.int32)  # lowest-similarity-like: not a permutation
  alpha = 0.9
  step = jax.jit(aggregators.fedcross_aggregate, static_argnames="global_from")
  mid_p, glob_paper = step(uploaded, partners, alpha, global_from="middleware")
  mid_a, glob_authors = step(uploaded, partners, alpha, global_from="uploaded")
  chex.assert_trees_all_equal(mid_p, mid_a)
  mixed = numpy_mix(uploaded, np.asarray(partners), alpha)
  chex.assert_trees_all_close(glob_paper, jax.tree.map(lambda v: v.mean(0), mixed), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(glob_authors, jax.tree.map(lambda v: np.asarray(v, np.float64).mean(0), uploaded),
                              rtol=1e-5, atol=1e-6)
  # They differ by (1 - alpha) * (mean of chosen partners - mean of uploads) (spec 1.5).
  diff = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), glob_paper, glob_authors)
  want = jax.tree.map(lambda v: (1 - alpha) * (np.asarray(v, np.float64)[np.asarray(partners)].mean(0) -
                                               np.asarray(v, np.float64).mean(0)), uploaded)
  chex.assert_trees_all_close(diff, want, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError):
    aggregators.fedcross_aggregate(uploaded, partners, alpha, global_from="both")


# --- similarity ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cosine", "paper", "layerwise"])
def test_similarity_matrix_matches_numpy(kind):
  rng = np.random.default_rng(4)
  for stacked in (random_stacked(rng), random_stacked(rng, origin_scale=1.0, spread=0.3)):
    got = np.asarray(similarity_jit(stacked, kind=kind))
    assert got.shape == (K, K) and got.dtype == np.float32
    want = numpy_similarity(stacked, kind)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, got.T, rtol=1e-6, atol=1e-7)


def test_similarity_kinds_rank_partners_differently():
  """Guards the kind switch: the printed '+' formula is not a monotone map of cosine."""
  rng = np.random.default_rng(5)
  stacked = jax.tree.map(lambda x: x * np.arange(1, K + 1, dtype=np.float32).reshape((K,) + (1,) * (x.ndim - 1)),
                         random_stacked(rng, origin_scale=1.0, spread=0.5))
  picks = {kind: np.asarray(aggregators.highest_similarity_partners(similarity_jit(stacked, kind=kind)))
           for kind in aggregators.fedcross.SIMILARITY_KINDS}
  assert not np.array_equal(picks["cosine"], picks["paper"])
  assert not np.array_equal(picks["cosine"], picks["layerwise"])


def test_cosine_is_accurate_for_nearly_identical_models():
  """Shared origin plus a 1% spread (1 - cos ~ 1e-5): exact up to float32 rounding of the output.

  A raw float32 Gram matrix is off by ~2e-7 here, a sizeable part of the gaps
  that lowest/highest selection has to rank.
  """
  rng = np.random.default_rng(6)
  origin = 3.0 + rng.normal(size=(1, 20000))
  stacked = {"w": (origin + 0.01 * rng.normal(size=(K, 20000))).astype(np.float32),
             "b": (origin[:, :300] + 0.01 * rng.normal(size=(K, 300))).astype(np.float32)}
  got = np.asarray(similarity_jit(stacked, kind="cosine"))
  np.testing.assert_allclose(got, numpy_similarity(stacked, "cosine"), rtol=0, atol=6e-8)  # half an ulp below 1
  got = np.asarray(similarity_jit(stacked, kind="layerwise"))
  np.testing.assert_allclose(got, numpy_similarity(stacked, "layerwise"), rtol=0, atol=3e-7)  # one layer: w and b share the root


def test_similarity_handles_all_zero_layers():
  """An all-zero layer (e.g. untouched zero-initialised statistics) has cosine 0, as torch's."""
  rng = np.random.default_rng(7)
  stacked = random_stacked(rng)
  stacked["batch_stats"]["bn"]["mean"] = np.zeros_like(stacked["batch_stats"]["bn"]["mean"])
  stacked["params"]["dense"]["bias"] = np.zeros_like(stacked["params"]["dense"]["bias"])
  for kind in aggregators.fedcross.SIMILARITY_KINDS:
    got = np.asarray(similarity_jit(stacked, kind=kind))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, numpy_similarity(stacked, kind), rtol=1e-5, atol=1e-6)


def test_similarity_rejects_bad_input():
  rng = np.random.default_rng(8)
  with pytest.raises(ValueError):
    aggregators.similarity_matrix(random_stacked(rng), kind="euclid")
  with pytest.raises(ValueError):
    aggregators.similarity_matrix(random_stacked(rng, num_models=1))
  with pytest.raises(ValueError):
    aggregators.similarity_matrix({"a": np.zeros((3, 2)), "b": np.zeros((4, 2))})
  with pytest.raises(ValueError):
    aggregators.in_order_partners(1, 0)


# --- similarity-based selection -------------------------------------------------


def test_similarity_selection_never_picks_self():
  rng = np.random.default_rng(9)
  lowest = jax.jit(aggregators.lowest_similarity_partners)
  highest = jax.jit(aggregators.highest_similarity_partners)
  for num_models in (2, 3, 6, 10):
    eye = np.eye(num_models, dtype=bool)
    for sim in (rng.normal(size=(num_models, num_models)),  # negative entries too
                np.where(eye, -5.0, 1.0),  # self strictly lowest; the rest tie
                np.where(eye, 5.0, -1.0),  # self strictly highest
                np.zeros((num_models, num_models))):
      sim = sim.astype(np.float32)
      for fn in (lowest, highest):
        got = np.asarray(fn(sim))
        assert got.dtype == np.int32 and (got != np.arange(num_models)).all(), (num_models, sim)


def test_similarity_selection_matches_masked_argmin_argmax():
  rng = np.random.default_rng(10)
  for _ in range(20):
    sim = rng.normal(size=(7, 7)).astype(np.float32)
    sim = (sim + sim.T) / 2
    masked = np.where(np.eye(7, dtype=bool), np.nan, sim)
    np.testing.assert_array_equal(np.asarray(jax.jit(aggregators.lowest_similarity_partners)(sim)),
                                  np.nanargmin(masked, axis=1))
    np.testing.assert_array_equal(np.asarray(jax.jit(aggregators.highest_similarity_partners)(sim)),
                                  np.nanargmax(masked, axis=1))


def test_tie_breaking_follows_the_authors_loops():
  rng = np.random.default_rng(11)
  lowest = jax.jit(aggregators.lowest_similarity_partners)
  highest = jax.jit(aggregators.highest_similarity_partners)
  for num_models in (2, 3, 5, 8):
    for _ in range(30):
      sim = rng.integers(1, 4, size=(num_models, num_models)).astype(np.float32)  # positive, many ties
      sim = np.triu(sim, 1) + np.triu(sim, 1).T
      np.fill_diagonal(sim, 0.0)  # the authors' table
      np.testing.assert_array_equal(np.asarray(lowest(sim)), authors_lowest(sim))
      np.testing.assert_array_equal(np.asarray(highest(sim)), authors_highest(sim))
  # Hand-made: row 0 ties between 1 (the scan's start) and 3; row 2 ties between 0 and 4, start 3 loses.
  sim = np.array([[0, 1, 2, 1, 5], [1, 0, 1, 1, 1], [1, 2, 0, 3, 1], [1, 1, 3, 0, 2], [5, 1, 1, 2, 0]], np.float32)
  np.testing.assert_array_equal(np.asarray(lowest(sim)), [1, 2, 0, 0, 1])
  np.testing.assert_array_equal(np.asarray(highest(sim)), [4, 0, 3, 2, 0])


@pytest.mark.parametrize("strategy", ["in_order", "lowest_similarity", "highest_similarity"])
def test_select_partners_end_to_end(strategy):
  rng = np.random.default_rng(12)
  uploaded = random_stacked(rng, origin_scale=1.0, spread=0.3)
  fn = jax.jit(aggregators.select_partners, static_argnames=("strategy", "similarity"))
  got = np.asarray(fn(uploaded, 4, strategy=strategy, similarity="layerwise"))
  sim = numpy_similarity(uploaded, "layerwise")
  want = {"in_order": numpy_in_order(K, 4), "lowest_similarity": authors_lowest(sim),
          "highest_similarity": authors_highest(sim)}[strategy]
  np.testing.assert_array_equal(got, want)
  assert (got != np.arange(K)).all()


# --- acceleration -------------------------------------------------------------------


def test_propeller_partners_are_consecutive_in_order_partners():
  fn = jax.jit(aggregators.propeller_partners, static_argnums=(0, 2))
  for num_models, num_propellers, r in [(5, 1, 3), (5, 4, 0), (6, 3, 7), (10, 9, 11)]:
    got = np.asarray(fn(num_models, r, num_propellers))
    assert got.shape == (num_models, num_propellers) and got.dtype == np.int32
    for p in range(num_propellers):
      np.testing.assert_array_equal(got[:, p], numpy_in_order(num_models, r + p))
    for i in range(num_models):
      assert len(set(got[i])) == num_propellers and i not in got[i]
  for bad in (0, 5):
    with pytest.raises(ValueError):
      aggregators.propeller_partners(5, 0, bad)


def test_propeller_aggregate_matches_numpy():
  rng = np.random.default_rng(13)
  uploaded = random_stacked(rng)
  props = np.asarray(aggregators.propeller_partners(K, 2, 3))
  fn = jax.jit(aggregators.propeller_aggregate)
  for alpha in (None, 0.9):
    a = 1 / 4 if alpha is None else alpha
    want = jax.tree.map(lambda v: a * np.asarray(v, np.float64) + (1 - a) * np.asarray(v, np.float64)[props].mean(1),
                        uploaded)
    chex.assert_trees_all_close(fn(uploaded, props, alpha), want, rtol=1e-5, atol=1e-6)


def test_propeller_limits():
  """P = 1 is cross-aggregation; P = K-1 with uniform weights is the authors' FedAvg warm-up."""
  rng = np.random.default_rng(14)
  uploaded = random_stacked(rng)
  one = aggregators.propeller_partners(K, 6, 1)
  chex.assert_trees_all_close(jax.jit(aggregators.propeller_aggregate)(uploaded, one, 0.99),
                              aggregators.cross_aggregate(uploaded, aggregators.in_order_partners(K, 6), 0.99),
                              rtol=1e-6, atol=1e-7)
  everyone = jax.jit(aggregators.propeller_aggregate)(uploaded, aggregators.propeller_partners(K, 6, K - 1))
  mean = jax.tree.map(lambda v: np.broadcast_to(np.asarray(v, np.float64).mean(0), v.shape), uploaded)
  chex.assert_trees_all_close(everyone, mean, rtol=1e-5, atol=1e-6)


def test_dynamic_alpha_schedule():
  rounds = np.arange(0, 130)
  got = np.asarray(jax.jit(jax.vmap(aggregators.dynamic_alpha))(jnp.asarray(rounds)))
  want = 0.5 + 0.49 * np.clip(rounds / 100, 0, 1)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got.dtype == np.float32 and got[0] == np.float32(0.5) and (got[100:] == np.float32(0.99)).all()
  assert (np.diff(got) >= 0).all()
  fn = jax.jit(aggregators.dynamic_alpha, static_argnames=("stage_start", "stage_length"))
  # PM-DA (Fig. 9): propellers for [0, 50), then alpha from 0.5 to 0.99 over [50, 100).
  pm_da = np.array([float(fn(r, stage_start=50, stage_length=50)) for r in (0, 50, 75, 100, 200)])  # one trace
  np.testing.assert_allclose(pm_da, [0.5, 0.5, 0.745, 0.99, 0.99], rtol=1e-6)
  with pytest.raises(ValueError):
    aggregators.dynamic_alpha(0, stage_length=0)


# --- tracking -----------------------------------------------------------------------


def test_middleware_similarity_stats_match_numpy():
  rng = np.random.default_rng(15)
  for stacked in (random_stacked(rng), random_stacked(rng, origin_scale=1.0, spread=0.05)):
    got = jax.jit(aggregators.middleware_similarity_stats)(stacked)
    x = np.concatenate(numpy_leaves(stacked), axis=1)
    off = ~np.eye(K, dtype=bool)
    dists = np.linalg.norm(x[:, None] - x[None, :], axis=-1)
    np.testing.assert_allclose(float(got["mean_cosine"]), numpy_cosine(x)[off].mean(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(got["mean_l2_distance"]), dists[off].mean(), rtol=1e-5)
  identical = jax.tree.map(lambda v: np.broadcast_to(v[:1], v.shape), random_stacked(rng))
  got = jax.jit(aggregators.middleware_similarity_stats)(identical)
  assert float(got["mean_l2_distance"]) == 0.0 and float(got["mean_cosine"]) == pytest.approx(1.0, abs=1e-7)


def test_one_jitted_round():
  """A whole server step under one jit: select (lowest, layerwise), mix, average, track."""
  rng = np.random.default_rng(16)
  uploaded = random_stacked(rng, origin_scale=1.0, spread=0.2)

  @jax.jit
  def server_step(uploaded, round_idx, alpha):
    partners = fedcross.select_partners(uploaded, round_idx)
    middleware, glob = fedcross.fedcross_aggregate(uploaded, partners, alpha, global_from="uploaded")
    return partners, middleware, glob, fedcross.middleware_similarity_stats(middleware)

  partners, middleware, glob, stats = server_step(uploaded, jnp.int32(3), jnp.float32(0.99))
  want_partners = authors_lowest(numpy_similarity(uploaded, "layerwise"))
  np.testing.assert_array_equal(np.asarray(partners), want_partners)
  chex.assert_trees_all_close(middleware, numpy_mix(uploaded, want_partners, 0.99), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(glob, jax.tree.map(lambda v: np.asarray(v, np.float64).mean(0), uploaded),
                              rtol=1e-5, atol=1e-6)
  assert set(stats) == {"mean_cosine", "mean_l2_distance"}
