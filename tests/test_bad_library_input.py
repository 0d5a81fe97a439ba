"""Library misuse, each rejected with a ValueError that names it, and properties of good aggregator inputs.

To probe a new misuse, add one line to `MISUSE`: a library call (configs, partitioners, sub-model maps,
aggregators; more aggregator cases are in tests/test_aggregator_inputs.py) and a regex the ValueError's
message must match. The CLI's and the dataset files' bad inputs are in tests/test_bad_input.py.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedjax_hetero import aggregators as A
from fedjax_hetero.config import DataConfig, FedGenConfig, FederationConfig, LocalConfig, OutputConfig, RunConfig
from fedjax_hetero.data import class_counts, dirichlet, iid_imbalanced, partition
from fedjax_hetero.hetero import build_group_map, complete, coverage, embed, extract, graft, identity_map, pick_global

# ----------------------------------------------------------------------------------------------- the library

LABELS = np.arange(200) % 10


def shapes(**leaves):
  """``{"params": {name: ShapeDtypeStruct}}`` of the given leaf shapes."""
  return {"params": {name: jax.ShapeDtypeStruct(shape, np.float32) for name, shape in leaves.items()}}


def zeros(**leaves):
  return {"params": {name: np.zeros(shape, np.float32) for name, shape in leaves.items()}}


WIDE = dict(w=(4, 3), b=(3,))
NARROW = dict(w=(4, 2), b=(2,))
MAP = build_group_map(shapes(**WIDE), shapes(**NARROW), "narrow")
DEEP = {"params": {"block0": {"w": jax.ShapeDtypeStruct((2,), np.float32)},
                   "block1": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}}
SHALLOW = {"params": {"block0": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}}
SHALLOW_MAP = build_group_map(DEEP, SHALLOW, "shallow")
UP = {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}}


def call(fn, *args, **kwargs):
  return functools.partial(fn, *args, **kwargs)


# (description, bad call, regex the ValueError's message must match)
MISUSE = [
    # --- configs built in code get the CLI's messages
    ("LocalConfig: infinite lr", call(LocalConfig, learning_rate=float("inf")), r"^--lr must be a finite number > 0"),
    ("LocalConfig: float epochs", call(LocalConfig, epochs=1.5), r"^--epochs must be an integer >= 1, got 1.5"),
    ("DataConfig: bool clients", call(DataConfig, num_clients=True), r"--num-clients must be an integer >= 1, got True"),
    ("DataConfig: text alpha", call(DataConfig, alpha="0.5"), r"--alpha must be a finite number > 0, got '0.5'"),
    ("OutputConfig: text flag", call(OutputConfig, resume="yes"), r"--resume must be true or false, got 'yes'"),
    ("FederationConfig: seed 2^32", call(FederationConfig, seed=2 ** 32), r"--seed must be an integer in"),
    ("FederationConfig: NaN draw", call(FederationConfig, group_draw=(float("nan"), 1.0)), r"--group-draw"),
    ("FederationConfig: a draw of text", call(FederationConfig, group_draw="0.5,0.5"),
     r"--group-draw must be a sequence of probabilities"),
    ("RunConfig: a draw per group", call(RunConfig.from_flags, group_draw=(1.0,)),
     r"--group-draw needs one probability per architecture group \(3\), got 1"),
    ("RunConfig: groups as text", call(RunConfig.from_flags, groups="cnn"), r"--groups must be a sequence of group"),
    ("RunConfig: a group as a number", call(RunConfig.from_flags, groups=("cnn", 0.5)),
     r"--groups: a group spec is a string such as 'cnn@0.5', got 0.5"),
    ("FedGen: no learning rate", call(FedGenConfig, ensemble_lr=0.0),
     r"--fedgen-ensemble-lr must be a finite number > 0, got 0.0"),
    ("FedGen: growing decay", call(FedGenConfig, coefficient_decay=1.5), r"--fedgen-coefficient-decay must be .* in \(0, 1\]"),
    ("FedGen: negative weight", call(FedGenConfig, generative_alpha=-1.0), r"--fedgen-generative-alpha must be .* >= 0"),
    ("check_sizes: subset too big", call(DataConfig(max_train_samples=70000).check_sizes, 60000, 10000, 10),
     r"--max-train-samples 70000 exceeds the 60000 training samples of fashion_mnist"),
    ("check_sizes: test subset too big", call(DataConfig(max_test_samples=20000).check_sizes, 60000, 10000, 10),
     r"--max-test-samples 20000 exceeds the 10000 test samples"),
    ("check_sizes: classes", call(DataConfig(partition="shards", classes_per_client=20).check_sizes, 60000, 10000, 10),
     r"--classes-per-client 20 exceeds the 10 classes of fashion_mnist"),
    ("check_sizes: clients", call(DataConfig(num_clients=100).check_sizes, 500, 100, 10),
     r"fashion_mnist's training set of 500 is too few for --num-clients 100: partition dirichlet needs at least 1000"),
    # --- partitioners
    ("partition: 2-D labels", call(partition, LABELS.reshape(20, 10), "iid", 4, 0), r"labels must be a 1-D integer"),
    ("partition: float labels", call(partition, LABELS * 1.0, "iid", 4, 0), r"1-D integer array, got float64"),
    ("partition: negative label", call(partition, LABELS - 1, "iid", 4, 0), r"labels must be >= 0, got -1"),
    ("partition: fractional clients", call(partition, LABELS, "iid", 2.5, 0), r"num_clients must be an integer"),
    ("partition: too many clients", call(partition, LABELS, "iid", 300, 0), r"num_clients=300 exceeds the 200"),
    ("partition: NaN alpha", call(partition, LABELS, "dirichlet", 4, 0, alpha=float("nan")), r"alpha .* got nan"),
    ("partition: infinite alpha", call(partition, LABELS, "dirichlet", 4, 0, alpha=float("inf")), r"got inf"),
    ("partition: min_size", call(partition, LABELS, "dirichlet", 4, 0, min_size=-1), r"min_size must be >= 0"),
    ("dirichlet: infeasible min_size", call(dirichlet, LABELS, 10, 0.5, 0, min_size=30),
     r"min_size=30 is infeasible: 10 clients x 30 > 200"),
    ("partition: fractional classes", call(partition, LABELS, "shards", 4, 0, classes_per_client=1.5),
     r"classes_per_client must be an integer"),
    ("partition: too many shards", call(partition, LABELS, "shards", 150, 0, classes_per_client=2),
     r"num_clients \* classes_per_client = 300 shards exceeds the 200"),
    ("iid_imbalanced: negative sigma", call(iid_imbalanced, LABELS, 4, 0, sigma=-1.0), r"sigma .* >= 0, got -1.0"),
    ("iid_imbalanced: infinite sigma", call(iid_imbalanced, LABELS, 4, 0, sigma=float("inf")), r"got inf"),
    ("class_counts: label past the classes", call(class_counts, LABELS, [np.arange(200)], 5),
     r"labels must be < num_classes=5, got 9"),
    # --- sub-model maps
    ("build_group_map: unknown layer", call(build_group_map, shapes(**WIDE), shapes(x=(2,)), "narrow"),
     r"^narrow: layer params/x does not exist in the global model"),
    ("build_group_map: wider group", call(build_group_map, shapes(**NARROW), shapes(**WIDE), "wide"),
     r"^wide: layer params/\w has shape \([\d, ]+\), which is not a leading slice"),
    ("build_group_map: another rank", call(build_group_map, shapes(**WIDE), shapes(w=(4, 2, 1)), "g"),
     r"layer params/w has shape \(4, 2, 1\), which is not a leading slice of the global shape \(4, 3\)"),
    ("extract: not a map", call(extract, zeros(**WIDE), {"params": {}}), r"group_map must be a SubmodelMap, got a dict"),
    ("extract: leaf of a wrong shape", call(extract, zeros(w=(5, 3), b=(3,)), MAP),
     r"global_vars leaf params/w has shape \(5, 3\); the global model of group_map has \(4, 3\)"),
    ("extract: extra leaf", call(extract, zeros(**WIDE, z=(1,)), MAP),
     r"global_vars has leaf params/z, which the global model of group_map does not have"),
    ("extract: float offset", call(extract, zeros(**WIDE), MAP, 0.5), r"offset must be an integer scalar, got float"),
    ("extract: vector offset", call(extract, zeros(**WIDE), MAP, np.arange(2)), r"got int64 of shape \(2,\)"),
    ("extract: not a tree", call(extract, [np.zeros(3)], MAP), r"global_vars must be a nested dict of arrays"),
    ("embed: global-shaped upload", call(embed, zeros(**WIDE), MAP, zeros(**WIDE)),
     r"group_vars leaf params/\w has shape \([\d, ]+\); the client model of group_map has"),
    ("embed: extra leaf", call(embed, zeros(**NARROW, z=(1,)), MAP, zeros(**WIDE)),
     r"group_vars has leaf params/z, which the client model of group_map does not have"),
    ("embed: global_like of another model", call(embed, zeros(**NARROW), MAP, zeros(w=(4, 3), b=(7,))),
     r"global_like leaf params/b has shape \(7,\); the global model of group_map has \(3,\)"),
    ("coverage: global_like of another model", call(coverage, MAP, zeros(w=(8, 3), b=(3,))),
     r"global_like leaf params/w has shape \(8, 3\)"),
    ("graft: missing block", call(graft, SHALLOW_MAP, [(("block1",), ("block5",))], "shallow"),
     r"shallow: the client model has no block block5 to graft"),
    ("graft: missing target", call(graft, SHALLOW_MAP, [(("block9",), ("block0",))], "shallow"),
     r"shallow: cannot graft params/block0/w onto params/block9/w: the global model has no such layer"),
    ("pick_global: a group that embeds nowhere", call(pick_global, [shapes(**WIDE), shapes(v=(9,))], ["a", "b"]),
     r"^b: layer params/v does not exist in the global model"),
    # --- aggregators, beyond tests/test_aggregator_inputs.py
    ("similarity_matrix: unknown kind", call(A.similarity_matrix, UP, "euclid"), r"unknown similarity kind 'euclid'"),
    ("select_partners: unknown strategy", call(A.select_partners, UP, 1, "random"), r"unknown strategy 'random'"),
    ("fedcross_aggregate: unknown global", call(A.fedcross_aggregate, UP, np.array([1, 2, 0]), 0.9, "mean"),
     r"global_from must be 'middleware' or 'uploaded', got 'mean'"),
    ("propeller_partners: none", call(A.propeller_partners, 3, 0, 0), r"num_propellers must be in \[1, 2\], got 0"),
    ("propeller_partners: every model", call(A.propeller_partners, 3, 0, 3), r"must be in \[1, 2\], got 3"),
    ("in_order_partners: one model", call(A.in_order_partners, 1, 0), r"at least 2 middleware models, got 1"),
    ("dynamic_alpha: empty stage", call(A.dynamic_alpha, 3, 0, 0), r"stage_length must be positive, got 0"),
    ("cross_aggregate: no leaves", call(A.cross_aggregate, {}, np.array([1, 0]), 0.5), r"have no leaves"),
    ("cross_layer_update: shapes differ", call(A.cross_layer_update, np.ones((3, 3)), np.ones((3, 2))),
     r"cross-layer target and source shapes differ: \(3, 3\) vs \(3, 2\)"),
    ("inco: unknown variant", call(A.inco, zeros(**WIDE), (), "best"), r"unknown InCo variant 'best'"),
    ("check_pairs: unknown leaf", call(A.check_pairs, [(("params", "w"), ("params", "v"))], zeros(**WIDE)),
     r"cross-layer pair names params/v, which is not a leaf of the model"),
    ("check_pairs: an int32 leaf", call(A.check_pairs, [(("params", "w"), ("params", "v"))],
                                        {"params": {"w": np.zeros(3, np.int32), "v": np.zeros(3, np.float32)}}),
     r"^cross-layer pair leaf params/w is int32; the aggregators take floating-point weights"),
]


@pytest.mark.parametrize("make_call, pattern", [c[1:] for c in MISUSE], ids=[c[0] for c in MISUSE])
def test_library_misuse_raises_a_named_value_error(make_call, pattern):
  with pytest.raises(ValueError, match=pattern):
    make_call()


def test_misuse_cases_are_listed_once_and_good_calls_pass():
  assert len({c[0] for c in MISUSE}) == len(MISUSE)
  narrow = extract(zeros(**WIDE), MAP, np.int32(1))
  chex.assert_trees_all_equal_shapes(narrow, zeros(**NARROW))
  chex.assert_trees_all_equal_shapes(embed(narrow, MAP, zeros(**WIDE)), zeros(**WIDE))
  chex.assert_trees_all_equal_shapes(extract({"params": {"w": np.zeros((4, 3))}}, MAP), {"params": {"w": narrow["params"]["w"]}})
  DataConfig(max_train_samples=1000).check_sizes(60000, 10000, 10)
  OutputConfig(dir="runs/x").check_paths()


def test_map_checks_run_while_tracing_and_accept_a_traced_offset():
  round_trip = jax.jit(lambda v, offset: embed(extract(v, MAP, offset), MAP, v, offset))
  chex.assert_trees_all_equal_shapes(round_trip(zeros(**WIDE), 3), zeros(**WIDE))
  with pytest.raises(ValueError, match=r"global_vars leaf params/w has shape \(5, 3\)"):
    jax.jit(lambda v: extract(v, MAP))(zeros(w=(5, 3), b=(3,)))


# ------------------------------------------------------------------------------------- aggregator properties

PROPERTY = settings(max_examples=10, deadline=None, database=None)
GLOBAL_SHAPES = {"params": {"w": (3, 2), "b": (2,)}}
GROUP_SHAPES = [{"params": {"w": (3, 1), "b": (1,)}}, GLOBAL_SHAPES]
GROUP_MAPS = [build_group_map(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), GLOBAL_SHAPES,
                                           is_leaf=lambda x: isinstance(x, tuple)),
                              jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), g,
                                           is_leaf=lambda x: isinstance(x, tuple)), f"g{i}")
              for i, g in enumerate(GROUP_SHAPES)]


def random_tree(tree_shapes, rng):
  return jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), tree_shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


@st.composite
def cohorts(draw):
  """Clients of both groups: (group of each client, weight of each client, a numpy generator)."""
  size = draw(st.integers(2, 5))
  groups = draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))
  weights = draw(st.lists(st.floats(0.1, 10.0), min_size=size, max_size=size))
  return np.array(groups), np.array(weights, np.float32), np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))


def group_inputs(groups, weights, deltas):
  """Each group's weighted sum of its clients' deltas and its total weight (the engine's reduction)."""
  sums, totals = [], []
  for g, group_shapes in enumerate(GROUP_SHAPES):
    members = [c for c in range(len(groups)) if groups[c] == g]
    zero = jax.tree.map(np.zeros, group_shapes, is_leaf=lambda x: isinstance(x, tuple))
    sums.append(functools.reduce(lambda acc, c: jax.tree.map(lambda a, d: a + weights[c] * d, acc, deltas[c]),
                                 members, jax.tree.map(lambda z: z.astype(np.float32), zero)))
    totals.append(float(sum(weights[c] for c in members)))
  return sums, totals


def a_sums(groups, weights, a_values):
  """FedNova's per-group sums of weight x local steps."""
  return [float(sum(w * a for grp, w, a in zip(groups, weights, a_values) if grp == g)) for g in range(len(GROUP_SHAPES))]


def assert_close(a, b):
  chex.assert_trees_all_equal_shapes(a, b)
  chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-5)


@PROPERTY
@given(cohort=cohorts(), scale=st.floats(0.01, 100.0))
def test_fedavg_uses_weights_normalized_to_sum_to_one(cohort, scale):
  _, weights, rng = cohort
  variables = random_tree(GLOBAL_SHAPES, rng)
  deltas = [random_tree(GLOBAL_SHAPES, rng) for _ in weights]
  summed = functools.reduce(lambda acc, d: jax.tree.map(np.add, acc, d),
                            [jax.tree.map(lambda x, w=w: w * x, d) for w, d in zip(weights, deltas)])
  got = A.fedavg(variables, summed, float(weights.sum()))
  p = weights / weights.sum()
  np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
  want = jax.tree.map(lambda v, *ds: v + sum(pi * d for pi, d in zip(p, ds)), variables, *deltas)
  assert_close(got, want)
  scaled = A.fedavg(variables, jax.tree.map(lambda x: np.float32(scale) * x, summed), float(scale * weights.sum()))
  assert_close(scaled, got)


@PROPERTY
@given(cohort=cohorts())
def test_averaging_identical_client_models_is_idempotent(cohort):
  groups, weights, rng = cohort
  model = random_tree(GLOBAL_SHAPES, rng)
  uploads = [extract(model, GROUP_MAPS[g]) for g in groups]
  sums, totals = group_inputs(groups, weights, uploads)
  averaged = A.hetero_avg_weights(model, sums, totals, GROUP_MAPS)
  assert_close(averaged, model)
  again = A.hetero_avg_weights(averaged, sums, totals, GROUP_MAPS)
  assert_close(again, averaged)
  stacked = jax.tree.map(lambda x: np.broadcast_to(x, (len(groups),) + x.shape), model)
  partners = ((np.arange(len(groups)) + rng.integers(1, len(groups))) % len(groups)).astype(np.int32)
  assert_close(A.cross_aggregate(stacked, partners, 0.3), stacked)


@PROPERTY
@given(cohort=cohorts(), data=st.data())
def test_aggregation_is_invariant_to_the_order_of_clients(cohort, data):
  groups, weights, rng = cohort
  order = np.array(data.draw(st.permutations(range(len(groups)))))
  global_vars = random_tree(GLOBAL_SHAPES, rng)
  deltas = [random_tree(GROUP_SHAPES[g], rng) for g in groups]
  a_values = rng.uniform(1.0, 4.0, len(groups)).astype(np.float32)
  base_sums, base_totals = group_inputs(groups, weights, deltas)
  perm_sums, perm_totals = group_inputs(groups[order], weights[order], [deltas[i] for i in order])
  assert_close(A.hetero_avg(global_vars, perm_sums, perm_totals, GROUP_MAPS),
               A.hetero_avg(global_vars, base_sums, base_totals, GROUP_MAPS))
  assert_close(A.fednova_delta(perm_sums, perm_totals, a_sums(groups[order], weights[order], a_values[order]),
                               GROUP_MAPS, global_vars),
               A.fednova_delta(base_sums, base_totals, a_sums(groups, weights, a_values), GROUP_MAPS, global_vars))
  # FedCross: relabelling the slots relabels the result.
  stacked = {"params": {"w": rng.normal(size=(len(groups), 3)).astype(np.float32)}}
  partners = np.array([(i + 1) % len(groups) for i in range(len(groups))], np.int32)
  inverse = np.argsort(order)
  relabelled = A.cross_aggregate(jax.tree.map(lambda x: x[order], stacked), inverse[partners[order]], 0.7)
  assert_close(relabelled, jax.tree.map(lambda x: x[order], A.cross_aggregate(stacked, partners, 0.7)))


def nan_like(tree):
  return jax.tree.map(lambda x: np.full_like(x, np.nan), tree)


def assert_same_and_finite(got, want):
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Every rule that weighs groups: (model, group sums or models, group weights, group maps) -> its result.
GROUP_RULES = {
    "hetero_avg": lambda model, sums, weights, maps: A.hetero_avg(model, sums, weights, maps),
    "hetero_avg_weights": lambda model, sums, weights, maps: A.hetero_avg_weights(model, sums, weights, maps),
    "heterogeneous_mean_delta": lambda model, sums, weights, maps: A.heterogeneous_mean_delta(sums, weights, maps,
                                                                                              model),
    "heterogeneous_sums": lambda model, sums, weights, maps: A.heterogeneous_sums(sums, weights, maps, model),
    "fednova_delta": lambda model, sums, weights, maps: A.fednova_delta(sums, weights, [2 * w for w in weights], maps,
                                                                        model),
    "scaffold_server_control": lambda model, sums, weights, maps: A.scaffold_server_control(model, sums, weights,
                                                                                            maps),
    "fedfa_aggregate": lambda model, sums, weights, maps: A.fedfa_aggregate(model, sums, weights, maps)[0],
}  # (FedFA's stats count every cohort client's zero-norm kernels, as its mu counts their norms: not compared)


@pytest.mark.parametrize("name", sorted(GROUP_RULES))
def test_a_group_of_zero_weight_contributes_nothing_even_when_it_holds_nan(name):
  """0 * NaN is NaN: a group without weight whose sums held NaN made every element it shares NaN (probe 94)."""
  rng = np.random.default_rng(0)
  model = random_tree(GLOBAL_SHAPES, rng)
  sums = [nan_like(random_tree(GROUP_SHAPES[0], rng)), random_tree(GROUP_SHAPES[1], rng)]
  rule = GROUP_RULES[name]
  assert_same_and_finite(rule(model, sums, [0.0, 2.0], GROUP_MAPS), rule(model, sums[1:], [2.0], GROUP_MAPS[1:]))


def test_fedavg_and_fedfa_ignore_a_traced_zero_weight_under_jit():
  """Their sums are their own (unlike the per-group rules' and the engine's), so they select them out under jit."""
  rng = np.random.default_rng(2)
  model = random_tree(GLOBAL_SHAPES, rng)
  fedavg = jax.jit(A.fedavg)
  assert_same_and_finite(fedavg(model, nan_like(model), np.float32(0.0)), model)
  weighted = random_tree(GROUP_SHAPES[1], rng)
  fedfa = jax.jit(lambda first, weights: A.fedfa_aggregate(model, [first, weighted], weights, GROUP_MAPS)[0])
  weights, narrow = [np.float32(0.0), np.float32(2.0)], random_tree(GROUP_SHAPES[0], rng)
  assert_same_and_finite(fedfa(nan_like(narrow), weights), fedfa(jax.tree.map(np.zeros_like, narrow), weights))


def test_zero_weight_nan_changes_neither_fedavg_nor_fednova_steps():
  rng = np.random.default_rng(1)
  model = random_tree(GLOBAL_SHAPES, rng)
  assert_same_and_finite(A.fedavg(model, nan_like(model), 0.0), model)  # documented: unchanged without clients
  sums = [random_tree(GROUP_SHAPES[0], rng), random_tree(GROUP_SHAPES[1], rng)]
  traced = jax.jit(lambda a_sums: A.fednova_delta(sums, [0.0, 2.0], a_sums, GROUP_MAPS, model))  # (NaN: not checked)
  assert_same_and_finite(traced([np.float32(np.nan), np.float32(3.0)]), traced([np.float32(0.0), np.float32(3.0)]))


@pytest.mark.parametrize("args", [(shapes(**WIDE), "cnn@0.5"), ("cnn@1", shapes(**NARROW))])
def test_a_group_map_of_something_other_than_variables_names_the_argument(args):
  """(A model spec string where variables go raised AttributeError deep in the flattening.)"""
  which = "group_shapes" if isinstance(args[1], str) else "global_shapes"
  with pytest.raises(TypeError, match=rf"build_group_map: {which} must be a model's variables .* got str 'cnn@"):
    build_group_map(*args)


# Trees whose leaves are not arrays (probe P61: shape tuples for arrays raised AttributeError deep in the flattening).
NOT_ARRAYS = [("a shape tuple", (4, 3)), ("a list", [[0.0] * 3] * 4), ("an int", 3), ("None", None)]
LEAF_CALLS = [  # (description, call with the bad tree ``t``, the argument the message must name, what it expects)
    ("build_group_map global", lambda t: build_group_map(t, shapes(**NARROW)), "build_group_map: global_shapes",
     "an array or a jax.ShapeDtypeStruct"),
    ("build_group_map group", lambda t: build_group_map(shapes(**WIDE), t), "build_group_map: group_shapes",
     "an array or a jax.ShapeDtypeStruct"),
    ("identity_map", identity_map, r"identity_map: tree", "an array or a jax.ShapeDtypeStruct"),
    ("pick_global", lambda t: pick_global([shapes(**WIDE), t], ["a", "b"]), r"pick_global: group_shapes\[1\] \(b\)",
     "an array or a jax.ShapeDtypeStruct"),
    ("extract", lambda t: extract(t, MAP), "extract: global_vars", "an array"),
    ("embed group_vars", lambda t: embed(t, MAP, zeros(**WIDE)), "embed: group_vars", "an array"),
    ("embed global_like", lambda t: embed(zeros(**NARROW), MAP, t), "embed: global_like",
     "an array or a jax.ShapeDtypeStruct"),
    ("coverage", lambda t: coverage(MAP, t), "coverage: global_like", "an array or a jax.ShapeDtypeStruct"),
    ("complete", lambda t: complete(t, [MAP], [MAP]), "complete: global_vars", "an array")]


@pytest.mark.parametrize("leaf", [leaf for _, leaf in NOT_ARRAYS], ids=[name for name, _ in NOT_ARRAYS])
@pytest.mark.parametrize("make_call, argument, expected", [c[1:] for c in LEAF_CALLS], ids=[c[0] for c in LEAF_CALLS])
def test_a_tree_whose_leaf_is_not_an_array_names_the_argument_and_the_leaf(make_call, argument, expected, leaf):
  tree = {"params": {"w": leaf, "b": np.zeros(3, np.float32)}}
  with pytest.raises(TypeError, match=rf"^{argument} leaf params/w is {type(leaf).__name__} .*; expected {expected}"):
    make_call(tree)
