"""How the clients of one architecture group are mapped onto hardware.

This is the ``for_each_client`` seam of FedJAX: the engine hands a backend the
group's start variables and the round's cohort, and gets back the weighted sum
of the clients' deltas (plus loss totals), all still on the device. Backends:

- ``sequential``: one client after another, each a host loop over jitted
  chunks of unrolled steps; only the chunks a client needs are run. Fastest
  on XLA:CPU, where vmapped convolutions become slow grouped convolutions.
- ``vmap``: the cohort as a leading axis of one program; the cohort is padded
  with empty clients (all steps masked) to the largest cohort the group can
  have, so every round runs the programs the first one compiled.
- ``sharded``: the ``vmap`` program with that axis split over a
  ``jax.sharding.Mesh`` of all devices, of every process in a multi-process run
  (`fedjax_hetero.distributed`); the cohort is padded to a multiple of the device count.
  Each process feeds only its own devices' clients, the cohort's sums are a collective
  inside the jitted reduction, and server state is replicated on every device.
- ``auto``: ``sharded`` in a multi-process run or on several accelerators,
  ``sequential`` on CPU, ``vmap`` on one accelerator.

All backends produce the same sums up to float tolerance, because every
client's randomness (its schedule, and the key `LocalTrainer.init_state` gets)
is ``fold_in(round_key, client_id)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_hetero import distributed
from fedjax_hetero.client.local import ClientOutput, LocalState, LocalTrainer
from fedjax_hetero.compilation import ChunkPrograms, compile_side_by_side, light_jit, program_cache
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.rounds import cohort
from fedjax_hetero.rounds.cohort import (GroupResult, by_reduction, empty_group_result, join_uploads, pad_stacked,
                                         split_uploads, with_stacked)
from fedjax_hetero.rounds.inputs import Cohort

BACKENDS = ("auto", "sequential", "vmap", "sharded")
Memory = tuple[Any, ...]  # per-client state of one group, per term, every leaf with a leading axis over its clients


class Backend(Protocol):
  name: str

  def slots(self, stack_size: int) -> int:
    """The rows a cohort of at most ``stack_size`` clients is padded to (`rounds.inputs.Cohort`)."""
    ...

  def train(self, trainer: LocalTrainer, start: Variables, store: FederatedStore, rows: Cohort,
            round_key: jax.Array, *, memory: Memory = (), server: tuple[Any, ...] = (),
            per_client_start: bool = False, stack_size: int) -> GroupResult:
    """Trains the cohort of ``rows`` (one round's, padded to `slots`) from ``start`` (stacked per client when
    ``per_client_start``).

    ``memory`` holds the group's per-client state (``rows.rows`` are the cohort's rows in it). It is consumed:
    the cohort's rows are written in place (its buffers are donated), and the result carries the updated
    memory; a caller that still needs the old values passes `copy_tree` of them.
    ``server`` is the group's share of server state, one entry per client term. Stacked uploads come back with
    ``stack_size`` rows (the largest cohort the group can have), the ones past the cohort copies of the first,
    so every round has one shape. A trainer's per-client inputs (``rows.inputs``) go to its ``begin``.
    """
    ...

  def place(self, tree: Variables) -> Variables:
    """Puts server state where this backend keeps it (so every round sees one placement)."""
    ...

  def local(self, tree: Variables) -> Variables:
    """This process's own copy of server values it placed, for host-side work such as evaluation: on a
    mesh that spans processes a jitted program would run on every device of every process."""
    ...


def _schedule_length(trainer: LocalTrainer, store: FederatedStore) -> int:
  return max(1, trainer.config.num_steps(store.max_size))


def _run_schedule(run_steps: ChunkPrograms, trainer: LocalTrainer, num_steps: int, state, store: FederatedStore,
                  ids, mask):
  """Runs the first ``num_steps`` scheduled steps as a host loop over unrolled chunks."""
  offset = 0
  for count in trainer.config.chunk_sizes(num_steps):
    state = run_steps(state, store.images, store.labels, ids, mask, offset, count)
    offset += count
  return state


def _start_jit(trainer: LocalTrainer):
  """`light_jit` for a program starting clients when the start only draws and copies (no term computes an
  initial value, no ``begin`` changes it), else `jax.jit`."""
  return light_jit if trainer.begin is None and all(t.init is None for t in trainer.terms) else jax.jit


def _take(tree, index):
  return jax.tree.map(lambda x: x[index], tree)


def _summed(output: ClientOutput, reductions: tuple[str | None, ...], weight) -> tuple[Variables, tuple[Any, ...]]:
  """The client's weighted delta and its summed uploads ("weighted" ones scaled by its weight)."""
  scale = lambda tree: jax.tree.map(lambda x: weight * x, tree)
  uploads = join_uploads({"weighted": scale(split_uploads(output.uploads, reductions, "weighted")),
                          "sum": output.uploads}, reductions)
  return scale(output.delta), uploads


@program_cache
def _sequential_program(trainer: LocalTrainer, schedule_length: int):

  @_start_jit(trainer)
  def start_client(start, index_table, client, num_examples, round_key, memory_row, server, inputs):
    key = jax.random.fold_in(round_key, client)
    ids, mask = trainer.schedule(index_table[client], num_examples, key, schedule_length)
    state = trainer.init_state(start, memory_row, server, key)
    if trainer.begin is not None:
      state, ids = trainer.begin(state, ids, index_table[client], num_examples, key, inputs)
    return state, ids, mask

  run_steps = ChunkPrograms(jax.jit(trainer.run_steps, donate_argnums=0, static_argnums=6),
                            trainer.config.chunk_lengths(schedule_length))

  @functools.partial(jax.jit, donate_argnums=0)
  def accumulate(result: GroupResult, state: LocalState, start, memory_row, server, weight):
    output = trainer.finish(state, start, memory_row, server)
    delta, uploads = _summed(output, trainer.reductions, weight)
    return (result._replace(delta_sum=jax.tree.map(jnp.add, result.delta_sum, delta),
                            weight_sum=result.weight_sum + weight, loss_sum=result.loss_sum + state.loss_sum,
                            num_examples=result.num_examples + state.num_examples,
                            uploads=jax.tree.map(jnp.add, result.uploads, uploads)),
            output.memory, split_uploads(output.uploads, trainer.reductions, "stack"))

  return start_client, run_steps, accumulate


@light_jit
def _take_row(tree, index):
  return _take(tree, index)


@functools.partial(light_jit, donate_argnums=0)
def _set_row(tree, index, row):
  return jax.tree.map(lambda x, r: x.at[index].set(r), tree, row)


@light_jit
def copy_tree(tree):
  """Fresh buffers holding ``tree``'s values: what a caller keeps when it hands ``tree`` to `Backend.train`,
  which updates per-client memory in place."""
  return jax.tree.map(jnp.copy, tree)


# One compiled program instead of a trace and a dispatch per leaf every round; its outputs are fresh
# buffers each call, as the sequential backend's `accumulate` donates them.
_zero_result = light_jit(empty_group_result, static_argnums=(0, 4))
_pad_stacked = light_jit(pad_stacked)


class SequentialBackend:
  name = "sequential"

  def place(self, tree):
    return tree

  def local(self, tree):
    return tree

  def slots(self, stack_size):
    return stack_size

  def train(self, trainer, start, store, rows, round_key, *, memory=(), server=(), per_client_start=False,
            stack_size):
    count = int(rows.count)
    clients, weights, memory_rows = rows.clients[:count], rows.weights[:count], rows.rows[:count]
    input_row = lambda i: jax.tree.map(lambda x: x[i], rows.inputs)
    start_client, run_steps, accumulate = _sequential_program(trainer, _schedule_length(trainer, store))
    first_start = _take_row(start, 0) if per_client_start else start
    first_row = _take_row(memory, int(memory_rows[0])) if memory else ()
    result = _zero_result(trainer, first_start, first_row, server, stack_size)
    summed, stacked = by_reduction(result.uploads, trainer.reductions)
    result = result._replace(uploads=summed)
    client_args = lambda client: (store.index_table, np.int32(client), np.int32(store.sizes[client]), round_key)
    if not run_steps.compiled_for(store.images, store.labels):  # the first round: compile side by side
      first_args = (first_start, *client_args(clients[0]), first_row, server, input_row(0))
      state, ids, mask = jax.eval_shape(start_client, *first_args)
      compile_side_by_side([lambda: start_client.lower(*first_args).compile(),
                            lambda: accumulate.lower(result, state, first_start, first_row, server,
                                                     np.float32(0)).compile(),
                            *run_steps.compile_jobs(state, store.images, store.labels, ids, mask)])
    for i, (client, weight) in enumerate(zip(clients, weights)):
      size = int(store.sizes[client])
      client_start = _take_row(start, i) if per_client_start else start
      row = _take_row(memory, int(memory_rows[i])) if memory else ()
      state, ids, mask = start_client(client_start, *client_args(client), row, server, input_row(i))
      state = _run_schedule(run_steps, trainer, trainer.config.num_steps(size), state, store, ids, mask)
      result, new_row, own = accumulate(result, state, client_start, row, server, np.float32(weight))
      if "stack" in trainer.reductions:
        stacked = _set_row(stacked, i, own)
      if memory:
        memory = _set_row(memory, int(memory_rows[i]), new_row)
    if "stack" in trainer.reductions:
      stacked = _pad_stacked(stacked, count)
    return with_stacked(result, stacked, trainer.reductions)._replace(memory=memory)


@program_cache
def _mapped_program(trainer: LocalTrainer, schedule_length: int, per_client_start: bool, mesh: Mesh | None):
  """The cohort's three programs: start (schedules and states), a chunk of steps, reduce (sums and uploads).

  On a mesh each is a `jax.shard_map` over the clients axis: every device runs the vmapped program on its own
  clients, so no client's computation depends on another's (left to XLA's partitioner, convolutions with
  per-client kernels were all-gathered and every device computed every client's), and the reduction's sums
  are an explicit ``psum``, the one collective of a round's training.
  """
  clients, whole = PartitionSpec("clients"), PartitionSpec()
  split = NamedSharding(mesh, clients) if mesh else None
  replicated = NamedSharding(mesh, whole) if mesh else None

  def on_devices(f, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs) if mesh else f

  def start_local(start, index_rows, num_examples, round_key, ids, memory_rows, server, inputs):
    # Every client's key from its id inside the program: each device derives its own clients' keys.
    return cohort.start(trainer, schedule_length, start, index_rows, num_examples, round_key, ids, memory_rows,
                        server, inputs, per_client_start=per_client_start)

  start_spec = clients if per_client_start else whole
  start_specs = (start_spec, clients, clients, whole, clients, clients, whole, clients)
  start_cohort = _start_jit(trainer)(on_devices(start_local, start_specs, (clients, clients, clients)),
                         out_shardings=(split, split, split) if mesh else None)

  def run_cohort_steps(states, images, labels, ids, mask, offset, count):
    def run(states, images, labels, ids, mask, offset):
      return cohort.steps(trainer, states, images, labels, ids, mask, offset, count)
    return on_devices(run, (clients, whole, whole, clients, clients, whole), clients)(
        states, images, labels, ids, mask, offset)

  # On a mesh the chunk program's shardings are fixed (clients split, data replicated), so the programs
  # compiled ahead by `ChunkPrograms` accept every chunk's inputs.
  chunk_shardings = dict(in_shardings=(split, replicated, replicated, split, split, replicated),
                         out_shardings=split) if mesh else {}
  run_steps = ChunkPrograms(jax.jit(run_cohort_steps, donate_argnums=0, static_argnums=6, **chunk_shardings),
                            trainer.config.chunk_lengths(schedule_length))

  def reduce_local(states: LocalState, start, memory_rows, server, weights, real):
    """The cohort's sums and its stacked uploads (a psum over the mesh's devices completes the sums)."""
    total = (lambda x: jax.lax.psum(x, "clients")) if mesh else (lambda x: x)
    return cohort.reduce(trainer, states, start, memory_rows, server, weights, real,
                         per_client_start=per_client_start, total=total)

  # The sums come back replicated, and so (gathered) do the clients' new memory rows and stacked uploads:
  # server state stays replicated and readable by every process.
  reduce = jax.jit(on_devices(reduce_local, (clients, start_spec, clients, whole, clients, clients),
                              (whole, clients, clients)),
                   out_shardings=replicated)
  return start_cohort, run_steps, reduce


@program_cache
def _row_programs(mesh: Mesh | None):
  """``(take_rows, replicate, scatter_rows)``: rows of a tree, split over the mesh's clients axis (the cohort's
  start models, memory rows and index rows); a tree replicated on the mesh (server state); and memory with
  the cohort's new rows written in."""
  split = NamedSharding(mesh, PartitionSpec("clients")) if mesh else None
  replicated = NamedSharding(mesh, PartitionSpec()) if mesh else None

  @functools.partial(light_jit, out_shardings=split)
  def take_rows(tree, rows):
    # Out-of-range rows (a padding client's memory row) clip to the last row; their results are dropped.
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), tree)

  # Host data the same on every process becomes a replicated global array without a collective (jit
  # copies a process's local input to its own devices), unlike `jax.device_put`, which checks equality.
  replicate = light_jit(lambda tree: tree, out_shardings=replicated)

  # Donated and placed as it came in, so the update is in place: a round costs the cohort's rows, not a
  # copy of every client's. Padding clients carry an out-of-range row index and are dropped.
  @functools.partial(light_jit, donate_argnums=0, out_shardings=replicated)
  def scatter_rows(memory, rows, new_rows):
    return jax.tree.map(lambda m, r: m.at[rows].set(r, mode="drop"), memory, new_rows)

  return take_rows, replicate, scatter_rows


class VmapBackend:
  """The cohort as a vmapped leading axis; ``mesh`` shards that axis over devices (of every process)."""

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = mesh
    self.name = "vmap" if mesh is None else "sharded"
    self._placed: dict[int, FederatedStore] = {}
    self._take_rows, self._replicate, self._scatter_rows = _row_programs(mesh)

  def slots(self, stack_size):
    if self.mesh is None:
      return stack_size
    return -(-stack_size // self.mesh.size) * self.mesh.size  # a multiple of the devices

  def _place(self, store: FederatedStore) -> FederatedStore:
    if self.mesh is None:
      return store
    if id(store) not in self._placed:
      # Replicated on the mesh; in a multi-process run each process copies its own devices' parts.
      put = lambda x: distributed.from_host(x, NamedSharding(self.mesh, PartitionSpec()))
      self._placed = {id(store): dataclasses.replace(store, images=put(store.images), labels=put(store.labels),
                                                     index_table=put(store.index_table))}
    return self._placed[id(store)]

  def place(self, tree):
    if self.mesh is None:
      return tree
    # Replicated from round 1 on: the aggregate comes back committed to the mesh,
    # and a change of input placement between rounds would recompile everything.
    return self._replicate(tree)

  def local(self, tree):
    if self.mesh is None:
      return tree
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)

  def _hostsplit_uploads(self, tree):
    """Host (numpy) cohort data, the same on every process, split over the clients axis: each process
    copies only its own devices' rows."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    split = NamedSharding(self.mesh, PartitionSpec("clients"))
    return jax.tree.map(lambda x: distributed.from_host(x, split), tree)

  def train(self, trainer, start, store, rows, round_key, *, memory=(), server=(), per_client_start=False,
            stack_size):
    store = self._place(store)
    padded_ids, sizes, client_weights, real, inputs = self._hostsplit_uploads(
        (rows.clients, rows.sizes, rows.weights, rows.real, rows.inputs))
    if per_client_start:  # the slots past the cohort start from slot 0's model
      start = self._take_rows(start, rows.slots)
    memory_rows = self._take_rows(memory, rows.rows) if memory else ()
    start_cohort, run_steps, reduce = _mapped_program(trainer, _schedule_length(trainer, store), per_client_start,
                                                      self.mesh)
    index_rows = self._take_rows(store.index_table, rows.clients)
    states, ids, mask = start_cohort(start, index_rows, sizes, round_key, padded_ids, memory_rows, server, inputs)
    states = _run_schedule(run_steps, trainer, int(rows.steps), states, store, ids, mask)
    result, new_rows, stacked = reduce(states, start, memory_rows, server, client_weights, real)
    if memory:
      memory = self._scatter_rows(memory, rows.rows, new_rows)
    if "stack" in trainer.reductions:
      stacked = _pad_stacked(jax.tree.map(lambda x: x[:stack_size], stacked), int(rows.count))
    return with_stacked(result, stacked, trainer.reductions)._replace(memory=memory)


def make_backend(name: str) -> Backend:
  """A backend by name; ``auto`` chooses by platform and process count (see module docstring). In a
  multi-process run only ``sharded`` (and ``auto``) are accepted: the others train on one process's devices."""
  name = name.lower()
  if name not in BACKENDS:
    raise ValueError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")
  processes = jax.process_count()
  if name == "auto":
    if processes > 1:
      name = "sharded"
    elif jax.default_backend() == "cpu":
      name = "sequential"
    else:
      name = "sharded" if jax.local_device_count() > 1 else "vmap"
  if processes > 1 and name != "sharded":
    raise ValueError(f"backend {name!r} trains on this process's devices only; a run of {processes} processes "
                     "needs the sharded backend (--backend sharded, or auto)")
  if name == "sequential":
    return SequentialBackend()
  if name == "vmap":
    return VmapBackend()
  # All devices of all processes, in jax's order (grouped by process): each process holds a contiguous block
  # of the cohort.
  return VmapBackend(Mesh(np.array(jax.devices()), ("clients",)))
