"""A client's objective and upload as a chain of small pure pieces, `ClientTerm`s.

Every client minimizes the data loss (masked cross-entropy) on its batches;
each term of a method may add to that, in the style of an optax chain. A term
holds its state for the round (``init``, from the client's `RoundInput`) and
any of these pieces, each with the data it needs:

* ``loss``: a `Loss`, a scalar added to the objective (FedProx's proximal
  term, MOON's model-contrastive loss, FedGen's generative regularizer), with
  its per-step ``prepare`` (outside differentiation) and the ``gradient`` it
  belongs to; with more than one gradient name the trainer takes one gradient
  per name and combines them with the method's rule (`LocalTrainer.combine`);
* ``logits``: a transform of the logits the data loss is taken on (HeteroFL's
  masking of the classes absent from the client's data);
* ``grad``: a transform of the gradient (SCAFFOLD's control-variate correction);
* ``update``: a change of its state after each step, from that step's training
  outputs (e.g. running per-class feature statistics);
* ``cuts``: the cut points of the model whose activations its loss or its
  ``update`` read (`Outputs.activations`), or a function of the group's model
  giving them (a split point that depends on the architecture);
* ``delta``: a change of the client's update after the round (FedNova's
  normalization, static BatchNorm's dropped statistics);
* ``upload``: an `Upload`, what the client sends after the round and how the
  cohort sums it: "weighted" (sum of w_c x_c), "sum" or "stack" (one row per
  client);
* ``memory``: a `Memory`, state kept across the rounds a client takes part in
  (SCAFFOLD's c_i, MOON's previous model): its first value and its next;
* ``share``: whether it reads what its server step broadcasts (`RoundInput.share`);
* ``wrap_model``: what it adds to the model the clients train (MOON's
  projection head).

The pieces after the round (``delta``, then ``upload`` and ``memory``) take
``(state, final, memory, share)``: the term's round state, the client's
`ClientFinal` (with the deltas of the terms before it applied), the client's
memory for the term and the term's share.

The link to the server is structural, never by name: a server step (or the
sampler) lists the terms whose uploads it reads in its ``reads``, and its
``broadcast`` goes to those of them that take a ``share``; `methods.Method`
refuses an upload nobody reads and a share nobody writes. Uploads, memory and
shares travel as tuples in the terms' order. Terms never look at another
term's data.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


Variables = Any
REDUCTIONS = ("weighted", "sum", "stack")  # how an upload is summed over a cohort


class RoundInput(NamedTuple):
  """What a term sees when a client's round starts."""

  start: Variables  # the variables the client starts from
  memory: Any  # the term's persistent state for this client (None if it keeps none)
  share: Any  # what the server step reading the term sends the client's group (if the term takes a ``share``)
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
  """A client at the end of its round."""

  start: Variables
  variables: Variables
  delta: Variables  # variables - start, after the ``delta`` of the terms before the one reading it
  num_steps: jax.Array


AfterRound = Callable[[Any, ClientFinal, Any, Any], Any]  # (state, final, memory, share) -> value


class Loss(NamedTuple):
  """A scalar a term adds to the objective of one gradient, and what it needs computed before each step."""

  value: Callable[[Variables, Any, Any, Outputs, StepContext], jax.Array]  # (variables, state, prepared, outputs, ctx)
  prepare: Callable[[Any, StepContext], Any] | None = None  # (state, ctx) -> prepared; per step, not differentiated
  gradient: str = "local"  # the gradient it belongs to (`LocalTrainer.combine`)


class Upload(NamedTuple):
  """What a client sends its server step after the round, and how its cohort sums it (`REDUCTIONS`)."""

  value: AfterRound
  reduce: str = "weighted"
  # Set where ``value`` is, for every ``params`` leaf of the client's update, the sum of this elementwise function
  # of its elements (zero at zero), as one vector (`update_leaf_sums`): a mapping that holds the updates in a
  # larger layout (the union's) computes it there.
  update_leaf_sum: Callable[[jax.Array], jax.Array] | None = None


def update_leaf_sums(f: Callable[[jax.Array], jax.Array], reduce: str = "weighted") -> Upload:
  """An `Upload` of ``sum(f(d))`` for every ``params`` leaf ``d`` of the client's update, one vector in the order
  of ``jax.tree.leaves`` (``f`` elementwise, with ``f(0) == 0``)."""
  return Upload(lambda _, final, memory, share: jnp.stack([jnp.sum(f(d)) for d in jax.tree.leaves(
      final.delta["params"])]), reduce, f)


class Memory(NamedTuple):
  """State a client keeps across the rounds it takes part in."""

  init: Callable[[Variables], Any]  # before the client's first round, from its model's variables
  next: AfterRound  # its value for the client's next round


class ClientTerm(NamedTuple):
  """One piece of a client's objective and upload (see the module docstring); all functions pure."""

  name: str
  init: Callable[[RoundInput], Any] | None = None  # its state for the round
  loss: Loss | None = None
  logits: Callable[[jax.Array, StepContext], jax.Array] | None = None  # data-loss logits -> logits
  grad: Callable[[Variables, Any], Variables] | None = None  # (gradient, state) -> gradient
  update: Callable[[Any, Outputs, StepContext], Any] | None = None  # per step, after the gradient step
  cuts: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ()
  delta: AfterRound | None = None  # -> the client's delta
  upload: Upload | None = None
  memory: Memory | None = None
  share: bool = False
  wrap_model: Callable[[nn.Module], nn.Module] | None = None


def term_cuts(term: ClientTerm, model: nn.Module) -> tuple[str, ...]:
  """The cut points ``term`` reads on ``model``."""
  return tuple(term.cuts(model) if callable(term.cuts) else term.cuts)


def check_term(term: ClientTerm) -> None:
  """Raises a TypeError naming the term and the piece when a piece is not of its type (e.g. an upload given as
  the old ``upload="weighted"``)."""
  for field, kind, function in (("loss", Loss, "value"), ("upload", Upload, "value"), ("memory", Memory, "next")):
    piece = getattr(term, field)
    if piece is not None and not (isinstance(piece, kind) and callable(getattr(piece, function))):
      raise TypeError(f"client term {term.name!r}: {field} must be {kind.__name__}(...) with a callable "
                      f"{function} (`fedjax_hetero.client.terms.{kind.__name__}`), got {piece!r}")
  if term.upload is not None and term.upload.reduce not in REDUCTIONS:
    raise ValueError(f"client term {term.name!r}: upload reduce={term.upload.reduce!r}; one of {REDUCTIONS}")


def tree_sub(a: Variables, b: Variables) -> Variables:
  return jax.tree.map(jnp.subtract, a, b)


# ---------------------------------------------------------------------------------------- per-client uploads


def upload_variables(name: str) -> ClientTerm:
  """Uploads each client's final variables, stacked over the cohort (FedCross's and FedGen's servers)."""
  return ClientTerm(name, upload=Upload(lambda _, final, memory, share: final.variables, "stack"))


def upload_flat_delta(name: str) -> ClientTerm:
  """Uploads each client's parameter change flattened to one vector, stacked over the cohort
  (CluSamp's representative gradients: ``theta_i^local - theta^sent``)."""

  def flat_delta(_, final, memory, share):
    return ravel_pytree(final.variables["params"])[0] - ravel_pytree(final.start["params"])[0]

  return ClientTerm(name, upload=Upload(flat_delta, "stack"))
