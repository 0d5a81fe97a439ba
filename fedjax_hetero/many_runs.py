"""Many runs in one program: R runs of one method and architectures advanced together on the round program.

Each run is a `Simulation` of its own, built from its own settings: its seed's partition, sampling, attack and
initialization, so every host-side input of a call (`round_program.CallInputs`) is that run's, computed as it
would be alone and stacked over a leading runs axis. The device side is one program: the round program's call
``vmap``-ped over the runs, with each run's server state, client memory and its data rows (index tables
padded to the widest: a client's schedule draws its permutation from a prefix of the same random stream, so
the padding changes nothing).

What differs between the runs inside the program is traced, per run:
  * the seed of the rounds' randomness (`state.round_key`, `state.server_key`);
  * the swept settings (`SWEEPABLE`): the local optimizer's learning rate, momentum and weight decay, and
    every numeric option of a catalog method (μ, λ, β, ...). The program is traced with a copy of the first
    run's `Simulation` whose local config and method are rebuilt from configs holding the traced values, so a
    method reads its μ as it always does. A setting whose use needs a concrete value (a Python ``if`` on it,
    a shape) stops the trace: it is refused, named, with the sweepable settings listed.

Anything else that differs (shapes, architectures, the method, the rounds, the sampler's state) is refused
(`check_batchable`). Memory grows linearly in R: the program is compiled before any compute and, when XLA's
estimate of its memory does not fit the device, the runs go in chunks that do (or fail naming the estimate
when one run alone does not fit).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client.attack import AttackedTrainer
from fedjax_hetero.engine import Simulation
from fedjax_hetero.round_program import CallInputs, GroupRounds
from fedjax_hetero.state import ServerState
from fedjax_hetero.sweeps import (CLIENT_SWEEPABLE, HOST_ONLY, NotBatchable, SweptValue, catalog_method, differing,
                                  get, substituted, sweepable)

# What tracing raises where a traced value is used as a concrete one (an ``if``, a shape, ``float()``).
CONCRETE_VALUE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                         jax.errors.TracerArrayConversionError)
# Of XLA's memory estimate, the share of the device's memory a program may take.
MEMORY_SHARE = 0.8


def check_batchable(sims: Sequence[Simulation], method_configs: Sequence[Any] | None) -> tuple[str, ...]:
  """The settings traced per run (the swept ones: client and method paths), or `NotBatchable`."""
  first = sims[0]
  allowed = (sweepable(method_configs[0]) if method_configs
             else tuple(f"client.{n}" for n in CLIENT_SWEEPABLE) + HOST_ONLY)
  problems = []
  for index, sim in enumerate(sims):
    why = None
    if not sim.round_program or not first.round_program:
      why = "it runs on the host loop (pass --round-program fused)"
    elif sim.method.name != first.method.name:
      why = f"its method is {sim.method.name}, not {first.method.name}"
    elif [g.name for g in sim.groups] != [g.name for g in first.groups]:
      why = "its architecture groups differ"
    elif _shapes(sim.state_shapes) != _shapes(first.state_shapes):
      why = "its server state or client memory has other shapes"
    elif (sim.store.mean, sim.store.std, sim.store.num_clients) != (first.store.mean, first.store.std,
                                                                    first.store.num_clients):
      why = "its data's normalization or number of clients differs"
    elif sim.round_program.rounds_per_call != first.round_program.rounds_per_call:
      why = "its rounds per call differ"
    if why:
      problems.append(f"run {index}: {why}")
  if problems:
    raise NotBatchable("these runs cannot share one program: " + "; ".join(problems))
  changed = differing([s.local for s in sims], "client.") + differing([s.config for s in sims], "federation.")
  if method_configs:
    changed += differing(method_configs, "method.")
  refused = [d for d in changed if d not in allowed]
  if refused:
    raise NotBatchable(f"{', '.join(refused)} cannot differ between runs of one program (it changes shapes, the "
                       f"method or what runs); sweepable settings: {', '.join(allowed)}")
  swept = tuple(d for d in changed if d not in HOST_ONLY)
  for path in swept:
    section, rest = path.split(".", 1)
    trees = [s.local for s in sims] if section == "client" else method_configs
    if len({bool(get(t, rest)) for t in trees}) > 1:
      raise NotBatchable(f"{path}: zero and non-zero values build different programs (a zero turns its part off); "
                         "sweep the zero in a job of its own")
  return swept


def _shapes(tree: Any) -> Any:
  return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@functools.partial(jax.jit, static_argnums=1)
def _unstack(tree: Any, count: int) -> list[Any]:
  """Every run's part of ``tree`` (one program, not one slice per leaf and run)."""
  return [jax.tree.map(lambda x: x[r], tree) for r in range(count)]


def _row_of(tree: Any, r: int) -> Any:
  return jax.tree.map(lambda x: x[r], tree)


def _device_memory() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _with_settings(trainer: Any, local: Any, method: Any) -> Any:
  """``trainer`` (a `LocalTrainer`, or a wrapper of one such as the attack's) with a run's settings and terms."""
  if isinstance(trainer, AttackedTrainer):
    return dataclasses.replace(trainer, trainer=_with_settings(trainer.trainer, local, method))
  return dataclasses.replace(trainer, config=local, terms=method.terms, combine=method.combine)


def memory_estimate(compiled: Any) -> int:
  """XLA's estimate of a compiled program's memory: arguments, outputs and temporaries (less what aliases)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


class ManyRuns:
  """R `Simulation`s (one per run, each with its round program) advanced together, one program per call.

  ``method_configs``: each run's `MethodConfig` when the method is the catalog's: the method is then rebuilt
  in the program with the run's traced settings (needed to sweep a method's options, or a learning rate a
  method reads). ``rebuild``: ``(method config, local config) -> Method`` (default: `methods.build_method`).
  ``memory_budget`` (bytes; default: the device's memory × `MEMORY_SHARE`) and ``max_runs_per_program`` bound
  the runs of one program; more go in chunks."""

  def __init__(self, sims: Sequence[Simulation], method_configs: Sequence[Any] | None = None,
               rebuild: Callable[[Any, Any], Any] | None = None, memory_budget: int | None = None,
               max_runs_per_program: int | None = None, log: Callable[[str], None] = print):
    self.sims, self.log = list(sims), log
    self.method_configs = list(method_configs) if method_configs else None
    self.swept = check_batchable(self.sims, method_configs)
    self.rebuild = (rebuild or functools.partial(catalog_method, self.sims[0].method.name)) if method_configs else None
    self.memory_budget = memory_budget if memory_budget is not None else int(_device_memory() * MEMORY_SHARE)
    self.max_runs_per_program = max_runs_per_program or len(self.sims)
    self.chunk_size: int | None = None  # runs per program, known after the first compile
    template = self.sims[0].round_program
    self.schedule_length = max(s.round_program.schedule_length for s in self.sims)
    self.rounds_per_call = template.rounds_per_call
    self._data = self._stacked_data()
    if self._data[1][0] is not None and self.sims[0].method.evaluation_variables:
      raise NotBatchable(f"{self.sims[0].method.name} evaluates with statistics of the training images, which differ "
                         "between these runs (a subset drawn per seed): run them one after another")
    if self._data[1][:2] == (None, None):  # one copy of the training data on the device, not one per run
      first = self.sims[0].store
      for sim in self.sims[1:]:
        sim.store = dataclasses.replace(sim.store, images=first.images, labels=first.labels)
    self._programs: dict[tuple, Any] = {}

  def replace(self, run: int, sim: Simulation, method_config: Any = None) -> None:
    """Run ``run`` goes on with ``sim`` (rebuilt by a rollback with a lower learning rate, now traced)."""
    self.sims[run] = sim
    if self.method_configs:
      self.method_configs[run] = method_config
    swept = check_batchable(self.sims, self.method_configs)
    if swept != self.swept:
      self.swept, self._programs = swept, {}

  # ------------------------------------------------------------------------------------------- host side

  def _stacked_data(self) -> tuple[tuple, tuple]:
    """The runs' data, and per part whether it is per run (axis 0) or shared (None); index tables padded."""
    stores = [s.store for s in self.sims]
    width = max(s.max_size for s in stores)
    tables = [np.pad(np.asarray(s.index_table), ((0, 0), (0, width - s.max_size))) for s in stores]
    parts = [[s.images for s in stores], [s.labels for s in stores], tables,
             [s.test_images for s in self.sims], [s.test_labels for s in self.sims]]
    data, axes = [], []
    for arrays in parts:
      same = all(a is arrays[0] or (a.shape == arrays[0].shape and np.array_equal(np.asarray(a),
                                                                                 np.asarray(arrays[0])))
                 for a in arrays[1:])
      data.append(jnp.asarray(arrays[0]) if same else jnp.stack([jnp.asarray(a) for a in arrays]))
      axes.append(None if same else 0)
    return tuple(data), tuple(axes)

  def run_values(self, runs: Sequence[int]) -> tuple[jax.Array, dict[str, jax.Array], jax.Array]:
    """The traced values of ``runs``: their seeds, their swept settings by path and their partitions' label
    counts (which a server step may read: FedGen's)."""
    seeds = jnp.asarray([self.sims[r].config.seed for r in runs], jnp.uint32)
    label_counts = jnp.asarray(np.stack([self.sims[r].store.label_counts for r in runs]), jnp.int32)
    configs = {"client": [self.sims[r].local for r in runs],
               "method": [self.method_configs[r] for r in runs] if self.method_configs else None}
    values = {}
    for path in self.swept:
      section, rest = path.split(".", 1)
      values[path] = jnp.asarray([float(get(c, rest)) for c in configs[section]], jnp.float32)
    return seeds, values, label_counts

  # ------------------------------------------------------------------------------------------- the program

  def _view(self, seed: jax.Array, values: dict[str, jax.Array], label_counts: jax.Array):
    """The first run's round program seen with one run's traced seed, settings and label counts."""
    template = self.sims[0]
    values = {p: SweptValue(p, v, bool(get(template.local if p.startswith("client.") else self.method_configs[0],
                                            p.split(".", 1)[1]))) for p, v in values.items()}
    local = substituted(template.local, {p.split(".", 1)[1]: v for p, v in values.items()
                                          if p.startswith("client.")})
    sim = copy.copy(template)
    if self.rebuild is not None and values:
      method_config = substituted(self.method_configs[0], {p.split(".", 1)[1]: v for p, v in values.items()
                                                            if p.startswith("method.")})
      method = self.rebuild(method_config, local)
      # What the build step appended to the catalog's method (the dissimilarity metric) stays as it is.
      sim.method = dataclasses.replace(template.method, terms=method.terms + template.method.terms[len(method.terms):],
                                       server=method.server + template.method.server[len(method.server):],
                                       combine=method.combine)
    sim.local = local
    sim.trainers = [_with_settings(t, local, sim.method) for t in template.trainers]
    store = template.store.with_label_counts(label_counts)
    sim.federations = [f._replace(terms=sim.method.terms, store=store)  # (steps read uploads by term)
                       for f in template.federations]
    program = copy.copy(template.round_program)
    program.sim, program.seed, program.schedule_length = sim, seed, self.schedule_length
    return program

  def _one_run_round(self, statics, carry, x, data, run):
    return self._view(*run)._round(statics, carry, x, data)

  def _build(self, statics: tuple, data_axes: tuple):
    one_round = jax.jit(functools.partial(self._one_run_round, statics))

    def call(server, memory, inputs, count, data, run):
      carry = (*server, memory)
      shapes = jax.eval_shape(one_round, carry, jax.tree.map(lambda a: a[0], inputs), data, run)[1]
      buffers = jax.tree.map(lambda s: jnp.zeros((self.rounds_per_call,) + s.shape, s.dtype), shapes)

      def body(i, loop):
        carry, buffers = loop
        carry, out = one_round(carry, jax.tree.map(lambda a: a[i], inputs), data, run)
        return carry, jax.tree.map(lambda b, o: b.at[i].set(o), buffers, out)

      return jax.lax.fori_loop(0, count, body, (carry, buffers))

    # Rounds, evaluation rounds and step counts are every run's (steps: the most of any run; a client's steps
    # past its own count are masked, so a run is unchanged): the device loops and a done group's skip stay
    # loops and branches, not selects computing every group's every step.
    group_axes = GroupRounds(*[None if name == "steps" else 0 for name in GroupRounds._fields])
    input_axes = CallInputs(None, None, None, tuple(group_axes for _ in self.sims[0].groups), 0)
    batched = jax.vmap(call, in_axes=(0, 0, input_axes, None, data_axes, 0))
    return jax.jit(batched, donate_argnums=1)

  def _compiled(self, statics: tuple, args: tuple):
    """The program for ``statics`` and the runs' count of ``args``, compiled (once per count)."""
    key = (statics, len(args[-1][0]))
    if key not in self._programs:
      try:
        self._programs[key] = self._build(statics, self._data[1]).lower(*args).compile()
      except CONCRETE_VALUE_ERRORS as e:  # (a traced setting reached past `SweptValue`)
        raise NotBatchable(self._concrete_message(e)) from None
    return self._programs[key]

  def _concrete_message(self, error: Exception) -> str:
    allowed = sweepable(self.method_configs[0]) if self.method_configs else CLIENT_SWEEPABLE + HOST_ONLY
    return (f"{self.sims[0].method.name} needs a concrete value of a swept setting ({', '.join(self.swept)}) to "
            f"build its program (it changes the program's structure), so it cannot be swept in one program; "
            f"sweepable settings: {', '.join(allowed)}; run them one after another instead. ({type(error).__name__})")

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

  def call_length(self, runs: Sequence[int], first: int, count: int) -> int:
    """The rounds of one call of ``runs`` from round ``first``, at most ``count``: as the round program cuts a
    run alone, at most ``rounds_per_call`` rounds and none past a change of a server step's static plan (a
    stage of FedCross)."""
    return min(self.sims[r].round_program.call_lengths(first, count)[0] for r in runs)

  def run(self, runs: Sequence[int], states: Sequence[ServerState], count: int, evaluate: Collection[int]
          ) -> list[tuple[ServerState, list[dict] | Exception]]:
    """``count`` rounds of each run in ``runs`` (indices into the simulations) from its state in ``states``
    (all at one round; their client memory is consumed), one call (`call_length`): per run its new state and
    rows, or the error its rows raised (`round_rows.NonFiniteLossError`)."""
    one_call = self.call_length(runs, states[0].round, count)
    if count > one_call:
      raise ValueError(f"{count} rounds from round {states[0].round} are more than one call of the program: at "
                       f"most {one_call} (rounds per call {self.rounds_per_call}, or a server step's static plan "
                       "changes); see ManyRuns.call_length")
    prepared = [self.sims[r].round_program.call_inputs(s, count, evaluate) for r, s in zip(runs, states)]
    statics = prepared[0][3]
    if any(p[3] != statics for p in prepared):
      raise NotBatchable("the runs' server steps plan differently in the same round")

    def args_of(chunk: Sequence[int]) -> tuple:
      at = [runs.index(r) for r in chunk]
      inputs = [prepared[i][0] for i in at]
      groups = tuple(g._replace(steps=np.max([x.groups[i].steps for x in inputs], axis=0))
                     for i, g in enumerate(jax.tree.map(lambda *xs: np.stack(xs), *[x.groups for x in inputs])))
      batched = CallInputs(inputs[0].rounds, np.max([x.steps for x in inputs], axis=0), inputs[0].evaluate, groups,
                           jax.tree.map(lambda *xs: np.stack(xs), *[x.plans for x in inputs]))
      server = _stack([(states[i].models, states[i].steps) for i in at])
      memory = _stack([states[i].memory for i in at])
      data = tuple(d if a is None else d[jnp.asarray(chunk)] for d, a in zip(*self._data))
      return server, memory, batched, np.int32(count), data, self.run_values(chunk)

    results = []
    for chunk in self.chunks(list(runs), statics, args_of):
      t0 = time.perf_counter()
      carry, outputs = self._compiled(statics, args := args_of(chunk))(*args)
      outputs = jax.device_get(outputs)
      seconds = (time.perf_counter() - t0) / count
      per_run = _unstack(carry, len(chunk))
      for j, r in enumerate(chunk):
        i = runs.index(r)
        program, state, (_, drawn, plans, _) = self.sims[r].round_program, states[i], prepared[i]
        models, steps, memory = per_run[j]
        new = ServerState(state.round + count, models, steps, state.sampler, memory)
        mine = _row_of(outputs, j)
        try:
          rows = [program._row(state.round + k, mine, k, drawn[k], plans[k], seconds, evaluate)
                  for k in range(count)]
        except ArithmeticError as e:  # (NonFiniteLossError)
          rows = e
        results.append((new, rows))
    return results
