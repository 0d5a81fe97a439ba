"""How the clients of one architecture group are mapped onto hardware.

This is the ``for_each_client`` seam of FedJAX: the engine hands a backend the
group's start variables and the round's cohort, and gets back the weighted sum
of the clients' deltas (plus loss totals), all still on the device. Backends:

- ``sequential``: one client after another, each a host loop over jitted
  chunks of unrolled steps; only the chunks a client needs are run. Fastest
  on XLA:CPU, where vmapped convolutions become slow grouped convolutions.
- ``vmap``: the cohort as a leading axis of one program; the cohort is padded
  to a power of two with empty clients (all steps masked) to bound recompiles.
- ``sharded``: the ``vmap`` program with that axis split over a
  ``jax.sharding.Mesh`` of all local devices (cohort padded to a multiple).
- ``auto``: ``sequential`` on CPU, ``sharded`` on several accelerators,
  ``vmap`` on one.

All backends produce the same sums up to float tolerance, because every
client's randomness (its schedule, and the key `LocalTrainer.init_state` gets)
is ``fold_in(round_key, client_id)``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_hetero.client.local import ClientOutput, LocalState, LocalTrainer
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import Variables

BACKENDS = ("auto", "sequential", "vmap", "sharded")
Memory = dict[str, Any]  # per-client state of one group, every leaf with a leading axis over its clients


class GroupResult(NamedTuple):
  delta_sum: Variables  # sum_c w_c * delta_c, group-shaped (FedNova: normalized deltas)
  weight_sum: jax.Array  # sum_c w_c
  loss_sum: jax.Array  # summed per-example training loss
  num_examples: jax.Array  # real examples processed
  extra_sums: dict[str, Any] = {}  # sum_c w_c * extra_c of every further upload (`ClientOutput.extras`)
  memory: Memory = {}  # the group's client memory with the cohort's rows updated
  uploads: Variables | None = None  # the clients' final variables stacked in cohort order, if asked for


class Backend(Protocol):
  name: str

  def train(self, trainer: LocalTrainer, start: Variables, store: FederatedStore, clients: np.ndarray,
            weights: np.ndarray, round_key: jax.Array, *, memory: Memory | None = None,
            rows: np.ndarray | None = None, server: dict[str, Any] | None = None, per_client_start: bool = False,
            keep_uploads: bool = False) -> GroupResult:
    """Trains ``clients`` from ``start`` (stacked per client when ``per_client_start``).

    ``memory`` holds the group's per-client state and ``rows`` the cohort's rows in it;
    ``server`` is the group's share of server state; ``keep_uploads`` also returns the
    clients' final variables stacked.
    """
    ...

  def place(self, tree: Variables) -> Variables:
    """Puts server state where this backend keeps it (so every round sees one placement)."""
    ...


def _schedule_length(trainer: LocalTrainer, store: FederatedStore) -> int:
  return max(1, trainer.config.num_steps(store.max_size))


def _run_schedule(run_steps, trainer: LocalTrainer, num_steps: int, state, store: FederatedStore, ids, mask):
  """Runs the first ``num_steps`` scheduled steps as a host loop over unrolled chunks."""
  offset = 0
  for count in trainer.config.chunk_sizes(num_steps):
    state = run_steps(state, store.images, store.labels, ids, mask, offset, count)
    offset += count
  return state


def _take(tree, index):
  return jax.tree.map(lambda x: x[index], tree)


def _weighted_sums(output: ClientOutput, weight) -> tuple[Variables, dict[str, Any]]:
  scale = lambda tree: jax.tree.map(lambda x: weight * x, tree)
  return scale(output.delta), scale(output.extras)


@functools.cache
def _sequential_program(trainer: LocalTrainer, schedule_length: int):

  @jax.jit
  def start_client(start, index_row, num_examples, key, memory_row, server):
    ids, mask = trainer.schedule(index_row, num_examples, key, schedule_length)
    return trainer.init_state(start, memory_row, server, key), ids, mask

  run_steps = jax.jit(trainer.run_steps, donate_argnums=0, static_argnames="count")

  @functools.partial(jax.jit, donate_argnums=0)
  def accumulate(result: GroupResult, state: LocalState, start, memory_row, server, weight):
    output = trainer.finish(state, start, memory_row, server)
    delta, extras = _weighted_sums(output, weight)
    return result._replace(delta_sum=jax.tree.map(jnp.add, result.delta_sum, delta),
                           weight_sum=result.weight_sum + weight, loss_sum=result.loss_sum + state.loss_sum,
                           num_examples=result.num_examples + state.num_examples,
                           extra_sums=jax.tree.map(jnp.add, result.extra_sums, extras)), output.memory

  return start_client, run_steps, accumulate


@jax.jit
def _take_row(tree, index):
  return _take(tree, index)


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(tree, index, row):
  return jax.tree.map(lambda x, r: x.at[index].set(r), tree, row)


@jax.jit
def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@jax.jit
def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def empty_result(start: Variables, extras: dict[str, Any] | None = None) -> GroupResult:
  """Zero sums shaped like ``start`` (and like ``extras``, if given)."""
  zero = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: the result is donated
  extra_sums = jax.tree.map(jnp.zeros_like, extras) if extras else {}
  return GroupResult(jax.tree.map(jnp.zeros_like, start), zero(), zero(), zero(), extra_sums)


def extras_like(trainer: LocalTrainer, start, memory_row, server):
  """Shapes of a client's extra uploads, without running anything."""
  state = jax.eval_shape(trainer.init_state, start, memory_row, server)
  return jax.eval_shape(trainer.finish, state, start, memory_row, server).extras


class SequentialBackend:
  name = "sequential"

  def place(self, tree):
    return tree

  def train(self, trainer, start, store, clients, weights, round_key, *, memory=None, rows=None, server=None,
            per_client_start=False, keep_uploads=False):
    start_client, run_steps, accumulate = _sequential_program(trainer, _schedule_length(trainer, store))
    memory, server = memory or {}, server or {}
    first_start = _take_row(start, 0) if per_client_start else start
    first_row = _take_row(memory, int(rows[0])) if memory else {}
    result = empty_result(first_start, extras_like(trainer, first_start, first_row, server))
    uploads = []
    memory = _copy(memory)  # the rows are updated in place (donated) below; the caller's state stays valid
    for i, (client, weight) in enumerate(zip(clients, weights)):
      size = int(store.sizes[client])
      client_start = _take_row(start, i) if per_client_start else start
      row = _take_row(memory, int(rows[i])) if memory else {}
      state, ids, mask = start_client(client_start, store.index_table[client], size,
                                      jax.random.fold_in(round_key, int(client)), row, server)
      state = _run_schedule(run_steps, trainer, trainer.config.num_steps(size), state, store, ids, mask)
      if keep_uploads:
        uploads.append(state.variables)
      result, new_row = accumulate(result, state, client_start, row, server, jnp.float32(weight))
      if memory:
        memory = _set_row(memory, int(rows[i]), new_row)
    return result._replace(memory=memory, uploads=_stack(uploads) if keep_uploads else None)


@functools.cache
def _mapped_program(trainer: LocalTrainer, schedule_length: int, per_client_start: bool):
  start_axis = 0 if per_client_start else None

  @jax.jit
  def start_cohort(start, index_rows, num_examples, keys, memory_rows, server):
    ids, mask = jax.vmap(lambda r, n, k: trainer.schedule(r, n, k, schedule_length))(index_rows, num_examples, keys)
    states = jax.vmap(trainer.init_state, in_axes=(start_axis, 0, None, 0), axis_size=len(keys))(
        start, memory_rows, server, keys)
    return states, ids, mask

  run_steps = jax.jit(jax.vmap(trainer.run_steps, in_axes=(0, None, None, 0, 0, None, None)), donate_argnums=0,
                      static_argnums=6)

  @jax.jit
  def reduce(states: LocalState, start, memory_rows, server, weights):
    outputs = jax.vmap(trainer.finish, in_axes=(0, start_axis, 0, None))(states, start, memory_rows, server)
    weighted_sum = lambda tree: jax.tree.map(lambda d: jnp.tensordot(weights, d, axes=1), tree)
    result = GroupResult(weighted_sum(outputs.delta), weights.sum(), states.loss_sum.sum(),
                         states.num_examples.sum(), weighted_sum(outputs.extras))
    return result, outputs.memory

  return start_cohort, run_steps, reduce


@jax.jit
def _scatter_rows(memory, rows, new_rows):
  # Padding clients carry an out-of-range row index and are dropped.
  return jax.tree.map(lambda m, r: m.at[rows].set(r, mode="drop"), memory, new_rows)


class VmapBackend:
  """The cohort as a vmapped leading axis; ``mesh`` shards that axis over devices."""

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = mesh
    self.name = "vmap" if mesh is None else "sharded"
    self._placed: dict[int, FederatedStore] = {}

  def _padded_size(self, cohort: int) -> int:
    size = 1 << (cohort - 1).bit_length()
    if self.mesh is not None:
      devices = self.mesh.size
      size = -(-size // devices) * devices
    return size

  def _place(self, store: FederatedStore) -> FederatedStore:
    if self.mesh is None:
      return store
    if id(store) not in self._placed:
      self._placed = {id(store): store.placed(NamedSharding(self.mesh, PartitionSpec()))}
    return self._placed[id(store)]

  def place(self, tree):
    if self.mesh is None:
      return tree
    # Replicated from round 1 on: the aggregate comes back committed to the mesh,
    # and a change of input placement between rounds would recompile everything.
    return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

  def _split(self, x):
    if self.mesh is None:
      return x
    return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec("clients")))

  def train(self, trainer, start, store, clients, weights, round_key, *, memory=None, rows=None, server=None,
            per_client_start=False, keep_uploads=False):
    store = self._place(store)
    memory, server = memory or {}, server or {}
    size = self._padded_size(len(clients))
    pad = size - len(clients)
    # Empty clients own no examples, so every one of their steps is masked.
    padded = np.concatenate([clients, np.zeros(pad, clients.dtype)])
    sizes = np.concatenate([store.sizes[clients], np.zeros(pad, np.int64)]).astype(np.int32)
    client_weights = np.concatenate([weights, np.zeros(pad)]).astype(np.float32)
    keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(jnp.asarray(padded))
    if per_client_start:
      start = self._split(jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]), start))
    memory_rows, padded_rows = {}, None
    if memory:
      num_rows = len(jax.tree.leaves(memory)[0])
      padded_rows = jnp.asarray(np.concatenate([rows, np.full(pad, num_rows)]), jnp.int32)
      memory_rows = self._split(jax.tree.map(lambda m: jnp.take(m, padded_rows, axis=0, mode="clip"), memory))
    start_cohort, run_steps, reduce = _mapped_program(trainer, _schedule_length(trainer, store), per_client_start)
    index_rows = self._split(store.index_table[jnp.asarray(padded)])
    states, ids, mask = start_cohort(start, index_rows, self._split(jnp.asarray(sizes)), self._split(keys),
                                     memory_rows, server)
    longest = max(trainer.config.num_steps(int(n)) for n in sizes[:len(clients)])
    states = _run_schedule(run_steps, trainer, longest, states, store, ids, mask)
    result, new_rows = reduce(states, start, memory_rows, server, self._split(jnp.asarray(client_weights)))
    if memory:
      memory = _scatter_rows(memory, padded_rows, new_rows)
    uploads = jax.tree.map(lambda x: x[:len(clients)], states.variables) if keep_uploads else None
    return result._replace(memory=memory, uploads=uploads)


def make_backend(name: str) -> Backend:
  """A backend by name; ``auto`` chooses by platform (see module docstring)."""
  name = name.lower()
  if name not in BACKENDS:
    raise ValueError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")
  if name == "auto":
    if jax.default_backend() == "cpu":
      name = "sequential"
    else:
      name = "sharded" if jax.local_device_count() > 1 else "vmap"
  if name == "sequential":
    return SequentialBackend()
  if name == "vmap":
    return VmapBackend()
  return VmapBackend(Mesh(np.array(jax.local_devices()), ("clients",)))
