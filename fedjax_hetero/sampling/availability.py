"""Which of a round's sampled clients answer: per-group dropout probabilities and a trace of absences.

A sampled client does not answer its round when its own draw falls under its group's dropout probability, or
when the trace lists it for that round. Every client's draw in round ``r`` is element ``c`` of one uniform
vector drawn from ``(seed, r)``, so whether it answers does not depend on who else was sampled, the sampler,
or where a run was resumed: a run repeats exactly. The round then aggregates the clients that answered; a
client that did not answer neither receives the model nor sends anything (its memory, SCAFFOLD's control for
instance, waits for its next round).
"""

from __future__ import annotations

import csv
from typing import NamedTuple, Sequence

import numpy as np

from fedjax_hetero.validation import check_integer, check_number

_STREAM = 3  # this draw's stream beside the sampler's (0, 1) and the group draw's (2) under the same seed


class Availability(NamedTuple):
  drop_probability: np.ndarray  # float [num_groups]: the chance a sampled client of the group does not answer
  absent: frozenset[tuple[int, int]]  # (client, round from 1) pairs of a trace that do not answer
  num_clients: int
  seed: int

  @property
  def on(self) -> bool:
    return bool(self.absent) or bool(np.any(self.drop_probability > 0))

  def answers(self, clients: np.ndarray, groups: np.ndarray, round_index: int) -> np.ndarray:
    """Whether each of ``clients`` (of architecture ``groups`` this round) answers round ``round_index``
    (0-based)."""
    clients, groups = np.asarray(clients), np.asarray(groups)
    _check_ids("clients", clients, self.num_clients, "clients")
    _check_ids("groups", groups, len(self.drop_probability), "architecture groups")
    if clients.shape != groups.shape:
      raise ValueError(f"clients and groups need one entry each per client, got shapes {clients.shape} and "
                       f"{groups.shape}")
    check_integer("round_index", round_index, minimum=0)
    answered = np.ones(len(clients), bool)
    if np.any(self.drop_probability > 0):
      draws = np.random.default_rng([self.seed, round_index, _STREAM]).random(self.num_clients)
      answered &= draws[clients] >= self.drop_probability[groups]
    if self.absent:
      answered &= np.asarray([(int(c), round_index + 1) not in self.absent for c in clients], bool)
    return answered


def availability(drop_probability: Sequence[float], absent: Sequence[tuple[int, int]], num_groups: int,
                 num_clients: int, seed: int) -> Availability:
  """An `Availability` from one dropout probability for every group or one per group (none: every client
  answers) and a trace's (client, round) pairs."""
  check_integer("num_groups", num_groups, minimum=1)
  check_integer("num_clients", num_clients, minimum=1)
  check_integer("seed", seed, minimum=0)
  if len(drop_probability) not in (0, 1, num_groups):
    raise ValueError(f"drop_probability takes one probability, or one per architecture group ({num_groups}), got "
                     f"{len(drop_probability)}")
  for g, value in enumerate(drop_probability):
    check_number(f"drop_probability[{g}]", value, 0, 1)
  for i, (client, round_) in enumerate(absent):
    check_integer(f"absent[{i}]'s client", client, 0, num_clients - 1)
    check_integer(f"absent[{i}]'s round (rounds count from 1)", round_, minimum=1)
  p = np.zeros(num_groups) if not len(drop_probability) else np.broadcast_to(
      np.asarray(drop_probability, float), (num_groups,)).copy()
  return Availability(p, frozenset((int(c), int(r)) for c, r in absent), num_clients, seed)


def _check_ids(name: str, ids: np.ndarray, count: int, what: str) -> None:
  if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
    raise ValueError(f"{name} must be a 1-D integer array, got {ids.dtype} {ids.shape}")
  if ids.size and (ids.min() < 0 or ids.max() >= count):
    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
    raise ValueError(f"{name} holds {bad}, outside the {count} {what} [0, {count})")


def read_trace(path: str, num_clients: int) -> list[tuple[int, int]]:
  """The (client, round) pairs of a trace file: one ``client,round`` pair a line (rounds count from 1), an
  optional ``client,round`` header, blank lines and ``#`` comments; ValueError naming the line that does not fit."""
  try:
    with open(path, newline="", encoding="utf-8-sig") as f:  # (a spreadsheet's "CSV UTF-8" starts with a BOM)
      lines = list(f)
  except OSError as e:
    raise ValueError(f"cannot be read: {e.strerror or e}") from None
  except UnicodeDecodeError:
    raise ValueError("is not a text file of client,round lines") from None
  pairs = []
  for number, fields in enumerate(csv.reader(lines), 1):
    fields = [x.strip() for x in fields]
    if not any(fields) or fields[0].startswith("#"):
      continue
    if number == 1 and [x.lower() for x in fields] == ["client", "round"]:
      continue
    if len(fields) != 2 or not all(x.lstrip("-").isdigit() for x in fields):
      raise ValueError(f"line {number}: expected two integers 'client,round', got {','.join(fields)!r}")
    client, round_ = map(int, fields)
    if not 0 <= client < num_clients:
      raise ValueError(f"line {number}: client {client} is not one of the run's {num_clients} clients (0 to "
                       f"{num_clients - 1})")
    if round_ < 1:
      raise ValueError(f"line {number}: round {round_}; rounds count from 1")
    pairs.append((client, round_))
  return pairs
