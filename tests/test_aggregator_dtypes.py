"""Aggregators given float16 models or deltas (results keep the model's dtype, sums and inner products run in float32),
bad InCo inputs and alphas outside [0, 1]; `test_aggregator_inputs` holds the table of bad inputs these extend."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fedjax_hetero import aggregators as A
from tests.test_aggregator_inputs import GLOBAL, GOOD, GV, MAPS, NARROW, _run, assert_trees_close, tree


@pytest.mark.parametrize("name", sorted(set(GOOD) - {"cross_aggregate", "fedcross_aggregate", "select_partners",
                                                     "propeller_aggregate", "weighted_coverage"}))
def test_averaging_keeps_each_leafs_float_dtype(name):
  """float16 models came back float32 (the weights' dtype won); every model-like output keeps the model's."""
  half = lambda x: jax.tree.map(lambda leaf: np.asarray(leaf, np.float16), x)
  models = {"variables", "delta_sum", "weighted_sums", "fallback", "global_vars", "global_like", "control",
            "global_model", "client_models", "group_sums", "group_delta_sums", "group_weight_sums",
            "group_normalized_sums", "group_control_delta_sums"}
  got = _run(name, {key: half(value) for key, value in GOOD[name].items() if key in models})
  if name == "fedfa_aggregate":
    got = got[0]  # (model, stats)
  if name == "heterogeneous_sums":  # (numerator, denominator): sums, accumulated in float32 (no float16 overflow)
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {np.dtype(np.float32)}
    return
  assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {np.dtype(np.float16)}


def test_a_float16_model_takes_float32_sums_above_its_range():
  """A group's float32 sums (600 clients' weights of 200) were cast to the float16 model's dtype before the
  float32 mean: inf where the mean is 200."""
  half = jax.tree.map(lambda x: np.asarray(x, np.float16), GV)
  got = A.hetero_avg_weights(half, [tree(NARROW, 600 * 200.0), tree(GLOBAL, 600 * 200.0)], [600.0, 600.0], MAPS)
  for leaf in jax.tree.leaves(got):
    assert leaf.dtype == np.float16 and np.all(np.asarray(leaf) == 200.0)
  clients = [tree(NARROW, 200.0), tree(GLOBAL, 200.0)]
  half_model, want = (A.fedfa_aggregate(g, clients, [600.0, 600.0], MAPS)[0] for g in (half, GV))
  assert_trees_close(jax.tree.map(lambda x: np.asarray(x, np.float32), half_model), want, rtol=1e-3)


def test_inco_of_small_float16_deltas_matches_float32():
  """A float16 3x3 slice of 1e-4 deltas has <g_0, g_0> ~ 1e-7, which underflowed in float16 (the update off by
  550x or zeroed); the step now computes in float32 and casts back."""
  g = np.random.default_rng(0).normal(0.0, 1e-4, (2, 3, 3, 2, 2)).astype(np.float32)
  delta = {"params": {"t": {"kernel": g[0]}, "s": {"kernel": g[1]}}}
  pairs = [(("params", "t", "kernel"), ("params", "s", "kernel"))]
  for variant in A.INCO_VARIANTS:
    wide, _ = A.inco(delta, pairs, variant)
    half, _ = A.inco(jax.tree.map(lambda x: x.astype(np.float16), delta), pairs, variant)
    got, want = (np.asarray(t["params"]["t"]["kernel"], np.float32) for t in (half, wide))
    assert half["params"]["t"]["kernel"].dtype == np.float16
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3 * np.abs(want).max(), err_msg=variant)


def test_inco_names_a_bad_coverage_and_a_non_finite_delta():
  delta = {"params": {"t": {"kernel": np.ones((3, 3, 2, 2), np.float32)}, "s": {"kernel": np.ones((3, 3, 2, 2),
                                                                                                   np.float32)}}}
  pairs = [(("params", "t", "kernel"), ("params", "s", "kernel"))]
  with pytest.raises(ValueError, match=r"^coverage is missing leaf params/t/kernel, expected by delta"):
    A.inco(delta, pairs, coverage={"params": {"s": {"kernel": np.ones((3, 3, 2, 2))}}})
  with pytest.raises(ValueError, match=r"^coverage leaf params/s/kernel has shape \(3,\); delta requires"):
    A.inco(delta, pairs, coverage={"params": {"t": {"kernel": np.ones((3, 3, 2, 2))}, "s": {"kernel": np.ones(3)}}})
  bad = {"params": {**delta["params"], "t": {"kernel": np.full((3, 3, 2, 2), np.inf, np.float32)}}}
  with pytest.raises(ValueError, match=r"^delta leaf params/t/kernel holds a non-finite value"):
    A.inco(bad, pairs)


def test_dynamic_alpha_refuses_an_alpha_outside_0_1():
  with pytest.raises(ValueError, match=r"^alpha_end is 1.5; it must be in \[0, 1\]"):
    A.dynamic_alpha(200, 0, 100, 0.5, 1.5)
