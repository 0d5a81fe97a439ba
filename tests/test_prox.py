"""FedProx's proximal client objective (Li et al. 2020, Eq. 2) and the *Prox methods."""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.cli import run as cli
from fedjax_hetero.cli.datasets import defaults_for
from fedjax_hetero.cli.flags import config_from_args
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.client.terms import RoundInput
from fedjax_hetero.config import FederationConfig, LocalConfig, RunConfig
from fedjax_hetero.data import partition, synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import extract, flatten
from fedjax_hetero.methods import FEDPROX_MU, METHODS, PER_GROUP, build_method, get_entry
from fedjax_hetero.methods.fedprox import proximal, proximal_term
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import ArchGroup, RoundSpec, assign_groups, make_backend, make_simulation
from fedjax_hetero.rounds.inputs import one_cohort
from fedjax_hetero.run.build import build_simulation
from tests.helpers import TINY_LOCAL, method_options, numpy_variables, random_batch, tiny_resnet, tiny_simulation

NUM_CLASSES = 4
MEAN, STD = (0.45,), (0.25,)
RTOL, ATOL = 1e-4, 1e-5


def model_variables(model, seed):
  return numpy_variables(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1))), seed)


def batch(seed, size):
  return random_batch(seed, size, NUM_CLASSES)


def float64_leaves(tree):
  return {"/".join(p): np.asarray(v, np.float64) for p, v in flatten(tree).items()}


def prox_mu(method) -> float:
  """The mu of a method's proximal term (0 without one), read off the term's loss: mu/2 * ||1 - 0||^2."""
  terms = [t for t in method.terms if t.name == "prox"]
  if not terms:
    return 0.0
  anchor = terms[0].init(RoundInput({"params": {"w": jnp.zeros(1)}}, None, None, None))
  return 2 * float(terms[0].loss.value({"params": {"w": jnp.ones(1)}}, anchor, None, None, None))


# ------------------------------------------------------------------------------------------ the local step


def test_proximal_term_matches_numpy():
  rng = np.random.default_rng(0)
  params = {"a": {"kernel": rng.normal(size=(3, 4)), "bias": rng.normal(size=4)}, "b": rng.normal(size=(2, 2))}
  anchor = jax.tree.map(lambda x: x + rng.normal(size=x.shape), params)
  want = 0.5 * 0.3 * sum(np.sum((p - a) ** 2) for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(anchor)))
  as32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  got = jax.jit(proximal_term, static_argnums=2)(as32(params), as32(anchor), 0.3)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  assert float(proximal_term(as32(params), as32(params), 0.3)) == 0.0


@pytest.fixture(scope="module")
def sgd_trainers():
  """Plain and proximal SGD trainers of one small CNN (no momentum: one step is p - lr * grad)."""
  model = build_model("cnn", NUM_CLASSES, 1.0, channels=(4, 8), hidden=8)
  config = LocalConfig(batch_size=8, optimizer="sgd", learning_rate=0.5)
  plain, prox = LocalTrainer(model, config, MEAN, STD), LocalTrainer(model, config, MEAN, STD, terms=(proximal(0.5),))
  return model_variables(model, 1), plain, jax.jit(plain.train_step), prox, jax.jit(prox.train_step)


def test_proximal_gradient_is_mu_times_distance_to_anchor(sgd_trainers):
  variables, plain, plain_step, prox, prox_step = sgd_trainers
  state0 = prox.init_state(variables)
  chex.assert_trees_all_equal(state0.terms[0], variables["params"])
  # Step 1 starts at the anchor, where the proximal gradient mu * (w - w^t) vanishes.
  state1 = prox_step(state0, *batch(0, 8), jnp.ones(8, bool))
  reference1 = plain_step(plain.init_state(variables), *batch(0, 8), jnp.ones(8, bool))
  chex.assert_trees_all_close(state1.variables, reference1.variables, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal(state1.terms[0], variables["params"])  # the anchor never moves

  # Step 2 from the same w1 (now away from the anchor), with and without the proximal term.
  images, labels = batch(1, 8)
  mask = jnp.asarray(np.array([1, 1, 0, 1, 1, 1, 0, 1], bool))
  with_prox = prox_step(state1, images, labels, mask)
  without = plain_step(state1._replace(terms=()), images, labels, mask)
  w1, anchor = float64_leaves(state1.variables["params"]), float64_leaves(variables["params"])
  got_prox, got_plain = float64_leaves(with_prox.variables["params"]), float64_leaves(without.variables["params"])
  largest = 0.0
  for k in anchor:
    want = -0.5 * 0.5 * (w1[k] - anchor[k])  # -lr * mu * (w1 - w^t)
    np.testing.assert_allclose(got_prox[k] - got_plain[k], want, rtol=0, atol=2e-6, err_msg=k)
    largest = max(largest, float(np.abs(want).max()))
  assert largest > 1e-3, "the test must move the weights measurably away from the anchor"
  # The reported training loss is the cross-entropy alone.
  np.testing.assert_allclose(float(with_prox.loss_sum), float(without.loss_sum), rtol=1e-6)
  assert float(with_prox.num_examples) == float(without.num_examples)


def test_zero_mu_keeps_the_plain_state_and_program(sgd_trainers):
  variables, plain, plain_step, *_ = sgd_trainers
  state = plain.init_state(variables)
  assert state.terms == ()
  # Without the term there is no leaf in the state and no op in the step.
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves((variables, state.opt_state))) + 3
  explicit = LocalTrainer(plain.model, LocalConfig(batch_size=8, optimizer="sgd", learning_rate=0.5), MEAN, STD)
  args = (state, *batch(2, 8), jnp.ones(8, bool))
  assert str(jax.make_jaxpr(plain.train_step)(*args)) == str(jax.make_jaxpr(explicit.train_step)(*args))
  chex.assert_trees_all_equal(plain_step(*args), jax.jit(explicit.train_step)(*args))


def test_all_masked_step_is_a_no_op_with_prox_and_batch_norm():
  model = tiny_resnet((1,), num_classes=NUM_CLASSES)  # BatchNorm in the stem and the block
  variables = model_variables(model, 0)
  trainer = LocalTrainer(model, LocalConfig(batch_size=8, optimizer="adam", learning_rate=0.1), MEAN, STD,
                         terms=(proximal(0.1),))
  step = jax.jit(trainer.train_step)
  state1 = step(trainer.init_state(variables), *batch(0, 8), jnp.ones(8, bool))
  state2 = step(state1, *batch(1, 8), jnp.ones(8, bool))  # away from the anchor: the penalty is nonzero
  assert float(proximal_term(state2.variables["params"], state2.terms[0], 0.1)) > 0
  state3 = step(state2, *batch(2, 8), jnp.zeros(8, bool))
  chex.assert_trees_all_equal(state3, state2)  # params, batch_stats, adam state, counters, anchor
  chex.assert_trees_all_equal(state3.terms[0], variables["params"])


@pytest.mark.parametrize("kwargs", [dict(prox_mu=-0.1), dict(prox_mu=float("nan")), dict(prox_mu=float("inf"))])
def test_configs_reject_bad_mu(kwargs):
  with pytest.raises(ValueError, match="--prox-mu must be a finite number >= 0"):
    method_options(**kwargs)
  with pytest.raises(ValueError, match="--prox-mu must be a finite number >= 0"):
    RunConfig.from_flags(method="FedProx", **kwargs)


# ------------------------------------------------------------------------------------------- the methods


def test_prox_methods_are_registered():
  assert FEDPROX_MU == 0.1  # InCo paper: "The hyper-parameter mu/2 for FedProx and InCoProx is 0.05"
  for name, per_group, inco in [("FedProx", True, False), ("HeteroProx", False, False), ("InCoProx", False, True)]:
    for spelling in (name, name.lower(), name.upper()):
      method = build_method(spelling)
      assert method.name == name and (method.sharing == PER_GROUP) == per_group
      assert ("inco" in [s.name for s in method.server]) == inco
      assert [t.name for t in method.terms] == ["prox"] and prox_mu(method) == pytest.approx(FEDPROX_MU)
  for name in ("FedAvg", "HeteroAvg", "InCoAvg"):
    assert build_method(name).terms == ()
  with pytest.raises(ValueError, match=r"unknown method 'FedMoon'; accepted: FedAvg, HeteroAvg, InCoAvg, FedProx, "
                     r"HeteroProx, InCoProx"):
    get_entry("FedMoon")
  assert {"fedprox", "heteroprox", "incoprox"} <= set(METHODS)


def test_one_proximal_mu():
  """--prox-mu is the mu of every method with FedProx's term (0 leaves the term out); it applies to no other."""
  mu = lambda name, **options: prox_mu(build_method(name, method_options(**options)))
  for name in ("FedProx", "HeteroProx", "InCoProx", "FedIN"):
    assert mu(name) == pytest.approx(FEDPROX_MU)
    assert mu(name, prox_mu=0.3) == pytest.approx(0.3)
  assert mu("FedProx", prox_mu=0.0) == 0.0  # an explicit 0 turns the term off
  assert mu("FedAvg") == 0.0
  with pytest.raises(ValueError, match="^--prox-mu applies to FedProx, HeteroProx, InCoProx, FedIN, not FedAvg$"):
    mu("FedAvg", prox_mu=0.05)


def initial_state(sim):
  shapes = jax.eval_shape(sim.spec.groups[sim.spec.global_index].model.init, jax.random.key(0), jnp.zeros((1,) + sim.spec.store.images.shape[1:]))
  global_vars = numpy_variables(shapes, 0)
  models = tuple(extract(global_vars, sim.spec.maps[f.members[0]]) if len(f.members) == 1 else global_vars
                 for f in sim.spec.federations)
  return sim.init_state()._replace(models=models)


def run(sim, rounds=1):
  state, rows = initial_state(sim), []
  for _ in range(rounds):
    state, (metrics,) = sim.run_rounds(state, 1)
    rows.append(metrics)
  return state, rows


@pytest.fixture(scope="module")
def mlp_runs():
  """One round of each MLP run, by (method, prox_mu)."""
  runs = {}
  for method, mu in [("FedAvg", None), ("FedProx", None), ("FedProx", 0.0), ("HeteroAvg", None),
                     ("HeteroProx", None), ("HeteroProx", 0.0)]:
    sim = tiny_simulation(method, widths=(0.5, 1.0), clients_per_round=5, **({} if mu is None else {"prox_mu": mu}))
    runs[method, mu] = (sim, *run(sim))
  sim = tiny_simulation(build_method("FedAvg", local=TINY_LOCAL).with_terms(proximal(0.1)), widths=(0.5, 1.0),
                        clients_per_round=5)  # the term added by value
  runs["FedAvg", 0.1] = (sim, *run(sim))
  return runs


@pytest.mark.parametrize("prox,plain", [("FedProx", "FedAvg"), ("HeteroProx", "HeteroAvg")])
def test_prox_methods_run_a_round_with_the_default_mu(mlp_runs, prox, plain):
  sim, state, rows = mlp_runs[prox, None]
  assert prox_mu(sim.spec.method) == pytest.approx(0.1) and all(t.terms == sim.spec.method.terms for t in sim.spec.trainers)
  assert len(state.models) == (2 if prox == "FedProx" else 1)
  assert set(rows[0]["train_loss_per_group"]) == {"mlp@0.5", "mlp@1.0"}
  assert np.isfinite(rows[0]["train_loss"])
  plain_sim, plain_state, plain_rows = mlp_runs[plain, None]
  assert prox_mu(plain_sim.spec.method) == 0.0
  assert rows[0]["clients"] == plain_rows[0]["clients"] and rows[0]["examples"] == plain_rows[0]["examples"]
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.models), jax.tree.leaves(plain_state.models))]
  assert any(moved), "the proximal term must change the trained models"
  # The proximal term pulls every client towards the start, so the server moves less than without it.
  start = initial_state(sim).models
  step = lambda models: sum(float(jnp.sum(jnp.square(a - b))) for a, b in zip(jax.tree.leaves(models),
                                                                               jax.tree.leaves(start)))
  assert step(state.models) < step(plain_state.models)


@pytest.mark.parametrize("prox,plain", [("FedProx", "FedAvg"), ("HeteroProx", "HeteroAvg")])
def test_prox_methods_with_zero_mu_equal_the_plain_methods_bit_for_bit(mlp_runs, prox, plain):
  sim, state, rows = mlp_runs[prox, 0.0]
  assert prox_mu(sim.spec.method) == 0.0
  _, plain_state, plain_rows = mlp_runs[plain, None]
  chex.assert_trees_all_equal(state.models, plain_state.models)
  assert rows[0]["train_loss"] == plain_rows[0]["train_loss"]


def test_fedavg_with_the_proximal_term_is_fedprox(mlp_runs):
  _, fedavg_state, fedavg_rows = mlp_runs["FedAvg", 0.1]
  _, fedprox_state, fedprox_rows = mlp_runs["FedProx", None]
  chex.assert_trees_all_equal(fedavg_state.models, fedprox_state.models)
  assert fedavg_rows[0]["train_loss"] == fedprox_rows[0]["train_loss"]


@pytest.mark.slow
def test_vmap_matches_sequential_with_prox():
  seq_sim, vmap_sim = (tiny_simulation("HeteroProx", backend, (0.5, 1.0), 5) for backend in ("sequential", "vmap"))
  assert vmap_sim.cohorts.backend.name == "vmap"
  seq_state, seq_rows = run(seq_sim, rounds=2)
  vmap_state, vmap_rows = run(vmap_sim, rounds=2)
  chex.assert_trees_all_close(vmap_state.models, seq_state.models, rtol=RTOL, atol=ATOL)
  for got, want in zip(vmap_rows, seq_rows):
    assert got["examples"] == want["examples"] and got["clients"] == want["clients"]
    np.testing.assert_allclose(got["train_loss"], want["train_loss"], rtol=1e-5)
  # One group's result directly, with weights != 1 and clients of unequal length (padded steps masked).
  results = []
  for sim in (seq_sim, vmap_sim):
    start = sim.spec.group_variables(initial_state(sim), 1)
    clients = sim.spec.groups[1].clients
    weights = np.arange(1, len(clients) + 1, dtype=float)
    backend, spec = sim.cohorts.backend, sim.spec
    rows = one_cohort(spec.store, spec.local, spec.trainers[1], clients, weights, backend.slots(len(clients)))
    results.append(backend.train(spec.trainers[1], start, spec.store, rows, jax.random.key(3), stack_size=len(clients)))
  assert len(set(seq_sim.spec.store.sizes[seq_sim.spec.groups[1].clients].tolist())) > 1
  chex.assert_trees_all_close(results[1], results[0], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_incoprox_runs_a_round_on_resnets():
  ds = synthetic_dataset(num_train=48, num_test=8, seed=0)
  parts = partition(ds.train_labels, "iid", 6, 0)
  store = FederatedStore.build(ds.train_images, ds.train_labels, parts, ds.num_classes, ds.mean, ds.std)
  groups = [ArchGroup(f"resnet{sizes}", tiny_resnet(sizes, num_classes=ds.num_classes), c)  # (1, 2): InCo pairs
            for sizes, c in zip(((1, 1), (1, 2)), assign_groups(6, 2))]
  local = LocalConfig(batch_size=8, steps_per_call=1)
  spec = RoundSpec.build(groups, store, local, build_method("incoprox"), FederationConfig(clients_per_round=3),
                         jnp.asarray(ds.test_images), jnp.asarray(ds.test_labels))
  sim = make_simulation(spec, make_backend("sequential"))
  assert sim.spec.method.name == "InCoProx" and prox_mu(sim.spec.method) == pytest.approx(0.1)
  pairs = groups[1].model.cross_layer_pairs()
  assert pairs != ()
  state, rows = run(sim)
  assert state.round == 1 and np.isfinite(rows[0]["train_loss"])
  assert set(rows[0]["inco"]) == {"/".join(t) for t, _ in pairs}
  leaves = jax.tree.leaves(state.models)
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)


# ----------------------------------------------------------------------------------------- runner and CLI


def test_cli_prox_mu_flag_reaches_the_simulation():
  defaults = defaults_for("synthetic").config()
  parser = cli.build_parser(defaults, "test")
  help_text = parser.format_help()
  assert "--prox-mu" in help_text and "options of FedProx, HeteroProx, InCoProx, FedIN:" in help_text
  dataset = synthetic_dataset(num_train=160, num_test=8, seed=0)
  common = ["--groups", "mlp@1,mlp@0.5", "--num-clients", "4", "--clients-per-round", "2"]
  cases = [(["--method", "FedProx"], 0.1), (["--method", "fedprox", "--prox-mu", "0.3"], 0.3),
           (["--method", "HeteroProx", "--prox-mu", "0"], 0.0), ([], 0.0)]
  for argv, effective in cases:
    config = config_from_args(parser.parse_args(argv + common))
    logs = []
    sim, _ = build_simulation(config, dataset, log=logs.append)
    assert prox_mu(sim.spec.method) == pytest.approx(effective)
    # The method's terms, and the dissimilarity metric's (on in every CLI run, added by the build step) after them.
    assert sim.spec.method.terms[-1].name == "dissimilarity" and all(t.terms == sim.spec.method.terms for t in sim.spec.trainers)
    assert ("client terms: prox" in logs[-1]) == bool(effective), logs
  with pytest.raises(ValueError, match="--prox-mu must be a finite number >= 0, got -1.0"):
    RunConfig.from_flags(dataset="synthetic", prox_mu=-1.0)
  assert parser.parse_args([]).prox_mu == FEDPROX_MU
