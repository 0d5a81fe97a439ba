"""The backends (sequential, vmap, sharded) train the same models up to float tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero.compilation import CompileLog, release_programs
from fedjax_hetero.data.partition import partition
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.rounds.backends import BACKENDS, make_backend
from fedjax_hetero.rounds.inputs import one_cohort
from tests.helpers import tiny_federation, tiny_simulation

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
ROUNDS = 2
RTOL, ATOL = 1e-4, 1e-5


def build(backend, method="HeteroAvg"):
  """A tiny simulation: 6 clients of unequal sizes, two MLP width groups, 5 clients per round."""
  return tiny_simulation(method, backend, (0.5, 1.0), 5)


def initial_state(sim):
  """The server state, filled with numpy (model.init would compile a PRNG kernel per leaf shape)."""
  model = sim.spec.groups[sim.spec.global_index].model
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  rng = np.random.default_rng(0)
  flat = {p: jnp.asarray(rng.normal(size=s.shape) / np.sqrt(max(1, np.prod(s.shape[:-1]))), jnp.float32)
          for p, s in traverse_util.flatten_dict(dict(shapes)).items()}
  return sim.init_state()._replace(models=(traverse_util.unflatten_dict(flat),))


def run(sim, rounds=ROUNDS):
  state = initial_state(sim)
  rows = []
  for _ in range(rounds):
    state, (metrics,) = sim.run_rounds(state, 1)
    rows.append(metrics)
  return state, rows


def flat_params(state):
  return {"/".join(p): np.asarray(v) for p, v in traverse_util.flatten_dict(dict(state.models[0])).items()}


@pytest.fixture(scope="module")
def sequential_run():
  sim = build("sequential")
  assert sim.cohorts.backend.name == "sequential"
  return run(sim)


def test_the_simulation_exercises_unequal_clients_and_both_groups(sequential_run):
  sim = build("sequential")
  assert len(set(sim.spec.store.sizes.tolist())) > 1
  state, rows = sequential_run
  for row in rows:
    assert set(row["train_loss_per_group"]) == {"mlp@0.5", "mlp@1.0"}
    # Every sampled client trains 2 epochs over all its examples (no drop_last).
    assert row["examples"] == 2 * int(sim.spec.store.sizes[row["clients"]].sum())
  initial = flat_params(initial_state(sim))
  final = flat_params(state)
  assert all(not np.allclose(initial[k], final[k]) for k in initial)


@pytest.mark.slow
def test_vmap_matches_sequential(sequential_run):
  sim = build("vmap")
  assert sim.cohorts.backend.name == "vmap"
  state, rows = run(sim)
  seq_state, seq_rows = sequential_run
  chex.assert_trees_all_close(state.models, seq_state.models, rtol=RTOL, atol=ATOL)
  for got, want in zip(rows, seq_rows):
    assert got["examples"] == want["examples"] and got["clients"] == want["clients"]
    np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-5)


def test_group_results_match_across_backends():
  """One group's GroupResult (the weighted delta sum, weights, losses) directly, with weights != 1."""
  results = {}
  for name in ("sequential", "vmap"):
    sim = build(name)
    start = sim.spec.group_variables(initial_state(sim), 1)
    clients = sim.spec.groups[1].clients
    weights = np.arange(1, len(clients) + 1, dtype=float)
    backend, spec = sim.cohorts.backend, sim.spec
    rows = one_cohort(spec.store, spec.local, spec.trainers[1], clients, weights, backend.slots(len(clients)))
    results[name] = backend.train(spec.trainers[1], start, spec.store, rows, jax.random.key(3),
                                  stack_size=len(clients))
  seq, vm = results["sequential"], results["vmap"]
  chex.assert_trees_all_close(vm, seq, rtol=RTOL, atol=ATOL)
  assert float(seq.weight_sum) == pytest.approx(6.0)
  assert float(seq.num_examples) == 2 * int(sim.spec.store.sizes[sim.spec.groups[1].clients].sum())


def memory_rounds(sim, consume):
  """Two rounds from one state; returns the states and whether the first round consumed its input."""
  first = initial_state(sim)
  second, (_,) = sim.run_rounds(first, 1, consume=consume)
  third, (_,) = sim.run_rounds(second, 1, consume=consume)
  consumed = all(x.is_deleted() for x in jax.tree.leaves(first.memory))
  return second if not consume else None, third, consumed


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_a_second_simulation_of_equal_settings_traces_no_client_program(backend):
  """Equal settings make equal trainers (the method's terms included), which share their compiled programs: a
  second simulation traces nothing for its clients, and trains what the first one trained."""
  first = tiny_simulation("HeteroProx", backend, (0.5, 1.0), 4, track_dissimilarity=True, prox_mu=0.1)
  second = tiny_simulation("HeteroProx", backend, (0.5, 1.0), 4, track_dissimilarity=True, prox_mu=0.1)
  assert second.spec.trainers == first.spec.trainers and first.spec.trainers[0].terms
  assert tiny_simulation("HeteroProx", backend, (0.5, 1.0), 4, prox_mu=0.2).spec.trainers != first.spec.trainers
  expected, _ = run(first, 1)
  with CompileLog() as log:
    state, _ = run(second, 1)
  clients = {"start_client", "run_steps", "accumulate", "start_local", "run_cohort_steps", "reduce_local"}
  assert not clients & set(log.names), log.names
  chex.assert_trees_all_equal(state.models, expected.models)


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_a_second_simulation_of_one_structure_with_other_shapes_compiles_its_own_programs(backend):
  """Equal trainers share their cached chunk programs; a second simulation with more clients per round, or a
  store twice as large (clients of the same sizes, so the same schedule), trains what it trains alone rather
  than calling executables compiled for the first one's shapes."""
  ds, store = tiny_federation(scheme="iid")
  images, labels = np.concatenate([ds.train_images] * 2), np.concatenate([ds.train_labels] * 2)
  larger = FederatedStore.build(images, labels, partition(labels, "iid", 2 * store.num_clients, 0), ds.num_classes,
                                ds.mean, ds.std)
  assert larger.max_size == store.max_size
  build = lambda cohort, data: tiny_simulation("HeteroAvg", backend, (0.5, 1.0), cohort, data=(ds, data))
  first = build(2, store)
  run(first, 1)
  for cohort, data in ((5, store), (2, larger)):
    second = build(cohort, data)
    assert second.spec.trainers == first.spec.trainers
    state, _ = run(second, 1)
    release_programs()
    alone, _ = run(build(cohort, data), 1)
    chex.assert_trees_all_equal(state.models, alone.models)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sequential", "vmap"])
@pytest.mark.parametrize("method", ["heteroscaffold", "heteromoon"])
def test_consuming_rounds_update_per_client_memory_in_place(backend, method):
  """``consume=True`` hands the per-client memory to the round (its buffers are donated, so a round costs the
  cohort's rows, not a copy of every client's) and gives the states a copying round gives; without it the
  caller's state stays usable."""
  sim = build(backend, method)
  kept, copied, consumed = memory_rounds(sim, consume=False)
  assert not consumed and jax.tree.leaves(kept.memory)
  _, donated, consumed = memory_rounds(sim, consume=True)
  assert consumed, "the round copied the memory instead of updating it in place"
  chex.assert_trees_all_close(donated.memory, copied.memory, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(donated.models, copied.models, rtol=1e-6, atol=1e-7)
  again, (_,) = sim.run_rounds(kept, 1)  # a state a copying round left behind trains again
  chex.assert_trees_all_close(again.memory, copied.memory, rtol=1e-6, atol=1e-7)


# Runs in a fresh interpreter: XLA_FLAGS must be set before jax is imported. It trains the same
# simulation with the sharded backend over 4 CPU devices and saves its model and rows; the test compares them
# with this process's sequential run (`sequential_run`).
SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests_dir!r})
    sys.path.insert(0, {repo_root!r})
    import jax
    import numpy as np
    assert jax.device_count() == 4, jax.devices()
    import test_backends as tb
    from fedjax_hetero.compilation import CompileLog
    from tests.golden_setting import golden_simulation

    sim = tb.build("sharded")
    state, rows = tb.run(sim)
    np.savez({out!r}, **tb.flat_params(state))
    # The golden setting leaves a group out of a round: its stand-in result must be placed like a real one.
    golden, compiled = golden_simulation("HeteroAvg", "sharded", "mlp"), []
    golden_state = golden.init_state()
    for _ in range(2):
      with CompileLog() as log:
        golden_state, (_,) = golden.run_rounds(golden_state, 1)
        golden.evaluate(golden_state)
      compiled.append(log.names)
    # Per-client memory on the mesh: updated in place by a consuming round, with a copying round's result.
    scaffold = tb.build("sharded", "heteroscaffold")
    _, copied, _ = tb.memory_rounds(scaffold, consume=False)
    _, donated, consumed = tb.memory_rounds(scaffold, consume=True)
    memory_equal = all(np.allclose(a, b, rtol=1e-6, atol=1e-7)
                       for a, b in zip(jax.tree.leaves(donated.memory), jax.tree.leaves(copied.memory)))
    print("RESULT " + json.dumps({{
        "devices": jax.device_count(), "backend": sim.cohorts.backend.name, "mesh_size": sim.cohorts.backend.mesh.size,
        "rows": rows, "compiled": compiled, "memory_consumed": consumed, "memory_equal": memory_equal}}))
""")


@pytest.mark.slow
def test_sharded_matches_sequential_on_four_cpu_devices(sequential_run, tmp_path):
  out = str(tmp_path / "sharded.npz")
  # Its own compilation cache: executables built for a 4-device client must not be read by this 1-device process.
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu",
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache_4_devices")}
  script = SHARDED_SCRIPT.format(tests_dir=TESTS_DIR, repo_root=REPO_ROOT, out=out)
  proc = subprocess.run([sys.executable, "-c", script],
                        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(lines[-1][len("RESULT "):])
  assert result["devices"] == 4
  assert result["backend"] == "sharded" and result["mesh_size"] == 4
  assert result["compiled"][0], "the first round compiles the programs"
  assert result["compiled"][1] == [], f"round 2 compiled {result['compiled'][1]}"
  assert result["memory_consumed"] and result["memory_equal"]
  seq_state, seq_rows = sequential_run
  assert len(result["rows"]) == len(seq_rows) == ROUNDS
  for got, want in zip(result["rows"], seq_rows):
    assert got["examples"] == want["examples"] and got["clients"] == want["clients"]
    np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-5)
  sharded = dict(np.load(out))
  want = flat_params(seq_state)
  assert set(sharded) == set(want)
  for k in want:
    np.testing.assert_allclose(sharded[k], want[k], rtol=RTOL, atol=ATOL, err_msg=k)


def test_make_backend_names():
  assert make_backend("sequential").name == "sequential"
  assert make_backend("VMAP").name == "vmap"
  if jax.default_backend() == "cpu":
    assert make_backend("auto").name == "sequential"
  else:
    assert make_backend("auto").name == ("sharded" if jax.local_device_count() > 1 else "vmap")
  sharded = make_backend("sharded")
  assert sharded.name == "sharded" and sharded.mesh.size == jax.local_device_count()


def test_make_backend_rejects_unknown_names():
  with pytest.raises(ValueError, match=r"unknown backend 'nope'; accepted: auto, sequential, vmap, sharded"):
    make_backend("nope")
  assert BACKENDS == ("auto", "sequential", "vmap", "sharded")
