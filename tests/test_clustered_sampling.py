"""Clustered sampling (Fraboni et al. 2021, Algorithms 1 and 2)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.cluster import hierarchy
from scipy.spatial import distance

from fedjax_hetero.sampling import (ClusteredSampler, flatten_update, pairwise_dissimilarity, similarity_clusters,
                                    size_clusters, weight_clusters)


def _random_sampler(seed: int, num_clients: int, m: int, similarity: str = "L1", updated: int | None = None,
                    dim: int = 12) -> ClusteredSampler:
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 60, num_clients)
  sampler = ClusteredSampler(sizes, m, seed=seed, similarity=similarity)
  ids = rng.choice(num_clients, updated or num_clients, replace=False)
  sampler.update(ids, rng.normal(size=(len(ids), dim)))
  return sampler


def _check_identities(sampler: ClusteredSampler) -> None:
  m, sizes = sampler.clients_per_round, sampler.sizes
  r = sampler.distributions()
  assert r.shape == (m, sampler.num_clients)
  assert np.all(r >= 0)
  np.testing.assert_allclose(r.sum(axis=1), 1.0, rtol=0, atol=1e-12)
  np.testing.assert_allclose(r.sum(axis=0), m * sizes / sizes.sum(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("similarity", ["L1", "L2", "arccos"])
@pytest.mark.parametrize("num_clients,m,updated", [(20, 4, None), (30, 5, 7), (9, 3, 2), (6, 6, None)])
def test_distributions_satisfy_the_identities(similarity, num_clients, m, updated):
  _check_identities(_random_sampler(1, num_clients, m, similarity, updated))


def test_identities_hold_in_integer_units_and_with_a_heavy_client():
  sizes = np.array([500, 3, 7, 1, 1, 20, 9])  # client 0 alone outweighs 1/m
  dissim = pairwise_dissimilarity(*(2 * [np.random.default_rng(0).normal(size=(7, 5))]))
  for m in (1, 2, 3, 7, 10):  # m larger than the number of clients too
    units = similarity_clusters(dissim, sizes, m)
    assert np.all(units.sum(axis=1) == sizes.sum())
    assert np.all(units.sum(axis=0) == m * sizes)
    units = size_clusters(sizes, m)
    assert np.all(units.sum(axis=1) == sizes.sum())
    assert np.all(units.sum(axis=0) == m * sizes)


@pytest.mark.parametrize("seed", range(4))
def test_weight_cut_matches_fcluster_on_importance_heights(seed):
  # Algorithm 2's cut, phrased as in the reference code: merge heights replaced by merged importance.
  rng = np.random.default_rng(seed)
  num_clients, m = 15, 4
  sizes = rng.integers(1, 30, num_clients)
  linkage = hierarchy.linkage(rng.normal(size=(num_clients, 3)), "ward")
  heights = list(sizes)
  for left, right in linkage[:, :2].astype(int):
    heights.append(heights[left] + heights[right])
  relinked = linkage.copy()
  relinked[:, 2] = heights[num_clients:]
  labels = hierarchy.fcluster(relinked, sizes.sum() / m, criterion="distance")
  expected = {frozenset(np.flatnonzero(labels == c)) for c in np.unique(labels)}
  assert {frozenset(c) for c in weight_clusters(linkage, sizes, m)} == expected


def test_zero_size_client_is_never_sampled():
  sampler = ClusteredSampler([0, 5, 5, 0, 10], 2, seed=0)
  assert np.all(sampler.distributions()[:, [0, 3]] == 0)
  drawn = np.concatenate([sampler.sample(r) for r in range(200)])
  assert not np.isin(drawn, [0, 3]).any()


def test_samples_are_valid_and_deterministic():
  sampler = _random_sampler(2, 25, 5)
  ids = sampler.sample(3)
  assert ids.shape == (5,) and ids.dtype == np.int64
  assert np.all((ids >= 0) & (ids < 25))
  for k, client in enumerate(ids):  # draw k comes from distribution k
    assert sampler.distributions()[k, client] > 0
  np.testing.assert_array_equal(ids, sampler.sample(3))
  twin = _random_sampler(2, 25, 5)
  np.testing.assert_array_equal(ids, twin.sample(3))
  rounds = np.stack([sampler.sample(r) for r in range(20)])
  assert len({tuple(row) for row in rounds}) > 1


@pytest.mark.parametrize("similarity", ["L1", "L2", "arccos"])
def test_identical_clients_cluster_together(similarity):
  rng = np.random.default_rng(3)
  num_groups, per_group, dim = 4, 3, 16
  num_clients = num_groups * per_group
  group_of = rng.permutation(np.repeat(np.arange(num_groups), per_group))  # groups not contiguous in id
  centres = rng.normal(size=(num_groups, dim)) * 3.0
  sampler = ClusteredSampler(np.full(num_clients, 10), num_groups, seed=0, similarity=similarity)
  sampler.update(np.arange(num_clients), centres[group_of])
  dissim = sampler.dissimilarity_matrix()
  assert np.all(dissim[group_of[:, None] == group_of[None, :]] == pytest.approx(0.0, abs=1e-6))
  # Each group weighs exactly 1/m, so every distribution is one whole group.
  supports = {frozenset(np.flatnonzero(row)) for row in sampler.distributions()}
  assert supports == {frozenset(np.flatnonzero(group_of == g)) for g in range(num_groups)}


def test_unbiased_in_expectation():
  sampler = _random_sampler(4, 10, 4, similarity="L2")
  rounds = 20_000
  counts = np.zeros(10)
  for r in range(rounds):
    np.add.at(counts, sampler.sample(r), 1)
  expected = 4 * sampler.sizes / sampler.sizes.sum()
  np.testing.assert_allclose(counts / rounds, expected, atol=0.03)


def test_cold_start():
  sizes = np.array([5, 40, 12, 12, 30, 1, 8, 20])
  algo1 = ClusteredSampler(sizes, 3, seed=0, cold_start="algorithm1")
  zeros = ClusteredSampler(sizes, 3, seed=0)
  np.testing.assert_array_equal(algo1.distributions(), size_clusters(sizes, 3) / sizes.sum())
  _check_identities(zeros)
  assert not zeros.has_gradients and np.all(zeros.dissimilarity_matrix() == 0)
  grads = np.random.default_rng(0).normal(size=(3, 4))
  for sampler in (algo1, zeros):
    sampler.update([1, 4, 6], grads)
  np.testing.assert_array_equal(algo1.distributions(), zeros.distributions())


def test_incremental_dissimilarity_matches_full_recomputation():
  rng = np.random.default_rng(5)
  sampler = ClusteredSampler(np.full(8, 4), 2, seed=0, similarity="arccos")
  stored = np.zeros((8, 6), np.float32)
  for _ in range(3):
    ids = rng.choice(8, 3, replace=False)
    rows = rng.normal(size=(3, 6)).astype(np.float32)
    sampler.update(ids, rows)
    stored[ids] = rows
  full = pairwise_dissimilarity(stored, stored, "arccos")
  np.fill_diagonal(full, 0.0)
  np.testing.assert_allclose(sampler.dissimilarity_matrix(), full, atol=1e-6)


def test_pairwise_dissimilarity_matches_scipy():
  rng = np.random.default_rng(6)
  a, b = rng.normal(size=(4, 9)), rng.normal(size=(5, 9))
  np.testing.assert_allclose(pairwise_dissimilarity(a, b, "L1"), distance.cdist(a, b, "cityblock"))
  np.testing.assert_allclose(pairwise_dissimilarity(a, b, "L2"), distance.cdist(a, b, "sqeuclidean"))
  np.testing.assert_allclose(pairwise_dissimilarity(a, b, "arccos"),
                             np.arccos(np.clip(1 - distance.cdist(a, b, "cosine"), -1, 1)), atol=1e-7)
  b[0] = 0.0  # a zero vector: angle 0, as in the reference implementation
  assert np.all(pairwise_dissimilarity(a, b, "arccos")[:, 0] == 0.0)


def test_update_validation_and_aggregation_weights():
  sampler = ClusteredSampler([1, 2, 3, 4], 2, seed=0)
  with pytest.raises(ValueError):
    sampler.update([0, 1], np.zeros((3, 5)))
  with pytest.raises(ValueError):
    sampler.update([4], np.zeros((1, 5)))
  sampler.update([0], np.ones((1, 5)))
  with pytest.raises(ValueError):
    sampler.update([1], np.ones((1, 6)))
  with pytest.raises(ValueError):
    ClusteredSampler([1, 2], 2, seed=0, similarity="cosine")
  np.testing.assert_allclose(sampler.aggregation_weights([3, 3]), [0.5, 0.5])
  np.testing.assert_allclose(sampler.aggregation_weights([1, 3], "size"), [1 / 3, 2 / 3])


def test_flatten_update():
  tree = {"a": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, "b": jnp.full((4,), 2.0)}
  flat = flatten_update(tree)
  assert flat.shape == (13,)
  assert float(flat.sum()) == 6.0 + 8.0
