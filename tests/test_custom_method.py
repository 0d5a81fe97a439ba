"""The method API's proof: FedAvgM (Hsu et al. 2019, server momentum) and FedDyn (Acar et al. 2021: an upload,
client memory and a server step with typed state), declared here with no library edit; and the construction
check of the links between a method's client and server halves."""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_hetero.client.terms import ClientTerm, Loss, Memory, Upload, tree_sub, upload_variables
from fedjax_hetero.methods import PER_GROUP, Method
from fedjax_hetero.methods.fedprox import proximal_term
from fedjax_hetero.server import ServerStep, apply_delta, mean_delta
from tests.helpers import tiny_simulation


def fedavgm(momentum: float = 0.9, server_lr: float = 1.0) -> Method:
  """FedAvg whose server applies the mean delta as the negative pseudo-gradient of SGD with momentum."""
  return Method("FedAvgM", "Hsu, Qi and Brown 2019", "FedAvg with server momentum",
                server=(mean_delta(), apply_delta(optax.sgd(server_lr, momentum=momentum))), sharing=PER_GROUP)


def run(method, rounds=4):
  sim = tiny_simulation(method, widths=(1.0,), clients_per_round=3)
  states, rows = [sim.init_state()], []
  for _ in range(rounds):
    state, (metrics,) = sim.run_rounds(states[-1], 1)
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


@pytest.mark.slow
def test_fedavgm_runs_on_the_round_program():
  """A method declared outside the library runs as one device program per call, as the host loop runs it."""
  host = tiny_simulation(fedavgm(), "vmap", widths=(1.0,), clients_per_round=3)
  program = tiny_simulation(fedavgm(), "vmap", widths=(1.0,), clients_per_round=3, round_program="fused")
  host_state, host_rows = host.run_rounds(host.init_state(), 3, evaluate={3})
  state, rows = program.run_rounds(program.init_state(), 3, evaluate={3})
  chex.assert_trees_all_close(state.steps, host_state.steps, rtol=1e-5, atol=1e-7)  # the momentum buffer
  np.testing.assert_allclose([r["train_loss"] for r in rows], [r["train_loss"] for r in host_rows], rtol=1e-5)
  assert rows[-1]["test_accuracy"] == host_rows[-1]["test_accuracy"]


# FedDyn (Acar et al. 2021), a method with an upload, client memory and a server step of its own -------------

class DynClient(NamedTuple):
  start: Any  # the round's start params, theta^{t-1}
  gradient: Any  # the client's linear term, grad L_k(theta_k^{t-1}) (its memory)


class DynServer(NamedTuple):
  h: Any  # the server's running correction


def feddyn(alpha: float = 0.1) -> Method:
  """Clients: loss - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2, then g_k -= alpha * their change, which
  they upload; server: h -= alpha * mean change, and the mean change less h / alpha is applied."""

  def loss(variables, state, _, outputs, ctx):
    params = variables["params"]
    linear = sum(jnp.vdot(g, p) for g, p in zip(jax.tree.leaves(state.gradient), jax.tree.leaves(params)))
    return proximal_term(params, state.start, alpha) - linear

  def change(state, final, gradient, share):
    return tree_sub(final.variables["params"], final.start["params"])

  def next_gradient(state, final, gradient, share):
    return jax.tree.map(lambda g, c: g - alpha * c, gradient, change(state, final, gradient, share))

  dynamic = ClientTerm("dynamic", init=lambda r: DynClient(r.start["params"], r.memory), loss=Loss(loss),
                       upload=Upload(change, "weighted"),
                       memory=Memory(lambda v: jax.tree.map(jnp.zeros_like, v["params"]), next_gradient))

  def update(carry, state, inputs, plan):
    mean = jax.tree.map(lambda u: u / inputs.weights[0], inputs.uploads(dynamic)[0])
    h = jax.tree.map(lambda h, m: h - alpha * m, state.h, mean)
    params = jax.tree.map(lambda d, h: d - h / alpha, carry.delta["params"], h)
    return carry._replace(delta={**carry.delta, "params": params}), DynServer(h)

  correction = ServerStep("dynamic", update, init=lambda model, f: DynServer(jax.tree.map(jnp.zeros_like,
                                                                                          model["params"])),
                          reads=(dynamic,))
  return Method("FedDyn", "Acar et al. 2021", "dynamic regularization", terms=(dynamic,),
                server=(mean_delta(), correction, apply_delta()), sharing=PER_GROUP)


def test_feddyn_declared_here_trains_with_its_upload_memory_and_server_state():
  sim, states, rows = run(feddyn(), rounds=3)
  assert all(np.isfinite(r["train_loss"]) for r in rows)
  h = jax.tree.leaves(states[-1].steps[0][1].h)
  assert h and all(np.abs(np.asarray(x)).max() > 0 for x in h)
  gradients = jax.tree.leaves(states[-1].memory[0][0])  # the group's clients' g_k, one row each
  assert any(np.abs(np.asarray(g)).max() > 0 for g in gradients)


def test_a_method_whose_upload_nobody_reads_is_refused_at_construction():
  orphan = upload_variables("orphan")
  with pytest.raises(ValueError, match="Broken: client term 'orphan' uploads .*no server step or sampler reads it"):
    Method("Broken", "", "", terms=(orphan,))
  with pytest.raises(ValueError, match="Broken: client term 'wants' takes a share, but no server step"):
    Method("Broken", "", "", terms=(ClientTerm("wants", share=True),))
  reader = ServerStep("reader", lambda carry, state, inputs, plan: (carry, state), reads=(orphan,))
  with pytest.raises(ValueError, match="Broken: the server step 'reader' reads client term 'orphan', which is not"):
    Method("Broken", "", "", server=(mean_delta(), reader, apply_delta()))
  Method("Fine", "", "", terms=(orphan,), server=(mean_delta(), reader, apply_delta()))


def test_a_piece_in_the_old_shape_is_refused_naming_the_term_and_the_piece():
  with pytest.raises(TypeError, match=r"client term 'old': upload must be Upload\(\.\.\.\) with a callable value"):
    Method("Old", "", "", terms=(ClientTerm("old", upload="weighted"),))
  with pytest.raises(TypeError, match=r"client term 'old': loss must be Loss\(\.\.\.\)"):
    Method("Old", "", "", terms=(ClientTerm("old", loss=lambda v, s, p, out, ctx: 0.0),))
  with pytest.raises(ValueError, match="client term 'odd': upload reduce='mean'"):
    Method("Odd", "", "", terms=(ClientTerm("odd", upload=Upload(lambda s, f, m, sh: f.delta, "mean")),))


def test_a_server_step_that_breaks_the_models_shape_or_dtype_is_named_when_it_runs():
  """(It failed one round later, deep inside jax, naming no step.)"""
  def to_int(carry, state, inputs, plan):
    return carry._replace(model=jax.tree.map(lambda x: x.astype(jnp.int32), carry.model)), state

  def transposed(carry, state, inputs, plan):
    return carry._replace(model=jax.tree.map(lambda x: x.T, carry.model)), state

  for step, message in ((to_int, r"server step 'to_int' changed the model's .* from float32\[.*\] to int32"),
                        (transposed, r"server step 'transposed' changed the model's .*kernel.* from float32\[")):
    method = Method("Broken", "", "", server=(mean_delta(), apply_delta(), ServerStep(step.__name__, step)),
                    sharing=PER_GROUP)
    with pytest.raises(ValueError, match=message):
      run(method, rounds=1)


def test_a_server_step_that_returns_the_wrong_result_or_changes_its_state_or_the_deltas_shapes_is_named():
  """(The first failed unpacking inside the library; the other two ran on: a state that changed dtype until a round
  program's loop refused it, naming no step, and a delta of per-leaf scalars broadcast into every weight.)"""
  def carry_alone(carry, state, inputs, plan):
    return carry

  def floating_count(carry, state, inputs, plan):
    return carry, state + 0.5

  def scalar_delta(carry, state, inputs, plan):
    return carry._replace(delta=jax.tree.map(jnp.mean, carry.delta)), state

  def scalar_mean(carry, state, inputs, plan):
    return carry._replace(delta=jax.tree.map(lambda x: jnp.zeros((), x.dtype), carry.model)), state

  for step, error, message in (
      (ServerStep("carry_alone", carry_alone), TypeError,
       r"server step 'carry_alone' returned a Carry alone; a step's update returns \(carry, state\)"),
      (ServerStep("floating_count", floating_count, init=lambda model, federation: jnp.int32(0)), ValueError,
       r"server step 'floating_count' changed its state from int32\[\] to float32\[\]; a server step keeps its"),
      (ServerStep("scalar_delta", scalar_delta), ValueError,
       r"server step 'scalar_delta' changed the delta's .* from float32\[4\] to float32\[\]; a server step that "),
      (ServerStep("scalar_mean", scalar_mean), ValueError,
       r"server step 'scalar_mean' gave the delta .* the shape \[\], where the model's is \[4\]")):
    first = () if step.name == "scalar_mean" else (mean_delta(),)  # (it fills the delta itself)
    method = Method("Broken", "", "", server=(*first, step, apply_delta()), sharing=PER_GROUP)
    with pytest.raises(error, match=message):
      run(method, rounds=1)
