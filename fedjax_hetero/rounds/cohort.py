"""A cohort of one architecture group's clients as one computation: start, steps, reduce.

Pure functions over a leading clients axis. ``mapping`` says how the clients
share the hardware inside a program: ``"vmap"`` runs them side by side (a
convolution with per-client kernels becomes a grouped convolution), ``"map"``
one after another (`jax.lax.map`). The vmap/sharded backends jit each piece
(`fedjax_hetero.rounds.backends`); the round program (`fedjax_hetero.round_program`)
inlines them into one program per round.

Every client's randomness is ``fold_in(round_key, client_id)``, so a client
trains the same way whichever cohort, padding or mapping it is part of.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero.client.local import LocalState, LocalTrainer
from fedjax_hetero.hetero.maps import Variables

MAPPINGS = ("vmap", "map")


class GroupResult(NamedTuple):
  delta_sum: Variables  # sum_c w_c * delta_c, group-shaped (FedNova: normalized deltas)
  weight_sum: jax.Array  # sum_c w_c
  loss_sum: jax.Array  # summed per-example training loss
  num_examples: jax.Array  # real examples processed
  # Every client term's upload in the terms' order, reduced over the cohort as the term says
  # (`LocalTrainer.reductions`): sum_c w_c * u_c ("weighted"), sum_c u_c ("sum"), or the clients' uploads
  # stacked in cohort order ("stack"); empty for a term that uploads nothing.
  uploads: tuple[Any, ...] = ()
  memory: Any = ()  # the group's client memory (one entry per term) with the cohort's rows updated


def over_clients(fn: Callable, in_axes: tuple[int | None, ...], mapping: str = "vmap") -> Callable:
  """``fn`` mapped over the leading clients axis of the arguments whose ``in_axes`` entry is 0 (the others are
  shared by every client), side by side (``"vmap"``) or one client after another (``"map"``)."""
  if mapping == "vmap":
    return jax.vmap(fn, in_axes=in_axes)
  if mapping != "map":
    raise ValueError(f"unknown client mapping {mapping!r}; accepted: {', '.join(MAPPINGS)}")

  def mapped(*args):
    per_client = tuple(a for a, axis in zip(args, in_axes) if axis is not None)

    def one(rows):
      rows = iter(rows)
      return fn(*(next(rows) if axis is not None else a for a, axis in zip(args, in_axes)))

    return jax.lax.map(one, per_client)

  return mapped


def split_uploads(uploads: tuple[Any, ...], reductions: tuple[str | None, ...], kind: str) -> tuple[Any, ...]:
  """The uploads whose terms reduce as ``kind`` ("weighted", "sum" or "stack"), the others left empty."""
  return tuple(value if reduction == kind else () for value, reduction in zip(uploads, reductions))


def join_uploads(parts: dict[str, tuple[Any, ...]], reductions: tuple[str | None, ...]) -> tuple[Any, ...]:
  """One tuple of uploads from its parts by reduction (`split_uploads`'s inverse)."""
  return tuple(parts[reduction][i] if reduction in parts else () for i, reduction in enumerate(reductions))


def with_stacked(result: GroupResult, stacked: tuple[Any, ...], reductions: tuple[str | None, ...]) -> GroupResult:
  """``result`` whose uploads hold ``stacked``'s where the terms stack."""
  return result._replace(uploads=join_uploads({"weighted": result.uploads, "sum": result.uploads, "stack": stacked},
                                              reductions))


def start(trainer: LocalTrainer, schedule_length: int, start_variables: Variables, index_rows: jax.Array,
          num_examples: jax.Array, round_key: jax.Array, client_ids: jax.Array, memory_rows: Any, share: Any,
          inputs: Any, *, per_client_start: bool, mapping: str = "vmap") -> tuple[LocalState, jax.Array, jax.Array]:
  """Every client's round start: its state (`LocalTrainer.init_state`, then the trainer's ``begin`` with the
  clients' ``inputs`` if it has one) and schedule ``(ids [C, S, B], mask)``. ``start_variables`` is stacked
  per client when ``per_client_start``."""
  keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(client_ids)
  ids, mask = jax.vmap(lambda r, n, k: trainer.schedule(r, n, k, schedule_length))(index_rows, num_examples, keys)
  start_axis = 0 if per_client_start else None
  init = lambda variables, row, key: trainer.init_state(variables, row, share, key)
  if mapping == "vmap":  # (axis_size: a cohort without per-client inputs besides the keys)
    states = jax.vmap(init, in_axes=(start_axis, 0, 0), axis_size=len(keys))(start_variables, memory_rows, keys)
  else:
    states = over_clients(init, (start_axis, 0, 0), mapping)(start_variables, memory_rows, keys)
  if trainer.begin is not None:
    states, ids = over_clients(trainer.begin, (0,) * 6, mapping)(states, ids, index_rows, num_examples, keys,
                                                                 inputs)
  return states, ids, mask


def steps(trainer: LocalTrainer, states: LocalState, images: jax.Array, labels: jax.Array, ids: jax.Array,
          mask: jax.Array, offset: Any, count: int, mapping: str = "vmap") -> LocalState:
  """Schedule steps ``[offset, offset + count)`` of every client."""
  step = lambda state, client_ids, client_mask: trainer.run_steps(state, images, labels, client_ids, client_mask,
                                                                  offset, count)
  return over_clients(step, (0, 0, 0), mapping)(states, ids, mask)


def reduce(trainer: LocalTrainer, states: LocalState, start_variables: Variables, memory_rows: Any, share: Any,
           weights: jax.Array, real: jax.Array, *, per_client_start: bool, mapping: str = "vmap",
           total: Callable[[jax.Array], jax.Array] = lambda x: x) -> tuple[GroupResult, Any, dict[str, Any]]:
  """The cohort's sums (padding clients have weight 0 and ``real`` 0; ``total`` completes a sum split over
  devices), the clients' new memory rows and their stacked uploads."""
  finish = lambda state, variables, row: trainer.finish(state, variables, row, share)
  outputs = over_clients(finish, (0, 0 if per_client_start else None, 0), mapping)(states, start_variables,
                                                                                     memory_rows)
  sum_with = lambda w: lambda tree: jax.tree.map(lambda d: total(jnp.tensordot(w, d, axes=1)), tree)
  weighted_sum = sum_with(weights)
  reductions = trainer.reductions
  uploads = join_uploads({"weighted": weighted_sum(split_uploads(outputs.uploads, reductions, "weighted")),
                          "sum": sum_with(real)(split_uploads(outputs.uploads, reductions, "sum"))}, reductions)
  result = GroupResult(weighted_sum(outputs.delta), total(weights.sum()), total(states.loss_sum.sum()),
                       total(states.num_examples.sum()), uploads)
  return result, outputs.memory, split_uploads(outputs.uploads, reductions, "stack")


def empty_result(start: Variables, uploads: tuple[Any, ...] = ()) -> GroupResult:
  """Zero sums shaped like ``start`` (and like ``uploads``, if given)."""
  zero = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: the result is donated
  upload_sums = jax.tree.map(jnp.zeros_like, uploads)
  return GroupResult(jax.tree.map(jnp.zeros_like, start), zero(), zero(), zero(), upload_sums)


def uploads_like(trainer: LocalTrainer, start, memory_row, server) -> tuple[Any, ...]:
  """Shapes of one client's uploads, without running anything."""
  state = jax.eval_shape(trainer.init_state, start, memory_row, server)
  return jax.eval_shape(trainer.finish, state, start, memory_row, server).uploads


def by_reduction(uploads: tuple[Any, ...], reductions: tuple[str | None, ...]) -> tuple[tuple[Any, ...],
                                                                                         tuple[Any, ...]]:
  """``uploads`` split into the ones a cohort sums and the ones it stacks (each with the others left empty)."""
  summed = join_uploads({"weighted": uploads, "sum": uploads}, reductions)
  return summed, split_uploads(uploads, reductions, "stack")


def empty_group_result(trainer: LocalTrainer, start, memory_row, server, stack_size: int) -> GroupResult:
  """The result of a group none of whose clients was sampled: zero sums, ``stack_size`` zero rows of
  every stacked upload, shaped as a real (padded) result."""
  summed, stacked = by_reduction(uploads_like(trainer, start, memory_row, server), trainer.reductions)
  result = empty_result(start, summed)
  rows = jax.tree.map(lambda x: jnp.zeros((stack_size,) + x.shape, x.dtype), stacked)
  return with_stacked(result, rows, trainer.reductions)


def pad_stacked(tree: Any, count: Any) -> Any:
  """Stacked uploads as the server steps read them: rows ``count`` and on (padding) copy row 0, or are zero when
  the cohort is empty (``count`` may be traced)."""
  def pad(x):
    real = (jnp.arange(x.shape[0]) < count).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(real, x, jnp.where(count > 0, x[:1], jnp.zeros_like(x[:1])))
  return jax.tree.map(pad, tree)
