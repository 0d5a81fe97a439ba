"""The backdoor attack of the FedFA paper (Park and Joe-Wong, Eq. 1), an option of every method.

A fixed subset of the clients is malicious (`malicious_clients`: round(F * N)
of the N clients, drawn from the federation seed, the same in every round).
A malicious client trains as usual and, from the same start, on the same
batches in the same order, trains a *copy* of its model on shuffled labels;
it then uploads ``delta + scale * delta_backdoor``.

Choices where the paper is silent:

* ``delta_backdoor`` (the paper's "backdoor modification", not defined further)
  is read by default as the copy's own update, ``copy - start`` (reading
  ``"update"``): the two trainings start from one point and Eq. 1 adds two
  updates. Reading ``"difference"`` takes ``copy - clean`` instead, the part of
  the copy's update that the shuffled labels cause; it is the other natural
  reading of "modification".
* "Shuffling the labels" is one fixed random permutation of the client's own
  labels over its samples (sample i trains with the label of sample pi(i)),
  drawn once per client from the seed and kept over every step and round: the
  attacker holds one poisoned data set, as in data poisoning. A per-batch
  reshuffle would instead give fresh noise labels every step.
* The copy trains like the client itself: same optimizer, same client terms of
  the method (FedProx's proximal term, SCAFFOLD's correction, ...).
* Only the ``params`` collection is poisoned; batch statistics stay the clean
  training's (an amplified update of a running variance can make it negative).
* The poisoned model replaces the client's trained model *before* the method's
  terms finish the round, so every upload a method reads (the delta, FedNova's
  normalized delta, SCAFFOLD's control change, FedCross's and FedGen's stacked
  models, CluSamp's flattened delta) carries the attack, and so does the
  client's memory (MOON's previous model).
* Malicious clients are drawn uniformly from all clients, so they keep the
  architecture group they were assigned to; or, with ``--malicious-group
  largest``, from the clients of the largest architecture (the global model's
  group): the paper argues (Sec. 3.1) that attackers would pick it, where
  incomplete aggregation leaves its own weights to its own clients, though its
  experiments do not say they did.

The attack is a trainer wrapper (`AttackedTrainer`) with the protocol of
`client.local.LocalTrainer`: the engine, the backends and the trainer know
nothing of it. The flag and the label permutation of each client are the
wrapper's per-client inputs (`AttackInput`, traced), so cohorts with or without
malicious clients run the same compiled programs; a run without malicious
clients wraps no trainer, so it compiles exactly the programs it would without
this module.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.aggregators.fedfa import is_kernel
from fedjax_hetero.config.declare import cli_name
from fedjax_hetero.config.federation import FederationConfig, num_malicious

if TYPE_CHECKING:
  from fedjax_hetero.client.local import LocalState, LocalTrainer

# Third entry of the numpy seed sequence ([seed, 0 or 1, STREAM]); the engine's other streams use 1 and 2.
STREAM = 3

Variables = Any


def malicious_clients(num_clients: int, fraction: float, seed: int, among: np.ndarray | None = None) -> np.ndarray:
  """The sorted ids of the malicious clients: `num_malicious` of all ``num_clients``, drawn without replacement from
  ``seed`` alone (the same set every round, and on every backend) from the ids ``among`` (default: every client)."""
  count = num_malicious(num_clients, fraction)
  pool = np.arange(num_clients, dtype=np.int64) if among is None else np.asarray(among, np.int64)
  if count > len(pool):  # (only a group can be too small: a fraction is at most 1)
    raise ValueError(f"{cli_name(FederationConfig, 'malicious_fraction')} {fraction:g} makes {count} malicious "
                     f"clients, more than the {len(pool)} of the group "
                     f"{cli_name(FederationConfig, 'malicious_group')} draws them from; pass at most "
                     f"{len(pool) / num_clients:g}")
  return np.sort(np.random.default_rng([seed, 0, STREAM]).choice(pool, size=count, replace=False))


@dataclasses.dataclass(frozen=True)
class Backdoor:
  """The attack's static settings, checked where they are declared (`FederationConfig`): ``scale`` is lambda
of Eq. 1, ``reading`` one of `config.federation.READINGS`, ``leaves`` one of `config.federation.BACKDOOR_LEAVES`."""

  scale: float
  reading: str = "update"
  leaves: str = "all"


class AttackInput(NamedTuple):
  """Per client (a leading cohort axis where a backend stacks them): traced, so no cohort recompiles."""

  malicious: Any  # bool
  label_seed: Any  # uint32: seeds the client's fixed label permutation


class BackdoorState(NamedTuple):
  """A client's second training during a round (`LocalState.wrapper` of an `AttackedTrainer`)."""

  copy: Any  # the copy's `LocalState`, trained on shuffled labels
  malicious: jax.Array  # bool: whether the copy trains and is added to the upload


def attack_table(num_clients: int, malicious: np.ndarray, seed: int) -> AttackInput:
  """Every client's `AttackInput` (numpy; a backend takes the cohort's rows)."""
  flags = np.zeros(num_clients, bool)
  flags[np.asarray(malicious, np.int64)] = True
  seeds = np.random.default_rng([seed, 1, STREAM]).integers(0, 2 ** 32, num_clients, dtype=np.uint32)
  return AttackInput(flags, seeds)


def cohort_inputs(table: AttackInput, clients: np.ndarray) -> AttackInput:
  """The rows of ``clients``, in cohort order."""
  return AttackInput(table.malicious[clients], table.label_seed[clients])


def shuffled_row(index_row: jax.Array, num_examples: jax.Array, label_seed: jax.Array) -> jax.Array:
  """``index_row`` with its first ``num_examples`` entries (the client's samples) permuted by a permutation
  fixed by ``label_seed``; the padding after them stays in place. ``labels[shuffled_row[p]]`` is the label
  the copy trains the sample at position ``p`` with."""
  size = index_row.shape[0]
  noise = jax.random.uniform(jax.random.key(label_seed), (size,))
  positions = jnp.arange(size)
  order = jnp.argsort(jnp.where(positions < num_examples, noise, 2.0 + positions), stable=True)
  return index_row[order]


def poisoned_params(start: Variables, clean: Variables, copy: Variables, malicious: jax.Array, scale: float,
                    reading: str, leaves: str = "all") -> Variables:
  """Per leaf: ``start + (clean - start) + scale * delta_backdoor`` where ``malicious`` (``clean``
  elsewhere); ``delta_backdoor`` is ``copy - start`` (reading "update") or ``copy - clean`` ("difference").
  ``leaves`` "kernels" (of two or more axes) or "others" takes ``scale`` on those alone, 1 on the rest."""

  def leaf(s, c, b):
    backdoor = b - c if reading == "difference" else b - s
    boosted = leaves == "all" or is_kernel(("params",), s) == (leaves == "kernels")
    return jnp.where(malicious, s + (c - s) + (scale if boosted else 1.0) * backdoor, c)

  return jax.tree.map(leaf, start, clean, copy)


@dataclasses.dataclass(frozen=True, eq=False)
class AttackedTrainer:
  """``trainer`` under the attack, with its protocol (`LocalTrainer`): every client also trains a copy on
  shuffled labels (an honest client's copy is masked and stays at the start), and a malicious one uploads
  Eq. 1. ``table`` holds every client's `AttackInput`; everything else is the wrapped trainer's."""

  trainer: "LocalTrainer"
  backdoor: Backdoor
  table: AttackInput

  def __getattr__(self, name: str) -> Any:
    if name == "trainer":  # (not set yet: copying, unpickling)
      raise AttributeError(name)
    return getattr(self.trainer, name)

  def client_inputs(self, clients: np.ndarray) -> AttackInput:
    return cohort_inputs(self.table, clients)

  def begin(self, state: "LocalState", ids: jax.Array, index_row: jax.Array, num_examples: jax.Array,
            key: jax.Array, attack: AttackInput) -> tuple["LocalState", jax.Array]:
    """A client's round start: ``state`` (from `init_state`) with its copy, and the schedule's ``ids [S, B]`` as
    ``[S, 2, B]``: the samples, and the samples whose labels the copy trains them with (the same schedule over
    the client's label-shuffled row)."""
    label_ids, _ = self.trainer.schedule(shuffled_row(index_row, num_examples, attack.label_seed), num_examples,
                                         key, ids.shape[0])
    copy = jax.tree.map(jnp.copy, state)
    malicious = jnp.asarray(attack.malicious, bool)
    return state._replace(wrapper=BackdoorState(copy, malicious)), jnp.stack([ids, label_ids], axis=1)

  def run_steps(self, state: "LocalState", images: jax.Array, labels: jax.Array, ids: jax.Array, mask: jax.Array,
                offset: jax.Array, count: int) -> "LocalState":
    """`LocalTrainer.run_steps`, each step one of the clean training and one of the copy on the same batch."""
    trainer = self.trainer
    client_labels = trainer.schedule_labels(labels, ids[:, 0], mask)
    ids = jax.lax.dynamic_slice_in_dim(ids, offset, count)
    mask = jax.lax.dynamic_slice_in_dim(mask, offset, count)
    for i in range(count):
      bd, batch = state.wrapper, images[ids[i, 0]]
      clean = trainer.train_step(state._replace(wrapper=()), batch, labels[ids[i, 0]], mask[i], client_labels)
      copy = trainer.train_step(bd.copy, batch, labels[ids[i, 1]], mask[i] & bd.malicious, client_labels)
      state = clean._replace(wrapper=bd._replace(copy=copy))
    return state

  def finish(self, state: "LocalState", start: Variables, memory: Any = None, share: Any = None):
    """The poisoned model replaces the trained one before the method's terms finish the round."""
    if isinstance(state.wrapper, BackdoorState):  # (shape-only uses may finish a state without the copy)
      bd = state.wrapper
      params = poisoned_params(start["params"], state.variables["params"], bd.copy.variables["params"],
                               bd.malicious, self.backdoor.scale, self.backdoor.reading, self.backdoor.leaves)
      state = state._replace(variables={**state.variables, "params": params})
    return self.trainer.finish(state, start, memory, share)


def trainer_wrapper(config: "FederationConfig", malicious: np.ndarray,
                    num_clients: int) -> Callable[["LocalTrainer"], Any]:
  """What wraps each group's trainer under ``config``'s attack on the ``malicious`` clients (no wrapper
  without any)."""
  if not len(malicious):
    return lambda trainer: trainer
  backdoor = Backdoor(config.backdoor_scale, config.backdoor_delta, config.backdoor_leaves)
  table = attack_table(num_clients, malicious, config.seed)
  return lambda trainer: AttackedTrainer(trainer, backdoor, table)
