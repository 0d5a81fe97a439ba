"""SCAFFOLD (Karimireddy et al., ICML 2020): the control-variate client term and the server's control variate.

The pure server update is `aggregators.scaffold_server_control` (public, shared with the README's pure
functions); this module holds the client's option II update, the term and the step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero import aggregators
from fedjax_hetero.client.terms import ClientTerm, Memory, Upload, Variables, tree_sub
from fedjax_hetero.compilation import program_cache
from fedjax_hetero.hetero.maps import SubmodelMap, extract
from fedjax_hetero.server.steps import ServerStep


def scaffold_control_update(control: Variables, server_control: Variables, delta_params: Variables,
                            num_steps: jax.Array, learning_rate: float) -> Variables:
  """SCAFFOLD's option II (Karimireddy et al. 2020, Alg. 1 line 12):
  ``c_i+ = c_i - c + (x - y_i) / (K eta)`` with ``x - y_i = -delta``, K the client's local steps."""
  scale = 1.0 / (learning_rate * jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0))  # (rate first: many_runs)
  return jax.tree.map(lambda ci, c, d: ci - c - scale * d, control, server_control, delta_params)


def scaffold_correction(learning_rate: float) -> ClientTerm:
  """SCAFFOLD's client side: every gradient plus ``c - c_i`` (Alg. 1 line 10); after the round the
  option II update of ``c_i`` (kept in the client's memory, zero at first) and the upload of its change.
  Reads the server's ``c`` (params-shaped) from its server step (`scaffold_control`)."""

  def next_control(_, final, control, server_control):
    return scaffold_control_update(control, server_control, final.delta["params"], final.num_steps, learning_rate)

  def control_change(_, final, control, server_control):
    return tree_sub(next_control(_, final, control, server_control), control)

  return ClientTerm("scaffold", init=lambda r: tree_sub(r.share, r.memory),
                    grad=lambda grads, correction: jax.tree.map(jnp.add, grads, correction),
                    upload=Upload(control_change, "weighted"),
                    memory=Memory(init=lambda v: jax.tree.map(jnp.zeros_like, v["params"]), next=next_control),
                    share=True)


@program_cache
def _extractor(group_map: SubmodelMap):
  return jax.jit(lambda tree: extract(tree, group_map))


class ControlState(NamedTuple):
  """SCAFFOLD's server state: the control variate ``c``, shaped like the federation's ``params``."""

  params: Variables


def scaffold_control(correction) -> ServerStep:
  """SCAFFOLD's server control variate ``c`` (Karimireddy et al. 2020, Alg. 1 line 17, as NIID-Bench:
  ``c <- c + mean_i delta_c_i`` over the sampled holders of each element; `aggregators.
  scaffold_server_control`) from the uploads of the ``correction`` client term
  (`scaffold_correction`). Starts at zero; each group's clients get their slice of it."""

  def init(model, federation):
    return ControlState(jax.tree.map(jnp.zeros_like, model["params"]))

  def update(carry, control, inputs, plan):
    deltas = [{"params": d} for d in inputs.uploads(correction)]
    new = aggregators.scaffold_server_control({"params": control.params}, deltas, inputs.weights,
                                              inputs.federation.maps, inputs.offset)
    return carry, ControlState(new["params"])

  def broadcast(control, federation, member, round_index):
    return _extractor(federation.maps[member])({"params": control.params})["params"]

  return ServerStep("scaffold", update, init, broadcast, reads=(correction,))
