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
* ``finish``: its upload and its memory after the round, and a change of the
  client's delta (SCAFFOLD's control delta, FedNova's normalization, a stacked
  copy of the final model for FedCross and FedGen).

A term's state lives for one round (``init`` builds it from the client's
`RoundInput`); ``init_memory`` makes state that persists across the rounds a
client takes part in (SCAFFOLD's c_i, MOON's previous model). A term with
``upload`` set uploads (`with_upload`), summed over the cohort as it says:
"weighted" (sum of w_c x_c), "sum" or "stack" (one row per client). The link to
the server is structural, never by name: a server step (or the sampler) lists
the terms whose uploads it reads in its ``reads``, and its ``broadcast`` goes to
those of them that take a ``share``; `methods.Method` refuses an upload nobody
reads and a share nobody writes. Uploads, memory and shares travel as tuples in
the terms' order. Terms never look at another term's data.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_hetero.moved import forward_moved

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
  """A client at the end of its round; a term's ``finish`` may change ``delta`` and sets its own ``upload``
  and ``memory`` (`with_upload`, `with_memory`; each empty when the term's finish starts)."""

  start: Variables
  variables: Variables
  delta: Variables
  num_steps: jax.Array
  upload: Any = ()
  memory: Any = ()


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
  upload: str | None = None  # how its upload is summed over a cohort (`REDUCTIONS`); None: it uploads nothing
  share: bool = False  # it reads the share its server step broadcasts (`RoundInput.share`)
  cuts: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ()
  gradient: str = "local"
  wrap_model: Callable[[nn.Module], nn.Module] | None = None  # e.g. MOON's projection head


def term_cuts(term: ClientTerm, model: nn.Module) -> tuple[str, ...]:
  """The cut points ``term`` reads on ``model``."""
  return tuple(term.cuts(model) if callable(term.cuts) else term.cuts)


def tree_sub(a: Variables, b: Variables) -> Variables:
  return jax.tree.map(jnp.subtract, a, b)


def with_upload(final: ClientFinal, value: Any) -> ClientFinal:
  """``final`` with the finishing term's upload."""
  return final._replace(upload=value)


def with_memory(final: ClientFinal, value: Any) -> ClientFinal:
  """``final`` with the finishing term's memory for the client's next round."""
  return final._replace(memory=value)


# ---------------------------------------------------------------------------------------- per-client uploads


def upload_variables(name: str) -> ClientTerm:
  """Uploads each client's final variables, stacked over the cohort (FedCross's and FedGen's servers)."""
  return ClientTerm(name, finish=lambda _, final, memory, share: with_upload(final, final.variables),
                    upload="stack")


def upload_flat_delta(name: str) -> ClientTerm:
  """Uploads each client's parameter change flattened to one vector, stacked over the cohort
  (CluSamp's representative gradients: ``theta_i^local - theta^sent``)."""

  def finish(_, final, memory, share):
    flat = ravel_pytree(final.variables["params"])[0] - ravel_pytree(final.start["params"])[0]
    return with_upload(final, flat)

  return ClientTerm(name, finish=finish, upload="stack")


# The client terms of single methods live in their method's module now (`fedjax_hetero.methods`); their old import
# paths keep working.
_MOVED = {
    "proximal_term": "fedjax_hetero.methods.fedprox",
    "proximal": "fedjax_hetero.methods.fedprox",
    "model_contrastive_loss": "fedjax_hetero.methods.moon",
    "ContrastiveAnchors": "fedjax_hetero.methods.moon",
    "model_contrastive": "fedjax_hetero.methods.moon",
    "scaffold_control_update": "fedjax_hetero.methods.scaffold",
    "scaffold_correction": "fedjax_hetero.methods.scaffold",
    "nova_normalizer": "fedjax_hetero.methods.fednova",
    "nova_normalization": "fedjax_hetero.methods.fednova",
}


__getattr__ = forward_moved(__name__, _MOVED)
