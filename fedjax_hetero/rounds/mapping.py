"""How a round's cohorts are mapped onto the hardware: the seam of the round (`rounds.body.run_round`).

This is FedJAX's ``for_each_client``: the round hands a mapping every group's start variables, share and cohort
rows, and gets back every group's sums (`cohort.GroupResult`), the client memory with the cohort's rows
written and, per federation, what the mapping computes itself in its own layout (the layer-wise mean of the
deltas and the groups' per-leaf squared norms, `server.steps.MappedSums`: the union mapping, `rounds.union`; None
here); the mapping also counts the evaluation's correct predictions (and, with
per-client evaluation, every client's on its held-out samples: `rounds.client_eval`). Two mappings:

- `HostCohorts`: the host loop. Each group's cohort trains through a `backends.Backend` (one client after
  another as jitted chunks, a vmapped cohort, or a cohort sharded over a device mesh), and every piece of the
  round is its own jitted program: fastest on XLA:CPU, and the mapping of multi-process runs and of samplers
  that keep host-side state. In its first round every group's programs compile side by side.
- `ProgramCohorts`: inside a device program (`rounds.simulation`), every group's cohort vmapped (or
  ``lax.map``-ped) and all groups stepping side by side in one device loop over the round's local steps (a
  group whose clients are done skips the rest, so a round costs the sum of the groups' longest clients' steps).
  Its evaluation (`ProgramCohorts.counts`) is a program of its own, run after a call's evaluated rounds.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import compile_side_by_side
from fedjax_hetero.models.evaluation import EVAL_BATCH, count_correct
from fedjax_hetero.rounds import client_eval, cohort
from fedjax_hetero.rounds.backends import Backend, copy_tree
from fedjax_hetero.rounds.body import RoundData, correct_counts, evaluated, server_round
from fedjax_hetero.rounds.inputs import RoundRows, cohort_rows
from fedjax_hetero.rounds.state import ServerState, round_key

if TYPE_CHECKING:
  from fedjax_hetero.rounds.spec import RoundSpec


class HostCohorts:
  """The host loop's mapping (see the module docstring): each group's cohort through ``backend``."""

  in_program = False

  def __init__(self, backend: Backend):
    self.backend, self.name = backend, backend.name
    self._warm = False  # the first round compiles every program, for every group and federation
    self._empty: dict[int, Any] = {}

  def slots(self, spec: "RoundSpec", group: int) -> int:
    return self.backend.slots(spec.stack_size(group))

  def place(self, state: ServerState) -> ServerState:
    """``state`` where the backend keeps server state (e.g. after a restore), so every round sees one placement."""
    return ServerState(state.round, *self.backend.place((state.models, state.steps, state.sampler, state.memory)))

  def train(self, spec: "RoundSpec", x: RoundRows, state: ServerState, starts: Sequence[Any], shares: Sequence[Any],
            data: RoundData) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
    key, stacked = round_key(spec.seed, x.index), spec.method.sharing.stacked

    def train(g: int):
      rows, memory = x.cohorts[g], state.memory[g]
      if rows.count == 0:
        if self._warm:
          return None
        # The first round: one client of the group trains, its result dropped, so that the group's programs
        # compile now rather than in the first round that samples it.
        rows = jax.tree.map(lambda a: a[0], cohort_rows(spec, g, [spec.groups[g].clients[:1]], [np.ones(1)],
                                                        self.slots(spec, g)))
        memory = copy_tree(memory) if memory else memory
      return self.backend.train(spec.trainers[g], starts[g], spec.store, rows, key, memory=memory, server=shares[g],
                                per_client_start=stacked, stack_size=spec.stack_size(g))

    groups = range(len(spec.groups))
    # In the first round the groups compile side by side (XLA compiles on one core), except in a multi-process
    # run: there every process must launch the programs, whose collectives pair up across processes, in one order.
    if self._warm or jax.process_count() > 1:
      trained = [train(g) for g in groups]
    else:
      trained = compile_side_by_side([functools.partial(train, g) for g in groups])
    results, memory = [], list(state.memory)
    for g, result in enumerate(trained):
      empty = self._empty_result(spec, g, starts[g], shares[g], state)  # (made in the first round, for every group)
      if x.cohorts[g].count == 0:
        results.append(empty)
      else:
        memory[g] = result.memory
        results.append(result._replace(memory=()))
    if not self._warm:
      self._compile_every_federation(spec, x, state, starts, results)
    return results, tuple(memory), (None,) * len(spec.federations)

  def _compile_every_federation(self, spec: "RoundSpec", x: RoundRows, state: ServerState, starts: Sequence[Any],
                                results: Sequence[Any]) -> None:
    """Runs (and drops) the server program of every federation the first round leaves out, so that no later
    round compiles."""
    for f in spec.federations:
      if not any(x.cohorts[g].count for g in f.members):
        jax.block_until_ready(server_round(spec, f.index, state, starts, results, x)[:2])
    self._warm = True

  def _empty_result(self, spec: "RoundSpec", group: int, start: Any, share: Any, state: ServerState) -> Any:
    """Zeros shaped as the group's result (the stand-in for a group none of whose clients was sampled), made once
    on the host and placed as the backend places real results (made by jax operations, each leaf's shape would
    compile a program of its own: on an accelerator, a compilation each)."""
    if group not in self._empty:
      # Shapes only: the round may have consumed the state's memory.
      row = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.memory[group])
             if state.memory[group] else ())
      shapes = jax.eval_shape(lambda *a: cohort.empty_group_result(spec.trainers[group], *a, spec.stack_size(group)),
                              start, row, share)
      zeros = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), shapes)
      self._empty[group] = self.backend.place(zeros)
    return self._empty[group]

  def correct(self, spec: "RoundSpec", state: ServerState, x: RoundRows, data: RoundData) -> tuple[Any, Any]:
    """Functions that count every group's correct test predictions and, with per-client evaluation, every client's
    on its held-out samples (`client_eval`); (None, ()) outside evaluation rounds."""
    if not x.evaluate:
      return None, ()
    # Counted when called: after the round's time is taken (`simulation.Simulation.run_call`).
    if spec.client_eval is None:
      return (lambda: correct_counts(spec, state, self.backend.local)), ()
    variables = evaluated(spec, state, self.backend.local)  # (made once for both)
    return (lambda: correct_counts(spec, state, self.backend.local, EVAL_BATCH, variables),
            lambda: client_eval.host_counts(spec, variables, data, EVAL_BATCH))


class ProgramCohorts:
  """The mapping inside a device program (see the module docstring): ``mapping`` maps a cohort's clients
  (`cohort.MAPPINGS`), ``eval_batch`` is the test batch of the in-program evaluation."""

  in_program = True
  capacity: int | None = None  # the most participants a round may have (None: each group's own slots bound them)

  def __init__(self, mapping: str = "vmap", eval_batch: int = EVAL_BATCH):
    self.mapping, self.eval_batch, self.name = mapping, eval_batch, mapping

  def slots(self, spec: "RoundSpec", group: int) -> int:
    return spec.stack_size(group)

  def place(self, state: ServerState) -> ServerState:
    return state

  def arguments(self) -> Any:
    """What the program takes in `RoundData.mapping` (nothing here)."""
    return ()

  def train(self, spec: "RoundSpec", x: RoundRows, state: ServerState, starts: Sequence[Any], shares: Sequence[Any],
            data: RoundData) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
    """Every group's cohort trained, all groups in one device loop over the round's steps."""
    stacked, key = spec.method.sharing.stacked, round_key(spec.seed, x.index)
    schedule = max(1, spec.local.num_steps(data.index_table.shape[1]))
    begun, client_starts, memory_rows = [], [], []
    for g, (trainer, rows) in enumerate(zip(spec.trainers, x.cohorts)):
      client_starts.append(jax.tree.map(lambda m: m[rows.slots], starts[g]) if stacked else starts[g])
      memory_rows.append(jax.tree.map(lambda m: jnp.take(m, rows.rows, axis=0, mode="clip"), state.memory[g]))
      begun.append(cohort.start(trainer, schedule, client_starts[g], data.index_table[rows.clients], rows.sizes, key,
                                rows.clients, memory_rows[g], shares[g], rows.inputs, per_client_start=stacked,
                                mapping=self.mapping))

    def step(i, states):
      # A group whose clients are all done skips the step (it would be masked: the state stays as it is).
      return tuple(jax.lax.cond(i < rows.steps, lambda s, t=t, b=b: cohort.steps(t, s, data.images, data.labels, b[1],
                                                                                 b[2], i, 1, self.mapping),
                                lambda s: s, s)
                   for t, s, b, rows in zip(spec.trainers, states, begun, x.cohorts))

    trained = jax.lax.fori_loop(0, x.steps, step, tuple(b[0] for b in begun))
    results, memory = [], list(state.memory)
    for g, (trainer, rows) in enumerate(zip(spec.trainers, x.cohorts)):
      result, new_rows, stacked_uploads = cohort.reduce(trainer, trained[g], client_starts[g], memory_rows[g],
                                                        shares[g], rows.weights, rows.real, per_client_start=stacked,
                                                        mapping=self.mapping)
      if memory[g]:
        memory[g] = jax.tree.map(lambda m, new: m.at[rows.rows].set(new, mode="drop"), memory[g], new_rows)
      results.append(cohort.with_stacked(result, cohort.pad_stacked(stacked_uploads, rows.count), trainer.reductions))
    return results, tuple(memory), (None,) * len(spec.federations)

  def correct(self, spec: "RoundSpec", state: ServerState, x: RoundRows, data: RoundData) -> tuple[Any, Any]:
    """Nothing: a device program's rounds do not evaluate. Evaluation is a program of its own (`counts`), run after
    a call's evaluated rounds (`simulation.Simulation.run_call`), so the round's program compiles without it."""
    return None, ()

  def counts(self, spec: "RoundSpec", state: ServerState, data: RoundData) -> tuple[jax.Array, Any]:
    """Every group's correct test predictions in ``state`` and, with per-client evaluation, every client's on its
    held-out samples (`client_eval`): the body of the evaluation program."""
    variables = [spec.evaluated_group_variables(state, i) for i in range(len(spec.groups))]
    tests = jnp.stack([count_correct(g.model, variables[i], data.test_images, data.test_labels, spec.store.mean,
                                     spec.store.std, self.eval_batch) for i, g in enumerate(spec.groups)])
    return tests.astype(jnp.int32), client_eval.program_counts(spec, variables, data, self.eval_batch)
