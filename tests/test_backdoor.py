"""The backdoor attack (`fedjax_hetero.client.attack`): the malicious set, the upload of Eq. 1 against two
separate trainings, backends agreeing, nothing compiled after round 1, fraction 0 changing nothing, bad
values rejected before compute, the ids recorded, and `experiments.compare`'s drop table."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.analysis import tables, runs as run_stats
from fedjax_hetero.client.attack import (AttackedTrainer, Backdoor, attack_table, malicious_clients, num_malicious,
                                         shuffled_row)
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.compilation import CompileLog, release_programs
from fedjax_hetero.config import FederationConfig, LocalConfig, RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import build_method
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import Simulation
from fedjax_hetero.rounds.backends import make_backend
from fedjax_hetero.rounds.inputs import one_cohort
from fedjax_hetero.rounds.state import round_key
from fedjax_hetero.run.runner import run_experiment
from tests import helpers
from tests.helpers import method_options, mlp_groups, model_variables, tiny_federation

# One worker runs the module, so its module-scoped runs train once (scripts/test.sh: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("backdoor")

LOCAL = LocalConfig(epochs=2, batch_size=8, optimizer="adam", learning_rate=1e-2, steps_per_call=1)  # as TINY_LOCAL
ROUNDS = 3
RTOL, ATOL = 1e-4, 1e-5  # the backends' tolerance (tests/test_backends.py)


def simulation(backend: str = "sequential", method: str = "HeteroAvg", widths=(0.5, 1.0), **federation) -> Simulation:
  """MLP width groups (two by default) over `tiny_federation`'s 6 clients, 3 per round."""
  return helpers.simulation(method, mlp_groups(widths), local=LOCAL, backend=backend, **federation)


def run(sim: Simulation, rounds: int = ROUNDS):
  """The final state, every round's metrics, and the names of the programs each round compiled."""
  state, rows, compiled = sim.init_state(), [], []
  for _ in range(rounds):
    with CompileLog() as log:
      state, (metrics,) = sim.run_rounds(state, 1)
    rows.append(metrics)
    compiled.append(log.names)
  return state, rows, compiled


# ------------------------------------------------------------------------------------------ the malicious set


def test_malicious_set_is_fixed_by_the_seed_and_has_round_f_n_clients():
  ids = malicious_clients(100, 0.2, seed=3)
  chex.assert_shape(ids, (20,))
  assert len(set(ids.tolist())) == 20 and ids.min() >= 0 and ids.max() < 100
  assert np.all(np.diff(ids) > 0)  # sorted
  np.testing.assert_array_equal(ids, malicious_clients(100, 0.2, seed=3))
  assert not np.array_equal(ids, malicious_clients(100, 0.2, seed=4))
  assert [num_malicious(100, f) for f in (0.0, 0.01, 0.2, 1.0)] == [0, 1, 20, 100]
  assert num_malicious(10, 0.25) == 3 and num_malicious(10, 0.24) == 2  # halves round up
  chex.assert_shape(malicious_clients(100, 0.0, seed=3), (0,))
  np.testing.assert_array_equal(malicious_clients(7, 1.0, seed=0), np.arange(7))
  sim = simulation(malicious_fraction=0.34)
  np.testing.assert_array_equal(sim.spec.malicious_clients, malicious_clients(6, 0.34, seed=0))
  chex.assert_shape(sim.spec.malicious_clients, (2,))


def test_malicious_group_largest_draws_every_attacker_from_the_global_models_group():
  sim = simulation(malicious_fraction=0.34, malicious_group="largest")
  spec = sim.spec
  largest = spec.groups[spec.global_index]
  assert largest.name == "mlp@1.0" and len(largest.clients) == 3  # (the global model: the full-width MLP)
  chex.assert_shape(spec.malicious_clients, (2,))
  assert set(spec.malicious_clients.tolist()) <= set(largest.clients.tolist())
  np.testing.assert_array_equal(spec.malicious_clients, malicious_clients(6, 0.34, 0, among=largest.clients))
  with pytest.raises(ValueError, match=r"^--malicious-fraction 0.67 makes 4 malicious clients, more than the 3 of "
                     r"the group --malicious-group draws them from; pass at most 0.5$"):
    simulation(malicious_fraction=0.67, malicious_group="largest")
  with pytest.raises(ValueError, match=r"--malicious-group must be one of any, largest"):
    FederationConfig(malicious_group="deepest")


def test_label_shuffle_is_a_fixed_permutation_of_the_clients_own_samples():
  _, store = tiny_federation()
  client = int(np.argmax(store.sizes))
  row, n = store.index_table[client], int(store.sizes[client])
  seeds = attack_table(store.num_clients, np.array([client]), seed=0).label_seed
  shuffled = np.asarray(shuffled_row(row, n, seeds[client]))
  chex.assert_shape(shuffled, row.shape)
  assert sorted(shuffled[:n].tolist()) == sorted(np.asarray(row[:n]).tolist())  # the client's own samples
  np.testing.assert_array_equal(shuffled[n:], np.asarray(row[n:]))  # the padding stays
  assert np.mean(shuffled[:n] != np.asarray(row[:n])) > 0.5
  np.testing.assert_array_equal(shuffled, np.asarray(shuffled_row(row, n, seeds[client])))
  assert not np.array_equal(shuffled, np.asarray(shuffled_row(row, n, seeds[client] + 1)))


# ------------------------------------------------------------------------------------ Eq. 1, worked by hand


def relabelled(store, client: int, label_seed) -> object:
  """``store`` with ``client``'s labels permuted as the attack's copy sees them."""
  row, n = store.index_table[client], int(store.sizes[client])
  source = shuffled_row(row, n, label_seed)
  labels = store.labels.at[row[:n]].set(store.labels[source[:n]])
  assert not np.array_equal(np.asarray(labels), np.asarray(store.labels))
  return dataclasses.replace(store, labels=labels)


@functools.lru_cache
def clean_setting(method: str):
  """A store, a model, its start and the method's clean trainer (shared by the parameters below, so that
  their programs compile once)."""
  ds, store = tiny_federation()
  model = build_model("mlp", ds.num_classes, 1.0, hidden=(16,))
  start = model_variables(model, jnp.zeros((1,) + ds.train_images.shape[1:]), seed=1)
  terms = build_method(method, method_options(), LOCAL).terms
  return store, model, start, terms, LocalTrainer(model, LOCAL, store.mean, store.std, terms)


@pytest.mark.slow
@pytest.mark.parametrize("method, reading, leaves", [("HeteroAvg", "update", "all"), ("HeteroAvg", "difference", "all"),
                                                     ("FedProx", "update", "all"), ("HeteroAvg", "update", "kernels"),
                                                     ("HeteroAvg", "update", "others")])
def test_malicious_upload_is_its_update_plus_lambda_times_the_backdoor_delta(method, reading, leaves):
  store, model, start, terms, clean_trainer = clean_setting(method)
  scale, key, backend = 3.0, round_key(0, 2), make_backend("sequential")
  bad, good = 1, 4
  table = attack_table(store.num_clients, np.array([bad]), seed=0)
  attacked_trainer = AttackedTrainer(LocalTrainer(model, LOCAL, store.mean, store.std, terms),
                                     Backdoor(scale, reading, leaves), table)

  def train(trainer, client, data=store):
    rows = one_cohort(data, LOCAL, trainer, np.array([client]), np.ones(1), 1)
    return backend.train(trainer, start, data, rows, key, stack_size=1)

  # Two separate clean trainings of the malicious client: on its data, and on its data relabelled.
  clean = train(clean_trainer, bad).delta_sum["params"]
  copy = train(clean_trainer, bad, relabelled(store, bad, table.label_seed[bad])).delta_sum["params"]
  backdoor = copy if reading == "update" else jax.tree.map(jnp.subtract, copy, clean)
  boosted = lambda b: leaves == "all" or (b.ndim >= 2) == (leaves == "kernels")  # (--backdoor-leaves)
  expected = jax.tree.map(lambda c, b: c + (scale if boosted(b) else 1.0) * b, clean, backdoor)
  assert {boosted(b) for b in jax.tree.leaves(backdoor)} == ({True} if leaves == "all" else {True, False})
  attacked = train(attacked_trainer, bad)
  chex.assert_trees_all_equal_shapes(attacked.delta_sum["params"], expected)
  chex.assert_trees_all_close(attacked.delta_sum["params"], expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(jax.tree.leaves(copy)[0], jax.tree.leaves(clean)[0], atol=1e-3)
  # The training loss it reports is its clean training's.
  np.testing.assert_allclose(attacked.loss_sum, train(clean_trainer, bad).loss_sum, rtol=1e-6)
  # An honest client of the same trainer uploads its plain update.
  honest = train(attacked_trainer, good).delta_sum["params"]
  chex.assert_trees_all_close(honest, train(clean_trainer, good).delta_sum["params"], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------- whole rounds


@pytest.fixture(scope="module")
def attacked_runs():
  """Three rounds of a backdoored HeteroAvg on each backend (2 of 6 clients malicious, lambda 5), from no program
  compiled (the test of it checks the first round compiles)."""
  release_programs()
  return {backend: run(simulation(backend, malicious_fraction=0.34, backdoor_scale=5.0))
          for backend in ("sequential", "vmap")}


@pytest.mark.slow
def test_cohorts_with_and_without_attackers_compile_nothing_after_round_one(attacked_runs):
  malicious = set(malicious_clients(6, 0.34, seed=0).tolist())
  for backend, (_, rows, compiled) in attacked_runs.items():
    attackers = [len(malicious & set(r["clients"])) for r in rows]
    assert min(attackers) < max(attackers), attackers  # the cohorts' attacker counts change between rounds
    assert compiled[0], "the first round compiles the programs"
    for round_index, names in enumerate(compiled[1:], start=2):
      assert not names, f"{backend} round {round_index} compiled {names}"


def test_backends_agree_under_attack(attacked_runs):
  (seq_state, seq_rows, _), (vmap_state, vmap_rows, _) = attacked_runs["sequential"], attacked_runs["vmap"]
  chex.assert_trees_all_close(vmap_state.models, seq_state.models, rtol=RTOL, atol=ATOL)
  for got, want in zip(vmap_rows, seq_rows):
    assert got["clients"] == want["clients"] and got["examples"] == want["examples"]
    np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-5)


def test_fraction_zero_is_the_clean_run_bit_for_bit_and_the_attack_changes_it():
  clean = simulation(widths=(1.0,))
  zero = simulation(widths=(1.0,), malicious_fraction=0.0, backdoor_scale=7.0, backdoor_delta="difference")
  assert all(type(t) is LocalTrainer for t in zero.spec.trainers)
  chex.assert_shape(zero.spec.malicious_clients, (0,))
  (clean_state, clean_rows, _), (zero_state, zero_rows, _) = run(clean, 2), run(zero, 2)
  chex.assert_trees_all_equal(zero_state.models, clean_state.models)
  assert [r["train_loss"] for r in zero_rows] == [r["train_loss"] for r in clean_rows]
  attacked = simulation(widths=(1.0,), malicious_fraction=0.5, backdoor_scale=7.0, backdoor_delta="difference")
  attacked_state = run(attacked, 2)[0]
  gap = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(jax.tree.leaves(attacked_state.models),
                                                             jax.tree.leaves(clean_state.models)))
  assert gap > 1e-2


@pytest.mark.slow
def test_every_method_kind_trains_under_attack_on_the_vmap_backend():
  """Methods with client memory (SCAFFOLD), stacked uploads (FedCross) and FedFA's weight uploads."""
  for method in ("SCAFFOLD", "FedCross", "FedFA"):
    sim = simulation("vmap", method, (1.0,), malicious_fraction=0.5, backdoor_scale=2.0)
    state, rows, compiled = run(sim, rounds=2)
    assert not compiled[1], (method, compiled[1])
    assert all(np.isfinite(r["train_loss"]) for r in rows)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.models))


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("settings, fragment", [
    (dict(malicious_fraction=1.5), "--malicious-fraction must be"),
    (dict(malicious_fraction=-0.1), "--malicious-fraction must be"),
    (dict(malicious_fraction=float("nan")), "--malicious-fraction"),
    (dict(malicious_fraction="0.2"), "--malicious-fraction"),
    (dict(backdoor_scale=-1.0), "--backdoor-scale must be"),
    (dict(backdoor_scale=float("inf")), "--backdoor-scale"),
    (dict(backdoor_delta="sum"), "--backdoor-delta"),
    (dict(num_clients=10, malicious_fraction=0.04), "rounds to no malicious client"),
])
def test_bad_attack_settings_fail_before_compute(settings, fragment, no_compute):
  with pytest.raises(ValueError, match=fragment):
    RunConfig.from_flags(dataset="synthetic", **settings)


def test_library_users_get_the_same_errors(no_compute):
  with pytest.raises(ValueError, match="--malicious-fraction must be"):
    FederationConfig(malicious_fraction=2.0)
  with pytest.raises(ValueError, match="--backdoor-scale must be"):
    FederationConfig(backdoor_scale=-0.5)
  with pytest.raises(ValueError, match="rounds to no malicious client"):
    simulation(malicious_fraction=0.05)


# ---------------------------------------------------------------------------------------- results and compare


@pytest.mark.slow
def test_results_folder_records_the_malicious_clients(tmp_path):
  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp",), num_clients=6, clients_per_round=3,
                                rounds=1, eval_every=1, progress=False, output_dir=str(tmp_path), batch_size=16,
                                malicious_fraction=0.34, backdoor_scale=5.0)
  logs = []
  summary = run_experiment(config, synthetic_dataset(num_train=240, num_test=64, seed=0), log=logs.append)
  ids = malicious_clients(6, 0.34, seed=0).tolist()
  assert summary["malicious_clients"] == ids
  with open(os.path.join(tmp_path, "summary.json")) as f:
    assert json.load(f)["malicious_clients"] == ids
  with open(os.path.join(tmp_path, "config.json")) as f:
    federation = json.load(f)["federation"]
  assert (federation["malicious_fraction"], federation["backdoor_scale"]) == (0.34, 5.0)
  with open(os.path.join(tmp_path, "partition.txt")) as f:
    report = f.read()
  assert "malicious clients (backdoor attack, fixed by the seed): 2 of 6" in report
  assert any(" ".join(map(str, ids)) in line for line in logs)


def fake_run(method, seed, accuracies, fraction=0.0, scale=20.0):
  rows = [{"round": r, "round_seconds": 1.0, "test_accuracy": {"mean": a}} for r, a in enumerate(accuracies, 1)]
  federation = {"seed": seed, "malicious_fraction": fraction, "backdoor_scale": scale, "backdoor_delta": "update"}
  return f"{method}_{fraction}_s{seed}", {"method": method, "config": {"federation": federation}}, rows


def test_compare_reports_the_drop_under_attack():
  runs = [fake_run("FedFA", 0, [0.5, 0.8]), fake_run("FedFA", 0, [0.5, 0.7], fraction=0.2),
          fake_run("FedFA", 1, [0.5, 0.9]), fake_run("FedFA", 1, [0.5, 0.7], fraction=0.2),
          fake_run("FlexiFed", 0, [0.5, 0.8]), fake_run("FlexiFed", 0, [0.4, 0.5], fraction=0.2)]
  lines = tables.drop_table(runs, baseline="FedFA").splitlines()
  assert lines[0].startswith("| method | attack | seeds | clean final (%) | attacked final (%) | drop (points) |")
  # FedFA: finals 80/90 clean, 70/70 attacked: drop 15 points; FlexiFed: 80 -> 50, 30 points, twice FedFA's.
  assert lines[2] == "| FedFA | backdoor 20% x20 | 2 | 85.00 | 70.00 | +15.00 | 1.00 | s0: +10.00, s1: +20.00 |"
  assert lines[3] == "| FlexiFed | backdoor 20% x20 | 1 | 80.00 | 50.00 | +30.00 | 2.00 | s0: +30.00 |"
  assert run_stats.method_of(runs[1][1]) == "FedFA [backdoor 20% x20]"
  assert run_stats.method_of(runs[0][1]) == "FedFA"
  # Paired per round against the clean run: the attacked variant is its own row.
  paired = tables.paired_table(runs, "FedFA").splitlines()
  assert any(line.startswith("| FedFA [backdoor 20% x20] | 2 | -7.50") for line in paired)
  assert tables.drop_table(runs[:1] + runs[4:5]) == ""  # no attacked run
  on_the_largest = fake_run("FedFA", 0, [0.5, 0.6], fraction=0.2)
  on_the_largest[1]["config"]["federation"]["malicious_group"] = "largest"
  assert run_stats.method_of(on_the_largest[1]) == "FedFA [backdoor 20% x20 largest]"  # (apart from the first attack)
