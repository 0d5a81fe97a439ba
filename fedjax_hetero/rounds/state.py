"""A simulation's server state, and the randomness of its rounds."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fedjax_hetero.hetero.maps import Variables


def round_key(seed: int, round_index: int) -> jax.Array:
  """The round's randomness; client c trains with ``fold_in(round_key, c)``."""
  return jax.random.fold_in(jax.random.key(seed), round_index)


def server_key(seed: int, round_index: int, num_clients: int, stream: int) -> jax.Array:
  """Server-side randomness of a round; no client shares it (client ids are < num_clients)."""
  return jax.random.fold_in(round_key(seed, round_index), num_clients + stream)


class ServerState(NamedTuple):
  round: int  # rounds completed
  models: tuple[Variables, ...]  # one per federation (stacked sharing: one model per cohort slot)
  steps: tuple[tuple[Any, ...], ...] = ()  # per federation: every server step's state
  sampler: Any = ()  # the sampler's state
  memory: tuple[dict[str, Any], ...] = ()  # per group: its clients' memory by term name, stacked over clients
