"""A round as the host loop: each architecture group's cohort trained by the backend, then each federation's
server program, with the round's metrics read back on the host.

This is the path of XLA:CPU, where the backends' jitted chunks of unrolled steps beat any device loop (see
docs/performance.md), of the sharded backend, and of methods whose sampler keeps host-side state (CluSamp). In
its first round every group's programs compile side by side, and so does every federation's server program and
every group's empty result (the stand-in for a group none of whose clients was sampled), so that no later round
compiles. On an accelerator `fedjax_hetero.round_program` runs the same rounds as one device program.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, Sequence

import jax
import numpy as np

from fedjax_hetero.backends import copy_tree, empty_group_result
from fedjax_hetero.compilation import mapping_headroom
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.round_rows import group_loss, host_metrics, merge, round_row
from fedjax_hetero.server.steps import Plan
from fedjax_hetero.state import ServerState, round_key, server_key

if TYPE_CHECKING:
  from fedjax_hetero.engine import Simulation


class HostLoop:
  """The host loop of one `Simulation` (its ``host_loop``)."""

  def __init__(self, sim: "Simulation"):
    self.sim = sim
    self._compiled = False  # see run_round and _compile_every_federation
    self._empty_results: dict[int, Any] = {}

  def run_round(self, state: ServerState, consume: bool) -> tuple[ServerState, dict[str, Any]]:
    """One round (see `Simulation.run_round`)."""
    sim = self.sim
    t0 = time.perf_counter()
    r, seed = state.round, sim.config.seed
    key = round_key(seed, r)
    chosen, cohorts, weights = sim.cohorts_of_round(state.sampler, r)
    starts = [sim.start_variables(state, gi) for gi in range(len(sim.groups))]
    shares = [sim.group_share(state, gi) for gi in range(len(sim.groups))]

    def train(gi: int):
      cohort, group_weights = cohorts[gi], weights[gi]
      if len(cohort) == 0:
        if self._compiled:
          return None
        # This object's first round: the group trains one client, result dropped, so that its programs
        # compile now rather than in the first round that samples it.
        cohort, group_weights = sim.groups[gi].clients[:1], np.ones(1)
      group_memory = state.memory[gi]
      if group_memory and not (consume and len(cohorts[gi])):  # (a compile-only result is dropped: keep it)
        group_memory = copy_tree(group_memory)
      return sim.backend.train(sim.trainers[gi], starts[gi], sim.store, cohort, group_weights, key,
                                memory=group_memory, rows=sim.row_of_client[cohort], server=shares[gi],
                                per_client_start=sim.method.sharing.stacked, capacity=sim.stack_size(gi))

    # In the first round the groups compile side by side (XLA compiles on one core), except in a multi-process
    # run: there every process must launch the programs, whose collectives pair up across processes, in one order.
    if not self._compiled:
      mapping_headroom()
    if self._compiled or jax.process_count() > 1:
      trained = [train(gi) for gi in range(len(sim.groups))]
    else:
      with concurrent.futures.ThreadPoolExecutor(len(sim.groups)) as pool:
        trained = list(pool.map(train, range(len(sim.groups))))
    if not self._compiled:
      self._compile_every_federation(state, starts, shares, cohorts)
    memory, results = list(state.memory), []
    losses: dict[str, float] = {}
    examples = 0.0
    for gi, (group, result) in enumerate(zip(sim.groups, trained)):
      if len(cohorts[gi]) == 0:
        results.append(None)
        continue
      memory[gi] = result.memory
      losses[group.name] = group_loss(r, group.name, result.loss_sum, result.num_examples)
      examples += float(result.num_examples)
      results.append(result._replace(memory=()))
    models, steps = list(state.models), list(state.steps)
    metrics: dict[str, Any] = {}
    for f in sim.federations:
      if any(results[g] is not None for g in f.members):
        models[f.index], steps[f.index], federation_metrics = self.aggregate(f.index, state, starts, shares,
                                                                            results, cohorts)
        merge(metrics, federation_metrics)
    sampler_state, sampler = state.sampler, sim.method.sampler
    if sampler.observe:
      read = sim.method.term_index(sampler.reads)
      for gi, result in enumerate(results):
        if result is not None:
          sampler_state = sampler.observe(sampler_state, cohorts[gi], result.uploads[read], sim.sampling)
    jax.block_until_ready((models, steps, sampler_state))
    metrics = round_row(r, losses, chosen.draws, examples, time.perf_counter() - t0, metrics)
    return ServerState(r + 1, tuple(models), tuple(steps), sampler_state, tuple(memory)), metrics

  def _compile_every_federation(self, state: ServerState, starts: Sequence[Variables], shares: Sequence[Any],
                                cohorts: Sequence[np.ndarray]) -> None:
    """In this object's first round, runs (and drops) the server program of every federation the round
    leaves out, and keeps every group's empty result (the stand-in for a group with no client in a
    round), so that no later round compiles."""
    sim = self.sim
    for gi in range(len(sim.groups)):
      self.empty_result(gi, starts[gi], shares[gi], state)
    no_results = [None] * len(sim.groups)
    for f in sim.federations:
      if not any(len(cohorts[g]) for g in f.members):
        jax.block_until_ready(self.aggregate(f.index, state, starts, shares, no_results, cohorts)[:2])
    self._compiled = True

  def aggregate(self, federation: int, state: ServerState, starts: Sequence[Variables], shares: Sequence[Any],
                results: Sequence[Any], cohorts: Sequence[np.ndarray]) -> tuple[Variables, tuple[Any, ...], dict]:
    """The server pipeline of one federation on the round's group results (None: nobody of that group
    was sampled; per group as in `run_round`): its new model, step states and host metrics."""
    sim = self.sim
    f, r = sim.federations[federation], state.round
    plans = [s.plan(r) if s.plan else Plan() for s in sim.method.server]
    filled = tuple(results[g] or self.empty_result(g, starts[g], shares[g], state) for g in f.members)
    sizes = [sim.stack_size(g) for g in f.members]
    valid = tuple(np.arange(n) < len(cohorts[g]) for g, n in zip(f.members, sizes))
    ids = tuple(np.concatenate([cohorts[g], np.full(n - len(cohorts[g]), sim.store.num_clients)])
                for g, n in zip(f.members, sizes))
    model, steps, metrics = sim.server_programs[federation](
        state.models[federation], state.steps[federation], tuple(starts[g] for g in f.members), filled, valid, ids, r,
        server_key(sim.config.seed, r, sim.store.num_clients, federation), tuple(p.inputs for p in plans),
        statics=tuple(p.static for p in plans))
    metrics = host_metrics(metrics)
    for p in plans:
      metrics.update(p.log)
    return model, steps, metrics

  def empty_result(self, group: int, start: Variables, share: dict[str, Any], state: ServerState):
    """Zeros shaped as the group's result, made once (made again, they would compile in a later round)."""
    sim = self.sim
    if group not in self._empty_results:
      # Shapes only: the round that calls this may have consumed the state's memory.
      row = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.memory[group])
             if state.memory and state.memory[group] else ())
      # Placed as the backend places real results, so the server program sees one input placement every round.
      self._empty_results[group] = sim.backend.place(empty_group_result(sim.trainers[group], start, row, share,
                                                                         sim.stack_size(group)))
    return self._empty_results[group]

