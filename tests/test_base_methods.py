"""SCAFFOLD, FedNova and MOON (client side and server steps), FedCross in the engine, and the method table."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.cli import run as cli
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.config import FedCrossConfig, LocalConfig, RunConfig
from fedjax_hetero.data.store import sample_clients
from fedjax_hetero.hetero.maps import build_group_map, identity_map
from fedjax_hetero.methods import METHODS, build_method, get_entry
from fedjax_hetero.methods.fednova import nova_normalizer
from fedjax_hetero.methods.moon import model_contrastive_loss
from fedjax_hetero.methods.scaffold import scaffold_control_update, scaffold_correction
from fedjax_hetero.models import build_model
from fedjax_hetero.run.runner import run_experiment
from tests.helpers import model_variables, random_batch, run_rounds, tiny_simulation

NUM_CLASSES = 4
MEAN, STD = (0.45,), (0.25,)


def batch(seed, size):
  return random_batch(seed, size, NUM_CLASSES)


def tree_numpy(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


# ------------------------------------------------------------------------------------------------ SCAFFOLD


@pytest.fixture(scope="module")
def cnn():
  model = build_model("cnn", NUM_CLASSES, 1.0, channels=(4, 8), hidden=8)
  return model, model_variables(model, jnp.zeros((1, 8, 8, 1)), 0)


def sgd(**kw):
  return LocalConfig(batch_size=8, optimizer="sgd", learning_rate=0.5, **kw)


def test_scaffold_with_zero_control_variates_equals_fedavg_for_one_step(cnn):
  model, variables = cnn
  plain = LocalTrainer(model, sgd(), MEAN, STD)
  scaffold = LocalTrainer(model, sgd(), MEAN, STD, terms=(scaffold_correction(0.5),))
  memory = scaffold.init_memory(variables)
  zeros = jax.tree.map(jnp.zeros_like, variables["params"])
  chex.assert_trees_all_equal(memory[0], zeros)
  args = (*batch(0, 8), jnp.ones(8, bool))
  got = jax.jit(scaffold.train_step)(scaffold.init_state(variables, memory, (zeros,)), *args)
  want = jax.jit(plain.train_step)(plain.init_state(variables), *args)
  chex.assert_trees_all_close(got.variables, want.variables, rtol=1e-6, atol=1e-7)


def test_scaffold_step_adds_the_correction_to_the_gradient(cnn):
  model, variables = cnn
  plain = LocalTrainer(model, sgd(), MEAN, STD)
  scaffold = LocalTrainer(model, sgd(), MEAN, STD, terms=(scaffold_correction(0.5),))
  rng = np.random.default_rng(1)
  noise = lambda: jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), variables["params"])
  c_i, c = noise(), noise()
  args = (*batch(0, 8), jnp.ones(8, bool))
  got = jax.jit(scaffold.train_step)(scaffold.init_state(variables, (c_i,), (c,)), *args)
  want = jax.jit(plain.train_step)(plain.init_state(variables), *args)
  # SGD: y <- y - lr (g + c - c_i)
  expected = jax.tree.map(lambda w, a, b: w - 0.5 * (a - b), want.variables["params"], c, c_i)
  chex.assert_trees_all_close(got.variables["params"], expected, rtol=1e-5, atol=1e-6)


def test_scaffold_option_two_matches_numpy():
  rng = np.random.default_rng(0)
  tree = lambda: {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
  c_i, c, delta = tree(), tree(), tree()
  got = scaffold_control_update(*(jax.tree.map(jnp.float32, t) for t in (c_i, c, delta)), jnp.float32(7), 0.01)
  want = jax.tree.map(lambda ci, cg, d: ci - cg + (-d) / (7 * 0.01), c_i, c, delta)  # c_i - c + (x - y)/(K lr)
  chex.assert_trees_all_close(tree_numpy(got), want, rtol=1e-5)


def test_scaffold_server_control_is_the_heterogeneous_mean_of_control_deltas():
  big = {"params": {"w": jnp.zeros((4, 3))}}
  small_shape = {"params": {"w": jnp.zeros((2, 3))}}
  maps = [build_group_map(big, small_shape, "small"), identity_map(big)]
  c = {"params": {"w": jnp.ones((4, 3))}}
  sums = [{"params": {"w": jnp.full((2, 3), 6.0)}}, {"params": {"w": jnp.full((4, 3), 2.0)}}]
  got = aggregators.scaffold_server_control(c, sums, [jnp.float32(3), jnp.float32(1)], maps)
  want = np.ones((4, 3))
  want[:2] += (6.0 + 2.0) / 4  # both groups own the first two rows: (3 clients' sum + 1 client's) / 4
  want[2:] += 2.0  # only the big group
  np.testing.assert_allclose(np.asarray(got["params"]["w"]), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------- FedNova


def test_nova_normalizer_matches_the_fednova_formulas():
  assert float(nova_normalizer(jnp.float32(7), "sgd", 0.0)) == 7.0
  assert float(nova_normalizer(jnp.float32(7), "adam", 0.0)) == 7.0
  rho, tau = 0.9, 7
  want = (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
  assert want == pytest.approx(sum((1 - rho ** (t + 1)) / (1 - rho) for t in range(tau)))  # sum of momentum gains
  np.testing.assert_allclose(float(nova_normalizer(jnp.float32(tau), "sgd", rho)), want, rtol=1e-5)


def random_group_sums(rng, maps, like):
  out = []
  for m in maps:
    out.append({"params": {"w": jnp.asarray(rng.normal(size=m.owned[("params", "w")]), jnp.float32)}})
  return out


def test_fednova_with_equal_step_counts_equals_fedavg():
  rng = np.random.default_rng(0)
  like = {"params": {"w": jnp.zeros((4, 3))}}
  maps = [build_group_map(like, {"params": {"w": jnp.zeros((2, 3))}}, "small"), identity_map(like)]
  weights = [jnp.float32(2), jnp.float32(3)]
  normalized = random_group_sums(rng, maps, like)  # sum_i w_i delta_i / a with a = 5 for every client
  a_sums = [5.0 * w for w in weights]
  got = aggregators.fednova_delta(normalized, weights, a_sums, maps, like)
  deltas = [jax.tree.map(lambda x: 5.0 * x, s) for s in normalized]
  want = aggregators.heterogeneous_mean_delta(deltas, weights, maps, like)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_fednova_matches_numpy_with_unequal_steps():
  # Two homogeneous clients: d_i = delta_i / a_i, p = w / sum w, update = (sum p a) * (sum p d).
  like = {"params": {"w": jnp.zeros((3,))}}
  maps = [identity_map(like)] * 2
  deltas = [np.array([1.0, 2.0, 3.0]), np.array([-2.0, 0.5, 4.0])]
  a, w = [2.0, 8.0], [1.0, 3.0]
  sums = [{"params": {"w": jnp.asarray(wi * d / ai, jnp.float32)}} for d, ai, wi in zip(deltas, a, w)]
  got = aggregators.fednova_delta(sums, [jnp.float32(x) for x in w], [wi * ai for wi, ai in zip(w, a)], maps, like)
  p = np.array(w) / sum(w)
  want = (p @ np.array(a)) * sum(pi * d / ai for pi, d, ai in zip(p, deltas, a))
  np.testing.assert_allclose(np.asarray(got["params"]["w"]), want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- MOON


def test_model_contrastive_loss_matches_numpy():
  rng = np.random.default_rng(0)
  z, zg, zp = (rng.normal(size=(5, 6)) for _ in range(3))
  mask = np.array([1, 1, 0, 1, 1], np.float32)
  cos = lambda a, b: np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
  pos, neg = np.exp(cos(z, zg) / 0.5), np.exp(cos(z, zp) / 0.5)
  want = np.sum(-np.log(pos / (pos + neg)) * mask) / mask.sum()
  got = model_contrastive_loss(*(jnp.asarray(x, jnp.float32) for x in (z, zg, zp)), 0.5, jnp.asarray(mask))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_moon_loss_is_log_two_when_global_and_previous_agree():
  z = jnp.ones((3, 4))
  assert float(model_contrastive_loss(z, 2 * z, 3 * z, 0.5, jnp.ones(3))) == pytest.approx(np.log(2), rel=1e-6)


# -------------------------------------------------------------------------------------------------- engine


def simulation(method, backend="sequential", widths=(0.5, 1.0), clients_per_round=5, **options):
  return tiny_simulation(method, backend, widths, clients_per_round, **options)


# One per kind of client state and sharing (the golden test runs every method on both backends as well).
@pytest.mark.slow
@pytest.mark.parametrize("method", ["HeteroScaffold", "FedNova", "HeteroMOON"])
def test_vmap_backend_matches_sequential(method):
  moon = method.endswith("MOON")
  # MOON's contrastive gradient is zero in exact arithmetic in round 1 (global = previous model), and
  # Adam scales its float noise up to the learning rate; SGD keeps the comparison meaningful. MOON also
  # gets a wider MLP: with 8 hidden units many rows have all-zero features, so z is the projection's
  # biases alone and the cosine's ~1/||z|| gradient amplifies float noise in those biases chaotically.
  options = dict(optimizer="sgd", hidden=(64,)) if moon else {}
  seq_state, seq_rows = run_rounds(simulation(method, "sequential", **options))
  vmap_state, vmap_rows = run_rounds(simulation(method, "vmap", **options))
  chex.assert_trees_all_close(vmap_state.models, seq_state.models, rtol=2e-4, atol=2e-5)
  # SCAFFOLD's c_i = -delta / (K lr) scales float differences of the weights by 1 / (K lr) ~ 10.
  chex.assert_trees_all_close(vmap_state.steps, seq_state.steps, rtol=2e-3, atol=2e-3)
  chex.assert_trees_all_close(vmap_state.memory, seq_state.memory, rtol=2e-3, atol=2e-3)
  assert [r["clients"] for r in vmap_rows] == [r["clients"] for r in seq_rows]


def test_scaffold_keeps_per_client_control_variates_for_sampled_clients_only():
  sim = simulation("HeteroScaffold")
  state0 = sim.init_state()
  state1, (row,) = sim.run_rounds(state0, 1)
  sampled = set(row["clients"])
  for gi, group in enumerate(sim.spec.groups):
    chex.assert_shape(jax.tree.leaves(state1.memory[gi][0])[0], (len(group.clients),) + jax.tree.leaves(
        state0.memory[gi][0])[0].shape[1:])
    for row, client in enumerate(group.clients):
      moved = any(float(jnp.abs(x[row]).max()) > 0 for x in jax.tree.leaves(state1.memory[gi][0]))
      assert moved == (int(client) in sampled), (group.name, client)
  control = state1.steps[0][[s.name for s in sim.spec.method.server].index("scaffold")]
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(control))


def test_moon_keeps_each_clients_previous_model():
  sim = simulation("HeteroMOON", widths=(1.0,), clients_per_round=2)
  state0 = sim.init_state()
  assert "projection_out" in state0.models[0]["params"]
  state1, (metrics,) = sim.run_rounds(state0, 1)
  for row, client in enumerate(sim.spec.groups[0].clients):
    prev0 = jax.tree.map(lambda x: x[row], state0.memory[0][0])
    prev1 = jax.tree.map(lambda x: x[row], state1.memory[0][0])
    changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(prev0), jax.tree.leaves(prev1)))
    assert changed == (int(client) in metrics["clients"])


@pytest.mark.slow
def test_fedcross_round_trains_each_middleware_model_and_cross_aggregates():
  sim = simulation("FedCross", widths=(1.0,), clients_per_round=4,
                   fedcross=FedCrossConfig(alpha=0.75, strategy="in_order"))
  state0 = sim.init_state()
  middleware0 = state0.models[0]
  chex.assert_tree_shape_prefix(middleware0, (4,))
  state1, (metrics,) = sim.run_rounds(state0, 1)
  assert sorted(metrics["clients"]) == sample_clients(sim.spec.store.num_clients, 4, 0, 0).tolist()
  assert metrics["fedcross_stage"] == "cross" and 0 <= metrics["middleware_similarity"]["mean_cosine"] <= 1
  # in-order selection mixes with weights that keep the slot mean: the global model is the uploads' mean
  chex.assert_trees_all_close(sim.spec.server_variables(state1), aggregators.global_model(state1.models[0]), rtol=1e-6)
  # the slots differ after one round (each trained by another client)
  first = jax.tree.leaves(state1.models[0])[0]
  assert not np.allclose(first[0], first[1])
  vmap_state, _ = run_rounds(simulation("FedCross", "vmap", widths=(1.0,), clients_per_round=4,
                                 fedcross=FedCrossConfig(alpha=0.75, strategy="in_order")), rounds=1)
  chex.assert_trees_all_close(vmap_state.models, state1.models, rtol=2e-4, atol=2e-5)


def test_fedcross_with_alpha_one_keeps_the_uploads_and_warmup_averages():
  base = dict(widths=(1.0,), clients_per_round=3)
  alone = run_rounds(simulation("FedCross", fedcross=FedCrossConfig(alpha=1.0), **base), rounds=1)[0]
  warm = run_rounds(simulation("FedCross", fedcross=FedCrossConfig(warmup_rounds=1), **base), rounds=1)[0]
  # alpha = 1: the middleware models are the uploads, and warm-up replaces each by their mean.
  chex.assert_trees_all_close(warm.models[0], jax.tree.map(
      lambda x: jnp.broadcast_to(x.mean(0), x.shape), alone.models[0]), rtol=1e-5, atol=1e-6)


def test_fedcross_needs_one_group():
  with pytest.raises(ValueError, match=r"FedCross trains one architecture"):
    simulation("FedCross")


def test_method_table_has_every_paper_name():
  inco = ["FedAvg", "FedProx", "Scaffold", "FedNova", "MOON", "HeteroAvg", "HeteroProx", "HeteroScaffold",
          "HeteroNova", "HeteroMOON", "InCoAvg", "InCoProx", "InCoScaffold", "InCoNova", "InCoMOON"]
  fedcross = ["FedAvg", "FedProx", "SCAFFOLD", "FedCross"]
  for name in inco + fedcross:
    assert get_entry(name).name.lower() == name.lower()
  help_text = cli.build_parser(RunConfig(), "test").format_help()
  for name in inco + ["FedCross", "lowest_similarity", "highest_similarity", "in_order", "layerwise"]:
    assert name in help_text


# Every method runs through the engine in tests/test_golden.py; through the runner (results folder,
# checkpoints of its state), one method of each kind of server state, sharing and sampler.
RUNNER_METHODS = ("FedAvg", "HeteroScaffold", "InCoMOON", "HeteroNova", "FedCross", "FedGen", "CluSamp")


def test_runner_methods_cover_every_kind():
  built = [build_method(m) for m in RUNNER_METHODS]
  assert {m.sharing.name for m in built} == {"per_group", "shared", "stacked"}
  assert {m.sampler.name for m in built} == {"uniform", "shuffled", "clustered"}
  assert set(METHODS) >= {m.lower() for m in RUNNER_METHODS}


@pytest.mark.slow
@pytest.mark.parametrize("method", RUNNER_METHODS)
def test_methods_run_from_the_runner(tmp_path, method):
  built = build_method(method)
  groups = ("mlp",) if built.one_group else ("mlp@0.5", "mlp")
  if any(step.name == "inco" for step in built.server):
    groups = ("vit_d1@0.125",)  # InCo's pairs need same-shaped layers (a ViT block's two LayerNorms); one group
  config = RunConfig.from_flags(dataset="synthetic", method=method, groups=groups, num_clients=4, clients_per_round=2,
                                rounds=1, epochs=1, batch_size=16, steps_per_call=1, output_dir=str(tmp_path), dissimilarity=False,
                                progress=False, max_train_samples=128, max_test_samples=64)
  summary = run_experiment(config, log=lambda m: None)
  assert np.isfinite(summary["final_accuracy"]["mean"])


def test_a_scaffold_checkpoint_of_the_memory_by_term_name_is_refused_saying_why(tmp_path):
  """Before issue 36 a client's memory was a dict by term name ({"scaffold": c_i}); it is one entry per term now.
  Such a checkpoint (no layout recorded) does not restore, and the error says an earlier version wrote it; one
  written now restores."""
  import orbax.checkpoint as ocp
  from fedjax_hetero.run import checkpoints

  sim = tiny_simulation("Scaffold", widths=(1.0,))
  state = sim.init_state()
  old = checkpoints.state_tree(state)
  old["memory"] = {"0": {"scaffold": old["memory"]["0"]["0"]}}
  manager = checkpoints.manager(str(tmp_path / "old"))
  manager.save(1, args=ocp.args.StandardSave(old), force=True, custom_metadata={checkpoints.ROUND_KEY: 1})
  manager.wait_until_finished()
  with pytest.raises(ValueError, match="written by an earlier version of fedjax_hetero.*start the run again"):
    checkpoints.restore_latest(checkpoints.manager(str(tmp_path / "old")), sim.spec.state_shapes)
  with pytest.raises(ValueError, match="written by an earlier version"):
    checkpoints.restore_latest_intact(str(tmp_path / "old"), sim.spec.state_shapes, warn=lambda _: None)
  new = checkpoints.manager(str(tmp_path / "new"))
  checkpoints.save(new, state._replace(round=1), force=True)
  new.wait_until_finished()
  restored = checkpoints.restore_latest(checkpoints.manager(str(tmp_path / "new")), sim.spec.state_shapes)
  chex.assert_trees_all_equal(restored.memory, state.memory)
