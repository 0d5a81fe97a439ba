"""A client's objective and upload as a chain of small pure pieces, `ClientTerm`s.

Every client minimizes the data loss (masked cross-entropy) on its batches;
each term of a method may add to that, in the style of an optax chain:

* ``loss``: a scalar added to the data loss (FedProx's proximal term, MOON's
  model-contrastive loss, FedGen's generative regularizer);
* ``logits``: a transform of the logits the data loss is taken on (HeteroFL's
  masking of the classes absent from the client's data);
* ``grad``: a transform of the gradient (SCAFFOLD's control-variate correction);
* ``gradient``: the name of the gradient its loss belongs to; with more than
  one name the trainer takes one gradient per name and combines them with the
  method's rule (`LocalTrainer.combine`);
* ``cuts``: cut points of the model whose activations its loss or its
  ``update`` read (`Outputs.activations`), or a function of the group's model
  giving them (a split point that depends on the architecture);
* ``update``: a change of its own state after each step, from that step's
  training outputs (e.g. running per-class feature statistics);
* ``finish``: what it adds to the client's upload or memory after the round
  (SCAFFOLD's control delta, FedNova's normalization, a stacked copy of the
  final model for FedCross and FedGen).

A term's state lives for one round (``init`` builds it from the client's
`RoundInput`); ``init_memory`` makes state that persists across the rounds a
client takes part in (SCAFFOLD's c_i, MOON's previous model). A term reads the
share of server state that the server step *of the same name* broadcasts, and
its upload goes to the server step or sampler of that name, summed over the
cohort as ``reduce`` says: "weighted" (sum of w_c x_c), "sum" or "stack" (one
row per client). Terms never look at another term's data.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

Variables = Any
REDUCTIONS = ("weighted", "sum", "stack")


class RoundInput(NamedTuple):
  """What a term sees when a client's round starts."""

  start: Variables  # the variables the client starts from
  memory: Any  # the term's persistent state for this client (None if it keeps none)
  share: Any  # what the server step of the term's name sends the client's group (None if nothing)
  key: jax.Array | None  # the client's round key (shape-only uses may leave it out)


class Batch(NamedTuple):
  x: jax.Array  # normalized images
  labels: jax.Array
  mask: jax.Array  # bool [B]: real rows
  weights: jax.Array  # the mask as float32


class Outputs(NamedTuple):
  logits: jax.Array
  activations: dict[str, jax.Array]  # at the cut points the terms asked for


Forward = Callable[..., tuple[Outputs, Variables]]  # (variables, x, train, mask, cuts) -> (outputs, updates)


class StepContext(NamedTuple):
  """What a term sees in one local step besides its own state."""

  model: nn.Module
  batch: Batch
  num_steps: jax.Array  # real steps taken before this one
  forward: Forward
  client_labels: jax.Array | None = None  # int [S*B]: every slot's label of the round's schedule, -1 if padded
  # (given only when some term has ``logits``)


class ClientFinal(NamedTuple):
  """A client at the end of its round; terms' ``finish`` update ``delta``, ``uploads`` and ``memory``."""

  start: Variables
  variables: Variables
  delta: Variables
  num_steps: jax.Array
  uploads: dict[str, Any]
  memory: dict[str, Any]


class ClientTerm(NamedTuple):
  """One piece of a client's objective and upload (see the module docstring); all functions pure."""

  name: str
  init: Callable[[RoundInput], Any] | None = None
  init_memory: Callable[[Variables], Any] | None = None
  prepare: Callable[[Any, StepContext], Any] | None = None  # per step, before (and outside) differentiation
  loss: Callable[[Variables, Any, Any, Outputs, StepContext], jax.Array] | None = None  # (vars, state, prepared,..)
  grad: Callable[[Variables, Any], Variables] | None = None
  logits: Callable[[jax.Array, StepContext], jax.Array] | None = None  # data-loss logits -> logits
  update: Callable[[Any, Outputs, StepContext], Any] | None = None  # per step, after the gradient step
  finish: Callable[[Any, ClientFinal, Any, Any], ClientFinal] | None = None  # (state, final, memory, share)
  reduce: str = "weighted"
  cuts: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ()
  gradient: str = "local"
  wrap_model: Callable[[nn.Module], nn.Module] | None = None  # e.g. MOON's projection head


def term_cuts(term: ClientTerm, model: nn.Module) -> tuple[str, ...]:
  """The cut points ``term`` reads on ``model``."""
  return tuple(term.cuts(model) if callable(term.cuts) else term.cuts)


def tree_sub(a: Variables, b: Variables) -> Variables:
  return jax.tree.map(jnp.subtract, a, b)


def with_upload(final: ClientFinal, name: str, value: Any) -> ClientFinal:
  return final._replace(uploads={**final.uploads, name: value})


def with_memory(final: ClientFinal, name: str, value: Any) -> ClientFinal:
  return final._replace(memory={**final.memory, name: value})


# ------------------------------------------------------------------------------------------------ FedProx


def proximal_term(params: Variables, anchor: Variables, mu: float) -> jax.Array:
  """FedProx's proximal term (Li et al. 2020, Eq. 2): ``mu/2 ||w - w^t||^2`` over all leaves of ``params``."""
  squares = jax.tree.map(lambda p, a: jnp.sum(jnp.square(p - a)), params, anchor)
  return 0.5 * mu * sum(jax.tree.leaves(squares))


def proximal(mu: float) -> ClientTerm:
  """FedProx: ``+ mu/2 ||w - w^t||^2`` with ``w^t`` the parameters the client started the round from."""
  return ClientTerm("prox", init=lambda r: r.start["params"],
                    loss=lambda v, anchor, _, out, ctx: proximal_term(v["params"], anchor, mu))


# --------------------------------------------------------------------------------------------------- MOON


def _cosine(u: jax.Array, v: jax.Array, eps: float = 1e-8) -> jax.Array:
  return jnp.sum(u * v, -1) / jnp.maximum(jnp.linalg.norm(u, axis=-1) * jnp.linalg.norm(v, axis=-1), eps)


def model_contrastive_loss(z: jax.Array, z_global: jax.Array, z_previous: jax.Array, temperature: float,
                           mask: jax.Array) -> jax.Array:
  """MOON's model-contrastive loss (Li, He, Song 2021, Eq. 3), mean over real rows.

  ``-log(e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}))`` with cosine
  similarity, i.e. ``softplus((sim(z, z_prev) - sim(z, z_glob)) / tau)``.
  """
  positive = _cosine(z, z_global) / temperature
  negative = _cosine(z, z_previous) / temperature
  return jnp.sum(jax.nn.softplus(negative - positive) * mask) / jnp.maximum(mask.sum(), 1.0)


def model_contrastive(mu: float, temperature: float) -> ClientTerm:
  """MOON: ``+ mu * l_con`` on the projection ``z`` of the "features" cut point, against the round's
  global model (positive) and the client's previous local model (negative), both frozen, eval mode."""
  from fedjax_hetero.models.projection import with_projection_head

  def project(ctx, variables, features):
    return ctx.model.apply(variables, features, method="project")

  def frozen_projection(ctx, variables):
    outputs, _ = ctx.forward(variables, ctx.batch.x, False, None, ("features",))
    return jax.lax.stop_gradient(project(ctx, variables, outputs.activations["features"]))

  def prepare(state, ctx):
    global_vars, previous = state
    return frozen_projection(ctx, global_vars), frozen_projection(ctx, previous)

  def loss(variables, state, frozen, outputs, ctx):
    z = project(ctx, variables, outputs.activations["features"])
    return mu * model_contrastive_loss(z, *frozen, temperature, ctx.batch.weights)

  return ClientTerm("moon", init=lambda r: (r.start, r.memory), init_memory=lambda v: v, prepare=prepare, loss=loss,
                    finish=lambda state, final, memory, share: with_memory(final, "moon", final.variables),
                    cuts=("features",), wrap_model=with_projection_head)


# ----------------------------------------------------------------------------------------------- SCAFFOLD


def scaffold_control_update(control: Variables, server_control: Variables, delta_params: Variables,
                            num_steps: jax.Array, learning_rate: float) -> Variables:
  """SCAFFOLD's option II (Karimireddy et al. 2020, Alg. 1 line 12):
  ``c_i+ = c_i - c + (x - y_i) / (K eta)`` with ``x - y_i = -delta``, K the client's local steps."""
  scale = 1.0 / (learning_rate * jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0))  # (rate first: many_runs)
  return jax.tree.map(lambda ci, c, d: ci - c - scale * d, control, server_control, delta_params)


def scaffold_correction(learning_rate: float) -> ClientTerm:
  """SCAFFOLD's client side: every gradient plus ``c - c_i`` (Alg. 1 line 10); after the round the
  option II update of ``c_i`` (kept in the client's memory, zero at first) and the upload of its change.
  Reads the server's ``c`` (params-shaped) from the "scaffold" server step."""

  def finish(_, final, control, server_control):
    new = scaffold_control_update(control, server_control, final.delta["params"], final.num_steps, learning_rate)
    return with_memory(with_upload(final, "scaffold", tree_sub(new, control)), "scaffold", new)

  return ClientTerm("scaffold", init=lambda r: tree_sub(r.share, r.memory),
                    init_memory=lambda v: jax.tree.map(jnp.zeros_like, v["params"]),
                    grad=lambda grads, correction: jax.tree.map(jnp.add, grads, correction), finish=finish)


# ------------------------------------------------------------------------------------------------ FedNova


def nova_normalizer(num_steps: jax.Array, optimizer: str, momentum: float) -> jax.Array:
  """FedNova's a_i (Wang et al. 2020, Sec. 4 and App. for momentum): the norm of the local
  aggregation vector. Plain SGD: ``tau``; SGD with momentum rho: ``[tau - rho(1 - rho^tau)/(1 - rho)]/(1 - rho)``.

  Adam has no such closed form; we use ``tau`` for it (each Adam step moves a weight by about
  the learning rate whatever the gradient scale, so the update grows linearly in ``tau``).
  """
  tau = jnp.asarray(num_steps, jnp.float32)
  if optimizer == "sgd" and momentum:
    rho = momentum
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
  return tau


def nova_normalization(optimizer: str, momentum: float) -> ClientTerm:
  """FedNova's client side: upload ``delta / a_i`` and ``a_i`` (for the "nova" server step)."""

  def finish(_, final, memory, share):
    a = nova_normalizer(final.num_steps, optimizer, momentum)
    safe = jnp.where(a > 0, a, 1.0)  # a client without steps (vmap padding) has a zero delta
    return with_upload(final._replace(delta=jax.tree.map(lambda d: d / safe, final.delta)), "nova", a)

  return ClientTerm("nova", finish=finish)


# ---------------------------------------------------------------------------------------- per-client uploads


def upload_variables(name: str) -> ClientTerm:
  """Uploads each client's final variables, stacked over the cohort (FedCross's and FedGen's servers)."""
  return ClientTerm(name, finish=lambda _, final, memory, share: with_upload(final, name, final.variables),
                    reduce="stack")


def upload_flat_delta(name: str) -> ClientTerm:
  """Uploads each client's parameter change flattened to one vector, stacked over the cohort
  (CluSamp's representative gradients: ``theta_i^local - theta^sent``)."""

  def finish(_, final, memory, share):
    flat = ravel_pytree(final.variables["params"])[0] - ravel_pytree(final.start["params"])[0]
    return with_upload(final, name, flat)

  return ClientTerm(name, finish=finish, reduce="stack")
