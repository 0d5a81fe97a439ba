"""A simulation's server state, and the randomness of its rounds."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_hetero.compilation import light_jit
from fedjax_hetero.hetero.maps import Variables


def round_key(seed: Any, round_index: Any) -> jax.Array:
  """The round's randomness; client c trains with ``fold_in(round_key, c)``."""
  return _round_key(_as_seed(seed), round_index)


def server_key(seed: Any, round_index: Any, num_clients: int, stream: int) -> jax.Array:
  """Server-side randomness of a round; no client shares it (client ids are < num_clients)."""
  return _server_key(_as_seed(seed), round_index, num_clients + stream)


# The host loop makes both keys on the host every round: one program each, where jax's eager operations compiled
# (and launched) one per operation. The seed goes in as uint32, whose key is the Python int's (seeds reach 2**32 - 1,
# past a jitted int32 argument).
def _as_seed(seed: Any) -> Any:
  return seed if isinstance(seed, jax.Array) else np.uint32(seed)  # (an array: a job's runs' seeds, traced)


@light_jit
def _round_key(seed: jax.Array, round_index: Any) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), round_index)


@light_jit
def _server_key(seed: jax.Array, round_index: Any, stream_id: Any) -> jax.Array:
  return jax.random.fold_in(_round_key(seed, round_index), stream_id)


class ServerState(NamedTuple):
  round: int  # rounds completed
  models: tuple[Variables, ...]  # one per federation (stacked sharing: one model per cohort slot)
  steps: tuple[tuple[Any, ...], ...] = ()  # per federation: every server step's state
  sampler: Any = ()  # the sampler's state
  memory: tuple[dict[str, Any], ...] = ()  # per group: its clients' memory by term name, stacked over clients
