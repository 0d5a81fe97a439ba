"""Many runs as one device program: a simulation's call of rounds (`simulation.program_call`) mapped over runs.

Each run has a `Simulation` of its own, built from its own settings: its seed's partition, sampling, attack and
initialization. Its call rows (`inputs.plan_call`) are the rows it would have alone, stacked over a leading runs
axis, and so are its server state and client memory. What differs between the runs inside the program is a value of
each run's (`RunValues`, the optax ``inject_hyperparams`` way): its seed, its partition's label counts, and the
settings swept between the runs, as arrays; each run's program is the first run's spec with its values
(`RoundSpec.with_values`, and ``specialize`` for the swept settings). Mapped over the runs:

- ``"vmap"`` (on an accelerator) runs them side by side; a run's results may then differ from the run alone in
  the last float bits (a batched convolution rounds otherwise than one run's) and these grow over the rounds;
- ``"map"`` (on a CPU, where a vmapped convolution is a slower grouped one) runs them one after another, each
  computing exactly what the run alone computes: a job of seeds equals its runs alone bit for bit.

Their evaluation is a program of its own, mapped over the runs alike, after a call's evaluated rounds.

Memory grows with the runs of one program: every program is compiled before any compute and, when XLA's estimate
of its memory does not fit the device, the runs go in chunks that do (or fail naming the estimate when one run
alone does not fit).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Collection, NamedTuple, Sequence

import jax
import numpy as np

from fedjax_hetero.compilation import compile_beside
from fedjax_hetero.rounds.body import RoundData
from fedjax_hetero.rounds.held_out import HeldOut
from fedjax_hetero.rounds.inputs import Call, CallInputs, Cohort, plan_call
from fedjax_hetero.rounds.rows import call_row
from fedjax_hetero.rounds.simulation import Simulation, piece_rows, program_call, run_pieces
from fedjax_hetero.rounds.spec import RoundSpec
from fedjax_hetero.rounds.stacking import stack, take_rows, unstack
from fedjax_hetero.rounds.state import ServerState

# What tracing raises where a traced value is used as a concrete one (an ``if``, a shape, ``float()``).
CONCRETE_VALUE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                         jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError)
# Of XLA's memory estimate, the share of the device's memory a program may take.
MEMORY_SHARE = 0.8
# A spec with one run's swept settings (given as traced values by their paths).
Specialize = Callable[[RoundSpec, dict[str, Any]], RoundSpec]


class NotBatchable(ValueError):
  """Runs that cannot share one program; the message names what differs and what may."""


class RunValues(NamedTuple):
  """What differs between the runs inside their program, one row per run."""

  seed: Any  # uint32: the seed of the rounds' randomness
  label_counts: Any  # int32 [clients, classes]: the partition's label counts (FedGen's server reads them)
  settings: dict[str, Any]  # float32, by setting path: the settings swept between the runs


def _stacked_held_out(specs: Sequence[RoundSpec]) -> tuple[tuple[HeldOut, ...], int | None]:
  """The runs' held-out samples of per-client evaluation (`client_eval`), shared (axis None) where every run holds
  the same, else stacked (axis 0), every group's padded to the run with the most (as samples of no client)."""
  held = [s.client_eval.held if s.client_eval is not None else () for s in specs]
  leaves = [[np.asarray(x) for x in jax.tree.leaves(h)] for h in held]
  if all(len(l) == len(leaves[0]) and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(l, leaves[0]))
         for l in leaves[1:]):
    return held[0], None
  stacked = []
  for g, group in enumerate(specs[0].groups):
    width = max(int(h[g].ids.shape[0]) for h in held)
    pad = lambda a, fill: np.pad(np.asarray(a), (0, width - a.shape[0]), constant_values=fill)
    stacked.append(HeldOut(jax.device_put(np.stack([pad(h[g].ids, 0) for h in held])),
                           jax.device_put(np.stack([pad(h[g].owners, len(group.clients)) for h in held]))))
  return tuple(stacked), 0


def check_batchable(sims: Sequence[Simulation]) -> None:
  """`NotBatchable` naming the runs whose program cannot be the first's: another method, architectures or state
  shapes, data normalization or clients, or not a device program."""
  first, problems = sims[0], []
  for index, sim in enumerate(sims):
    spec, why = sim.spec, None
    if not sim.cohorts.in_program:
      why = "it runs on the host loop (pass --round-program fused)"
    elif spec.method.name != first.spec.method.name:
      why = f"its method is {spec.method.name}, not {first.spec.method.name}"
    elif [g.name for g in spec.groups] != [g.name for g in first.spec.groups]:
      why = "its architecture groups differ"
    elif _shapes(spec.state_shapes) != _shapes(first.spec.state_shapes):
      why = "its server state or client memory has other shapes"
    elif (spec.store.mean, spec.store.std, spec.store.num_clients) != (first.spec.store.mean, first.spec.store.std,
                                                                      first.spec.store.num_clients):
      why = "its data's normalization or number of clients differs"
    elif (spec.client_eval is None) != (first.spec.client_eval is None):
      why = "it evaluates every client and the first run does not, or the other way (--client-eval-fraction)"
    elif sim.rounds_per_call != first.rounds_per_call:
      why = "its rounds per call differ"
    elif _pieces(spec) != _pieces(first.spec):
      why = "its method's client terms or server steps differ (a setting of zero turns a part off)"
    elif [spec.stack_size(g) for g in range(len(spec.groups))] != [first.spec.stack_size(g)
                                                                    for g in range(len(first.spec.groups))]:
      why = "its cohorts hold other numbers of clients"
    if why:
      problems.append(f"run {index}: {why}")
  if problems:
    raise NotBatchable("these runs cannot share one program: " + "; ".join(problems))


def _pieces(spec: RoundSpec) -> tuple:
  return tuple(t.name for t in spec.method.terms), tuple(s.name for s in spec.method.server)


def _shapes(tree: Any) -> Any:
  return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _device_memory() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_estimate(compiled: Any) -> int:
  """XLA's estimate of a compiled program's memory: arguments, outputs and temporaries (less what aliases)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def runs_mapping() -> str:
  """How a program maps its runs on this platform (see the module docstring)."""
  return "map" if jax.default_backend() == "cpu" else "vmap"


class ManyRuns:
  """R simulations (one per run, each a device program) advanced together, one program per call.

  ``settings``: per run, the values of the settings swept between the runs by path (the same paths for every
  run); ``specialize`` makes the first run's spec another run's from them (traced). ``memory_budget`` (bytes;
  default: the device's memory × `MEMORY_SHARE`) and ``max_runs_per_program`` bound the runs of one program;
  more go in chunks."""

  def __init__(self, sims: Sequence[Simulation], settings: Sequence[dict[str, float]] = (),
               specialize: Specialize | None = None, memory_budget: int | None = None,
               max_runs_per_program: int | None = None, mapping: str | None = None,
               log: Callable[[str], None] = print):
    self.sims, self.log = list(sims), log
    check_batchable(self.sims)
    self.settings = list(settings) or [{} for _ in self.sims]
    self.specialize = specialize
    if any(self.settings) and specialize is None:
      raise NotBatchable(f"runs of {self.sims[0].spec.method.name} that differ in {', '.join(self.settings[0])} need "
                         "a way to make one run's program from another's")
    self.memory_budget = memory_budget if memory_budget is not None else int(_device_memory() * MEMORY_SHARE)
    self.max_runs_per_program = max_runs_per_program or len(self.sims)
    self.mapping = mapping or runs_mapping()
    self.chunk_size: int | None = None  # runs per program, known after the first compile
    self.rounds_per_call = self.sims[0].rounds_per_call
    self._data, self._data_axes = self._stacked_data()
    if self._data_axes[0] is not None and self.sims[0].spec.method.evaluation_variables:
      raise NotBatchable(f"{self.sims[0].spec.method.name} evaluates with statistics of the training images, which "
                         "differ between these runs (a subset drawn per seed): run them one after another")
    self._programs: dict[tuple, Any] = {}
    self._evaluations: dict[int, Callable] = {}  # by runs per program
    self._compiling: dict[int, concurrent.futures.Future] = {}  # evaluations compiling, by runs per program

  def replace(self, run: int, sim: Simulation, settings: Sequence[dict[str, float]], specialize: Specialize) -> None:
    """Run ``run`` goes on with ``sim`` (after a rollback, with a lower learning rate), every run with ``settings``
    (which may now hold the learning rate) and ``specialize``."""
    self.sims[run], self.settings, self.specialize = sim, list(settings), specialize
    check_batchable(self.sims)
    self._programs, self._evaluations, self._compiling = {}, {}, {}

  # ----------------------------------------------------------------------------------------------- the data

  def _stacked_data(self) -> tuple[RoundData, RoundData]:
    """The runs' data, and per part whether it is per run (axis 0) or shared (None). The index tables are padded
    to the widest: a client's schedule draws its permutation from a prefix of the same random stream, so the
    padding changes nothing."""
    specs = [s.spec for s in self.sims]
    width = max(s.store.max_size for s in specs)
    tables = [np.pad(np.asarray(s.store.index_table), ((0, 0), (0, width - s.store.max_size))) for s in specs]
    parts = [[s.store.images for s in specs], [s.store.labels for s in specs], tables,
             [s.test_images for s in specs], [s.test_labels for s in specs]]
    data, axes = [], []
    for arrays in parts:
      same = all(a is arrays[0] or (a.shape == arrays[0].shape and np.array_equal(np.asarray(a),
                                                                                 np.asarray(arrays[0])))
                 for a in arrays[1:])
      data.append(jax.device_put(arrays[0]) if same else jax.device_put(np.stack([np.asarray(a) for a in arrays])))
      axes.append(None if same else 0)
    held, held_axis = _stacked_held_out(specs)
    return RoundData(*data, held, self.sims[0].cohorts.arguments()), RoundData(*axes, held_axis, None)

  def run_values(self, runs: Sequence[int]) -> RunValues:
    return RunValues(jax.device_put(np.asarray([self.sims[r].spec.seed for r in runs], np.uint32)),
                     jax.device_put(np.stack([self.sims[r].spec.store.label_counts for r in runs]).astype(np.int32)),
                     {path: jax.device_put(np.asarray([self.settings[r][path] for r in runs], np.float32))
                      for path in self.settings[0]})

  # ---------------------------------------------------------------------------------------------- the program

  def program(self, statics: tuple) -> Callable:
    """A call's program, unjitted: ``(values, server, memory, inputs, count, data) -> (carry, outputs)``, every
    argument with a leading runs axis (but ``count``, and the data shared by every run)."""
    template, cohorts = self.sims[0].spec, self.sims[0].cohorts

    def one_run(values: RunValues, server, memory, inputs: CallInputs, count, data: RoundData):
      spec = template.with_values(seed=values.seed, label_counts=values.label_counts)
      if values.settings:
        spec = self.specialize(spec, values.settings)
      return program_call(spec, cohorts, statics, self.rounds_per_call)(server, memory, inputs, count, data)

    if self.mapping == "vmap":
      # Rounds, evaluation rounds and step counts are every run's (steps: the most of any run; a client's steps
      # past its own are masked, so a run is unchanged): the device loops and a done group's skip stay loops and
      # branches, not selects computing every group's every step.
      cohort_axes = Cohort(*[None if name == "steps" else 0 for name in Cohort._fields])
      input_axes = CallInputs(None, None, None, (cohort_axes,) * len(template.groups), 0)
      return jax.vmap(one_run, in_axes=(0, 0, 0, input_axes, None, self._data_axes))

    def mapped(values, server, memory, inputs, count, data):
      own, merge = self._own_data(data)
      return jax.lax.map(lambda x: one_run(x[0], x[1], x[2], x[3], count, merge(x[4])),
                         (values, server, memory, inputs, own))

    return mapped

  def _own_data(self, data: RoundData) -> tuple[RoundData, Callable[[RoundData], RoundData]]:
    """The runs' own parts of ``data`` (None where shared), to map over, and how one run's slice of them is
    merged back with the shared parts."""
    own = RoundData(*[d if a is not None else None for d, a in zip(data, self._data_axes)])
    return own, lambda mine: RoundData(*[d if a is None else m for m, d, a in zip(mine, data, self._data_axes)])

  def _evaluation(self, runs: int) -> Callable:
    """The runs' evaluation program (`ProgramCohorts.counts` mapped over them as `program` maps the rounds):
    ``(values, round, server, data) -> (correct, client correct)``, each with a leading runs axis."""
    if runs not in self._evaluations:
      template, cohorts = self.sims[0].spec, self.sims[0].cohorts

      def one_run(values: RunValues, index, server, data: RoundData):
        spec = template.with_values(seed=values.seed, label_counts=values.label_counts)
        if values.settings:
          spec = self.specialize(spec, values.settings)
        return cohorts.counts(spec, ServerState(index, *server, (), ()), data)

      if self.mapping == "vmap":
        mapped = jax.vmap(one_run, in_axes=(0, None, 0, self._data_axes))
      else:
        def mapped(values, index, server, data):
          own, merge = self._own_data(data)
          return jax.lax.map(lambda x: one_run(x[0], index, x[1], merge(x[2])), (values, server, own))
      self._evaluations[runs] = jax.jit(mapped)
    return self._evaluations[runs]

  def _compile_evaluation(self, args: tuple) -> None:
    """The evaluation's program for the runs of ``args`` (`arguments`) compiled in a thread of its own, beside the
    rounds' program (as `Simulation._compile_evaluation`)."""
    values, server, _, _, _, data = args
    self._compiling[len(values.seed)] = compile_beside(self._evaluation(len(values.seed)), values, np.int32(0),
                                                       server, data)

  def _evaluate(self, values: RunValues, index, server, data: RoundData):
    """The runs' evaluation (`_evaluation`), once its program has compiled where `_compile_evaluation` started it."""
    if (compiling := self._compiling.get(len(values.seed))) is not None:
      compiling.result()
    return self._evaluation(len(values.seed))(values, index, server, data)

  def _compiled(self, statics: tuple, args: tuple):
    """The program for ``statics`` and the runs' count of ``args``, compiled (once per count)."""
    key = (statics, len(args[0].seed))
    if key not in self._programs:
      try:
        self._programs[key] = jax.jit(self.program(statics), donate_argnums=2).lower(*args).compile()
      except CONCRETE_VALUE_ERRORS as e:  # (a method read a swept setting as a Python number)
        raise NotBatchable(f"{self.sims[0].spec.method.name} reads one of {', '.join(self.settings[0])} as a Python "
                           f"number when it is made, so it cannot differ between runs of one program; run them "
                           f"one after another ({type(e).__name__})") from None
    return self._programs[key]

  def chunks(self, runs: Sequence[int], statics: tuple, args_of: Callable) -> list[list[int]]:
    """``runs`` in chunks whose program fits the memory budget (each size compiled, and checked, before any
    compute)."""
    size = min(self.chunk_size or self.max_runs_per_program, len(runs))
    while (statics, size) not in self._programs:
      estimate = memory_estimate(self._compiled(statics, args_of(runs[:size])))
      if estimate <= self.memory_budget:
        break
      del self._programs[(statics, size)]
      if size == 1:
        raise MemoryError(f"one run's program needs about {estimate / 2**20:.0f} MiB (XLA's estimate), more than "
                          f"the budget of {self.memory_budget / 2**20:.0f} MiB")
      fit = min(size - 1, max(1, int(size * self.memory_budget / estimate)))
      self.log(f"{size} runs in one program need about {estimate / 2**20:.0f} MiB (XLA's estimate), over the "
               f"budget of {self.memory_budget / 2**20:.0f} MiB: running chunks of {fit} runs")
      size = fit
    self.chunk_size = size
    return [list(runs[i:i + size]) for i in range(0, len(runs), size)]

  def call_length(self, runs: Sequence[int], first: int, stop: int) -> int:
    """The rounds of one call of ``runs`` from round ``first``, none from ``stop`` on: where every run alone would
    end its call (`Simulation.call_length`)."""
    return min(self.sims[r].call_length(first, stop) for r in runs)

  def plan(self, runs: Sequence[int], states: Sequence[ServerState], count: int, evaluate: Collection[int]
           ) -> tuple[list[Call], tuple]:
    """Every run's call of ``count`` rounds from its state, planned as the run alone plans it, and their static plan
    (one for all)."""
    one_call = self.call_length(runs, states[0].round, states[0].round + count)
    if count > one_call:
      raise ValueError(f"{count} rounds from round {states[0].round} are more than one call of the program: at "
                       f"most {one_call} (rounds per call {self.rounds_per_call}, or a server step's static plan "
                       "changes); see ManyRuns.call_length")
    calls: list[Call] = []
    for r, state in zip(runs, states):
      sim = self.sims[r]
      slots = [sim.cohorts.slots(sim.spec, g) for g in range(len(sim.spec.groups))]
      calls.append(plan_call(sim.spec, state, count, evaluate, slots, self.rounds_per_call))
    if any(c.statics != calls[0].statics for c in calls):
      raise NotBatchable("the runs' server steps plan differently in the same round")
    return calls, calls[0].statics

  def arguments(self, chunk: Sequence[int], runs: Sequence[int], calls: Sequence[Call],
                states: Sequence[ServerState], count: int) -> tuple:
    """The program's arguments for the runs ``chunk`` (of ``runs``, whose ``calls`` and ``states`` these are)."""
    at = [runs.index(r) for r in chunk]
    every = list(chunk) == list(range(len(self.sims)))
    data = RoundData(*[d if a is None or every else take_rows(d, np.asarray(chunk, np.int32))
                       for d, a in zip(self._data, self._data_axes)])
    return (self.run_values(chunk), stack([(states[i].models, states[i].steps) for i in at]),
            stack([states[i].memory for i in at]), self._inputs([calls[i] for i in at]), np.int32(count), data)

  def _inputs(self, calls: Sequence[Call], first: int = 0) -> CallInputs:
    """The program's rows of ``calls`` (one per run of a chunk) from their round ``first`` on."""
    inputs = stack([c.inputs_from(first) for c in calls])
    if self.mapping == "vmap":  # (see `program`: one round index and loop count for every run)
      inputs = inputs._replace(rounds=inputs.rounds[0], evaluate=inputs.evaluate[0], steps=inputs.steps.max(0),
                               cohorts=tuple(c._replace(steps=c.steps.max(0)) for c in inputs.cohorts))
    return inputs

  def run(self, runs: Sequence[int], states: Sequence[ServerState], count: int, evaluate: Collection[int],
          stop_requested: Callable[[], bool] | None = None) -> list[tuple[ServerState, list[dict] | Exception]]:
    """``count`` rounds of each run in ``runs`` (indices into the simulations) from its state in ``states`` (all at
    one round; their client memory is consumed), one call (`call_length`): per run its new state and rows, or the
    error its rows raised (`rows.NonFiniteLossError`); its state and no rows if ``stop_requested()`` turned true
    while the first chunk's program compiled."""
    calls, statics = self.plan(runs, states, count, evaluate)
    args_of = lambda chunk: self.arguments(chunk, runs, calls, states, count)
    # Started once per count of runs, before the memory budget chunks them: the first count it tries is a guess (a
    # chunk of another count compiles its evaluation at its first evaluated round).
    size = min(self.chunk_size or self.max_runs_per_program, len(runs))
    if size not in self._compiling and any(states[0].round < r <= states[0].round + count for r in evaluate):
      self._compile_evaluation(args_of(list(runs)[:size]))
    results = []
    for chunk in self.chunks(list(runs), statics, args_of):
      program = self._compiled(statics, args := args_of(chunk))
      if not results and stop_requested is not None and stop_requested():  # (a signal waited for the compile)
        return [(state, []) for state in states]
      values, server, memory, inputs, _, data = args
      own_calls = [calls[runs.index(r)] for r in chunk]

      def run_piece(carry, first, n):
        rows = inputs if first == 0 else self._inputs(own_calls, first)
        return program(values, carry[:2], carry[2], rows, np.int32(n), data)

      # (The runs' calls have the same rounds, evaluated alike: the first run's pieces are every run's.)
      carry, pieces, seconds = run_pieces(calls[0], evaluate, (*server, memory), time.perf_counter(), run_piece,
                                          lambda index, server: self._evaluate(values, index, server, data))
      for j, (models, steps, memory) in enumerate(unstack(carry, len(chunk))):
        i = runs.index(chunk[j])
        state, call = states[i], calls[i]
        new = ServerState(state.round + count, models, steps, state.sampler, memory)
        try:
          outputs = [row for piece in pieces for row in piece_rows(*piece, (j,))]
          rows = [call_row(self.sims[chunk[j]].spec, call, k, outputs[k], seconds[k], evaluate) for k in range(count)]
        except ArithmeticError as e:  # (NonFiniteLossError)
          rows = e
        results.append((new, rows))
    return results
