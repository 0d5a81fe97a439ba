"""Bad inputs to the public aggregators (one probe table) and properties of good ones (hypothesis).

To probe a new misuse, add one line to `CASES`: a description, a callable making the bad call, and a
regex the ValueError's message must match.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from hypothesis import given, settings
from hypothesis import strategies as st

from fedjax_hetero import aggregators as A
from fedjax_hetero.hetero import build_group_map, extract
from tests.helpers import random_tree

# The package exports a function of the module's name.
hetero_avg_module = importlib.import_module("fedjax_hetero.aggregators.hetero_avg")

# Leaf shapes by path: the global model and two groups (a narrow one and the full one).
GLOBAL = {"params/hidden1/kernel": (4, 3), "params/hidden1/bias": (3,), "params/out/kernel": (3, 2),
          "batch_stats/bn/mean": (3,)}
NARROW = {"params/hidden1/kernel": (4, 2), "params/hidden1/bias": (2,), "params/out/kernel": (2, 2),
          "batch_stats/bn/mean": (2,)}
GROUPS = [NARROW, GLOBAL]


def tree(shapes, fill=1.0):
  """Nested dict of float32 arrays, one per ``"a/b/c": shape`` entry."""
  return traverse_util.unflatten_dict({tuple(p.split("/")): np.full(s, fill, np.float32) for p, s in shapes.items()})


def with_int(shapes, path):
  """``tree(shapes)`` with the leaf at ``path`` an int32 counter (e.g. a model's step)."""
  flat = {**traverse_util.flatten_dict(tree(shapes), sep="/"), path: np.arange(np.prod(shapes[path]), dtype=np.int32)}
  return traverse_util.unflatten_dict(flat, sep="/")


def put(shapes, path, shape):
  return {**shapes, path: shape}


def drop(shapes, path):
  return {p: s for p, s in shapes.items() if p != path}


def params_only(shapes):
  return {p: s for p, s in shapes.items() if p.startswith("params/")}


def shape_tree(shapes):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(shapes))


MAPS = [build_group_map(shape_tree(GLOBAL), shape_tree(g), f"g{i}") for i, g in enumerate(GROUPS)]
GV = tree(GLOBAL)
SUMS = [tree(NARROW), tree(GLOBAL)]
W = [2.0, 3.0]
NAN, INF = float("nan"), float("inf")

K = 3  # FedCross middleware models
UP = {"params": {"w": np.arange(K * 4, dtype=np.float32).reshape(K, 4), "b": np.ones((K,), np.float32)}}
PARTNERS = np.array([1, 2, 0], np.int32)
PROPELLERS = np.array([[1, 2], [2, 0], [0, 1]], np.int32)


CONTROL = tree(params_only(GLOBAL))  # SCAFFOLD's control variate covers params only
CONTROL_SUMS = [tree(params_only(g)) for g in GROUPS]
KERNEL, BIAS, OUT, BN = "params/hidden1/kernel", "params/hidden1/bias", "params/out/kernel", "batch_stats/bn/mean"

# A good call of every checked aggregator, by keyword; `call` changes some arguments of it.
GOOD = {
    "fedavg": dict(variables=GV, delta_sum=GV, weight=1.0),
    "masked_mean": dict(weighted_sums=GV, weight_sums=GV, fallback=GV),
    "heterogeneous_sums": dict(group_sums=SUMS, group_weights=W, group_maps=MAPS, global_like=GV),
    "weighted_coverage": dict(group_weights=W, group_maps=MAPS, global_like=GV),
    "heterogeneous_mean_delta": dict(group_delta_sums=SUMS, group_weights=W, group_maps=MAPS, global_like=GV),
    "hetero_avg": dict(global_vars=GV, group_delta_sums=SUMS, group_weights=W, group_maps=MAPS),
    "hetero_avg_weights": dict(global_vars=GV, group_weight_sums=SUMS, group_weights=W, group_maps=MAPS),
    "fednova_delta": dict(group_normalized_sums=SUMS, group_weights=W, group_a_sums=[1.0, 2.0], group_maps=MAPS,
                          global_like=GV),
    "scaffold_server_control": dict(control=CONTROL, group_control_delta_sums=CONTROL_SUMS, group_weights=W,
                                    group_maps=MAPS),
    "cross_aggregate": dict(uploaded=UP, partners=PARTNERS, alpha=0.9),
    "fedcross_aggregate": dict(uploaded=UP, partners=PARTNERS, alpha=0.9),
    "select_partners": dict(uploaded=UP, round_idx=3),
    "propeller_aggregate": dict(uploaded=UP, propellers=PROPELLERS, alpha=0.5),
    "fedfa_aggregate": dict(global_model=GV, client_models=SUMS, client_weights=W, client_maps=MAPS),
}


def _run(name, changes):
  return getattr(A, name)(**{**GOOD[name], **changes})


def call(name, **changes):
  """The good call of aggregator ``name`` with some arguments changed (not run yet)."""
  return functools.partial(_run, name, changes)


def sums_with(i, shapes):
  """SUMS with group ``i``'s tree replaced by one of ``shapes``."""
  return [tree(shapes) if j == i else x for j, x in enumerate(SUMS)]


# (description, bad call, regex the ValueError's message must match); the test id prefixes the aggregator's name.
CASES = [
    # --- unequal per-group sequences (zip used to drop a group silently)
    ("a delta sum too few", call("hetero_avg", group_delta_sums=SUMS[:1]), r"group_delta_sums has 1"),
    ("a weight too few", call("hetero_avg", group_weights=W[:1]), r"group_weights has 1"),
    ("a map too few", call("hetero_avg", group_maps=MAPS[:1]), r"group_maps has 1"),
    ("a tree, not a list", call("hetero_avg", group_delta_sums=SUMS[1]),
     r"group_delta_sums must be a sequence with one entry per group"),
    ("no groups", call("hetero_avg", group_delta_sums=[], group_weights=[], group_maps=[]),
     r"group_weights sum to 0 over 0 groups"),
    ("lengths", call("hetero_avg_weights", group_weights=W[:1]),
     r"group_weight_sums has 2, group_weights has 1, group_maps has 2"),
    ("lengths", call("heterogeneous_mean_delta", group_delta_sums=SUMS[:1]), r"sequences differ in length"),
    ("a map too few", call("heterogeneous_sums", group_maps=MAPS[:1]), r"group_maps has 1"),
    ("lengths", call("weighted_coverage", group_weights=W[:1]), r"group_weights has 1, group_maps"),
    ("an a-sum too few", call("fednova_delta", group_a_sums=[1.0]), r"group_a_sums has 1"),
    ("lengths", call("scaffold_server_control", group_control_delta_sums=CONTROL_SUMS[:1]),
     r"group_control_delta_sums has 1"),
    # --- tree structure: the argument and the missing / extra leaf path
    ("sums miss a leaf", call("hetero_avg", group_delta_sums=sums_with(0, drop(NARROW, BIAS))),
     r"group_delta_sums\[0\] is missing leaf params/hidden1/bias"),
    ("sums have an extra leaf", call("hetero_avg", group_delta_sums=sums_with(1, put(GLOBAL, "x/k", (2,)))),
     r"group_delta_sums\[1\] has leaf x/k, not expected by group_maps\[1\]"),
    ("global_vars misses a leaf", call("hetero_avg", global_vars=tree(drop(GLOBAL, OUT))),
     r"group_delta_sums\[0\] has leaf params/out/kernel, not expected .* in global_vars"),
    ("global_vars has an extra leaf", call("hetero_avg", global_vars=tree(put(GLOBAL, "x/k", (1,)))),
     r"global_vars has leaf x/k, which the global model of group_maps\[0\] does not have"),
    ("a map is no SubmodelMap", call("hetero_avg", group_maps=[MAPS[0], GV]),
     r"group_maps\[1\] must be a SubmodelMap, got a dict"),
    ("sums miss a leaf", call("hetero_avg_weights", group_weight_sums=sums_with(0, drop(NARROW, BN))),
     r"group_weight_sums\[0\] is missing leaf batch_stats/bn/mean"),
    ("sums miss a leaf", call("heterogeneous_sums", group_sums=sums_with(1, drop(GLOBAL, OUT))),
     r"group_sums\[1\] is missing leaf params/out/kernel"),
    ("sums have an extra leaf", call("heterogeneous_mean_delta", group_delta_sums=sums_with(0, put(NARROW, "x", (1,)))),
     r"group_delta_sums\[0\] has leaf x,"),
    ("sums have an extra leaf", call("fednova_delta", group_normalized_sums=sums_with(0, put(NARROW, "z", (1,)))),
     r"group_normalized_sums\[0\] has leaf z"),
    ("sums hold batch_stats, control not", call("scaffold_server_control", group_control_delta_sums=SUMS),
     r"group_control_delta_sums\[0\] has leaf batch_stats/bn/mean, not expected .* in control"),
    ("weight_sums miss a leaf", call("masked_mean", weight_sums=tree(drop(GLOBAL, BIAS))),
     r"weight_sums is missing leaf params/hidden1/bias, expected by weighted_sums"),
    ("fallback has an extra leaf", call("masked_mean", fallback=tree(put(GLOBAL, "x", (1,)))),
     r"fallback has leaf x, not expected by weighted_sums"),
    ("delta_sum misses a leaf", call("fedavg", delta_sum=tree(drop(GLOBAL, KERNEL))),
     r"delta_sum is missing leaf params/hidden1/kernel"),
    # --- leaf shapes (broadcastable ones used to pass)
    ("broadcastable group leaf", call("hetero_avg", group_delta_sums=sums_with(0, put(NARROW, KERNEL, (1, 2)))),
     r"group_delta_sums\[0\] leaf params/hidden1/kernel has shape \(1, 2\); .* requires \(4, 2\)"),
    ("global-shaped sums of a narrow group", call("hetero_avg", group_delta_sums=sums_with(0, GLOBAL)),
     r"group_delta_sums\[0\] leaf batch_stats/bn/mean has shape \(3,\); .* requires \(2,\)"),
    ("global_vars leaf of a wrong shape", call("hetero_avg", global_vars=tree(put(GLOBAL, OUT, (3, 1)))),
     r"global_vars leaf params/out/kernel has shape \(3, 1\); group_maps\[0\] requires \(3, 2\)"),
    ("global_like of another model", call("weighted_coverage", global_like=tree(put(GLOBAL, BN, (5,)))),
     r"global_like leaf batch_stats/bn/mean has shape \(5,\)"),
    ("broadcastable weight leaf", call("masked_mean", weight_sums=tree(put(GLOBAL, BIAS, (1,)))),
     r"weight_sums leaf params/hidden1/bias has shape \(1,\); weighted_sums requires \(3,\)"),
    ("broadcastable delta leaf", call("fedavg", delta_sum=tree(put(GLOBAL, OUT, (1, 2)))),
     r"delta_sum leaf params/out/kernel has shape \(1, 2\); variables requires \(3, 2\)"),
    # --- weights: finite, >= 0, positive total, scalar
    ("NaN weight", call("hetero_avg", group_weights=[NAN, 1.0]), r"group_weights\[0\] is nan; a weight must"),
    ("infinite weight", call("hetero_avg", group_weights=[1.0, INF]), r"group_weights\[1\] is inf; .*finite"),
    ("negative weight", call("hetero_avg", group_weights=[2.0, -1.0]), r"group_weights\[1\] is -1.0; .* >= 0"),
    ("zero weights", call("hetero_avg", group_weights=[0.0, 0.0]), r"group_weights sum to 0.0 .* positive"),
    ("vector weight", call("hetero_avg", group_weights=[np.ones(2), 1.0]), r"\[0\] must be a scalar, got shape \(2,\)"),
    ("NaN jnp weight", call("heterogeneous_mean_delta", group_weights=[jnp.float32(NAN), 1.0]), r"\[0\] is nan"),
    ("negative weight", call("heterogeneous_sums", group_weights=[-2.0, 3.0]), r"\[0\] is -2.0"),
    ("NaN weight", call("weighted_coverage", group_weights=[1.0, NAN]), r"group_weights\[1\] is nan"),
    ("negative weight", call("hetero_avg_weights", group_weights=[-1.0, 3.0]), r"\[0\] is -1.0"),
    ("NaN a-sum", call("fednova_delta", group_a_sums=[1.0, NAN]), r"group_a_sums\[1\] is nan"),
    ("negative weight", call("fednova_delta", group_weights=[-1.0, 1.0]), r"group_weights\[0\] is -1.0"),
    ("NaN weight", call("scaffold_server_control", group_weights=[NAN, 1.0]), r"group_weights\[0\] is nan"),
    ("negative weight element", call("masked_mean", weight_sums=tree(GLOBAL, -1.0)), r"holds -1.0 at \(0"),
    ("NaN weight element", call("masked_mean", weight_sums=tree(GLOBAL, NAN)), r"weight_sums leaf \S+ holds nan"),
    ("NaN weight", call("fedavg", weight=NAN), r"weight is nan; a weight must be finite and >= 0"),
    ("negative weight", call("fedavg", weight=-3.0), r"weight is -3.0"),
    ("vector weight", call("fedavg", weight=np.ones(3)), r"weight must be a scalar"),
    ("float offset", call("hetero_avg", offset=0.5), r"offset must hold integers"),
    # --- integer leaves: averaging them came back float32 in silence (probe 81)
    ("an int32 leaf", call("hetero_avg", global_vars=with_int(GLOBAL, BN)),
     r"^global_vars leaf batch_stats/bn/mean is int32; the aggregators take floating-point weights"),
    ("an int32 leaf", call("hetero_avg_weights", global_vars=with_int(GLOBAL, BIAS)),
     r"^global_vars leaf params/hidden1/bias is int32"),
    ("an int32 leaf", call("heterogeneous_mean_delta", global_like=with_int(GLOBAL, BN)),
     r"^global_like leaf \S+ is int"),
    ("an int32 leaf", call("heterogeneous_sums", global_like=with_int(GLOBAL, BN)), r"^global_like leaf \S+ is int"),
    ("an int32 leaf", call("fednova_delta", global_like=with_int(GLOBAL, BN)), r"^global_like leaf \S+ is int32"),
    ("an int32 leaf", call("scaffold_server_control", control=with_int(params_only(GLOBAL), BIAS)),
     r"^control leaf params/hidden1/bias is int32"),
    ("an int32 fallback leaf", call("masked_mean", fallback=with_int(GLOBAL, BN)), r"^fallback leaf \S+ is int32"),
    ("an int32 leaf", call("fedavg", variables=with_int(GLOBAL, BN)), r"^variables leaf batch_stats/bn/mean is int32"),
    ("an int32 leaf", call("fedfa_aggregate", global_model=with_int(GLOBAL, BN)), r"^global_model leaf \S+ is int32"),
    # --- FedCross: partner indices, alpha, stacked models
    ("partner index K", call("cross_aggregate", partners=np.array([1, 3, 0])),
     r"partners holds 3 at \(1,\); indices must be in \[0, 3\)"),
    ("negative partner", call("cross_aggregate", partners=np.array([-1, 2, 0])), r"holds -1 at \(0,\)"),
    ("float partners", call("cross_aggregate", partners=np.array([1.0, 2.0, 0.0])),
     r"partners must hold integers, got dtype float64"),
    ("too few partners", call("cross_aggregate", partners=np.array([1, 2])), r"must have shape \(3,\)"),
    ("a model paired with itself", call("cross_aggregate", partners=np.array([0, 2, 1])),
     r"^partners\[0\] is 0, slot 0 itself"),
    ("alpha = 2", call("cross_aggregate", alpha=2.0), r"alpha is 2.0; it must be in \[0, 1\]"),
    ("negative alpha", call("cross_aggregate", alpha=-0.1), r"alpha is -0.1"),
    ("NaN alpha", call("cross_aggregate", alpha=NAN), r"alpha is nan"),
    ("vector alpha", call("cross_aggregate", alpha=np.full(3, 0.5)), r"alpha must be a scalar"),
    ("leading axes differ", call("cross_aggregate", uploaded={"a": np.ones((3, 2)), "b": np.ones(2)}),
     r"same leading \(model\) axis"),
    ("partner out of range", call("fedcross_aggregate", partners=np.array([5, 0, 1])), r"holds 5"),
    ("a model paired with itself", call("fedcross_aggregate", partners=np.array([1, 1, 0])), r"partners\[1\] is 1"),
    ("alpha = 2", call("fedcross_aggregate", alpha=2.0), r"alpha is 2.0"),
    ("float round", call("select_partners", round_idx=1.5), r"round_idx must hold integers"),
    ("vector round", call("select_partners", round_idx=np.array([1, 2])), r"round_idx must be a scalar"),
    ("one model", call("select_partners", uploaded={"w": np.ones((1, 2))}), r"at least 2 middleware"),
    ("index out of range", call("propeller_aggregate", propellers=np.array([[1, 2], [2, 3], [0, 1]])),
     r"propellers holds 3 at \(1, 1\)"),
    ("float indices", call("propeller_aggregate", propellers=PROPELLERS * 1.0), r"must hold integers"),
    ("too few rows", call("propeller_aggregate", propellers=PROPELLERS[:2]), r"shape \(3, any\)"),
    ("no propellers", call("propeller_aggregate", propellers=np.zeros((3, 0), int)), r"one column"),
    ("a model its own propeller", call("propeller_aggregate", propellers=np.array([[1, 2], [2, 1], [0, 1]])),
     r"^propellers\[1, 1\] is 1, slot 1 itself"),
    ("alpha = 1.5", call("propeller_aggregate", alpha=1.5), r"alpha is 1.5"),
    # --- a weighted upload holding NaN or inf spread into its whole layer with no error (eighth probe survey)
    ("NaN in a weighted group's sums", call("hetero_avg", group_delta_sums=[tree(NARROW, NAN), SUMS[1]]),
     r"^group_delta_sums\[0\] leaf \S+ holds a non-finite value"),
    ("inf in a weighted group's sums", call("hetero_avg_weights", group_weight_sums=[SUMS[0], tree(GLOBAL, INF)]),
     r"^group_weight_sums\[1\] leaf \S+ holds a non-finite value"),
    ("NaN sums", call("heterogeneous_sums", group_sums=[tree(NARROW, NAN), SUMS[1]]), r"^group_sums\[0\] leaf"),
    ("NaN sums", call("heterogeneous_mean_delta", group_delta_sums=[SUMS[0], tree(GLOBAL, NAN)]),
     r"^group_delta_sums\[1\] leaf \S+ holds a non-finite"),
    ("NaN sums", call("fednova_delta", group_normalized_sums=[tree(NARROW, NAN), SUMS[1]]),
     r"^group_normalized_sums\[0\] leaf"),
    ("inf sums", call("scaffold_server_control", group_control_delta_sums=[CONTROL_SUMS[0], tree(
        params_only(GLOBAL), INF)]), r"^group_control_delta_sums\[1\] leaf"),
    ("NaN delta", call("fedavg", delta_sum=tree(GLOBAL, NAN)), r"^delta_sum leaf \S+ holds a non-finite value"),
    ("a NaN client", call("fedfa_aggregate", client_models=[tree(NARROW, NAN), SUMS[1]]),
     r"^client_models\[0\] leaf \S+ holds a non-finite value"),
    ("a NaN model", call("select_partners", uploaded={"w": np.array([[1.0, NAN], [1.0, 2.0], [3.0, 1.0]])}),
     r"^uploaded leaf w holds a non-finite value"),
]


def case_id(desc, make_call):
  return f"{make_call.args[0]}: {desc}"


@pytest.mark.parametrize("make_call, pattern", [pytest.param(c, p, id=case_id(d, c)) for d, c, p in CASES])
def test_bad_input_raises_a_named_value_error(make_call, pattern):
  with pytest.raises(ValueError, match=pattern):
    make_call()


def test_the_table_probes_every_checked_aggregator_once_or_more():
  assert len({case_id(d, c) for d, c, _ in CASES}) == len(CASES)
  assert {make_call.args[0] for _, make_call, _ in CASES} == set(GOOD)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_good_calls_pass(name):
  call(name)()


def test_edge_cases_that_stay_allowed():
  A.hetero_avg(GV, SUMS, [0.0, 3.0], MAPS)  # a group without sampled clients
  A.hetero_avg(GV, [tree(NARROW, NAN), SUMS[1]], [0.0, 3.0], MAPS)  # (a weight-0 group's sums are not read)
  A.fedavg(GV, tree(GLOBAL, NAN), 0.0)
  A.fedfa_aggregate(GV, [tree(NARROW, NAN), SUMS[1]], [0.0, 3.0], MAPS)
  A.hetero_avg_weights(GV, SUMS, W, MAPS, offset=np.int32(2))
  A.fednova_delta(SUMS, W, [0.0, 4.0], MAPS, GV)
  A.masked_mean(GV, tree(GLOBAL, 0.0), GV)  # nobody covered anything: the fallback
  A.fedavg(GV, GV, 0.0)  # documented: unchanged when no client took part
  A.fedcross_aggregate(UP, [1, 2, 0], 0.0)
  A.propeller_aggregate(UP, PROPELLERS, 1.0)
  A.select_partners(UP, np.int64(4), "lowest_similarity")
  A.hetero_avg(GV, SUMS, [jnp.bfloat16(2.0), jnp.bfloat16(3.0)], MAPS)  # (bfloat16 numbers were refused)
  A.fedavg(GV, GV, jnp.bfloat16(2.0))


def test_a_trimmed_norm_of_nothing_is_a_named_error():
  """(Fifth probe survey: an empty array raised XLA's gather error.)"""
  with pytest.raises(ValueError, match=r"^x is empty \(shape \(0, 3\)\): a trimmed norm needs at least one"):
    A.trimmed_norm(jnp.zeros((0, 3)))


def test_traced_values_are_not_checked_but_structure_is():
  """Under jit value checks are skipped (no host round trip): the bad weight is silently ignored there."""
  weights = [jnp.float32(NAN), jnp.float32(1.0)]
  jitted = jax.jit(lambda w: A.hetero_avg(GV, SUMS, w, MAPS))(weights)
  bare = jax.tree.map(jnp.add, GV, hetero_avg_module._heterogeneous_mean_delta(SUMS, weights, MAPS, GV, 0))
  for x, y in zip(jax.tree.leaves(jitted), jax.tree.leaves(bare), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  jax.jit(A.cross_aggregate)(UP, jnp.array([1, 7, 0]), 2.0)
  with pytest.raises(ValueError, match=r"group_delta_sums\[0\] leaf params/hidden1/kernel has shape \(1, 2\)"):
    jax.jit(lambda s: A.hetero_avg(GV, s, W, MAPS))(sums_with(0, put(NARROW, KERNEL, (1, 2))))


def test_checks_add_nothing_to_the_traced_program():
  checked = jax.make_jaxpr(lambda g, s, w: A.hetero_avg(g, s, w, MAPS))(GV, SUMS, W)
  bare = jax.make_jaxpr(lambda g, s, w: jax.tree.map(
      jnp.add, g, hetero_avg_module._heterogeneous_mean_delta(hetero_avg_module._selected(s, w), w, MAPS, g, 0)))(
          GV, SUMS, W)
  assert str(checked) == str(bare)
  checked = jax.make_jaxpr(A.masked_mean)(GV, GV, GV)
  assert str(checked) == str(jax.make_jaxpr(hetero_avg_module._masked_mean)(GV, GV, GV))


# --- properties ------------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=25, deadline=None, database=None)
# Three groups: narrow, full, and a second narrow one lacking batch_stats (elements nobody owns remain).
PROP_GROUPS = [NARROW, GLOBAL, params_only(put(NARROW, "params/out/kernel", (1, 2)))]
PROP_MAPS = [build_group_map(shape_tree(GLOBAL), shape_tree(g), f"p{i}") for i, g in enumerate(PROP_GROUPS)]
weights_st = st.lists(st.floats(0.01, 100.0), min_size=3, max_size=3)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), weights=weights_st, scale=st.floats(0.01, 100.0))
def test_hetero_avg_depends_only_on_normalized_weights(seed, weights, scale):
  rng = np.random.default_rng(seed)
  global_vars = random_tree(GLOBAL, rng)
  sums = [random_tree(g, rng) for g in PROP_GROUPS]
  scaled = [jax.tree.map(lambda x: np.float32(scale) * x, s) for s in sums]
  base = A.hetero_avg(global_vars, sums, weights, PROP_MAPS)
  assert_trees_close(A.hetero_avg(global_vars, scaled, [scale * w for w in weights], PROP_MAPS), base)


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), weights=weights_st)
def test_identical_clients_give_their_delta_where_covered(seed, weights):
  rng = np.random.default_rng(seed)
  delta = random_tree(GLOBAL, rng)
  sums = [jax.tree.map(lambda x, w=w: np.float32(w) * x, extract(delta, m)) for w, m in zip(weights, PROP_MAPS)]
  got = A.heterogeneous_mean_delta(sums, weights, PROP_MAPS, delta)
  covered = A.weighted_coverage(weights, PROP_MAPS, delta)
  want = jax.tree.map(lambda d, c: np.where(np.asarray(c) > 0, d, 0.0), delta, covered)
  assert_trees_close(got, want)
  global_vars = random_tree(GLOBAL, rng)
  assert_trees_close(A.hetero_avg(global_vars, sums, weights, PROP_MAPS), jax.tree.map(np.add, global_vars, want))


@PROPERTY
@given(seed=st.integers(0, 2 ** 31 - 1), weights=weights_st, order=st.permutations(range(3)))
def test_hetero_avg_is_invariant_to_group_order(seed, weights, order):
  rng = np.random.default_rng(seed)
  global_vars = random_tree(GLOBAL, rng)
  sums = [random_tree(g, rng) for g in PROP_GROUPS]
  base = A.hetero_avg(global_vars, sums, weights, PROP_MAPS)
  permuted = A.hetero_avg(global_vars, [sums[i] for i in order], [weights[i] for i in order],
                          [PROP_MAPS[i] for i in order])
  assert_trees_close(permuted, base)
  delta = A.heterogeneous_mean_delta([sums[i] for i in order], [weights[i] for i in order],
                                     [PROP_MAPS[i] for i in order], global_vars)
  assert_trees_close(delta, A.heterogeneous_mean_delta(sums, weights, PROP_MAPS, global_vars))


@st.composite
def cross_inputs(draw):
  num_models = draw(st.integers(2, 5))
  offsets = np.array(draw(st.lists(st.integers(1, num_models - 1), min_size=num_models, max_size=num_models)))
  partners = ((np.arange(num_models) + offsets) % num_models).astype(np.int32)  # any partner but the slot itself
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
  uploaded = {"params": {"w": rng.normal(size=(num_models, 3, 2)).astype(np.float32),
                         "b": rng.normal(size=(num_models,)).astype(np.float32)}}
  return uploaded, partners


@PROPERTY
@given(inputs=cross_inputs())
def test_cross_aggregate_with_alpha_one_returns_the_uploads(inputs):
  uploaded, partners = inputs
  for got, want in zip(jax.tree.leaves(A.cross_aggregate(uploaded, partners, 1.0)), jax.tree.leaves(uploaded)):
    np.testing.assert_array_equal(np.asarray(got), want)


@PROPERTY
@given(inputs=cross_inputs(), alpha=st.floats(0.0, 1.0))
def test_cross_aggregate_is_a_convex_combination(inputs, alpha):
  uploaded, partners = inputs
  got = A.cross_aggregate(uploaded, partners, alpha)
  for mixed, v in zip(jax.tree.leaves(got), jax.tree.leaves(uploaded)):
    mixed, own, other = np.asarray(mixed), v, v[partners]
    tol = 1e-6 * (1.0 + np.abs(v).max())
    assert (mixed >= np.minimum(own, other) - tol).all() and (mixed <= np.maximum(own, other) + tol).all()
    np.testing.assert_allclose(mixed, alpha * own + (1.0 - alpha) * other, rtol=1e-5, atol=1e-6)
