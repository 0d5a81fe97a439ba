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
  architecture group they were assigned to (the paper suggests attackers would
  pick the largest architecture; the experiments do not say they did).

The flag and the label permutation of each client are traced inputs
(`AttackInput`), so cohorts with or without malicious clients run the same
compiled programs; a run without malicious clients builds no trainer with a
`Backdoor`, so it compiles exactly the programs it would without this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.validation import check_choice, check_number

READINGS = ("update", "difference")  # what delta_backdoor is: the copy's update, or copy minus clean
# Third entry of the numpy seed sequence ([seed, 0 or 1, STREAM]); the engine's other streams use 1 and 2.
STREAM = 3

Variables = Any


def num_malicious(num_clients: int, fraction: float) -> int:
  """round(fraction * num_clients), halves rounded up (Python's ``round`` would round 2.5 to 2)."""
  return int(np.floor(fraction * num_clients + 0.5))


def malicious_clients(num_clients: int, fraction: float, seed: int) -> np.ndarray:
  """The sorted ids of the malicious clients: `num_malicious` of them, drawn without replacement from
  ``seed`` alone (the same set every round, and on every backend)."""
  count = num_malicious(num_clients, fraction)
  rng = np.random.default_rng([seed, 0, STREAM])
  return np.sort(rng.choice(num_clients, size=count, replace=False)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Backdoor:
  """The attack's static settings, as a `LocalTrainer` holds them: ``scale`` is lambda of Eq. 1."""

  scale: float
  reading: str = "update"

  def __post_init__(self):
    check_number("federation.backdoor_scale", self.scale, minimum=0)
    check_choice("federation.backdoor_delta", self.reading, READINGS)


class AttackInput(NamedTuple):
  """Per client (a leading cohort axis where a backend stacks them): traced, so no cohort recompiles."""

  malicious: Any  # bool
  label_seed: Any  # uint32: seeds the client's fixed label permutation


class BackdoorState(NamedTuple):
  """A client's second training during a round (`LocalState.backdoor`)."""

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


def padded_inputs(inputs: AttackInput, size: int) -> AttackInput:
  """``inputs`` padded to ``size`` rows with honest clients (a vmapped cohort's padding)."""
  pad = size - len(inputs.malicious)
  return AttackInput(np.concatenate([inputs.malicious, np.zeros(pad, bool)]),
                     np.concatenate([inputs.label_seed, np.zeros(pad, np.uint32)]))


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
                    reading: str) -> Variables:
  """Per leaf: ``start + (clean - start) + scale * delta_backdoor`` where ``malicious`` (``clean``
  elsewhere); ``delta_backdoor`` is ``copy - start`` (reading "update") or ``copy - clean`` ("difference")."""

  def leaf(s, c, b):
    backdoor = b - c if reading == "difference" else b - s
    return jnp.where(malicious, s + (c - s) + scale * backdoor, c)

  return jax.tree.map(leaf, start, clean, copy)
