"""FedFA (grafting), FlexiFed and FedRolex: hand-worked cases and two-round runs of each method on tiny models. FedFA's
scalable aggregation: tests/test_fedfa_aggregation.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.cli import run as cli
from fedjax_hetero.config import FedFAOptions, LocalConfig
from fedjax_hetero.hetero import build_group_map, coverage, embed, extract, graft, identity_map
from fedjax_hetero.methods import METHODS, build_method
from fedjax_hetero.methods.fedfa import ScaledKernels, graft_pairs, grafted_maps
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import Simulation
from fedjax_hetero.rounds.cohort import empty_group_result, empty_result
from tests.helpers import (aggregate, method_options, numpy_variables, run_rounds, simulation, tiny_federation,
                           tiny_resnet, tiny_simulation)

# One worker runs the module, so its module-scoped run trains once (scripts/test.sh: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("fedfa")


def params(**leaves):
  return {"params": {name: {k: jnp.asarray(v, jnp.float32) for k, v in leaf.items()} for name, leaf in leaves.items()}}


def shapes_of(model, image=(8, 8, 1)):
  return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1,) + image))


# ------------------------------------------------------------------------------------------ layer grafting


def test_resnet_declares_its_stages():
  assert tiny_resnet((2, 1)).stage_blocks() == ((("stage1_block0",), ("stage1_block1",)), (("stage2_block0",),))
  names = set(shapes_of(tiny_resnet((2, 1)))["params"])
  assert {b[0] for stage in tiny_resnet((2, 1)).stage_blocks() for b in stage} <= names


def test_graft_pairs_fill_each_stage_from_its_last_block():
  big, small = tiny_resnet((3, 3)), tiny_resnet((2, 1))
  group_map = build_group_map(shapes_of(big), shapes_of(small), "small")
  # Stage 1: block 2 <- block 1. Stage 2: the client's only block downsamples (other shapes), so no pair.
  assert graft_pairs(small, big, group_map, "small") == ((("stage1_block2",), ("stage1_block1",)),)
  one = tiny_resnet((1, 2))  # stage 1's block 0 keeps the stem's width and stride: it grafts
  pairs = graft_pairs(one, big, build_group_map(shapes_of(big), shapes_of(one), "one"), "one")
  assert pairs == ((("stage1_block1",), ("stage1_block0",)), (("stage1_block2",), ("stage1_block0",)),
                   (("stage2_block2",), ("stage2_block1",)))
  assert graft_pairs(big, big, identity_map(shapes_of(big)), "big") == ()


def test_grafted_client_fills_deeper_blocks_with_its_last_block():
  big, small = tiny_resnet((3, 2)), tiny_resnet((1, 2))
  glob, client = shapes_of(big), numpy_variables(shapes_of(small), seed=1)
  grafted = graft(build_group_map(glob, shapes_of(small), "small"),
                  graft_pairs(small, big, build_group_map(glob, shapes_of(small)), "small"), "small")
  placed = embed(client, grafted, numpy_variables(glob, seed=2))
  for collection in ("params", "batch_stats"):
    for j in range(3):  # global block j <- client block min(j, 0)
      chex.assert_trees_all_equal(placed[collection][f"stage1_block{j}"], client[collection]["stage1_block0"])
    chex.assert_trees_all_equal(placed[collection]["stage2_block1"], client[collection]["stage2_block1"])
  assert float(coverage(grafted, glob)["params"]["stage1_block2"]["conv1"]["kernel"].min()) == 1.0
  chex.assert_trees_all_equal(extract(numpy_variables(glob, 3), grafted), extract(numpy_variables(glob, 3),
                              build_group_map(glob, shapes_of(small))))  # what the client receives is unchanged


def test_grafting_a_deeper_client_names_the_group():
  big, deep = tiny_resnet((2, 2)), tiny_resnet((3, 2))
  with pytest.raises(ValueError, match="deep: stage 1 has 3 blocks, deeper than the global model's 2"):
    graft_pairs(deep, big, identity_map(shapes_of(big)), "deep")


def test_grafting_needs_declared_stages_only_when_depths_differ():
  mlp = lambda hidden, width=1.0: build_model("mlp", 4, width, hidden=hidden)
  wide, thin, shallow = mlp((8, 8)), mlp((8, 8), 0.5), mlp((8,))
  assert graft_pairs(thin, wide, build_group_map(shapes_of(wide), shapes_of(thin)), "thin") == ()
  with pytest.raises(ValueError, match="shallow: FedFA's layer grafting needs the models to declare their stages"):
    graft_pairs(shallow, wide, build_group_map(shapes_of(wide), shapes_of(shallow)), "shallow")


# ------------------------------------------------------------------------------------------------ FedRolex


def test_fedrolex_window_by_hand():
  method = build_method("FedRolex")
  glob = params(first={"kernel": np.zeros((5, 4))}, layer={"kernel": np.arange(24.0).reshape(4, 6),
                                                            "bias": np.arange(6.0)})
  client = params(first={"kernel": np.zeros((5, 2))}, layer={"kernel": np.zeros((2, 3)), "bias": np.zeros(3)})
  rolling = method.submodel(glob, client, "half")
  got = extract(glob, rolling, 5)["params"]["layer"]  # rows (5, 6) mod 4 = 1, 2; columns 5, 0, 1
  np.testing.assert_array_equal(got["kernel"], [[11, 6, 7], [17, 12, 13]])
  np.testing.assert_array_equal(got["bias"], [5, 0, 1])
  np.testing.assert_array_equal(coverage(rolling, glob, offset=5)["params"]["layer"]["bias"], [1, 1, 0, 0, 0, 1])
  assert not build_method("HeteroAvg").submodel(glob, client, "half").rolling


# ---------------------------------------------------------------------------------------- two-round runs


def resnet_simulation(method, **options):
  return simulation(method, [(f"resnet{sizes}", tiny_resnet(sizes)) for sizes in [(1, 1), (2, 2)]],
                    tiny_federation(4, 48, 8, "iid"), LocalConfig(batch_size=16), options=options, clients_per_round=4)


@pytest.fixture(scope="module")
def resnet_fedfa():
  """FedFA on two ResNet depth groups, after two rounds: (simulation, state, per-round metrics)."""
  sim = resnet_simulation("FedFA")
  return (sim, *run_rounds(sim))


@pytest.mark.slow
def test_fedfa_two_rounds_on_resnet_depth_groups(resnet_fedfa):
  sim, state, metrics = resnet_fedfa
  maps = grafted_maps(sim.spec.federations[0])
  assert len(maps[0].push) > len(sim.spec.federations[0].maps[0].push)  # the shallow group is grafted
  for m in metrics:
    assert 0 < m["fedfa"]["alpha_min"] <= 1 <= m["fedfa"]["alpha_max"] and m["fedfa"]["fallbacks"] == 0
    assert np.isfinite(m["train_loss"])
  for leaf in jax.tree.leaves(state.models[0]):
    chex.assert_tree_all_finite(leaf)
  chex.assert_trees_all_equal_shapes(state.models[0], shapes_of(tiny_resnet((2, 2))))


@pytest.mark.slow
def test_fedfa_grafting_feeds_the_shallow_clients_into_deeper_blocks(resnet_fedfa):
  sim, state, _ = resnet_fedfa
  rng = np.random.default_rng(3)
  model = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), state.models[0])
  state = state._replace(models=(model,))
  starts = [sim.spec.group_variables(state, i) for i in range(2)]
  # The shallow group (weight 1) uploads its start + 1, the deep one (weight 3) its start + 5. Every norm
  # row is 0, so alpha = 1 and the kernels come through the fallback part, unscaled.
  results = []
  for g, (start, value, weight) in enumerate(zip(starts, (1.0, 15.0), (1.0, 3.0))):
    empty = empty_group_result(sim.spec.trainers[g], start, (), (), sim.spec.stack_size(g))
    sums = jax.tree.map(lambda x, v=value: jnp.full_like(x, v), start)
    uploaded = jax.tree.map(lambda d, x, w=weight: d + w * x, sums, start)
    scaled = ScaledKernels(aggregators.fedfa.kernels(uploaded), aggregators.fedfa.kernels(
        jax.tree.map(jnp.zeros_like, start)))
    uploads = (scaled,) + empty.uploads[1:]  # the terms: scaled_upload's two
    results.append(empty._replace(delta_sum=sums, weight_sum=jnp.float32(weight), uploads=uploads))
  new, _, metrics = aggregate(sim, state, starts, results, [np.array([0]), np.array([2, 3])])
  assert metrics["fedfa"]["fallbacks"] > 0
  kernel = lambda tree, block: np.asarray(tree["params"][block]["conv2"]["kernel"])
  # stage1_block1 = (1 * (1 + shallow block 0) + 3 * (5 + block 1)) / 4: the graft's copy of block 0.
  np.testing.assert_allclose(kernel(new, "stage1_block1"),
                             (1 + kernel(model, "stage1_block0") + 3 * (5 + kernel(model, "stage1_block1"))) / 4,
                             rtol=1e-5, atol=1e-5)
  # stage2_block1: the shallow client's stage 2 is its downsampling block, not grafted: the deep group's alone.
  np.testing.assert_allclose(kernel(new, "stage2_block1"), 5 + kernel(model, "stage2_block1"), rtol=1e-5, atol=1e-5)
  bias = lambda tree, block: np.asarray(tree["params"][block]["bn2"]["bias"])  # alpha 1 always; grafted too
  np.testing.assert_allclose(bias(new, "stage1_block1"),
                             (1 + bias(model, "stage1_block0") + 3 * (5 + bias(model, "stage1_block1"))) / 4,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_flexifed_and_fedrolex_two_rounds_and_fedfa_without_its_parts_is_flexifed():
  runs = {}
  for name in ("FlexiFed", "FedRolex"):
    sim = tiny_simulation(name, widths=(1.0, 0.5))
    assert all(m.rolling == (name == "FedRolex") for m in sim.spec.maps[1:])
    state, metrics = run_rounds(sim)
    assert state.round == 2 and all(np.isfinite(m["train_loss"]) for m in metrics)
    assert 0 <= sim.evaluate(state)["mean"] <= 1
    runs[name] = sim, state
  # Random uploads aggregated by FlexiFed's server program and by FedFA's without its two parts.
  sim, state = runs["FlexiFed"]
  starts = [sim.spec.group_variables(state, i) for i in range(2)]
  rng = np.random.default_rng(5)
  results = [empty_result(st)._replace(delta_sum=jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape),
                                                                                     jnp.float32), st),
                                       weight_sum=jnp.float32(w)) for st, w in zip(starts, (2.0, 1.0))]
  cohorts = [np.array([0, 1]), np.array([3])]
  flexifed = aggregate(sim, state, starts, results, cohorts)[0]
  off = build_method("FedFA", method_options(fedfa_graft=False, fedfa_scale=False))
  without_parts = Simulation(sim.spec.with_values(method=off), sim.cohorts)
  chex.assert_trees_all_close(aggregate(without_parts, state, starts, results, cohorts)[0], flexifed,
                              rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------- catalog and CLI


def test_help_lists_the_new_methods_under_their_papers():
  text = cli.methods_help()
  fedfa_heading = text.index("FedFA (Park & Joe-Wong, ECML-PKDD 2024)")
  rolex_heading = text.index("FedRolex (Alam et al., NeurIPS 2022)")
  for name, heading in (("FedFA", fedfa_heading), ("FlexiFed", fedfa_heading), ("FedRolex", rolex_heading)):
    lines = [line for line in text.splitlines() if line.startswith(f"    {name} ")]
    assert len(lines) == 1 and text.index(lines[0]) > heading
    assert METHODS[name.lower()].name == name


def test_fedfa_options_are_checked():
  with pytest.raises(ValueError, match="--fedfa-norm must be one of l2, rms"):
    method_options(fedfa_norm="l1")
  with pytest.raises(ValueError, match="--fedfa-percentile"):
    method_options(fedfa_percentile=0.0)
  with pytest.raises(ValueError, match="^--fedfa-graft applies to FedFA, not HeteroAvg$"):
    build_method("HeteroAvg", method_options(fedfa_graft=False))
  with pytest.raises(ValueError, match="--no-fedfa-scale turns off"):
    build_method("FedFA", method_options(fedfa_scale=False, fedfa_norm="rms"))
  assert [t.name for t in build_method("FedFA").terms] == ["fedfa", "fedfa_norms"]
  assert build_method("FedFA", method_options(fedfa_scale=False)).terms == ()
  assert build_method("FedFA").evaluation_variables is None
  static = build_method("FedFA", method_options(fedfa_static_bn=True))
  assert [t.name for t in static.terms] == ["fedfa", "fedfa_norms", "static_bn"]
  assert static.evaluation_variables is not None


@pytest.mark.slow
def test_fedfa_with_static_bn_averages_no_running_statistics(resnet_fedfa):
  """--fedfa-static-bn (the paper's sBN, Sec. 5.1): the federation's running statistics stay as initialized
  while its weights train, and each evaluation re-estimates them; without it they are averaged and move."""
  sim = resnet_simulation("FedFA", fedfa_static_bn=True)
  start = sim.init_state()
  state, metrics = run_rounds(sim, 2)
  chex.assert_trees_all_equal(state.models[0]["batch_stats"], start.models[0]["batch_stats"])
  kernel = lambda s: s.models[0]["params"]["stem_conv"]["kernel"]
  assert not np.allclose(kernel(state), kernel(start))
  assert all(0 < m["fedfa"]["alpha_min"] <= 1 <= m["fedfa"]["alpha_max"] for m in metrics)
  assert 0.0 <= sim.evaluate(state)["mean"] <= 1.0
  _, plain, _ = resnet_fedfa  # the same start (seed and models), without sBN
  stem_mean = lambda s: s.models[0]["batch_stats"]["stem_bn"]["mean"]
  assert not np.allclose(stem_mean(plain), stem_mean(start))


def test_fedrolex_rejects_a_flattened_feature_map():
  shapes = lambda width: jax.eval_shape(build_model("cnn", 4, width).init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  with pytest.raises(ValueError, match=r"half: FedRolex rolls channel windows, but axis 0 of params/fc1/kernel "
                     r"\(1568 of 3136\) is no layer's channel axis"):
    build_method("FedRolex").submodel(shapes(1.0), shapes(0.5), "half")


def test_cli_flags_reach_the_method_and_bad_ones_stop_before_compute(tmp_path, capsys, monkeypatch, no_compute):
  base = ["--groups", "resnet10,resnet14", "--num-clients", "10", "--rounds", "1", "--no-progress",
          "--compile-cache", "off", "--output-dir", str(tmp_path / "out")]
  configs = []
  monkeypatch.setattr(cli, "run_checked", lambda config, *_, **__: configs.append(config) or {
      "final_accuracy": {}, "best_mean_accuracy": None, "train_seconds_all_rounds": 0.0})
  cli.main("fashion_mnist", base + ["--method", "fedfa", "--no-fedfa-graft", "--fedfa-norm", "rms",
                                                         "--fedfa-percentile", "90"])
  method = configs[0].method
  assert (method.name, method.fedfa) == ("fedfa", FedFAOptions(graft=False, scale=True, norm="rms", percentile=90.0))
  for args, fragment in ((["--method", "HeteroAvg", "--no-fedfa-scale"], "applies to FedFA, not HeteroAvg"),
                         (["--method", "FedFA", "--fedfa-percentile", "101"], "--fedfa-percentile"),
                         (["--method", "FedFA", "--fedfa-norm", "l1"], "invalid choice")):
    with pytest.raises(SystemExit) as info:
      cli.main("fashion_mnist", base + args)
    assert info.value.code == 2 and fragment in capsys.readouterr().err
