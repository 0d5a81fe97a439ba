"""The method API's proof: FedAvgM (Hsu et al. 2019, server momentum), declared here with no library edit."""

import chex
import jax
import numpy as np
import optax

from fedjax_hetero.methods import PER_GROUP, Method
from fedjax_hetero.server import apply_delta, mean_delta
from tests.helpers import tiny_simulation


def fedavgm(momentum: float = 0.9, server_lr: float = 1.0) -> Method:
  """FedAvg whose server applies the mean delta as the negative pseudo-gradient of SGD with momentum."""
  return Method("FedAvgM", "Hsu, Qi and Brown 2019", "FedAvg with server momentum",
                server=(mean_delta(), apply_delta(optax.sgd(server_lr, momentum=momentum))), sharing=PER_GROUP)


def run(method, rounds=4):
  sim = tiny_simulation(method, widths=(1.0,), clients_per_round=3)
  states, rows = [sim.init_state()], []
  for _ in range(rounds):
    state, metrics = sim.run_round(states[-1])
    states.append(state)
    rows.append(metrics)
  return sim, states, rows


def test_fedavgm_trains_and_keeps_server_momentum():
  sim, states, rows = run(fedavgm())
  assert rows[-1]["train_loss"] < rows[0]["train_loss"]
  assert sim.evaluate(states[-1])["mean"] > sim.evaluate(states[0])["mean"]
  momentum = jax.tree.leaves(states[-1].steps[0][1])  # the "apply" step's optax state: the momentum buffer
  assert momentum and all(np.abs(np.asarray(m)).max() > 0 for m in momentum)


def test_fedavgm_without_momentum_is_fedavg():
  _, plain, plain_rows = run("FedAvg", rounds=2)
  _, zero, zero_rows = run(fedavgm(momentum=0.0), rounds=2)
  # Equal up to float rounding: XLA fuses w + delta and w - (-delta) differently (1-ulp differences).
  chex.assert_trees_all_close(zero[-1].models, plain[-1].models, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose([r["train_loss"] for r in zero_rows], [r["train_loss"] for r in plain_rows], rtol=1e-6)


def test_fedavgm_runs_on_the_round_program():
  """A method declared outside the library runs as one device program per call, as the host loop runs it."""
  host = tiny_simulation(fedavgm(), "vmap", widths=(1.0,), clients_per_round=3)
  program = tiny_simulation(fedavgm(), "vmap", widths=(1.0,), clients_per_round=3, round_program="fused")
  host_state, host_rows = host.run_rounds(host.init_state(), 3, evaluate={3})
  state, rows = program.run_rounds(program.init_state(), 3, evaluate={3})
  chex.assert_trees_all_close(state.steps, host_state.steps, rtol=1e-5, atol=1e-7)  # the momentum buffer
  np.testing.assert_allclose([r["train_loss"] for r in rows], [r["train_loss"] for r in host_rows], rtol=1e-5)
  assert rows[-1]["test_accuracy"] == host_rows[-1]["test_accuracy"]
