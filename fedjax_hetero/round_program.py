"""Several rounds of a simulation as one device program: the round program.

The engine's host loop (`Simulation.run_round`) launches, per round and group, a start, chunks of steps, a
reduction and a server program, and reads losses and example counts back between them: on an accelerator a
round is then bound by launches and host round trips, not arithmetic. Here the rounds of a call are one jitted
function of the server state, written as DrJAX writes a round:

  for each round of the call (a device loop):
    broadcast  every group's start variables and server share, from its federation's state;
    map        every group's cohort trains (`client.cohort`, clients vmapped or lax.mapped), all groups
               stepping side by side in one device loop over the round's local steps (a group whose
               clients are done skips the rest, so a round costs the sum of the groups' longest
               clients' steps, not the groups times the longest);
    reduce     every federation's server steps (`server.steps.run_server_steps`) on its groups' sums;
    evaluate   in evaluation rounds, every group's test accuracy.

What the host knows ahead is computed before the call (`CallInputs`): who takes part (the method's sampler,
which must keep no state), every server step's plan, and how many local steps each round's longest client
takes. The draws are the host loop's, so are the results, to float tolerance. Metrics come back as arrays and
are read once per call. A call ends where a server step's static plan changes (FedCross's stage): the host
splits the rounds there. Every call runs the program compiled for ``rounds_per_call`` rounds, whatever its
length, so nothing compiles after the first.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Collection, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client import cohort
from fedjax_hetero.evaluation import EVAL_BATCH, count_correct
from fedjax_hetero.round_rows import accuracies, group_loss, host_metrics, merge, round_row
from fedjax_hetero.server.steps import Plan, run_server_steps
from fedjax_hetero.state import ServerState, round_key, server_key

if TYPE_CHECKING:
  from fedjax_hetero.engine import Simulation


class GroupRounds(NamedTuple):
  """One architecture group's cohort in each round of a call, padded to the group's capacity ``C``."""

  clients: np.ndarray  # int32 [K, C]: client ids (padding: 0, with no sample, so every step of it is masked)
  sizes: np.ndarray  # int32 [K, C]: samples per client (padding: 0)
  weights: np.ndarray  # float32 [K, C]: aggregation weights (padding: 0)
  real: np.ndarray  # float32 [K, C]: 1 for a sampled client
  rows: np.ndarray  # int32 [K, C]: rows in the group's client memory (padding: past the last, dropped)
  slots: np.ndarray  # int32 [K, C]: stacked sharing: the model slot each client starts from (padding: 0)
  server_ids: np.ndarray  # int32 [K, C]: the ids the server steps see (padding: the number of clients)
  count: np.ndarray  # int32 [K]: sampled clients
  steps: np.ndarray  # int32 [K]: local steps of the group's longest client
  inputs: Any  # the cohort's per-client trainer inputs [K, C] (`LocalTrainer.client_inputs`; often none)


class CallInputs(NamedTuple):
  """What the host computes ahead for the K rounds of a call (rounds past the call's length repeat its last)."""

  rounds: np.ndarray  # int32 [K]: 0-based round index
  steps: np.ndarray  # int32 [K]: local steps of the round's longest client (of every group)
  evaluate: np.ndarray  # bool [K]: evaluate after the round
  groups: tuple[GroupRounds, ...]
  plans: tuple[Any, ...]  # every server step's plan inputs, stacked over the rounds


class RoundOutputs(NamedTuple):
  loss_sum: jax.Array  # float32 [G]
  num_examples: jax.Array  # float32 [G]
  server_metrics: tuple[Any, ...]  # per federation
  correct: jax.Array  # int32 [G]: correct test predictions after the round (0 outside evaluation rounds)


def unsupported(sim: "Simulation") -> str | None:
  """Why ``sim`` cannot run on the round program (None: it can)."""
  sampler = sim.method.sampler
  if sampler.observe is not None:
    return (f"{sim.method.name}'s sampler ({sampler.name}) updates host-side state from every round's uploads, "
            "so a round's draw is not known before the round before it ends")
  if jax.process_count() > 1 or getattr(sim.backend, "mesh", None) is not None:
    return "the sharded backend splits cohorts over devices (and processes): it runs the host loop"
  return None


def _stacked_rows(tree: Any, count: jax.Array) -> Any:
  """Stacked uploads as the host loop gives them: rows past the cohort copy its first, or are zero without one."""
  def pad(x):
    real = (jnp.arange(x.shape[0]) < count).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(real, x, jnp.where(count > 0, x[:1], jnp.zeros_like(x[:1])))
  return jax.tree.map(pad, tree)


def _select(keep_new: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(keep_new, a, b), new, old)


class RoundProgram:
  """The round program of one `Simulation` (see the module docstring); ``mapping`` maps a cohort's clients
  (`client.cohort.MAPPINGS`), ``eval_batch`` is the test batch of the in-program evaluation."""

  def __init__(self, sim: "Simulation", rounds_per_call: int, mapping: str = "vmap", eval_batch: int = EVAL_BATCH):
    self.sim, self.rounds_per_call, self.mapping, self.eval_batch = sim, rounds_per_call, mapping, eval_batch
    self.seed = sim.config.seed  # the rounds' randomness (`many_runs` traces it, one per run)
    self.schedule_length = max(1, sim.local.num_steps(sim.store.max_size))
    self._programs: dict[tuple, Any] = {}

  # ---------------------------------------------------------------------------------------------- host side

  def _plans(self, round_index: int) -> list[Plan]:
    return [s.plan(round_index) if s.plan else Plan() for s in self.sim.method.server]

  def call_lengths(self, first: int, count: int) -> list[int]:
    """Rounds ``first .. first + count - 1`` as calls of at most ``rounds_per_call`` rounds, cut where a server
    step's static plan changes."""
    lengths, start = [], first
    while start < first + count:
      statics = tuple(p.static for p in self._plans(start))
      end = start + 1
      while (end < first + count and end - start < self.rounds_per_call
             and tuple(p.static for p in self._plans(end)) == statics):
        end += 1
      lengths.append(end - start)
      start = end
    return lengths

  def _group_rounds(self, group: int, cohorts: list[np.ndarray], weights: list[np.ndarray]) -> GroupRounds:
    sim = self.sim
    capacity, num_rows = sim.stack_size(group), len(sim.groups[group].clients)
    fields = {name: [] for name in GroupRounds._fields}
    for clients, w in zip(cohorts, weights):
      pad = capacity - len(clients)
      fields["clients"].append(np.concatenate([clients, np.zeros(pad, np.int64)]))
      fields["sizes"].append(np.concatenate([sim.store.sizes[clients], np.zeros(pad, np.int64)]))
      fields["weights"].append(np.concatenate([w, np.zeros(pad)]))
      fields["real"].append(np.arange(capacity) < len(clients))
      fields["rows"].append(np.concatenate([sim.row_of_client[clients], np.full(pad, num_rows)]))
      fields["slots"].append(np.concatenate([np.arange(len(clients)), np.zeros(pad, np.int64)]))
      fields["server_ids"].append(np.concatenate([clients, np.full(pad, sim.store.num_clients)]))
      fields["count"].append(len(clients))
      fields["steps"].append(max([sim.local.num_steps(int(n)) for n in sim.store.sizes[clients]] or [0]))
      fields["inputs"].append(cohort.padded_inputs(sim.trainers[group].client_inputs(clients), capacity))
    stack = lambda name, dtype: np.stack(fields[name]).astype(dtype)
    inputs = jax.tree.map(lambda *rows: np.stack(rows), *fields["inputs"])
    return GroupRounds(stack("clients", np.int32), stack("sizes", np.int32), stack("weights", np.float32),
                       stack("real", np.float32), stack("rows", np.int32), stack("slots", np.int32),
                       stack("server_ids", np.int32), np.asarray(fields["count"], np.int32),
                       np.asarray(fields["steps"], np.int32), inputs)

  def call_inputs(self, state: ServerState, count: int, evaluate: Collection[int]):
    """The inputs of a call of ``count`` rounds from ``state`` (rounds in ``evaluate``, 1-based, are evaluated),
    with what the host keeps: each round's draws, plans and the call's static plan."""
    sim, rounds = self.sim, [state.round + i for i in range(count)]
    padded = rounds + [rounds[-1]] * (self.rounds_per_call - count)
    drawn = [sim.cohorts_of_round(state.sampler, r) for r in padded]
    plans = [self._plans(r) for r in padded]
    groups = tuple(self._group_rounds(g, [d[1][g] for d in drawn], [d[2][g] for d in drawn])
                   for g in range(len(sim.groups)))
    steps = np.max([g.steps for g in groups], axis=0)
    plan_inputs = tuple(jax.tree.map(lambda *xs: np.stack(xs), *(p[s].inputs for p in plans))
                        for s in range(len(sim.method.server)))
    inputs = CallInputs(np.asarray(padded, np.int32), np.asarray(steps, np.int32),
                        np.asarray([r + 1 in evaluate for r in padded]) & (np.arange(len(padded)) < count),
                        groups, plan_inputs)
    return inputs, drawn[:count], plans[:count], tuple(p.static for p in plans[0])

  # ------------------------------------------------------------------------------------------- the program

  def _round(self, statics, carry, x: CallInputs, data) -> tuple[Any, RoundOutputs]:
    """One round (``x`` holds its slice of the call's inputs): broadcast, map, reduce, evaluate."""
    sim = self.sim
    models, step_states, memory = (list(part) for part in carry)
    images, labels, index_table, test_images, test_labels = data
    before = ServerState(x.rounds, tuple(models), tuple(step_states))
    starts = [sim.start_variables(before, g) for g in range(len(sim.groups))]
    shares = [sim.group_share(before, g) for g in range(len(sim.groups))]
    results, memory = self._train(x, starts, shares, memory, images, labels, index_table)
    server_metrics = []
    for f in sim.federations:
      trains = functools.reduce(jnp.logical_or, [x.groups[g].count > 0 for g in f.members])
      model, new_states, metrics = run_server_steps(
          sim.method.server, f, models[f.index], step_states[f.index], tuple(starts[g] for g in f.members),
          tuple(results[g] for g in f.members), tuple(x.groups[g].real > 0 for g in f.members),
          tuple(x.groups[g].server_ids for g in f.members), x.rounds,
          server_key(self.seed, x.rounds, sim.store.num_clients, f.index), x.plans, statics)
      models[f.index] = _select(trains, model, models[f.index])
      step_states[f.index] = _select(trains, new_states, step_states[f.index])
      server_metrics.append(metrics)
    after = ServerState(x.rounds + 1, tuple(models), tuple(step_states))
    correct = jax.lax.cond(x.evaluate, lambda: self._correct(after, test_images, test_labels),
                           lambda: jnp.zeros(len(sim.groups), jnp.int32))
    outputs = RoundOutputs(jnp.stack([res.loss_sum for res in results]),
                           jnp.stack([res.num_examples for res in results]), tuple(server_metrics), correct)
    return (tuple(models), tuple(step_states), tuple(memory)), outputs

  def _train(self, x: CallInputs, starts, shares, memory, images, labels, index_table):
    """Every group's cohort trained (all groups in one device loop over the round's steps): the groups'
    results, and their client memory with the cohort's rows written."""
    sim, stacked = self.sim, self.sim.method.sharing.stacked
    key = round_key(self.seed, x.rounds)
    begun, client_starts, memory_rows = [], [], []
    for g, (trainer, gx) in enumerate(zip(sim.trainers, x.groups)):
      client_starts.append(jax.tree.map(lambda m: m[gx.slots], starts[g]) if stacked else starts[g])
      memory_rows.append(jax.tree.map(lambda m: jnp.take(m, gx.rows, axis=0, mode="clip"), memory[g]))
      begun.append(cohort.start(trainer, self.schedule_length, client_starts[g], index_table[gx.clients], gx.sizes,
                                key, gx.clients, memory_rows[g], shares[g], gx.inputs, per_client_start=stacked,
                                mapping=self.mapping))

    def step(i, states):
      # A group whose clients are all done skips the step (it would be masked: the state stays as it is).
      return tuple(jax.lax.cond(i < gx.steps, lambda s, t=t, b=b: cohort.steps(t, s, images, labels, b[1], b[2], i, 1,
                                                                               self.mapping), lambda s: s, s)
                   for t, s, b, gx in zip(sim.trainers, states, begun, x.groups))

    trained = jax.lax.fori_loop(0, x.steps, step, tuple(b[0] for b in begun))
    results, memory = [], list(memory)
    for g, (trainer, gx) in enumerate(zip(sim.trainers, x.groups)):
      result, new_rows, stacked_uploads = cohort.reduce(trainer, trained[g], client_starts[g], memory_rows[g],
                                                        shares[g], gx.weights, gx.real, per_client_start=stacked,
                                                        mapping=self.mapping)
      if memory[g]:
        memory[g] = jax.tree.map(lambda m, new: m.at[gx.rows].set(new, mode="drop"), memory[g], new_rows)
      results.append(cohort.with_stacked(result, _stacked_rows(stacked_uploads, gx.count), trainer.reductions))
    return results, memory

  def _correct(self, state: ServerState, test_images: jax.Array, test_labels: jax.Array) -> jax.Array:
    sim = self.sim
    return jnp.stack([count_correct(g.model, sim.evaluated_variables(sim.group_variables(state, i), i), test_images,
                                    test_labels, sim.store.mean, sim.store.std, self.eval_batch)
                      for i, g in enumerate(sim.groups)]).astype(jnp.int32)

  def program(self, statics: tuple):
    """The jitted call for one static plan: ``(server, memory, inputs, count, data) -> (carry, outputs [K, ...])``
    with ``server`` the models and server step states, ``carry`` those and the memory after the call. The client
    memory is donated (updated in place, as the host loop's backends do); the models are not, so a checkpoint
    still being written from them stays valid."""
    if statics not in self._programs:
      self._programs[statics] = self._build(statics)
    return self._programs[statics]

  def _build(self, statics: tuple):
    one_round = jax.jit(functools.partial(self._round, statics))  # traced once: eval_shape below, then the loop

    def call(server, memory, inputs: CallInputs, count, data):
      carry = (*server, memory)
      first = jax.tree.map(lambda a: a[0], inputs)
      shapes = jax.eval_shape(one_round, carry, first, data)[1]
      buffers = jax.tree.map(lambda s: jnp.zeros((self.rounds_per_call,) + s.shape, s.dtype), shapes)

      def body(i, loop):
        carry, buffers = loop
        carry, out = one_round(carry, jax.tree.map(lambda a: a[i], inputs), data)
        return carry, jax.tree.map(lambda b, o: b.at[i].set(o), buffers, out)

      return jax.lax.fori_loop(0, count, body, (carry, buffers))

    return jax.jit(call, donate_argnums=1)

  def run(self, state: ServerState, count: int, evaluate: Collection[int]) -> tuple[ServerState, list[dict]]:
    """``count`` rounds from ``state`` in one call (its client memory is donated); the new state and the rows."""
    sim = self.sim
    t0 = time.perf_counter()
    inputs, drawn, plans, statics = self.call_inputs(state, count, evaluate)
    data = (sim.store.images, sim.store.labels, sim.store.index_table, sim.test_images, sim.test_labels)
    carry, outputs = self.program(statics)((state.models, state.steps), state.memory, inputs, np.int32(count), data)
    outputs = jax.device_get(outputs)
    seconds = (time.perf_counter() - t0) / count
    rows = [self._row(state.round + i, outputs, i, drawn[i], plans[i], seconds, evaluate) for i in range(count)]
    return ServerState(state.round + count, *carry[:2], state.sampler, carry[2]), rows

  def _row(self, r: int, outputs: RoundOutputs, i: int, drawn, plans: list[Plan], seconds: float,
           evaluate: Collection[int]) -> dict[str, Any]:
    sim = self.sim
    chosen, cohorts, _ = drawn
    trained = [g for g in range(len(sim.groups)) if len(cohorts[g])]
    losses = {sim.groups[g].name: group_loss(r, sim.groups[g].name, outputs.loss_sum[i, g],
                                             outputs.num_examples[i, g]) for g in trained}
    server: dict[str, Any] = {}
    for f in sim.federations:
      if any(len(cohorts[g]) for g in f.members):
        merge(server, {**host_metrics(jax.tree.map(lambda a: a[i], outputs.server_metrics[f.index])),
                       **{k: v for p in plans for k, v in p.log.items()}})
    examples = sum(float(outputs.num_examples[i, g]) for g in trained)
    row = round_row(r, losses, chosen.draws, examples, seconds, server)
    row["test_accuracy"] = (accuracies(outputs.correct[i], [g.name for g in sim.groups], len(sim.test_labels))
                            if r + 1 in evaluate else None)
    return row
