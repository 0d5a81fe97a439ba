"""The privacy a run spent: epsilon at ``--dp-delta`` after every round, from dp-accounting's RDP accountant.

A round is one subsampled Gaussian mechanism (`fedjax_hetero.methods.privacy`): the noise's standard deviation
over the clip is z. The accountant composes the rounds trained, by ``--dp-accountant``:

* ``without_replacement`` (the default): ``SampledWithoutReplacementDpEvent`` of clients_per_round of
  num_clients, the draw the runs make; its neighbouring datasets replace one client's data, which moves the sum
  of the clipped updates by up to 2C, so the Gaussian's multiplier is z / 2;
* ``poisson``: ``PoissonSampledDpEvent`` with q = clients_per_round / num_clients and multiplier z (neighbours
  add or remove a client, sensitivity C): the bound the DP-FedAvg papers report, an approximation of the fixed-size
  draw.

Rounds trained and dropped by a rollback (`run.guard`) were released too, so they count. The accountant works on
the host, once per run for one round; a row's epsilon is that round's Renyi divergences times the rounds spent,
converted at delta (`dp_accounting.rdp.compute_epsilon`), so a resumed run reports what a straight one does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.validation import check_integer

if TYPE_CHECKING:
  import dp_accounting
  from dp_accounting import rdp

Row = dict[str, Any]


def round_event(privacy: PrivacyConfig, clients_per_round: int, num_clients: int) -> dp_accounting.DpEvent:
  """One round's `dp_accounting.DpEvent` (see the module docstring)."""
  _check_draw(clients_per_round, num_clients)
  import dp_accounting  # (here, not above: its scipy imports take a second of every command's start)
  if privacy.accountant == "poisson":
    return dp_accounting.PoissonSampledDpEvent(clients_per_round / num_clients,
                                               dp_accounting.GaussianDpEvent(privacy.noise_multiplier))
  return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, clients_per_round,
                                                        dp_accounting.GaussianDpEvent(privacy.noise_multiplier / 2))


def _check_draw(clients_per_round: int, num_clients: int) -> None:
  check_integer("num_clients", num_clients, minimum=1)
  check_integer("clients_per_round", clients_per_round, minimum=1)
  if clients_per_round > num_clients:
    raise ValueError(f"clients_per_round {clients_per_round} exceeds num_clients {num_clients}: a round draws its "
                     "clients from the num_clients without replacement")


def accountant(privacy: PrivacyConfig) -> rdp.RdpAccountant:
  """An empty RDP accountant with the neighbouring relation ``privacy.accountant`` needs."""
  import dp_accounting
  from dp_accounting import rdp
  relation = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE if privacy.accountant == "poisson" else
              dp_accounting.NeighboringRelation.REPLACE_ONE)
  return rdp.RdpAccountant(neighboring_relation=relation)


@functools.lru_cache(maxsize=32)
def _round_rdp(privacy: PrivacyConfig, clients_per_round: int, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
  """The accountant's orders and one round's Renyi divergences at them."""
  one = accountant(privacy)
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)  # (fractional orders whose series does not converge are dropped, with a warning each)
  try:
    one.compose(round_event(privacy, clients_per_round, num_clients))
  finally:
    absl.setLevel(level)
  return np.asarray(one._orders), np.asarray(one._rdp)  # (no public reader of them; one round's, computed once)


def epsilon(privacy: PrivacyConfig, clients_per_round: int, num_clients: int, rounds: int) -> float | None:
  """Epsilon at ``privacy.delta`` after ``rounds`` rounds; None where there is no bound (no noise)."""
  _check_draw(clients_per_round, num_clients)
  check_integer("rounds", rounds, minimum=0)
  if rounds == 0:
    return 0.0
  if privacy.noise_multiplier == 0:
    return None
  from dp_accounting import rdp
  orders, per_round = _round_rdp(privacy, clients_per_round, num_clients)
  value = float(rdp.compute_epsilon(orders, rounds * per_round, privacy.delta)[0])
  return value if math.isfinite(value) else None


def rounds_spent(round_: int, rollbacks: Sequence[dict[str, Any]]) -> int:
  """Rounds trained up to round ``round_`` (a row written now): the round itself and every round the rollbacks so
  far dropped (from the one after the checkpoint restored to the one that diverged)."""
  return round_ + sum(r["diverged_round"] - r["to_round"] for r in rollbacks)


def privacy_entry(config: Any, round_: int, rollbacks: Sequence[dict[str, Any]] = ()) -> Row | None:
  """A row's ``privacy``: epsilon and delta after round ``round_`` of the run of ``config`` (a `RunConfig`), and the
  rounds spent; None when privacy is off."""
  privacy = config.privacy
  if not privacy.on:
    return None
  spent = rounds_spent(round_, rollbacks)
  return {"epsilon": epsilon(privacy, config.federation.clients_per_round, config.data.num_clients, spent),
          "delta": privacy.delta, "rounds_spent": spent}


def private_row(row: Row, config: Any, rollbacks: Sequence[dict[str, Any]] = ()) -> Row:
  """``row`` with its ``privacy`` (`privacy_entry`), unchanged when privacy is off."""
  entry = privacy_entry(config, row["round"], rollbacks)
  return row if entry is None else {**row, "privacy": entry}


def summary_privacy(config: Any, rows: Sequence[Row]) -> Row | None:
  """summary.json's ``privacy``: the settings, how epsilon is counted, and the last row's epsilon (None when off)."""
  privacy = config.privacy
  if not privacy.on:
    return None
  last = rows[-1].get("privacy") if rows else None
  return {"clip": privacy.clip, "noise_multiplier": privacy.noise_multiplier, "delta": privacy.delta,
          "accountant": privacy.accountant, "epsilon": last["epsilon"] if last else 0.0,
          "rounds_spent": last["rounds_spent"] if last else 0,
          "accounted_by": f"dp-accounting {importlib.metadata.version('dp-accounting')}, RDP accountant"}
