"""FedGen and CluSamp in the engine: generator server state, generative client term, clustered sampling, resume."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.config import FedGenConfig, RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.data.store import FederatedStore, sample_clients
from fedjax_hetero.methods import PER_GROUP, build_method
from fedjax_hetero.run import checkpoints
from fedjax_hetero.run.build import build_simulation, run_method
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.sampling import ClusteredSampler
from tests.helpers import tiny_federation, tiny_simulation

# One worker runs the module, so its module-scoped runs train once (scripts/test.sh: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("fedgen_clusamp_engine")

NUM_CLIENTS = 6
# A generator small enough for the tests: 2 server steps of batch 16 per round, 8 generated labels per local step.
TINY_FEDGEN = FedGenConfig(noise_dim=4, hidden_dim=16, batch_size=16, ensemble_epochs=2, n_teacher_iters=1,
                           gen_batch_size=8)


@pytest.fixture(scope="module")
def data():
  return tiny_federation(NUM_CLIENTS)


def simulation(data, method, backend="sequential", widths=(1.0,), clients_per_round=3, optimizer="adam"):
  fedgen = {"fedgen": TINY_FEDGEN} if method == "FedGen" else {}  # FedGen's options are FedGen's alone
  return tiny_simulation(method, backend, widths, clients_per_round, optimizer, data=data, **fedgen)


def run(sim, rounds=2):
  states, rows = [sim.init_state()], []
  for _ in range(rounds):
    state, (metrics,) = sim.run_rounds(states[-1], 1)
    states.append(state)
    rows.append(metrics)
  return states, rows


def leaves_differ(a, b) -> bool:
  return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_difference(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))


# ---------------------------------------------------------------------------------------------------- FedGen


@pytest.fixture(scope="module")
def fedgen_run(data):
  # SGD clients: the generator's first Dense feeds a BatchNorm, so its bias gets a zero gradient in exact
  # arithmetic, and Adam moves it by +-lr on the sign of float noise; with clients' Adam (which does the
  # same to their weights) the backends' float differences would reach the generator's learning rate.
  sim = simulation(data, "FedGen", optimizer="sgd")
  return sim, *run(sim)


def generator_state(sim, state, federation=0):
  return state.steps[federation][[s.name for s in sim.spec.method.server].index("fedgen")]


@pytest.mark.slow
def test_fedgen_trains_the_generator_and_runs(fedgen_run):
  sim, states, rows = fedgen_run
  for before, after in zip(states, states[1:]):
    generator0, generator1 = generator_state(sim, before), generator_state(sim, after)
    assert leaves_differ(generator0.params, generator1.params)
    assert leaves_differ(generator0.batch_stats, generator1.batch_stats)
    # Adam's step count carries over between rounds (FedGen keeps one optimizer)
    assert int(generator1.opt_state[1].count) == int(generator0.opt_state[1].count) + 2
  assert all(np.isfinite(v) for row in rows for v in row["fedgen_generator"]["mlp@1.0"].values())
  accuracy = sim.evaluate(states[-1])
  assert np.isfinite(accuracy["mean"]) and 0 <= accuracy["mean"] <= 1


@pytest.mark.slow
def test_fedgen_regularizer_changes_local_training_only_when_switched_on(fedgen_run, data):
  sim, states, _ = fedgen_run
  # In the engine: round 1 (coefficients 0, FedGen code) trains as FedAvg, round 2 does not.
  fedavg_states, _ = run(simulation(data, "FedAvg", optimizer="sgd"))
  chex.assert_trees_all_close(states[1].models, fedavg_states[1].models, rtol=1e-5, atol=1e-6)
  assert max_difference(states[2].models, fedavg_states[2].models) > 1e-3
  # One local step, from the same start with the same key:
  trainer = sim.spec.trainers[0]
  plain = LocalTrainer(trainer.model, trainer.config, trainer.mean, trainer.std)
  _, store = data
  ids = np.asarray(store.index_table[0, :8])
  args = (store.images[ids], store.labels[ids], jnp.ones(8, bool))
  start = sim.spec.group_variables(states[1], 0)
  key = jax.random.key(3)
  want = jax.jit(plain.train_step)(plain.init_state(start), *args)
  for state, changes in ((states[0], False), (states[1], True)):  # coefficients (0, 0) in round 0 (FedGen code)
    server = sim.spec.group_share(state, 0)
    got = jax.jit(trainer.train_step)(trainer.init_state(start, (), server, key), *args)
    if changes:
      assert max_difference(got.variables["params"], want.variables["params"]) > 1e-4
    else:
      chex.assert_trees_all_close(got.variables, want.variables, rtol=1e-6, atol=1e-7)
    assert float(got.loss_sum) == pytest.approx(float(want.loss_sum), rel=1e-6)  # the logged loss is the CE


@pytest.mark.slow
def test_fedgen_vmap_backend_matches_sequential(fedgen_run, data):
  _, seq_states, seq_rows = fedgen_run
  vmap_states, vmap_rows = run(simulation(data, "FedGen", "vmap", optimizer="sgd"))
  assert [r["clients"] for r in vmap_rows] == [r["clients"] for r in seq_rows]
  chex.assert_trees_all_close(vmap_states[-1].models, seq_states[-1].models, rtol=2e-4, atol=2e-5)
  chex.assert_trees_all_close(vmap_states[-1].steps, seq_states[-1].steps, rtol=2e-4, atol=2e-5)


def test_fedgen_gives_every_group_its_own_generator(data):
  sim = simulation(data, "FedGen", widths=(0.5, 1.0), clients_per_round=4)
  state = sim.init_state()
  latent = [generator_state(sim, state, f).params["latent"]["kernel"].shape[1] for f in range(2)]
  assert latent == [8, 16]  # each group's feature width (multi-group runs: test_every_method_runs_from_the_runner)


# --------------------------------------------------------------------------------------------------- CluSamp


@pytest.fixture(scope="module")
def clusamp_run(data):
  sim = simulation(data, "CluSamp")
  return sim, *run(sim)


def test_clusamp_records_representative_gradients_and_samples_from_them(clusamp_run, data):
  sim, states, rows = clusamp_run
  stored0, stored1 = states[0].sampler, states[1].sampler
  assert not np.asarray(stored0.updated).any() and not np.asarray(stored0.gradients).any()
  participants = set(rows[0]["clients"])
  updated = np.asarray(stored1.updated)
  assert set(np.flatnonzero(updated)) == participants
  norms = np.abs(np.asarray(stored1.gradients)).sum(axis=1)
  assert np.all(norms[updated] > 0) and np.all(norms[~updated] == 0)

  # Each round's clients are the draws of Fraboni et al.'s sampler on the stored gradients.
  _, store = data
  expected = ClusteredSampler(store.sizes, 3, seed=0)
  assert rows[0]["clients"] == expected.sample(0).tolist()
  expected.update(np.flatnonzero(updated), np.asarray(stored1.gradients)[updated])
  assert rows[1]["clients"] == expected.sample(1).tolist()
  fresh = simulation(data, "CluSamp")  # its sampler rebuilt from the stored gradients alone
  for r in range(1, 12):
    assert fresh.spec.method.sampler.sample(states[1].sampler, r, fresh.spec.sampling).draws.tolist() == \
        expected.sample(r).tolist()
  # With gradients present the draws are neither uniform nor the cold start's.
  cold = ClusteredSampler(store.sizes, 3, seed=0)
  assert not np.array_equal(expected.distributions(), cold.distributions())
  assert any(expected.sample(r).tolist() != sample_clients(NUM_CLIENTS, 3, 0, r).tolist() for r in range(2, 12))
  assert np.isfinite(sim.evaluate(states[-1])["mean"])


def test_clusamp_counts_a_client_drawn_twice_twice(data):
  ds, _ = data
  # Client 0 holds more than 1/m of the data, so it is split over two of the m = 3 distributions.
  parts = [np.arange(100)] + [np.arange(100 + 12 * i, 112 + 12 * i) for i in range(NUM_CLIENTS - 1)]
  store = FederatedStore.build(ds.train_images, ds.train_labels, parts, ds.num_classes, ds.mean, ds.std)
  sim = simulation((ds, store), "CluSamp")
  state = sim.init_state()
  sampler = ClusteredSampler(store.sizes, 3, seed=0)
  r = next(r for r in range(100) if len(set(sampler.sample(r).tolist())) < 3)
  clients, weights, draws = sim.spec.method.sampler.sample(state.sampler, r, sim.spec.sampling)
  assert draws.tolist() == sampler.sample(r).tolist()
  assert clients.tolist() == sorted(set(draws.tolist()))  # each client trains once ...
  np.testing.assert_allclose(weights, [draws.tolist().count(c) / 3 for c in clients])  # ... and counts per draw


def test_clusamp_needs_one_group(data):
  with pytest.raises(ValueError, match="CluSamp trains one architecture"):
    simulation(data, "CluSamp", widths=(0.5, 1.0))
  with pytest.raises(ValueError, match="CluSamp trains one architecture group"):
    run_method(RunConfig.from_flags(dataset="synthetic", method="CluSamp", groups=("mlp@0.5", "mlp")))


@pytest.mark.slow
def test_clusamp_resume_equals_an_uninterrupted_run(tmp_path):
  dataset = synthetic_dataset(num_train=160, num_test=32, seed=0)
  base = RunConfig.from_flags(dataset="synthetic", method="CluSamp", groups=("mlp",), num_clients=NUM_CLIENTS,
                              clients_per_round=3, rounds=2, checkpoint_every=1, eval_every=1, batch_size=16,
                              steps_per_call=2, progress=False)
  straight = base.replace(output_dir=str(tmp_path / "straight"))
  run_experiment(straight, dataset, log=lambda _: None)
  resumed = base.replace(output_dir=str(tmp_path / "resumed"))
  run_experiment(resumed.replace(rounds=1), dataset, log=lambda _: None)
  summary = run_experiment(resumed.replace(resume=True), dataset, log=lambda _: None)
  assert summary["final_round"] == 2  # round 2 samples from the restored round-1 gradients

  def rows(config):
    with open(os.path.join(config.output.dir, "metrics.jsonl")) as f:
      return [json.loads(line) for line in f if line.strip()]

  for a, b in zip(rows(straight), rows(resumed), strict=True):
    assert a["clients"] == b["clients"] and a["train_loss"] == b["train_loss"], a["round"]
    assert a["test_accuracy"] == b["test_accuracy"]

  def final_state(config):
    sim, _ = build_simulation(config, dataset, log=lambda _: None)
    return checkpoints.restore_latest(checkpoints.manager(config.output.dir), sim.spec.state_shapes)

  a, b = final_state(straight), final_state(resumed)
  chex.assert_trees_all_equal((a.models, a.steps, a.sampler), (b.models, b.steps, b.sampler))
  assert np.asarray(a.sampler.updated).dtype == bool


def test_methods_are_in_the_table():
  fedgen = build_method("fedgen")
  assert [t.name for t in fedgen.terms] == ["fedgen"] and fedgen.sharing == PER_GROUP
  clusamp = build_method("CluSamp")
  assert clusamp.sampler.name == "clustered" and clusamp.one_group
