"""Who takes part in a round, and with which aggregation weight: a method's `Sampler`.

``sample(state, round, info)`` runs on the host and returns the round's
`Participants`; a sampler with state (CluSamp's representative gradients)
keeps it in the run's checkpointed server state and updates it in
``observe`` from the uploads of its client term, ``reads``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client.terms import upload_flat_delta
from fedjax_hetero.data.store import sample_clients
from fedjax_hetero.sampling.clustered import ClusteredSampler


class SamplingInfo(NamedTuple):
  sizes: np.ndarray  # every client's sample count
  clients_per_round: int
  seed: int
  weighting: str  # "uniform" or "num_samples"
  parameter_count: int  # scalars in a model's params (one architecture group only)

  @property
  def num_clients(self) -> int:
    return len(self.sizes)

  def weights(self, clients: np.ndarray) -> np.ndarray:
    return np.ones(len(clients)) if self.weighting == "uniform" else self.sizes[clients].astype(float)


class Participants(NamedTuple):
  clients: np.ndarray  # the clients that train, in training order (distinct)
  weights: np.ndarray  # their aggregation weights
  draws: np.ndarray  # what the sampler drew (logged; may repeat clients)


class Sampler(NamedTuple):
  name: str
  sample: Callable[[Any, int, SamplingInfo], Participants]
  init: Callable[[SamplingInfo], Any] | None = None
  observe: Callable[[Any, np.ndarray, Any, SamplingInfo], Any] | None = None  # (state, cohort, uploads, info)
  reads: Any = None  # the `ClientTerm` whose uploads ``observe`` reads


def uniform() -> Sampler:
  """Uniform without replacement, a pure function of (seed, round); sorted client ids."""

  def sample(state, round_index, info):
    clients = sample_clients(info.num_clients, info.clients_per_round, info.seed, round_index)
    return Participants(clients, info.weights(clients), clients)

  return Sampler("uniform", sample)


def shuffled() -> Sampler:
  """Uniform sampling in a random order, every client weighing 1 (FedCross: the i-th client trains
  middleware model i)."""

  def sample(state, round_index, info):
    clients = sample_clients(info.num_clients, info.clients_per_round, info.seed, round_index)
    clients = np.random.default_rng([info.seed, round_index, 1]).permutation(clients)
    return Participants(clients, np.ones(len(clients)), clients)

  return Sampler("shuffled", sample)


class ClusteredState(NamedTuple):
  gradients: jax.Array  # float32 [num_clients, D]: each client's last flattened parameter delta
  updated: jax.Array  # bool [num_clients]: which rows were ever written


@jax.jit
def _store_rows(state: ClusteredState, clients: jax.Array, rows: jax.Array) -> ClusteredState:
  # Padding rows carry an out-of-range client id and are dropped.
  return ClusteredState(state.gradients.at[clients].set(rows, mode="drop"),
                        state.updated.at[clients].set(True, mode="drop"))


def clustered(similarity: str = "L1") -> Sampler:
  """CluSamp: clustered sampling by representative-gradient similarity (Fraboni et al. 2021, Alg. 2).

  The representative gradients (zero before a client's first round) are the uploads of its client
  term (``reads``, `client.terms.upload_flat_delta`). Draws may repeat a client: it trains
  once and its update counts once per draw, weighted ``1/m`` per draw (Fraboni's unbiased scheme)
  under uniform weighting, ``n_i / sum of the drawn n_j`` (the FedCross framework's) by sample count.
  """
  mirror: dict[str, Any] = {}  # host ClusteredSampler for the gradients it was last synced to

  def host_sampler(state: ClusteredState, info: SamplingInfo) -> ClusteredSampler:
    # Rebuilding from the stored rows gives the incrementally updated dissimilarities bit for bit
    # (each pair's sum runs over the same two rows in the same order), so a resumed run matches.
    if mirror.get("gradients") is state.gradients:
      return mirror["sampler"]
    sampler = ClusteredSampler(info.sizes, info.clients_per_round, info.seed, similarity)
    updated = np.flatnonzero(np.asarray(state.updated))
    if len(updated):
      sampler.update(updated, np.asarray(state.gradients)[updated])
    mirror.update(gradients=state.gradients, sampler=sampler)
    return sampler

  def init(info):
    zeros = jnp.zeros((info.num_clients, info.parameter_count), jnp.float32)
    return ClusteredState(zeros, jnp.zeros(info.num_clients, bool))

  def sample(state, round_index, info):
    sampler = host_sampler(state, info)
    draws = sampler.sample(round_index)
    per_draw = sampler.aggregation_weights(draws, "size" if info.weighting == "num_samples" else "uniform")
    clients, which = np.unique(draws, return_inverse=True)
    return Participants(clients, np.bincount(which, weights=per_draw, minlength=len(clients)), draws)

  def observe(state, cohort, uploads, info):
    sampler = host_sampler(state, info)
    padded = np.full(len(uploads), info.num_clients)
    padded[:len(cohort)] = cohort
    stored = _store_rows(state, jnp.asarray(padded), uploads)
    sampler.update(cohort, np.asarray(uploads)[:len(cohort)])
    mirror.update(gradients=stored.gradients, sampler=sampler)
    return stored

  return Sampler("clustered", sample, init, observe, reads=upload_flat_delta("clustered"))
