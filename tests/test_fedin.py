"""FedIN: the gradient rule (Eq. 14 and the Eq. 13 projection), the IN loss reaching only the intermediate layers,
the feature bank's modes and its non-finite guard, resume, InclusiveFL's momentum distillation, bad input, and
two-round runs."""

from __future__ import annotations

from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero.client.terms import Batch, RoundInput, StepContext
from fedjax_hetero.config import FedINConfig, LocalConfig, RunConfig
from fedjax_hetero.methods import fedin as fi
from fedjax_hetero.methods.fedin import (NAME, distillation_targets, feature_bank, intermediate_training,
                                         momentum_distillation)
from fedjax_hetero.run import checkpoints
from fedjax_hetero.run.build import run_method
from fedjax_hetero.server.steps import Carry
from tests.helpers import model_variables, run_rounds, simulation, tiny_federation, tiny_resnet


def pairs(s_in, s_out, valid):
  return fi.FeaturePairs(jnp.asarray(s_in, jnp.float32), jnp.asarray(s_out, jnp.float32), jnp.asarray(valid, bool))


# ------------------------------------------------------------------------------------------ the gradient rule


G_IN = {"stem": jnp.zeros(2), "stage": jnp.array([1.0, 0.0]), "other": jnp.array([0.0, 2.0])}
G_LOCAL = {"stem": jnp.array([1.0, 1.0]), "stage": jnp.array([-1.0, 1.0]), "other": jnp.array([3.0, 0.0])}


def test_eq14_and_the_plain_sum():
  z = fi.combine(G_IN, G_LOCAL, FedINConfig())
  chex.assert_trees_all_close(z, {"stem": jnp.array([.5, .5]), "stage": jnp.array([.5, .5]),
                                  "other": jnp.array([1.5, 2.0])})
  z = fi.combine(G_IN, G_LOCAL, FedINConfig(lam=4.0))
  chex.assert_trees_all_close(z["stage"], jnp.array([-1.0, 2.0]))
  z = fi.combine(G_IN, G_LOCAL, FedINConfig(rule="sum"))
  chex.assert_trees_all_close(z, jax.tree.map(jnp.add, G_IN, G_LOCAL))


def test_eq13_projects_per_tensor_onto_the_half_space():
  z = fi.combine(G_IN, G_LOCAL, FedINConfig(rule="project"))
  # stage: b = <g, i> = -1 < 0, a = 2: Z = i + g / 2, orthogonal to g; other: b = 0, Z = G_IN untouched.
  chex.assert_trees_all_close(z["stage"], jnp.array([0.5, 0.5]))
  assert float(jnp.vdot(z["stage"], G_LOCAL["stage"])) == pytest.approx(0.0)
  chex.assert_trees_all_close(z["other"], G_IN["other"])
  chex.assert_trees_all_close(z["stem"], G_LOCAL["stem"])  # G_IN does not reach it: the local gradient


def test_eq13_projects_globally_over_the_tensors_g_in_reaches():
  z = fi.combine(G_IN, G_LOCAL, FedINConfig(rule="project", projection="global"))
  # over stage and other: a = 2 + 9 = 11, b = -1 + 0 = -1: Z = i + g / 11 on both.
  chex.assert_trees_all_close(z["stage"], jnp.array([1 - 1 / 11, 1 / 11]))
  chex.assert_trees_all_close(z["other"], jnp.array([3 / 11, 2.0]))
  chex.assert_trees_all_close(z["stem"], G_LOCAL["stem"])
  inner = sum(float(jnp.vdot(z[k], G_LOCAL[k])) for k in ("stage", "other"))
  assert inner == pytest.approx(0.0, abs=1e-6)


def test_with_an_empty_bank_every_rule_follows_the_local_gradient_alone():
  zero = jax.tree.map(jnp.zeros_like, G_IN)
  chex.assert_trees_all_close(fi.combine(zero, G_LOCAL, FedINConfig(rule="project")), G_LOCAL)
  chex.assert_trees_all_close(fi.combine(zero, G_LOCAL, FedINConfig(rule="sum")), G_LOCAL)


# --------------------------------------------------------------------------------------------- the IN loss


@pytest.mark.slow
def test_the_in_loss_reaches_only_the_intermediate_layers():
  model = tiny_resnet((1, 2))
  images = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 8, 1)), jnp.float32)
  variables = model_variables(model, images, seed=1)
  s_in = model.apply(variables, images, stop="stem")
  s_out = model.apply(variables, images, stop="stage2") + 1.0
  term = intermediate_training()
  state = term.init(RoundInput(variables, None, pairs(s_in, s_out, [True] * 4), None))
  ctx = StepContext(model, None, jnp.float32(0), None)

  def loss(params):
    return term.loss.value({**variables, "params": params}, state, None, None, ctx)

  value, grads = jax.value_and_grad(loss)(variables["params"])
  assert float(value) > 0
  for path, g in traverse_util.flatten_dict(grads).items():
    touched = float(jnp.abs(g).max()) > 0
    assert touched == path[0].startswith("stage"), path  # stem and head exactly zero, every stage reached


def test_the_in_loss_is_the_mse_over_the_valid_pairs():
  model = tiny_resnet()
  images = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8, 8, 1)), jnp.float32)
  variables = model_variables(model, images, seed=2)
  s_in = model.apply(variables, images, stop="stem")
  target = jnp.zeros_like(model.apply(variables, images, stop="stage2"))
  term = intermediate_training()
  ctx = StepContext(model, None, jnp.float32(0), None)
  valid = jnp.array([True, True, False])
  state = term.init(RoundInput(variables, None, pairs(s_in, target, valid), None))
  out, _ = model.apply(variables, s_in, train=True, mask=valid, start="stem", stop="stage2", mutable=["batch_stats"])
  expected = float(jnp.mean(jnp.square(out[:2])))
  assert float(term.loss.value(variables, state, None, None, ctx)) == pytest.approx(expected, rel=1e-5)
  empty = term.init(RoundInput(variables, None, pairs(s_in, target, [False] * 3), None))
  assert float(term.loss.value(variables, empty, None, None, ctx)) == 0.0  # the first round: local loss only


def test_the_upload_is_the_last_real_batch_of_pairs_detached():
  model = tiny_resnet()
  term = intermediate_training(FedINConfig(num_pairs=3))
  state = term.init(RoundInput(None, None, fi.empty_pairs(3, (8, 8, 4), (4, 4, 8)), None))
  acts = {"stem": jnp.ones((2, 8, 8, 4)), "stage2": 2 * jnp.ones((2, 4, 4, 8))}
  batch = Batch(None, None, jnp.array([True, True]), None)
  state = term.update(state, SimpleNamespace(activations=acts), StepContext(model, batch, jnp.float32(0), None))
  upload = state[1]
  np.testing.assert_array_equal(upload.valid, [True, True, False])  # a batch of 2 fills 2 of the 3 rows
  assert float(upload.s_in[:2].min()) == 1.0 and float(upload.s_out[2].max()) == 0.0


# ------------------------------------------------------------------------------------------ the feature bank


def test_the_latest_bank_holds_the_last_round_with_pairs():
  bank = fi.empty_pairs(4, (1,), (1,))
  new = pairs([[1], [2], [3], [4]], [[1], [2], [3], [4]], [True, False, True, False])
  bank, _ = fi.add_to_bank(bank, jnp.int32(0), new, "latest")
  np.testing.assert_array_equal(bank.valid, [True, True, False, False])
  np.testing.assert_array_equal(bank.s_in[:2, 0], [1, 3])
  none = pairs([[9]] * 4, [[9]] * 4, [False] * 4)
  kept, _ = fi.add_to_bank(bank, jnp.int32(0), none, "latest")  # a round without pairs keeps the bank
  chex.assert_trees_all_equal(kept, bank)


def test_the_history_bank_is_a_ring_buffer():
  bank, slot = fi.empty_pairs(3, (1,), (1,)), jnp.int32(0)
  for values in ([1, 2], [3, 4]):
    new = pairs([[v] for v in values], [[v] for v in values], [True, True])
    bank, slot = fi.add_to_bank(bank, slot, new, "history")
  np.testing.assert_array_equal(bank.valid, [True] * 3)
  np.testing.assert_array_equal(bank.s_in[:, 0], [4, 2, 3])  # 4 overwrote the oldest pair, 1
  assert int(slot) == 1


def test_a_batch_is_drawn_without_replacement_or_with_it_from_a_small_bank():
  bank = pairs(np.arange(20)[:, None], np.arange(20)[:, None], [True] * 20)
  batch = fi.sample_batch(bank, 16, jax.random.key(0))
  assert len(set(np.asarray(batch.s_in[:, 0]).tolist())) == 16 and bool(batch.valid.all())
  small = pairs(np.arange(20)[:, None], np.arange(20)[:, None], [i < 3 for i in range(20)])
  batch = fi.sample_batch(small, 16, jax.random.key(1))
  assert set(np.asarray(batch.s_in[:, 0]).tolist()) <= {0, 1, 2} and bool(batch.valid.all())
  empty = fi.sample_batch(fi.empty_pairs(5, (1,), (1,)), 4, jax.random.key(2))
  assert not bool(empty.valid.any())


def depth_simulation(method, groups=((1, 1), (1, 2)), **options):
  return simulation(method, [(f"resnet{s}", tiny_resnet(s)) for s in groups], tiny_federation(4, 48, 8, "iid"),
                    LocalConfig(batch_size=8), options=options, clients_per_round=4)


@pytest.mark.slow
def test_pairs_with_a_non_finite_value_are_dropped_and_counted():
  sim = depth_simulation("FedIN", fedin=FedINConfig(num_pairs=2))
  federation = sim.spec.federations[0]
  step = feature_bank(FedINConfig(num_pairs=2), sim.spec.method.terms[-1])
  bank = step.init(None, federation)
  in_shape, out_shape = bank.pairs.s_in.shape[1:], bank.pairs.s_out.shape[1:]
  good = fi.FeaturePairs(jnp.ones((1, 2) + in_shape), jnp.ones((1, 2) + out_shape), jnp.ones((1, 2), bool))
  bad = good._replace(s_out=good.s_out.at[0, 1, 0].set(jnp.nan))
  stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), good, bad)
  inputs = SimpleNamespace(uploads=lambda name: [stacked], valid=(jnp.array([True, True]),), key=jax.random.key(0),
                           federation=federation)
  carry, bank = step.update(Carry(None), bank, inputs, None)
  assert float(carry.metrics[NAME][federation.name]["dropped_clients"]) == 1.0
  assert int(bank.pairs.valid.sum()) == 2  # the good client's two pairs
  assert bool(bank.ready) and np.all(np.isfinite(np.asarray(bank.batch.s_out)))


# ------------------------------------------------------------------------------------------ InclusiveFL


@pytest.fixture(scope="module")
def inclusive_sim():
  return depth_simulation("InclusiveFL", groups=((1, 1), (1, 3)), inclusivefl_beta=0.5, inclusivefl_momentum=0.5)


@pytest.mark.slow
def test_inclusivefl_distills_the_deeper_blocks_update_into_a_shallow_stage_top(inclusive_sim):
  sim = inclusive_sim
  federation = sim.spec.federations[0]
  targets = distillation_targets(federation.models, federation.group_names, federation.largest,
                                 federation.maps[0].global_shapes)
  assert len(targets) == 1  # stage 2 at depth 1 (stage 1 has one block everywhere)
  leaves = dict(targets[0])
  # stage2_block0 changes width: only its conv2 and BatchNorms match the deeper blocks' shapes.
  assert ("params", "stage2_block0", "conv2", "kernel") in leaves
  assert ("params", "stage2_block0", "conv1", "kernel") not in leaves
  assert leaves[("params", "stage2_block0", "conv2", "kernel")] == (
      ("params", "stage2_block1", "conv2", "kernel"), ("params", "stage2_block2", "conv2", "kernel"))

  step = momentum_distillation(beta=0.5, momentum=0.5)
  model = sim.init_state().models[0]
  delta = jax.tree.map(jnp.zeros_like, model)
  flat = traverse_util.flatten_dict(delta)
  kernel = ("params", "stage2_block0", "conv2", "kernel")
  flat[("params", "stage2_block1", "conv2", "kernel")] = jnp.full_like(flat[kernel], 2.0)
  flat[("params", "stage2_block2", "conv2", "kernel")] = jnp.full_like(flat[kernel], 4.0)
  delta = traverse_util.unflatten_dict(flat)
  state = step.init(model, federation)
  inputs = SimpleNamespace(federation=federation)
  for expected_m in (1.5, 2.25):  # m <- 0.5 m + 0.5 * mean(2, 4)
    carry, state = step.update(Carry(model, delta), state, inputs, None)
    out = traverse_util.flatten_dict(carry.delta)
    np.testing.assert_allclose(out[kernel], 0.5 * expected_m)
    np.testing.assert_allclose(out[("params", "stage2_block1", "conv2", "kernel")], 2.0)  # deeper blocks untouched


# ------------------------------------------------------------------------------------------ runs and bad input


@pytest.mark.slow
def test_two_inclusivefl_rounds_on_resnet_depth_groups(inclusive_sim):
  _, metrics = run_rounds(inclusive_sim)
  assert all(np.isfinite(m["train_loss"]) for m in metrics)


def test_bad_input_is_refused_before_compute():
  with pytest.raises(ValueError, match="--groups, group cnn: FedIN needs .* CNN declares none"):
    run_method(RunConfig.from_flags(groups=("cnn",), method="FedIN"))
  with pytest.raises(ValueError, match="--fedin-rule"):
    FedINConfig(rule="projection")
  with pytest.raises(ValueError, match="--fedin-bank-capacity"):
    FedINConfig(bank_capacity=0)
  with pytest.raises(ValueError, match="^--fedin-bank applies to FedIN, not HeteroAvg$"):
    run_method(RunConfig.from_flags(method="HeteroAvg", fedin_bank="history"))
  with pytest.raises(ValueError, match="--inclusivefl-momentum"):
    RunConfig.from_flags(method="InclusiveFL", inclusivefl_momentum=1.0)


def test_groups_of_different_feature_shapes_cannot_share_pairs():
  federation = depth_simulation("FedIN").spec.federations[0]
  wider = federation._replace(models=(federation.models[0], federation.models[1].clone(width=2.0)))
  with pytest.raises(ValueError, match="need one shape"):
    feature_bank(FedINConfig(), intermediate_training()).init(None, wider)


@pytest.mark.slow
def test_a_checkpoint_restores_the_bank_and_the_run_goes_on_bit_for_bit(tmp_path):
  """Also FedIN's two-round run on synthetic data (one-stage depth groups: one and two blocks)."""
  sim = depth_simulation("FedIN", groups=((1,), (2,)))
  state, _ = run_rounds(sim, 1)
  manager = checkpoints.manager(str(tmp_path))
  checkpoints.save(manager, state, force=True)
  manager.wait_until_finished()
  restored = checkpoints.restore_latest(checkpoints.manager(str(tmp_path)), sim.init_state())
  assert restored.round == 1 and bool(restored.steps[0][-1].ready)
  chex.assert_trees_all_equal(restored.steps, state.steps)
  straight, (metrics,) = sim.run_rounds(state, 1)
  resumed, (_,) = sim.run_rounds(restored, 1)
  assert np.isfinite(metrics["train_loss"]) and metrics[NAME]["global"]["dropped_clients"] == 0
  assert metrics[NAME]["global"]["bank_pairs"] > 0
  assert int(straight.steps[0][-1].pairs.valid.sum()) > 0
  chex.assert_trees_all_equal(resumed.steps, straight.steps)  # round 2's bank and S grew from the restored one
  chex.assert_trees_all_equal(resumed.models, straight.models)
