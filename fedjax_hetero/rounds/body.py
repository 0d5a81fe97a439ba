"""One round, written once: broadcast -> map the cohorts -> reduce with the server steps -> evaluate.

`run_round` is a plain function of the spec, the server state and the round's rows (`inputs.RoundRows`), in
the manner of DrJAX: it knows no method (the spec's method supplies the steps) and no hardware. How the
round's cohorts are mapped onto the machine is its one seam, the ``cohorts`` argument (`rounds.mapping`): the
host loop runs this function eagerly, each piece its own jitted program, with the groups' cohorts trained by a
backend; a device program traces it, K rounds in a device loop, with the cohorts trained inside the program.
Where the host knows a value (a group none of whose clients was sampled) it skips the work; in a program the
same choice is a select.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import light_jit
from fedjax_hetero.models.evaluation import EVAL_BATCH, correct_predictions
from fedjax_hetero.rounds.inputs import RoundRows
from fedjax_hetero.rounds.state import ServerState, server_key

if TYPE_CHECKING:
  from fedjax_hetero.rounds.spec import RoundSpec


class RoundData(NamedTuple):
  """The arrays a round reads: the training store's, the test set and the clients' held-out samples."""

  images: jax.Array
  labels: jax.Array
  index_table: jax.Array
  test_images: jax.Array
  test_labels: jax.Array
  held_out: tuple[Any, ...] = ()  # per group, its clients' held-out samples (`held_out.HeldOut`; () without)
  # What the mapping reads as arguments rather than building as constants (the union's leaf offsets, so that XLA
  # compiles a kernel per leaf shape, not per leaf, and its groups' held masks: `union.UnionInputs`); () for the
  # others (`mapping.ProgramCohorts.arguments`).
  mapping: Any = ()

  @classmethod
  def of(cls, spec: "RoundSpec", mapping: Any = ()) -> "RoundData":
    store, held = spec.store, spec.client_eval.held if spec.client_eval is not None else ()
    return cls(store.images, store.labels, store.index_table, spec.test_images, spec.test_labels, held, mapping)


class RoundOutputs(NamedTuple):
  loss_sum: tuple[Any, ...]  # per group: summed training loss
  num_examples: tuple[Any, ...]  # per group: real examples trained on
  server_metrics: tuple[Any, ...]  # per federation: its steps' metrics (None where the host skipped it)
  # Per group: correct test predictions after the round (None outside evaluation rounds and inside a device program,
  # whose evaluation is a program of its own; on the host loop a function that counts them, called once the round's
  # time is taken).
  correct: Any
  # Per federation: the largest magnitude of a weight of its model after the round (inf where one is not finite).
  largest_weight: tuple[Any, ...] = ()
  # Per group: every client's correct predictions on its held-out samples, as `correct` (() without client evaluation).
  client_correct: Any = ()


@light_jit
def largest_weight(tree: Any) -> jax.Array:
  """The largest magnitude of an element of the floating-point leaves of ``tree`` (float32), inf if one is not
  finite (a NaN too, whatever the backend's max does with one), as a finiteness check: one reduction over every
  leaf's elements (one per leaf would be a kernel per leaf for XLA to compile)."""
  leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  values = jnp.concatenate(leaves) if leaves else jnp.zeros((0,), jnp.float32)
  return jnp.max(jnp.where(jnp.isfinite(values), jnp.abs(values), jnp.inf), initial=0)


def any_of(flags: Sequence[Any]) -> Any:
  """Whether any flag is set: a Python bool where the host knows them all, else a traced one."""
  if all(isinstance(f, (bool, np.bool_)) for f in flags):
    return bool(any(flags))
  return functools.reduce(jnp.logical_or, flags)


def select(flag: Any, new: Any, old: Any) -> Any:
  """``new`` where ``flag``, else ``old``: chosen on the host when ``flag`` is a Python bool."""
  if isinstance(flag, bool):
    return new if flag else old
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


def server_round(spec: "RoundSpec", federation: int, state: ServerState, starts: Sequence[Any],
                 results: Sequence[Any], x: RoundRows, mapped: Any = None
                 ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
  """Federation ``federation``'s server steps on its groups' results (and what the mapping computed itself,
  `server.steps.MappedSums`): its new model, step states and metrics."""
  f = spec.federations[federation]
  cohorts = [x.cohorts[g] for g in f.members]
  return spec.server_programs[federation](
      state.models[federation], state.steps[federation], tuple(starts[g] for g in f.members),
      tuple(results[g] for g in f.members), tuple(c.real > 0 for c in cohorts), tuple(c.server_ids for c in cohorts),
      x.index, server_key(spec.seed, x.index, spec.store.num_clients, federation), x.plans, statics=x.statics,
      mapped=mapped)


def run_round(spec: "RoundSpec", cohorts: Any, state: ServerState, x: RoundRows, data: RoundData
              ) -> tuple[ServerState, RoundOutputs]:
  """The round ``x`` from ``state``: the state after it and the round's outputs. ``cohorts`` maps the groups'
  cohorts onto the hardware (`rounds.mapping`); it may update the client memory in place."""
  groups = range(len(spec.groups))
  starts = tuple(spec.start_variables(state, g) for g in groups)  # broadcast
  shares = tuple(spec.group_share(state, g) for g in groups)
  results, memory, mapped = cohorts.train(spec, x, state, starts, shares, data)  # map
  models, steps, metrics = list(state.models), list(state.steps), []
  for f in spec.federations:  # reduce
    trains = any_of([x.cohorts[g].count > 0 for g in f.members])
    if trains is False:
      metrics.append(None)
      continue
    model, new_steps, federation_metrics = server_round(spec, f.index, state, starts, results, x, mapped[f.index])
    models[f.index] = select(trains, model, models[f.index])
    steps[f.index] = select(trains, new_steps, steps[f.index])
    metrics.append(federation_metrics)
  sampler_state, sampler = state.sampler, spec.method.sampler
  if sampler.observe:  # (host-side state: the host loop's alone, see `mapping.unsupported_in_program`)
    read = spec.method.term_index(sampler.reads)
    for cohort, result in zip(x.cohorts, results):
      if cohort.count:
        sampler_state = sampler.observe(sampler_state, cohort.clients[:cohort.count], result.uploads[read],
                                        spec.sampling)
  after = ServerState(x.index + 1, tuple(models), tuple(steps), sampler_state, memory)
  correct, client_correct = cohorts.correct(spec, after, x, data)  # evaluate
  outputs = RoundOutputs(tuple(r.loss_sum for r in results), tuple(r.num_examples for r in results),
                         tuple(metrics), correct, tuple(map(largest_weight, models)), client_correct)
  return after, outputs


def correct_counts(spec: "RoundSpec", state: ServerState, local: Callable[[Any], Any] = lambda tree: tree,
                   batch_size: int = EVAL_BATCH, variables: Callable[[int], Any] | None = None) -> list[int]:
  """Every group's correct test predictions, each batch its own jitted program (as XLA:CPU runs fastest), on
  ``local`` of the variables (a process's own copy of replicated server state, see `backends.Backend.local`);
  ``variables(g)``: group ``g``'s evaluated variables where the caller has them (see `evaluated`)."""
  variables = variables or evaluated(spec, state, local)
  return [correct_predictions(g.model, variables(i), spec.test_images, spec.test_labels, spec.store.mean,
                              spec.store.std, batch_size) for i, g in enumerate(spec.groups)]


def evaluated(spec: "RoundSpec", state: ServerState, local: Callable[[Any], Any] = lambda tree: tree
              ) -> Callable[[int], Any]:
  """Group ``g`` -> its variables as the method evaluates them, each made once (HeteroFL's re-estimated BatchNorm
  serves the test set and the clients' held-out samples alike)."""
  return functools.cache(lambda i: spec.evaluated_variables(local(spec.group_variables(state, i)), i))
