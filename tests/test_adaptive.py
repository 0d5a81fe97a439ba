"""Adaptive server optimizers (`fedjax_hetero.methods.adaptive`, ``--server-optimizer``): Reddi et al.'s update
rules against a hand computation, the elements no client held left alone, and the optimizer through the runner
(any method, resume, a job of seeds)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.config import RunConfig
from fedjax_hetero.config.server import ServerOptimizerConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.hetero import build_group_map
from fedjax_hetero.methods import build_method
from fedjax_hetero.methods.adaptive import AdaptiveState, adaptive_apply, with_server_optimizer
from fedjax_hetero.run.jobs import parse_sweep, run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.server.steps import Carry
from tests import golden
from tests.helpers import TrainedAlone, measured
from tests.test_runner import read_rows, restore

BETA1, BETA2, TAU, LR = 0.9, 0.99, 1e-3, 0.05
pytestmark = pytest.mark.xdist_group("adaptive")  # (one worker sets up the module's fixtures)


def by_hand(kind: str, deltas: list[np.ndarray], x: np.ndarray) -> np.ndarray:
  """Alg. 2 of Reddi et al. in float64, written out."""
  m, v = np.zeros_like(x), np.full_like(x, TAU**2)
  for d in deltas:
    m = BETA1 * m + (1 - BETA1) * d
    if kind == "adagrad":
      v = v + d**2
    elif kind == "yogi":
      v = v - (1 - BETA2) * d**2 * np.sign(v - d**2)
    else:
      v = BETA2 * v + (1 - BETA2) * d**2
    x = x + LR * m / (np.sqrt(v) + TAU)
  return x


def one_group_inputs(model):
  """What `adaptive_apply` reads of a round: one group holding the whole model, with weight 1."""
  federation = types.SimpleNamespace(maps=(build_group_map(model, model),))
  return types.SimpleNamespace(weights=[jnp.float32(1.0)], federation=federation, offset=0)


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_three_rounds_of_each_optimizer_equal_the_papers_equations_by_hand(kind):
  rng = np.random.default_rng(0)
  x0 = rng.normal(size=(3, 4)).astype(np.float32)
  deltas = [rng.normal(scale=s, size=(3, 4)).astype(np.float32) for s in (0.1, 0.02, 0.3)]
  model = {"params": {"w": jnp.asarray(x0)}, "batch_stats": {"mean": jnp.ones(4)}}
  step = adaptive_apply(ServerOptimizerConfig(kind, LR, BETA1, BETA2, TAU))
  state, inputs = step.init(model, None), one_group_inputs(model)
  for d in deltas:
    delta = {"params": {"w": jnp.asarray(d)}, "batch_stats": {"mean": jnp.full(4, 0.5)}}
    carry, state = step.update(Carry(model, delta), state, inputs, None)
    model = carry.model
  np.testing.assert_allclose(model["params"]["w"], by_hand(kind, deltas, x0.astype(np.float64)), rtol=2e-5)
  np.testing.assert_array_equal(model["batch_stats"]["mean"], np.full(4, 2.5))  # statistics take the mean update


def test_an_element_no_client_held_and_no_step_updated_keeps_its_value_and_its_moments():
  """A wide model shared with a narrow group, in a round where only the narrow group trained: the wide-only
  elements neither move nor change m and v (the narrow group's elements do)."""
  wide = {"params": {"w": jnp.ones((2, 4))}}
  narrow = {"params": {"w": jnp.ones((2, 2))}}
  maps = (build_group_map(wide, wide), build_group_map(wide, narrow))
  inputs = types.SimpleNamespace(weights=[jnp.float32(0.0), jnp.float32(2.0)],
                                 federation=types.SimpleNamespace(maps=maps), offset=0)
  step = adaptive_apply(ServerOptimizerConfig("adam", LR, BETA1, BETA2, TAU))
  state = AdaptiveState({"w": jnp.full((2, 4), 0.3)}, {"w": jnp.full((2, 4), 0.2)})
  delta = {"params": {"w": jnp.zeros((2, 4)).at[:, :2].set(0.1)}}
  carry, new = step.update(Carry(wide, delta), state, inputs, None)
  w = np.asarray(carry.model["params"]["w"])
  assert (w[:, 2:] == 1.0).all() and (w[:, :2] != 1.0).all()
  assert (np.asarray(new.m["w"])[:, 2:] == 0.3).all() and (np.asarray(new.v["w"])[:, 2:] == 0.2).all()
  assert (np.asarray(new.m["w"])[:, :2] != 0.3).all()


def test_a_method_without_a_mean_update_is_refused_naming_the_flag():
  with pytest.raises(ValueError, match=r"--server-optimizer adam: FedCross applies no mean update"):
    with_server_optimizer(build_method("FedCross", RunConfig().method, RunConfig().client),
                          ServerOptimizerConfig("adam"))


def test_a_users_method_gets_the_optimizer_and_one_with_an_optimizer_of_its_own_is_refused():
  import optax

  from fedjax_hetero.methods import PER_GROUP, Method
  from fedjax_hetero.server import apply_delta, mean_delta
  plain = Method("Mine", "", "", server=(mean_delta(), apply_delta()), sharing=PER_GROUP)
  adam = ServerOptimizerConfig("adam")
  assert [s.init is not None for s in with_server_optimizer(plain, adam).server] == [False, True]
  momentum = Method("FedAvgM", "", "", server=(mean_delta(), apply_delta(optax.sgd(1.0, momentum=0.9))),
                    sharing=PER_GROUP)
  with pytest.raises(ValueError, match=r"FedAvgM applies its mean update through an optimizer of its own"):
    with_server_optimizer(momentum, adam)


def test_optimizer_settings_without_an_optimizer_are_refused():
  with pytest.raises(ValueError, match=r"--server-lr, --server-tau set the server optimizer, and there is none"):
    RunConfig.from_flags(server_lr=0.1, server_tau=0.01)



def config(out, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=6, clients_per_round=2, rounds=4,
               checkpoint_every=2, eval_every=1, progress=False, output_dir=str(out), batch_size=16,
               dissimilarity=False, method="HeteroAvg", server_optimizer="yogi", server_lr=0.03)
  return RunConfig.from_flags(**{**flags, **changes})


def job_config(out) -> RunConfig:
  """`config` as the jobs below run it: FedAdam on the round program, two rounds, one group (what a job checks of the
  server optimizer does not depend on the groups, and one group compiles fewer programs)."""
  return config(out, groups=("mlp@1",), round_program="fused", rounds=2, server_optimizer="adam")


@pytest.fixture(scope="module")
def trained_alone(tmp_path_factory) -> TrainedAlone:
  return TrainedAlone(tmp_path_factory, lambda: synthetic_dataset(num_train=240, num_test=64, seed=0))


@pytest.mark.slow
def test_a_run_with_a_server_optimizer_resumes_bit_for_bit_and_differs_from_plain_averaging(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  straight = config(tmp_path / "straight")
  run_experiment(straight, dataset, log=lambda _: None)
  halves = config(tmp_path / "halves", rounds=2)
  run_experiment(halves, dataset, log=lambda _: None)
  run_experiment(halves.replace(rounds=4, resume=True), dataset, log=lambda _: None)
  assert measured(halves.output.dir) == measured(straight.output.dir)
  jax.tree.map(np.testing.assert_array_equal, restore(halves.replace(rounds=4), dataset)[0].steps,
               restore(straight, dataset)[0].steps)
  plain = config(tmp_path / "plain").replace(server_optimizer="none", server_lr=1e-2)
  run_experiment(plain, dataset, log=lambda _: None)
  assert read_rows(plain.output.dir)[-1]["train_loss"] != read_rows(straight.output.dir)[-1]["train_loss"]


@pytest.mark.slow
@pytest.mark.default_emitters
def test_a_job_of_seeds_with_a_server_optimizer_equals_its_runs_alone(tmp_path, trained_alone):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(job_config(tmp_path / "job"), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  for run in runs:
    assert measured(run.output.dir) == measured(trained_alone(run))


@pytest.mark.slow
def test_a_job_sweeping_the_server_optimizers_settings_equals_its_runs_alone(tmp_path, trained_alone):
  """Held-out probe U8: --sweep server.lr on the fused program was refused once the folders were written; the
  server optimizer's numbers are traced per run, and each run of the program steps with its own. (The run of the
  default lr and beta1 is seed 0 of the job of seeds above: trained alone once.)"""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  base = job_config(tmp_path / "job")
  runs = runs_of(base, None, [parse_sweep("server.lr=0.03,0.3", base), parse_sweep("server.beta1=0,0.9", base)])
  run_together(runs, dataset, log=lambda _: None)
  losses = set()
  for run in runs:  # (a traced setting leaves the last bits free: the losses to float tolerance)
    alone = trained_alone(run)
    for have, want in zip(measured(run.output.dir), measured(alone), strict=True):
      assert (have["clients"], have["test_accuracy"]) == (want["clients"], want["test_accuracy"]), run.output.dir
      assert have["train_loss"] == pytest.approx(want["train_loss"], rel=golden.TOLERANCE["loss"]), run.output.dir
    losses.add(measured(run.output.dir)[-1]["train_loss"])
  assert len(losses) == len(runs), "every run's server settings change its trajectory"

