"""Every client's held-out samples for per-client evaluation (``--client-eval-fraction``), as a spec holds them;
the evaluation that reads them is `rounds.client_eval`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import numpy as np


class HeldOut(NamedTuple):
  """One group's held-out samples (device arrays, one entry per sample, client after client)."""

  ids: jax.Array  # int32 [S]: sample ids into the store's images and labels
  owners: jax.Array  # int32 [S]: the sample's client, as its position among the group's clients (padding: past them)


@dataclasses.dataclass(frozen=True, eq=False)
class ClientEval:
  """Every group's held-out samples (`HeldOut`), and how many each of its clients holds (host, for the rows)."""

  held: tuple[HeldOut, ...]
  sizes: tuple[np.ndarray, ...]

  @classmethod
  def build(cls, held_out: Sequence[np.ndarray], group_clients: Sequence[np.ndarray]) -> "ClientEval":
    """From every client's held-out sample ids (``held_out[c]``) and every group's clients; ValueError for a
    client without a held-out sample (its accuracy would be undefined)."""
    held, sizes = [], []
    for clients in group_clients:
      parts = [np.asarray(held_out[c], np.int64) for c in clients]
      empty = [int(c) for c, p in zip(clients, parts) if not len(p)]
      if empty:
        raise ValueError(f"client {empty[0]} has no held-out sample to evaluate on")
      owners = np.repeat(np.arange(len(clients)), [len(p) for p in parts])
      ids = np.concatenate(parts).astype(np.int32)
      held.append(HeldOut(jax.device_put(ids), jax.device_put(owners.astype(np.int32))))
      sizes.append(np.array([len(p) for p in parts], np.int64))
    return cls(tuple(held), tuple(sizes))
