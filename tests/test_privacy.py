"""Differential privacy at the client (`fedjax_hetero.methods.privacy`, ``--dp-clip``): the clip exact, the noise's
standard deviation against z C / E measured on many elements, epsilon against dp-accounting's own composition, the
refusals, a user's method, and through the runner: both drivers, resume bit for bit, a job of seeds."""

from __future__ import annotations

import types

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp

from fedjax_hetero.client.terms import ClientFinal
from fedjax_hetero.config import RunConfig
from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.hetero import build_group_map
from fedjax_hetero.methods import METHODS, PER_GROUP, Method, build_method
from fedjax_hetero.methods.privacy import clip_term, clipped, private_mean, with_privacy
from fedjax_hetero.run import privacy_accounting
from fedjax_hetero.run.jobs import parse_sweep, run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.server import apply_delta, mean_delta
from fedjax_hetero.server.steps import Carry
from tests.helpers import TrainedAlone, measured
from tests.test_runner import read_rows, restore


pytestmark = pytest.mark.xdist_group("privacy")  # (one worker sets up the module's fixtures)


def tree_norm(tree) -> float:
  return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))))


def test_an_update_above_the_clip_is_scaled_to_it_and_one_below_is_kept_bit_for_bit():
  rng = np.random.default_rng(0)
  delta = {"params": {"w": jnp.asarray(rng.normal(size=(30, 20)), jnp.float32), "b": jnp.asarray(rng.normal(size=20),
                                                                                                  jnp.float32)},
           "batch_stats": {"mean": jnp.asarray(rng.normal(size=20), jnp.float32)}}
  norm = tree_norm(delta)
  out = clipped(delta, 1.5)
  np.testing.assert_allclose(tree_norm(out), 1.5, rtol=1e-6)  # every collection, as one vector
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(delta)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b) * 1.5 / norm, rtol=1e-6, atol=1e-7)  # the direction kept
  jax.tree.map(np.testing.assert_array_equal, clipped(delta, norm * 1.01), delta)
  zeros = jax.tree.map(jnp.zeros_like, delta)
  jax.tree.map(np.testing.assert_array_equal, clipped(zeros, 1.0), zeros)
  # The client's half: the term's ``delta`` clips what the client ends its round with.
  final = ClientFinal(zeros, delta, delta, jnp.float32(3))
  np.testing.assert_allclose(tree_norm(clip_term(0.25).delta((), final, (), ())), 0.25, rtol=1e-6)
  # One term per bound: the trainers of two private runs of one bound are equal and share their programs.
  assert clip_term(0.25) is clip_term(0.25) and clip_term(0.25) is not clip_term(0.5)


def round_inputs(model, groups, members_clients, num_clients, key=0):
  """What `private_mean` reads of a round: the groups' delta sums and client counts, their maps into ``model``."""
  federation = types.SimpleNamespace(maps=tuple(build_group_map(model, shapes) for shapes, _, _ in groups),
                                     members=tuple(range(len(groups))), clients=members_clients,
                                     store=types.SimpleNamespace(num_clients=num_clients))
  results = [types.SimpleNamespace(delta_sum=sums, weight_sum=jnp.float32(count)) for _, sums, count in groups]
  return types.SimpleNamespace(results=results, weights=[r.weight_sum for r in results], federation=federation,
                               offset=0, key=jax.random.key(key))


def test_the_noise_on_each_element_has_standard_deviation_z_c_over_the_clients_per_round():
  """One group holding the model, zero updates: the noised mean is pure noise of std z C / m (m the cohort size)."""
  z, clip, m = 1.3, 0.7, 4
  model = {"params": {"w": jnp.zeros((400, 500)), "b": jnp.zeros(500)}}
  inputs = round_inputs(model, [(model, jax.tree.map(jnp.zeros_like, model), m)], (np.arange(10),), 10)
  carry, _ = private_mean(clip, z, m).update(Carry(model), (), inputs, None)
  noise = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(carry.delta)])
  assert abs(noise.std() / (z * clip / m) - 1) < 0.01 and abs(noise.mean()) < 0.01 * z * clip / m
  again, _ = private_mean(clip, z, m).update(Carry(model), (), inputs, None)  # seeded by the round's key
  jax.tree.map(np.testing.assert_array_equal, again.delta, carry.delta)
  other, _ = private_mean(clip, z, m).update(Carry(model), (), round_inputs(
      model, [(model, jax.tree.map(jnp.zeros_like, model), m)], (np.arange(10),), 10, key=1), None)
  assert not np.array_equal(np.asarray(other.delta["params"]["w"]), np.asarray(carry.delta["params"]["w"]))


def test_without_noise_the_update_is_the_sum_over_the_expected_holders_and_with_groups_the_noise_follows_them():
  """A wide group of 2 clients and a narrow one of 6 (of 8), 4 per round: the narrow elements are held by every
  client (E = 4), the wide-only ones by a quarter of them (E = 1); the noise there is z C / E."""
  wide, narrow = {"params": {"w": jnp.zeros((300, 400))}}, {"params": {"w": jnp.zeros((300, 200))}}
  rng = np.random.default_rng(1)
  sums = [{"params": {"w": jnp.asarray(rng.normal(size=s["params"]["w"].shape), jnp.float32)}} for s in (wide, narrow)]
  groups = [(wide, sums[0], 1), (narrow, sums[1], 3)]
  inputs = round_inputs(wide, groups, (np.arange(2), np.arange(2, 8)), 8)
  plain, _ = private_mean(1.0, 0.0, 4).update(Carry(wide), (), inputs, None)
  total = np.asarray(sums[0]["params"]["w"]).copy()
  total[:, :200] += np.asarray(sums[1]["params"]["w"])
  expected = np.concatenate([np.full((300, 200), 4.0), np.full((300, 200), 1.0)], axis=1)
  np.testing.assert_allclose(np.asarray(plain.delta["params"]["w"]), total / expected, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(plain.coverage["params"]["w"]), expected)
  noised, _ = private_mean(0.5, 2.0, 4).update(Carry(wide), (), inputs, None)
  noise = np.asarray(noised.delta["params"]["w"]) - total / expected
  for columns, count in ((slice(0, 200), 4), (slice(200, 400), 1)):
    assert abs(noise[:, columns].std() / (2.0 * 0.5 / count) - 1) < 0.02


def test_the_expected_holders_count_only_the_clients_expected_to_answer():
  """Under --client-dropout the divisor is the expected count of the clients that answer, so the mean stays
  unbiased (a group of 2 of 8 clients and one of 6, 4 per round)."""
  import types

  from fedjax_hetero.methods.privacy import expected_holders
  federation = types.SimpleNamespace(store=types.SimpleNamespace(num_clients=8), members=(0, 1),
                                     clients=(np.arange(2), np.arange(2, 8)))
  assert expected_holders(federation, 4, ()) == [1.0, 3.0]
  assert expected_holders(federation, 4, (), (0.5,)) == [0.5, 1.5]
  assert expected_holders(federation, 4, (), (0.5, 0.0)) == [0.5, 3.0]
  assert expected_holders(federation, 4, (0.25, 0.75), (0.0, 0.2)) == [1.0, 3.0 * 0.8]


@pytest.mark.parametrize("accountant", ["without_replacement", "poisson"])
def test_epsilon_equals_dp_accountings_own_composition_of_the_rounds(accountant):
  privacy = PrivacyConfig(clip=1.0, noise_multiplier=1.1, delta=1e-6, accountant=accountant)
  for rounds in (1, 7, 250):
    if accountant == "poisson":
      relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
      event = dp_accounting.PoissonSampledDpEvent(10 / 500, dp_accounting.GaussianDpEvent(1.1))
    else:  # a replaced client moves the sum by up to 2C: the multiplier is z / 2
      relation = dp_accounting.NeighboringRelation.REPLACE_ONE
      event = dp_accounting.SampledWithoutReplacementDpEvent(500, 10, dp_accounting.GaussianDpEvent(0.55))
    independent = rdp.RdpAccountant(neighboring_relation=relation)
    independent.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    ours = privacy_accounting.epsilon(privacy, 10, 500, rounds)
    np.testing.assert_allclose(ours, independent.get_epsilon(1e-6), rtol=1e-9)
  more_noise = PrivacyConfig(clip=1.0, noise_multiplier=2.2, delta=1e-6, accountant=accountant)
  assert privacy_accounting.epsilon(more_noise, 10, 500, 250) < privacy_accounting.epsilon(privacy, 10, 500, 250)
  assert privacy_accounting.epsilon(PrivacyConfig(clip=1.0, noise_multiplier=0.0), 10, 500, 3) is None  # no bound


def test_rounds_a_rollback_dropped_are_spent():
  assert privacy_accounting.rounds_spent(7, []) == 7
  assert privacy_accounting.rounds_spent(7, [{"diverged_round": 9, "to_round": 5}]) == 11


REFUSED = {"Scaffold", "HeteroScaffold", "InCoScaffold", "FedNova", "HeteroNova", "InCoNova", "FedCross", "FedGen",
           "CluSamp", "FedImpro", "FedFA", "FedIN"}


def test_methods_whose_clients_upload_more_than_their_update_are_refused_naming_the_flag_and_the_reason():
  on, config = PrivacyConfig(clip=1.0), RunConfig()
  for name in METHODS:
    method = build_method(name, config.method, config.client)
    if method.name in REFUSED:
      with pytest.raises(ValueError, match=rf"--dp-clip: {method.name} cannot be made differentially private"):
        with_privacy(method, on, config.federation)
    else:
      private = with_privacy(method, on, config.federation)
      assert private.terms[-1].name == "dp_clip" and [s.name for s in private.server] == [s.name for s in method.server]
  with pytest.raises(ValueError, match=r"client term 'scaffold' \(weighted\), which would leave the client"):
    with_privacy(build_method("Scaffold", config.method, config.client), on, config.federation)
  with pytest.raises(ValueError, match=r"--dp-clip needs --weighting uniform \(got num_samples\)"):
    RunConfig.from_flags(dp_clip=1.0, weighting="num_samples")
  with pytest.raises(ValueError, match=r"--dp-noise-multiplier sets differential privacy, which is off: add --dp-clip"):
    RunConfig.from_flags(dp_noise_multiplier=0.5)
  with pytest.raises(ValueError, match=r"--dp-clip: FedNova cannot"):  # before any data is loaded
    from fedjax_hetero.run.build import run_method
    run_method(RunConfig.from_flags(method="FedNova", dp_clip=1.0))


def mine() -> Method:
  return Method("Mine", "", "a user's FedAvg", server=(mean_delta(), apply_delta()), sharing=PER_GROUP)


def test_a_users_method_gets_privacy_with_no_code_of_its_own():
  method = mine()
  private = with_privacy(method, PrivacyConfig(clip=2.0), RunConfig().federation)
  assert [t.name for t in private.terms] == ["dp_clip"] and private.server[0] is not method.server[0]
  assert private.server[1] is method.server[1]
  assert with_privacy(method, PrivacyConfig(), RunConfig().federation) is method  # off: the method as it is



def config(out, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=6, clients_per_round=3, rounds=4,
               checkpoint_every=2, eval_every=1, progress=False, output_dir=str(out), batch_size=16,
               dissimilarity=False, method="HeteroAvg", dp_clip=0.5, dp_noise_multiplier=0.8)
  return RunConfig.from_flags(**{**flags, **changes})


def job_config(out) -> RunConfig:
  """`config` as the jobs below run it: on the round program, two rounds, one group (what a job checks of privacy
  does not depend on the groups, whose noise the tests above check, and one group compiles fewer programs)."""
  return config(out, groups=("mlp@1",), round_program="fused", rounds=2)


@pytest.fixture(scope="module")
def trained_alone(tmp_path_factory) -> TrainedAlone:
  return TrainedAlone(tmp_path_factory, lambda: synthetic_dataset(num_train=240, num_test=64, seed=0))


@pytest.mark.slow
def test_a_private_run_resumes_bit_for_bit_reports_epsilon_and_differs_from_one_without_noise(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  straight = config(tmp_path / "straight")
  summary = run_experiment(straight, dataset, log=lambda _: None)
  halves = config(tmp_path / "halves", rounds=2)
  run_experiment(halves, dataset, log=lambda _: None)
  resumed = run_experiment(halves.replace(rounds=4, resume=True), dataset, log=lambda _: None)
  assert measured(halves.output.dir) == measured(straight.output.dir)
  jax.tree.map(np.testing.assert_array_equal, restore(halves.replace(rounds=4), dataset)[0].models,
               restore(straight, dataset)[0].models)
  rows = read_rows(straight.output.dir)
  epsilons = [privacy_accounting.epsilon(straight.privacy, 3, 6, r) for r in (1, 2, 3, 4)]
  assert [r["privacy"] for r in rows] == [{"epsilon": e, "delta": 1e-5, "rounds_spent": i + 1}
                                          for i, e in enumerate(epsilons)]
  assert summary["privacy"]["epsilon"] == resumed["privacy"]["epsilon"] == epsilons[-1]
  clipped_only = config(tmp_path / "clipped_only", dp_noise_multiplier=0.0)
  run_experiment(clipped_only, dataset, log=lambda _: None)
  assert read_rows(clipped_only.output.dir)[-1]["train_loss"] != rows[-1]["train_loss"]
  assert read_rows(clipped_only.output.dir)[-1]["privacy"]["epsilon"] is None


@pytest.mark.slow
@pytest.mark.default_emitters
def test_a_job_of_seeds_with_privacy_equals_its_runs_alone_on_the_round_program(tmp_path, trained_alone):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(job_config(tmp_path / "job"), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  for run in runs:
    assert measured(run.output.dir) == measured(trained_alone(run))
    assert read_rows(run.output.dir)[-1]["privacy"]["epsilon"] > 0
  assert measured(runs[0].output.dir)[-1]["train_loss"] != measured(runs[1].output.dir)[-1]["train_loss"]


@pytest.mark.slow
def test_a_users_method_runs_private_through_the_runner_on_both_drivers(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  rows = {}
  for program in ("host", "fused"):
    run = config(tmp_path / program, method="Mine", groups=("mlp@1",), round_program=program, rounds=2)
    summary = run_experiment(run, dataset, log=lambda _: None, method=mine())
    assert summary["client_terms"] == ["dp_clip"] and summary["privacy"]["epsilon"] > 0
    rows[program] = measured(run.output.dir)
  np.testing.assert_allclose([r["train_loss"] for r in rows["host"]], [r["train_loss"] for r in rows["fused"]],
                             rtol=1e-5)
  assert [r["privacy"] for r in rows["host"]] == [r["privacy"] for r in rows["fused"]]


@pytest.mark.slow
def test_a_sweep_of_the_noise_multiplier_runs_in_one_program_and_equals_its_runs_alone(tmp_path, trained_alone):
  """(The run of z = 0.8 is seed 0 of the job of seeds above: trained alone once.)"""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  base = job_config(tmp_path / "sweep")
  runs = runs_of(base, None, [parse_sweep("privacy.noise_multiplier=0.8,2", base)])
  run_together(runs, dataset, log=lambda _: None)
  for run, z in zip(runs, (0.8, 2.0), strict=True):
    assert measured(run.output.dir) == measured(trained_alone(run))
    assert read_rows(run.output.dir)[-1]["privacy"]["epsilon"] == privacy_accounting.epsilon(
        PrivacyConfig(clip=0.5, noise_multiplier=z), 3, 6, 2)
