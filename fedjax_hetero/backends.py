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
client's randomness is ``fold_in(round_key, client_id)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_hetero.client.local import LocalState, LocalTrainer, tree_sub, weighted_add
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import Variables

BACKENDS = ("auto", "sequential", "vmap", "sharded")


class GroupResult(NamedTuple):
  delta_sum: Variables  # sum_c w_c * (local_c - start), group-shaped
  weight_sum: jax.Array  # sum_c w_c
  loss_sum: jax.Array  # summed per-example training loss
  num_examples: jax.Array  # real examples processed


class Backend(Protocol):
  name: str

  def train(self, trainer: LocalTrainer, start: Variables, store: FederatedStore, clients: np.ndarray,
            weights: np.ndarray, round_key: jax.Array) -> GroupResult:
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


@functools.cache
def _sequential_program(trainer: LocalTrainer, schedule_length: int):

  @jax.jit
  def start_client(start, index_row, num_examples, key):
    ids, mask = trainer.schedule(index_row, num_examples, key, schedule_length)
    return trainer.init_state(start), ids, mask

  run_steps = jax.jit(trainer.run_steps, donate_argnums=0, static_argnames="count")

  @functools.partial(jax.jit, donate_argnums=0)
  def accumulate(result: GroupResult, state: LocalState, start, weight):
    return GroupResult(weighted_add(result.delta_sum, tree_sub(state.variables, start), weight),
                       result.weight_sum + weight, result.loss_sum + state.loss_sum,
                       result.num_examples + state.num_examples)

  return start_client, run_steps, accumulate


def empty_result(start: Variables) -> GroupResult:
  zero = lambda: jnp.zeros((), jnp.float32)  # distinct buffers: the result is donated
  return GroupResult(jax.tree.map(jnp.zeros_like, start), zero(), zero(), zero())


class SequentialBackend:
  name = "sequential"

  def place(self, tree):
    return tree

  def train(self, trainer, start, store, clients, weights, round_key):
    start_client, run_steps, accumulate = _sequential_program(trainer, _schedule_length(trainer, store))
    result = empty_result(start)
    for client, weight in zip(clients, weights):
      size = int(store.sizes[client])
      state, ids, mask = start_client(start, store.index_table[client], size,
                                      jax.random.fold_in(round_key, int(client)))
      state = _run_schedule(run_steps, trainer, trainer.config.num_steps(size), state, store, ids, mask)
      result = accumulate(result, state, start, jnp.float32(weight))
    return result


@functools.cache
def _mapped_program(trainer: LocalTrainer, schedule_length: int):

  @jax.jit
  def start_cohort(start, index_rows, num_examples, keys):
    ids, mask = jax.vmap(lambda r, n, k: trainer.schedule(r, n, k, schedule_length))(index_rows, num_examples, keys)
    state = trainer.init_state(start)
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(keys),) + x.shape), state)
    return states, ids, mask

  run_steps = jax.jit(jax.vmap(trainer.run_steps, in_axes=(0, None, None, 0, 0, None, None)), donate_argnums=0,
                      static_argnums=6)

  @jax.jit
  def reduce(states: LocalState, start, weights):
    deltas = tree_sub(states.variables, start)
    delta_sum = jax.tree.map(lambda d: jnp.tensordot(weights, d, axes=1), deltas)
    return GroupResult(delta_sum, weights.sum(), states.loss_sum.sum(), states.num_examples.sum())

  return start_cohort, run_steps, reduce


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

  def train(self, trainer, start, store, clients, weights, round_key):
    store = self._place(store)
    size = self._padded_size(len(clients))
    pad = size - len(clients)
    # Empty clients own no examples, so every one of their steps is masked.
    padded = np.concatenate([clients, np.zeros(pad, clients.dtype)])
    sizes = np.concatenate([store.sizes[clients], np.zeros(pad, np.int64)]).astype(np.int32)
    client_weights = np.concatenate([weights, np.zeros(pad)]).astype(np.float32)
    keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(jnp.asarray(padded))
    start_cohort, run_steps, reduce = _mapped_program(trainer, _schedule_length(trainer, store))
    rows = self._split(store.index_table[jnp.asarray(padded)])
    states, ids, mask = start_cohort(start, rows, self._split(jnp.asarray(sizes)), self._split(keys))
    longest = max(trainer.config.num_steps(int(n)) for n in sizes[:len(clients)])
    states = _run_schedule(run_steps, trainer, longest, states, store, ids, mask)
    return reduce(states, start, self._split(jnp.asarray(client_weights)))


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
