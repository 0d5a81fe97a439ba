"""A simulation: a frozen `RoundSpec`, how its cohorts are mapped (`rounds.mapping`), and its calls of rounds.

`Simulation.run_rounds` cuts rounds into calls (`inputs.call_length`), plans each call on the host
(`inputs.plan_call`) and runs it: on the host loop one round at a time, the round's body run eagerly; in a device
program (`ProgramCohorts`) up to ``rounds_per_call`` rounds as one jitted function of the server state, the body
traced once, the rounds a device loop, the metrics read once per call; a call runs in pieces cut after its
evaluated rounds, each followed by the evaluation's own program (`Simulation.evaluation`). Either way every
round's metrics row is written by `rows.call_row`. Every call of a program runs the program compiled for
``rounds_per_call`` rounds, whatever its length, so nothing compiles after the first; a call also ends where a
server step's static plan changes. `make_simulation` is the one place that chooses the mapping (see
docs/performance.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import compile_beside, in_background, mapping_headroom
from fedjax_hetero.config.run import AUTO_ROUNDS_PER_CALL, ROUND_PROGRAMS
from fedjax_hetero.garbage import deferred_full_collections
from fedjax_hetero.methods.api import Method
from fedjax_hetero.models.evaluation import ACCELERATOR_EVAL_BATCH, EVAL_BATCH
from fedjax_hetero.rounds.backends import Backend, copy_tree
from fedjax_hetero.rounds import client_eval
from fedjax_hetero.rounds.body import RoundData, RoundOutputs, correct_counts, evaluated, run_round
from fedjax_hetero.rounds.inputs import Call, CallInputs, RoundRows, call_length, plan_call
from fedjax_hetero.rounds.mapping import HostCohorts, ProgramCohorts
from fedjax_hetero.rounds.rows import accuracies, call_row
from fedjax_hetero.rounds.spec import RoundSpec
from fedjax_hetero.rounds.state import ServerState
from fedjax_hetero.rounds.union import UnionCohorts, union_reason
from fedjax_hetero.validation import check_integer


def host_loop_reason(method: Method, backend: str) -> str | None:
  """Why a run of ``method`` on ``backend`` (its name) cannot run as a device program (None: it can)."""
  sampler = method.sampler
  if sampler.observe is not None:
    return (f"{method.name}'s sampler ({sampler.name}) updates host-side state from every round's uploads, "
            "so a round's draw is not known before the round before it ends")
  if jax.process_count() > 1 or backend == "sharded":
    return "the sharded backend splits cohorts over devices (and processes): it runs the host loop"
  return None


def runs_in_program(round_program: str, method: Method, backend: str) -> bool:
  """Whether rounds run as a device program (``round_program`` "fused" or "union"; "auto": on an accelerator,
  where the method and backend allow it) or as the host loop (see docs/performance.md); ValueError if a program
  is asked and cannot be."""
  if round_program not in ROUND_PROGRAMS:
    raise ValueError(f"--round-program must be one of {', '.join(ROUND_PROGRAMS)}, got {round_program!r}")
  why_not = host_loop_reason(method, backend)
  if round_program in ("fused", "union") and why_not:
    raise ValueError(f"{method.name} cannot run as one program per round: {why_not}; use --round-program host "
                     "(or auto)")
  return round_program in ("fused", "union") or (round_program == "auto" and not why_not and
                                                 jax.default_backend() != "cpu")


def make_simulation(spec: RoundSpec, backend: Backend, round_program: str = "auto",
                    rounds_per_call: int | None = None) -> "Simulation":
  """``spec``'s simulation on ``backend``'s host loop, or as a device program of ``rounds_per_call`` (default
  `AUTO_ROUNDS_PER_CALL`) rounds (`runs_in_program`): the one place that chooses."""
  if not all(hasattr(backend, attribute) for attribute in ("name", "train", "place")):  # (a Protocol)
    raise ValueError(f"backend must be a Backend (make_backend(name)), got {type(backend).__name__} {backend!r:.60}")
  check_integer("--rounds-per-call", rounds_per_call, minimum=1, optional=True)
  mapping_headroom()  # (before anything of it compiles)
  if not runs_in_program(round_program, spec.method, backend.name):
    return Simulation(spec, HostCohorts(backend))
  eval_batch = EVAL_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_EVAL_BATCH
  per_call = rounds_per_call or AUTO_ROUNDS_PER_CALL
  if round_program == "union" or (round_program == "auto" and backend.name != "sequential"):
    why_not = union_reason(spec)
    if why_not is None:
      return Simulation(spec, UnionCohorts(spec, eval_batch), per_call)
    if round_program == "union":
      raise ValueError(f"{spec.method.name} on {', '.join(g.name for g in spec.groups)} cannot train as one union "
                       f"model: {why_not}; use --round-program fused (or auto)")
  mapping = "map" if backend.name == "sequential" else "vmap"
  return Simulation(spec, ProgramCohorts(mapping, eval_batch), per_call)


def program_call(spec: RoundSpec, cohorts: ProgramCohorts, statics: tuple, rounds_per_call: int) -> Callable:
  """The device program of a call, unjitted: ``(server, memory, inputs, count, data) -> (carry, outputs [K, ...])``
  with ``server`` the models and server step states, ``carry`` those and the memory after ``count`` rounds."""

  def one_round(carry, x: CallInputs, data: RoundData):
    models, steps, memory = carry
    rows = RoundRows(x.rounds, x.steps, x.evaluate, x.cohorts, x.plans, statics)
    after, outputs = run_round(spec, cohorts, ServerState(x.rounds, models, steps, (), memory), rows, data)
    return (after.models, after.steps, after.memory), outputs

  one_round = jax.jit(one_round)  # traced once: eval_shape below, then the loop

  def call(server, memory, inputs: CallInputs, count, data: RoundData):
    carry = (*server, memory)
    shapes = jax.eval_shape(one_round, carry, jax.tree.map(lambda a: a[0], inputs), data)[1]
    buffers = jax.tree.map(lambda s: jnp.zeros((rounds_per_call,) + s.shape, s.dtype), shapes)

    def body(i, loop):  # (lax's indexing: ``i`` is in range, and jnp's would add a bounds check per leaf)
      carry, buffers = loop
      x = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False, allow_negative_indices=False),
                       inputs)
      carry, out = one_round(carry, x, data)
      return carry, jax.tree.map(
          lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o, i, 0, allow_negative_indices=False), buffers, out)

    return jax.lax.fori_loop(0, count, body, (carry, buffers))

  return call


def run_pieces(call: Call, evaluate: Collection[int], carry: tuple, t0: float, run: Callable, evaluation: Callable
               ) -> tuple[tuple, list[tuple[int, Any, Any]], list[float]]:
  """A device program's call in pieces cut after its evaluated rounds (`Call.pieces`), from ``carry`` (models,
  steps, memory) and the time ``t0`` its first piece's time counts from: ``run(carry, first, count) -> (carry,
  outputs)`` runs a piece, ``evaluation(round, server) -> counts`` evaluates the models and steps after an
  evaluated one (untimed, as the host loop's evaluation). The carry after the call, per piece its rounds, its
  outputs and its counts (None where not evaluated), on the host, and every round's seconds."""
  pieces, seconds = [], []
  for a, b in call.pieces(evaluate):
    carry, outputs = run(carry, a, b - a)
    outputs = jax.device_get(outputs)
    seconds += [(time.perf_counter() - t0) / (b - a)] * (b - a)
    index = call.first + b
    pieces.append((b - a, outputs, jax.device_get(evaluation(np.int32(index), carry[:2])) if index in evaluate
                   else None))
    t0 = time.perf_counter()
  return carry, pieces, seconds


def _done_unless(job: concurrent.futures.Future, stop_requested: Callable[[], bool] | None) -> bool:
  """Waits for ``job`` (raising its error); False as soon as ``stop_requested()`` is true while it runs."""
  while stop_requested is not None and not job.done():
    if stop_requested():
      return False
    concurrent.futures.wait([job], timeout=0.05)
  job.result()
  return True


def piece_rows(count: int, outputs: Any, counts: Any, at: tuple[int, ...] = ()) -> list[RoundOutputs]:
  """A piece's ``count`` rounds' outputs (of `run_pieces`; ``at``: the leading indices before the rounds axis, a
  run's), its last round's with the evaluation's ``counts`` where it was evaluated."""
  rows = [jax.tree.map(lambda x: x[(*at, k)], outputs) for k in range(count)]
  if counts is not None:
    correct, clients = jax.tree.map(lambda x: x[at], counts)
    rows[-1] = rows[-1]._replace(correct=correct, client_correct=clients)
  return rows


@dataclasses.dataclass(frozen=True, eq=False)
class Simulation:
  """``spec``'s rounds with its cohorts mapped by ``cohorts``, in calls of at most ``rounds_per_call`` rounds
  (see the module docstring); build it with `make_simulation`."""

  spec: RoundSpec
  cohorts: HostCohorts | ProgramCohorts
  rounds_per_call: int = 1
  _programs: dict = dataclasses.field(default_factory=dict, repr=False)
  _compiling: dict = dataclasses.field(default_factory=dict, repr=False)  # futures of programs compiled in threads
  _compiled: set = dataclasses.field(default_factory=set, repr=False)  # the call programs `_compile_traced` compiled

  def with_values(self, **values: Any) -> "Simulation":
    """This simulation with other values of its spec (`RoundSpec.with_values`): a lower learning rate after a
    rollback. Nothing is rebuilt but what reads them: the trainers, the method's pieces, the programs."""
    cohorts = HostCohorts(self.cohorts.backend) if isinstance(self.cohorts, HostCohorts) else self.cohorts
    return Simulation(self.spec.with_values(**values), cohorts, self.rounds_per_call)

  def init_state(self) -> ServerState:
    return self.place(self.spec.init_state())

  def place(self, state: ServerState) -> ServerState:
    """``state`` where the mapping keeps server state (e.g. after a restore), so every round sees one placement."""
    return self.cohorts.place(state)

  def _local(self, tree: Any) -> Any:
    """This process's own copy of server state (`backends.Backend.local`; a device program's is the state)."""
    return self.cohorts.backend.local(tree) if isinstance(self.cohorts, HostCohorts) else tree

  def evaluate(self, state: ServerState, batch_size: int = EVAL_BATCH) -> dict[str, float]:
    """Test accuracy of every group's model, and their mean under ``"mean"``. It runs on this process's own copy
    of the model, with no collective: in a multi-process run every process gets the same numbers."""
    return accuracies(correct_counts(self.spec, state, self._local, batch_size), [g.name for g in self.spec.groups],
                      len(self.spec.test_labels))

  def client_accuracy(self, state: ServerState) -> dict[str, Any]:
    """``{"client_accuracy": ...}``, every client's accuracy on its held-out samples with its group's model in
    ``state`` (`client_eval.accuracy_row`), as an evaluation round's row holds it; {} without per-client evaluation."""
    if self.spec.client_eval is None:
      return {}
    counts = client_eval.host_counts(self.spec, evaluated(self.spec, state, self._local), RoundData.of(self.spec),
                                     EVAL_BATCH)
    return {"client_accuracy": client_eval.accuracy_row(self.spec, jax.device_get(counts))}

  def call_length(self, first: int, stop: int) -> int:
    """The rounds of this simulation's call from round ``first`` (0-based) that stops before round ``stop``: at most
    ``rounds_per_call``, and none past a change of a server step's static plan (`inputs.call_length`)."""
    return call_length(self.spec, first, stop, self.rounds_per_call)

  def run_rounds(self, state: ServerState, count: int, *, evaluate: Collection[int] = (),
                 consume: bool = False) -> tuple[ServerState, list[dict[str, Any]]]:
    """``count`` rounds from ``state``: the new state and one metrics row per round, whose ``test_accuracy``
    holds every group's test accuracy after the rounds in ``evaluate`` (1-based round numbers), else None.

    A non-finite loss raises `rows.NonFiniteLossError` for the first such round of its call, whose rounds are
    then all dropped. With ``consume`` the rounds update ``state``'s per-client memory in place (its buffers are
    donated), so ``state`` must not be used again; without it the memory is copied first, a cost that grows with
    the number of clients (SCAFFOLD's control variates, MOON's previous models), not with the rounds' work."""
    check_integer("count", count, minimum=0)
    if not consume and jax.tree.leaves(state.memory):
      state = state._replace(memory=copy_tree(state.memory))
    rows: list[dict[str, Any]] = []
    stop = state.round + count
    while state.round < stop:
      state, call_rows = self.run_call(state, self.call_length(state.round, stop), evaluate)
      rows += call_rows
    return state, rows

  @deferred_full_collections()  # (its first call traces)
  def run_call(self, state: ServerState, count: int, evaluate: Collection[int],
               while_compiling: Callable[[], Any] | None = None,
               stop_requested: Callable[[], bool] | None = None) -> tuple[ServerState, list[dict]]:
    """One call of ``count`` rounds (at most ``rounds_per_call``, with one static plan) from ``state``, whose client
    memory it consumes: the new state and the rounds' rows. ``while_compiling``: work for another thread, started
    once the call's program is traced (at once on the host loop), so that its Python does not slow the tracing.
    If ``stop_requested()`` turns true while the call's program compiles, the call returns ``state`` and no rows:
    at once while the first call's compiles on its thread (`compile_first_call_beside`, which goes on for a later
    call), else once it is compiled."""
    t0 = time.perf_counter()
    spec, in_program = self.spec, self.cohorts.in_program
    call = self._plan(state, count, evaluate)
    capacity = getattr(self.cohorts, "capacity", None)
    if capacity is not None and (most := int(np.sum([c.count for c in call.inputs.cohorts], axis=0).max())) > capacity:
      raise ValueError(f"a round of {spec.method.name} has {most} participants; the union mapping holds "
                       f"--clients-per-round ({capacity}): use --round-program fused")
    if in_program:
      first_call = self._compiling.get("first call")
      if first_call is not None and not _done_unless(first_call, stop_requested):
        return state, []
      self._compiling.pop("first call", None)  # (its program is then compiled, or it failed: `result` raised)
      data, program = RoundData.of(spec, self.cohorts.arguments()), self.program(call.statics)
      pieces, beside = call.pieces(evaluate), [while_compiling] if while_compiling else []
      if any(call.first + end in evaluate for _, end in pieces):
        beside.append(lambda: self._compile_evaluation(state, data))
      self._compile_traced((state.models, state.steps), state.memory, call.inputs, np.int32(pieces[0][1]), data,
                           program=program, beside=beside)  # (as `run_pieces` calls it first: from round 0)
      if stop_requested is not None and stop_requested():  # (a signal waits for a compile on this thread)
        return state, []

      def evaluation(index, server):
        self._compiling["evaluation"].result()  # (compiled)
        return self.evaluation(index, server, data)

      carry, pieces, seconds = run_pieces(
          call, evaluate, (state.models, state.steps, state.memory), t0,
          lambda carry, first, n: program(carry[:2], carry[2], call.inputs_from(first), np.int32(n), data), evaluation)
      per_round = [row for piece in pieces for row in piece_rows(*piece)]
      state = ServerState(state.round + count, *carry[:2], state.sampler, carry[2])
    else:
      if while_compiling:
        while_compiling()
      state, per_round, seconds = self._host_call(state, call, t0)
    return state, [call_row(spec, call, i, per_round[i], seconds[i], evaluate) for i in range(count)]

  def _plan(self, state: ServerState, count: int, evaluate: Collection[int]) -> Call:
    """The call of ``count`` rounds from ``state`` (`inputs.plan_call`), its rows padded to the mapping's slots and,
    in a device program, to ``rounds_per_call`` rounds (the program's shapes)."""
    slots = [self.cohorts.slots(self.spec, g) for g in range(len(self.spec.groups))]
    length = self.rounds_per_call if self.cohorts.in_program else None
    return plan_call(self.spec, state, count, evaluate, slots, length)

  def _host_call(self, state: ServerState, call: Call, t0: float) -> tuple[ServerState, list[RoundOutputs], list]:
    per_round, seconds, data = [], [], RoundData.of(self.spec)
    for i in range(call.count):
      state, outputs = run_round(self.spec, self.cohorts, state, call.round(i), data)
      jax.block_until_ready((state.models, state.steps, state.sampler))
      seconds.append(time.perf_counter() - t0)
      # The round's time is taken before its evaluation (the host loop counts after it).
      counted = outputs.correct() if callable(outputs.correct) else outputs.correct
      clients = outputs.client_correct() if callable(outputs.client_correct) else outputs.client_correct
      per_round.append(jax.device_get(outputs._replace(correct=counted, client_correct=clients)))
      t0 = time.perf_counter()
    return state, per_round, seconds

  def compile_first_call_beside(self, while_compiling: Callable[[], Any] | None = None) -> None:
    """A fresh run's first call's program traced, lowered and compiled on a thread of its own, from the server
    state's shapes (`RoundSpec.state_shapes`), beside the rest of the caller's setup (the initialization's compile,
    the results folder): the first `run_call` from round 0 finds it compiled. ``while_compiling`` starts there once
    the program is lowered, as `run_call`'s does. The host loop's programs compile in its first round as before."""
    if not self.cohorts.in_program or "first call" in self._compiling:
      return

    def compile_program() -> None:
      state = self.spec.state_shapes._replace(round=0, sampler=self.spec.initial_sampler_state())
      call = self._plan(state, 1, ())
      self._compile_traced((state.models, state.steps), state.memory, call.inputs, np.int32(1),
                           RoundData.of(self.spec, self.cohorts.arguments()), program=self.program(call.statics),
                           beside=[while_compiling] if while_compiling else [])

    self._compiling["first call"] = in_background(compile_program)

  def _compile_traced(self, *args, program: Any, beside: Sequence[Callable[[], Any]]) -> None:
    """``program``'s first call for ``args`` traced and lowered here, then compiled while the work ``beside`` starts
    (threads whose Python, started before, would slow the tracing: one GIL); jit's cache keeps the program."""
    if program in self._compiled:
      lowered = None
    else:
      lowered = program.trace(*args).lower()
      self._compiled.add(program)
    for job in beside:
      job()
    if lowered is not None:
      lowered.compile()

  def _compile_evaluation(self, state: ServerState, data: RoundData) -> concurrent.futures.Future:
    """The evaluation's program compiled in a thread of its own, started once: XLA compiles a module on one core,
    so on a call's first evaluation it compiles beside the round's program (a first call's time is the longer of
    the two); a later call of the jitted `evaluation` finds it compiled."""
    if "evaluation" not in self._compiling:
      self._compiling["evaluation"] = compile_beside(self.evaluation, np.int32(state.round),
                                                     (state.models, state.steps), data)
    return self._compiling["evaluation"]

  @functools.cached_property
  def evaluation(self) -> Callable:
    """The jitted evaluation of a device program's state: ``(round, (models, steps), data) -> (correct, client
    correct)`` (`ProgramCohorts.counts`), a program of its own."""
    def evaluation(index, server, data):
      return self.cohorts.counts(self.spec, ServerState(index, *server, (), ()), data)

    return jax.jit(evaluation)

  def program(self, statics: tuple) -> Callable:
    """The jitted program of a call for one static plan (`program_call`). The client memory is donated (updated in
    place, as the host loop's backends do); the models are not, so a checkpoint still being written from them
    stays valid."""
    if statics not in self._programs:
      self._programs[statics] = jax.jit(program_call(self.spec, self.cohorts, statics, self.rounds_per_call),
                                        donate_argnums=1)
    return self._programs[statics]
