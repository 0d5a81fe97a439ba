"""A client's local training: shuffled, batched, masked, on the device.

The client's whole schedule (which sample goes in which slot of which step, and
whether the slot is real) is drawn on the device from its padded index row, so
no data leaves the device. Steps run in jitted *chunks* of fully unrolled
steps: XLA:CPU runs convolutions inside a while loop (or a ``lax.cond``) about
ten times slower than the same ops unrolled, and a chunk loop on the host costs
one dispatch per chunk (see docs/performance.md). A client's step count
is covered exactly by chunks of ``steps_per_call`` steps followed by single
steps (e.g. 19 = 8 + 8 + 1 + 1 + 1): no padded step is computed on the
sequential path, and a group needs at most two compiled chunk programs. A step whose batch holds no real
example (vmapped cohorts of unequal clients) leaves the whole state untouched, optimizer included.

What a client optimizes beyond the data loss, and what it uploads, comes from
the method's `ClientTerm`s (see `fedjax_hetero.client.terms`); the trainer
itself knows no method.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_hetero.client.flat import FlatLayout
from fedjax_hetero.client.terms import (Batch, ClientFinal, ClientTerm, Outputs, RoundInput, StepContext, check_term,
                                        term_cuts, tree_sub)
from fedjax_hetero.config.client import LocalConfig
from fedjax_hetero.config.declare import is_off
from fedjax_hetero.data.store import normalize
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.models.batch_norm import fused_batch_norm


def make_optimizer(config: LocalConfig) -> optax.GradientTransformation:
  if config.optimizer == "adam":
    tx = optax.adam(config.learning_rate)
  else:
    tx = optax.sgd(config.learning_rate, momentum=None if is_off(config.momentum) else config.momentum)
  if not is_off(config.weight_decay):
    tx = optax.chain(optax.add_decayed_weights(config.weight_decay), tx)
  return tx


class LocalState(NamedTuple):
  variables: Variables
  opt_state: Any
  loss_sum: jax.Array  # summed per-example data loss over real examples seen (no regularizers)
  num_examples: jax.Array
  num_steps: jax.Array  # steps that saw at least one real example (FedNova's tau_i)
  terms: tuple[Any, ...] = ()  # each client term's state for the round, in the terms' order
  wrapper: Any = ()  # what a trainer wrapper adds to the state (`client.attack`); empty otherwise


class ClientOutput(NamedTuple):
  """What one client hands back after a round."""

  delta: Variables  # local - start (after the terms' finish, e.g. FedNova's normalization)
  uploads: tuple[Any, ...]  # every term's upload in the terms' order (empty if it uploads nothing)
  memory: tuple[Any, ...]  # the client's state kept across rounds, per term (empty if no term keeps any)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean cross-entropy over real examples, and the summed loss."""
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels) * mask
  total = per_example.sum()
  return total / jnp.maximum(mask.sum(), 1.0), total


GradientRule = Callable[[dict[str, Variables]], Variables]  # gradients by name -> the step's gradient


class TermPlan(NamedTuple):
  """What the trainer needs to know of its terms, read in one pass when it is built (`plan_terms`)."""

  cuts: tuple[str, ...]  # the cut points the terms read, in the model's order
  gradient_names: tuple[str, ...]  # "local" first, then the other gradients the terms' losses belong to
  reductions: tuple[str | None, ...]  # how each term's upload is summed over a cohort (None: no upload)
  keeps_memory: bool  # some term keeps client memory
  transforms_logits: bool  # some term transforms the data loss's logits (the schedule's labels are needed)
  updates: bool  # some term updates its state after each step (the step's outputs are kept)


def plan_terms(terms: Sequence[ClientTerm], model: nn.Module) -> TermPlan:
  """The `TermPlan` of ``terms`` on ``model``; raises naming the term whose pieces are malformed or repeated,
  or whose cut point ``model`` lacks."""
  known = tuple(getattr(model, "cut_points", ()))
  names, cuts, gradients = set(), set(), {"local": None}
  for term in terms:
    check_term(term)
    if term.name in names:
      raise ValueError(f"client term names must be unique, got {[t.name for t in terms]}")
    names.add(term.name)
    for cut in term_cuts(term, model):
      if cut not in known:
        raise ValueError(f"a client term reads cut point {cut!r}, which {type(model).__name__} does not have; its "
                         f"cut points: {', '.join(known)}")
      cuts.add(cut)
    if term.loss:
      gradients[term.loss.gradient] = None
  return TermPlan(tuple(c for c in known if c in cuts), tuple(gradients),
                  tuple(t.upload.reduce if t.upload else None for t in terms),
                  any(t.memory for t in terms), any(t.logits for t in terms), any(t.update for t in terms))


def draw_schedule(index_row: jax.Array, num_examples: jax.Array, key: jax.Array, *, epochs: int,
                  batch_size: int, num_steps: int, drop_last: bool) -> tuple[jax.Array, jax.Array]:
  """Sample ids and realness masks of every step of one client's local training.

  Each epoch is a fresh permutation of the client's ``num_examples`` samples;
  steps are packed epoch after epoch, and steps past the client's own count are
  all-masked. Returns ``(ids [num_steps, B], mask [num_steps, B])``.
  """
  max_n = index_row.shape[0]
  if drop_last:
    per_epoch = num_examples // batch_size
  else:
    per_epoch = (num_examples + batch_size - 1) // batch_size

  def permutation(k):
    noise = jax.random.uniform(k, (max_n,))
    return jnp.argsort(jnp.where(jnp.arange(max_n) < num_examples, noise, 2.0))

  perms = jax.vmap(permutation)(jax.random.split(key, epochs))
  step = jnp.arange(num_steps)
  safe = jnp.maximum(per_epoch, 1)
  epoch, within = step // safe, step % safe
  active = step < epochs * per_epoch
  position = within[:, None] * batch_size + jnp.arange(batch_size)[None, :]
  mask = (position < num_examples) & active[:, None]
  local = perms[jnp.clip(epoch, 0, epochs - 1)[:, None], jnp.clip(position, 0, max_n - 1)]
  return index_row[local], mask


@dataclasses.dataclass(frozen=True)
class LocalTrainer:
  """The pieces of local training for one architecture group (pure; jitted by backends).

  ``terms`` are the method's client terms; with terms in more than one ``gradient``, ``combine``
  turns the gradients by name into the one the optimizer applies.

  The protocol the backends and the round program use is ``schedule``, ``init_state``, ``run_steps`` and
  ``finish``, plus ``client_inputs`` (per-client traced inputs, none here) and ``begin`` (a change of every
  client's state and schedule at its round start, none here). A wrapper with the same protocol changes
  how clients train without the engine knowing (`fedjax_hetero.client.attack.AttackedTrainer`).
  Trainers of equal pieces are equal and share their compiled programs (`compilation.program_cache`).
  """

  model: nn.Module
  config: LocalConfig
  mean: tuple[float, ...]
  std: tuple[float, ...]
  terms: tuple[ClientTerm, ...] = ()
  combine: GradientRule | None = None
  # The state's variables as one vector per collection, the model reading them through this layout
  # (`client.flat`): the same step in far fewer kernels, for a step vmapped over many clients (the union mapping).
  flat: FlatLayout | None = None
  begin: ClassVar[Callable | None] = None  # (state, ids, index_row, num_examples, key, inputs) -> (state, ids)

  def __post_init__(self):
    if len(self.plan.gradient_names) > 1 and self.combine is None:
      raise ValueError(f"terms take gradients {self.plan.gradient_names}; a rule to combine them is needed")

  @functools.cached_property
  def plan(self) -> TermPlan:
    return plan_terms(self.terms, self.model)

  @property
  def tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.config)

  @property
  def reductions(self) -> tuple[str | None, ...]:
    """How each term's upload is summed over a cohort, in the terms' order (None: no upload)."""
    return self.plan.reductions

  @property
  def keeps_memory(self) -> bool:
    return self.plan.keeps_memory

  def client_inputs(self, clients) -> Any:
    """The per-client inputs ``begin`` reads, rows in ``clients``' order (numpy; none here)."""
    return ()

  def init_memory(self, variables: Variables) -> tuple[Any, ...]:
    """A client's persistent state before its first round, per term (empty when no term keeps any)."""
    if not self.keeps_memory:
      return ()
    return tuple(t.memory.init(variables) if t.memory else () for t in self.terms)

  def _per_term(self, values: Any) -> tuple[Any, ...]:
    """Memory rows or shares, one per term (``()``, ``{}`` or None: none for any)."""
    if isinstance(values, dict) and values:
      raise TypeError(f"client memory and shares are tuples in the terms' order, not dicts by name (got keys "
                      f"{sorted(values)})")
    return tuple(values) if values else ((),) * len(self.terms)

  def init_state(self, start: Variables, memory: tuple[Any, ...] | None = None,
                 share: tuple[Any, ...] | None = None, key: jax.Array | None = None) -> LocalState:
    """A client's state at the start of a round, from the server's ``start`` variables, the
    client's ``memory`` (`init_memory`), its group's share of server state (one entry per term) and the
    client's round ``key`` (shape-only uses may leave it out)."""
    rounds = (RoundInput(start, m, s, key) for m, s in zip(self._per_term(memory), self._per_term(share)))
    terms = tuple(t.init(r) if t.init else () for t, r in zip(self.terms, rounds))
    zero = jnp.zeros((), jnp.float32)
    return LocalState(start, self.tx.init(start["params"]), zero, zero, zero, terms)

  def forward(self, variables: Variables, x: jax.Array, train: bool, mask: jax.Array | None,
              cuts: Sequence[str] = ()) -> tuple[Outputs, Variables]:
    """The model's logits and its activations at ``cuts`` (one pass, split at the cut points), and
    the updated batch statistics in training mode."""
    mutable = train and "batch_stats" in variables
    activations, start, h = {}, "input", x
    for stop in tuple(cuts) + ("logits",):
      out = self.model.apply(variables, h, train=train, mask=mask, start=start, stop=stop,
                             **({"mutable": ["batch_stats"]} if mutable else {}))
      if mutable:
        out, updates = out
        variables = {**variables, **updates}
      activations[stop], start, h = out, stop, out
    logits = activations.pop("logits")
    return Outputs(logits, activations), ({"batch_stats": variables["batch_stats"]} if mutable else {})

  def train_step(self, state: LocalState, images: jax.Array, labels: jax.Array, mask: jax.Array,
                 client_labels: jax.Array | None = None) -> LocalState:
    """One masked step on the mean data loss of the real rows (on the logits as the terms' ``logits``
    transform them; ``client_labels`` for those, see `StepContext`) plus the terms' losses, with the
    terms' gradient transforms applied before the optimizer. Its training-mode BatchNorms are `models.batch_norm`'s
    (flax's function with its gradient written out: fewer kernels to compile)."""
    x = normalize(images, self.mean, self.std)
    maskf = mask.astype(jnp.float32)
    ctx = StepContext(self.model, Batch(x, labels, mask, maskf), state.num_steps, self.forward, client_labels)
    prepared = [t.loss.prepare(s, ctx) if t.loss and t.loss.prepare else None
                for t, s in zip(self.terms, state.terms)]

    # A step with no real row (a padding client's, or one past a client's schedule in a vmapped cohort) is
    # discarded below; its forward treats every row as real, because BatchNorm's statistics over no row are
    # NaN, which a grouped convolution of the cohort's clients may carry into the other clients' results.
    forward_mask = mask | ~mask.any()

    # With a flat layout the model's leaves are read from the vectors before differentiating, and the gradient's
    # leaves concatenated after: differentiating the reads would add a vector-sized update per leaf.
    model_variables = self.flat.unravel(state.variables) if self.flat else state.variables

    def losses(params):
      variables = {**model_variables, "params": params}
      outputs, updates = self.forward(variables, x, True, forward_mask, self.plan.cuts)
      if self.flat:
        updates = self.flat.ravel(updates)
      logits = outputs.logits
      for term in self.terms:
        if term.logits:
          logits = term.logits(logits, ctx)
      loss, total = masked_cross_entropy(logits, labels, maskf)
      by_gradient = {"local": loss}
      for term, term_state, aux in zip(self.terms, state.terms, prepared):
        if term.loss:
          value, name = term.loss.value(variables, term_state, aux, outputs, ctx), term.loss.gradient
          by_gradient[name] = by_gradient[name] + value if name in by_gradient else value
      return by_gradient, (updates, total, outputs if self.plan.updates else None)

    def local_loss(params):
      parts, aux = losses(params)
      return parts["local"], aux

    params = model_variables["params"]
    with fused_batch_norm():  # (the model is traced here: its training-mode BatchNorms as `models.batch_norm`)
      if len(self.plan.gradient_names) == 1:
        (_, (model_updates, total, outputs)), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
      else:
        parts, pullback, (model_updates, total, outputs) = jax.vjp(losses, params, has_aux=True)
        grads = self.combine({name: pullback({n: jnp.float32(n == name) for n in parts})[0] for name in parts})
    if self.flat:
      grads, params = self.flat.ravel({"params": grads})["params"], state.variables["params"]
    for term, term_state in zip(self.terms, state.terms):
      if term.grad:
        grads = term.grad(grads, term_state)
    updates, opt_state = self.tx.update(grads, state.opt_state, params)
    variables = {**state.variables, **model_updates, "params": optax.apply_updates(params, updates)}
    terms = state.terms
    if self.plan.updates:
      outputs = jax.lax.stop_gradient(outputs)
      terms = tuple(t.update(s, outputs, ctx) if t.update else s for t, s in zip(self.terms, state.terms))
    active = maskf.sum() > 0
    stepped = LocalState(variables, opt_state, state.loss_sum + total, state.num_examples + maskf.sum(),
                         state.num_steps + 1.0, terms)
    return jax.tree.map(lambda new, old: jnp.where(active, new, old), stepped, state)

  def finish(self, state: LocalState, start: Variables, memory: tuple[Any, ...] | None = None,
             share: tuple[Any, ...] | None = None) -> ClientOutput:
    """The client's upload and its memory for the next round it is sampled in."""
    final = ClientFinal(start, state.variables, tree_sub(state.variables, start), state.num_steps)
    uploads, memories = [], []
    for term, term_state, row, term_share in zip(self.terms, state.terms, self._per_term(memory),
                                                 self._per_term(share)):
      if term.delta:
        final = final._replace(delta=term.delta(term_state, final, row, term_share))
      uploads.append(term.upload.value(term_state, final, row, term_share) if term.upload else ())
      memories.append(term.memory.next(term_state, final, row, term_share) if term.memory else ())
    return ClientOutput(final.delta, tuple(uploads), tuple(memories) if self.keeps_memory else ())

  def run_steps(self, state: LocalState, images: jax.Array, labels: jax.Array, ids: jax.Array, mask: jax.Array,
                offset: jax.Array, count: int) -> LocalState:
    """Runs schedule steps ``[offset, offset + count)``, unrolled (``count`` is static)."""
    client_labels = self.schedule_labels(labels, ids, mask)
    ids = jax.lax.dynamic_slice_in_dim(ids, offset, count)
    mask = jax.lax.dynamic_slice_in_dim(mask, offset, count)
    for i in range(count):
      state = self.train_step(state, images[ids[i]], labels[ids[i]], mask[i], client_labels)
    return state

  def schedule_labels(self, labels: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array | None:
    """The labels of the client's whole schedule, for the terms' ``logits`` (None when no term has one)."""
    if not self.plan.transforms_logits:
      return None
    return jnp.where(mask, labels[ids], -1).reshape(-1)

  def schedule(self, index_row: jax.Array, num_examples: jax.Array, key: jax.Array, num_steps: int):
    c = self.config
    return draw_schedule(index_row, num_examples, key, epochs=c.epochs, batch_size=c.batch_size,
                         num_steps=num_steps, drop_last=c.drop_last)
