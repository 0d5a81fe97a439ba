"""How rounds are drawn (`FederationConfig`), and the one check that a federation fits its clients, groups and
method (`check_federation`), which the run's build step and the engine both call."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Sequence

import numpy as np

from fedjax_hetero.config.declare import (Custom, Integer, Number, OneOf, Settings, Text, cli_name, in_messages,
                                          setting, validate)
from fedjax_hetero.validation import SEED_MAX

WEIGHTINGS = ("uniform", "num_samples")  # of a client's delta in the server's mean
READINGS = ("update", "difference")  # the backdoor's delta_backdoor: the copy's update, or copy minus clean
MALICIOUS_GROUPS = ("any", "largest")  # where the malicious clients are drawn from
BACKDOOR_LEAVES = ("all", "kernels", "others")  # the parameters lambda multiplies (the others take lambda 1)


def num_malicious(num_clients: int, fraction: float) -> int:
  """round(fraction * num_clients), halves rounded up (Python's ``round`` would round 2.5 to 2)."""
  return int(np.floor(fraction * num_clients + 0.5))


def _check_probabilities(name: str, draw: Any) -> None:
  if not isinstance(draw, (tuple, list)) or not all(isinstance(p, numbers.Real) and not isinstance(p, bool)
                                                    for p in draw):
    raise ValueError(f"{name} must be a sequence of probabilities, got {draw!r}")
  probabilities = np.asarray(draw, float)
  if len(probabilities) and not (np.all(np.isfinite(probabilities)) and np.all(probabilities >= 0)
                                 and abs(probabilities.sum() - 1) < 1e-6):
    raise ValueError(f"{name} must be non-negative probabilities summing to 1, got {tuple(draw)}")


def _check_dropout(name: str, dropout: Any) -> None:
  if not isinstance(dropout, (tuple, list)) or not all(isinstance(p, numbers.Real) and not isinstance(p, bool)
                                                       for p in dropout):
    raise ValueError(f"{name} must be a sequence of probabilities, got {dropout!r}")
  bad = [p for p in dropout if not 0 <= p <= 1]  # (NaN fails both)
  if bad:
    raise ValueError(f"{name} takes probabilities in [0, 1], got {bad[0]}")
  if dropout and all(p == 1 for p in dropout):
    raise ValueError(f"{name} {','.join(f'{p:g}' for p in dropout)}: no client would ever answer, so no round would "
                     "train; pass probabilities below 1")


def parse_probabilities(text: str) -> tuple[float, ...]:
  try:
    return tuple(float(p) for p in text.split(",") if p.strip())
  except ValueError:
    raise ValueError(f"expected comma-separated probabilities, got {text!r}") from None


def parse_dropout(text: str) -> tuple[float, ...]:
  """--client-dropout's probabilities; all 0 is no dropout, () (a resume of a run without it may say 0)."""
  probabilities = parse_probabilities(text)
  return probabilities if any(probabilities) else ()


@dataclasses.dataclass(frozen=True)
class FederationConfig(Settings):
  """How rounds are drawn: participants per round, the seed, and the clients' aggregation weights; and
  which clients attack (`fedjax_hetero.client.attack`: a fraction of all clients, each uploading its update
  plus ``backdoor_scale`` times its update on shuffled labels). A fraction of 0 changes nothing."""

  TITLE = "federation: cohorts, seeds, aggregation weights, and FedFA's backdoor attack (every method)"

  clients_per_round: int = setting(10, "clients sampled per round", Integer(minimum=1))
  seed: int = setting(0, "seed of partition, sampling, init and shuffling", Integer(minimum=0, maximum=SEED_MAX))
  sample_seed: int | None = setting(
      None, "seed of the rounds' cohorts alone (partition, init and shuffling keep --seed); default: --seed",
      Integer(minimum=0, maximum=SEED_MAX))
  weighting: str = setting("uniform", "client weights in aggregation: uniform (InCo's code) or by sample count",
                           OneOf(WEIGHTINGS))
  group_draw: tuple[float, ...] = setting(
      (), "comma-separated probabilities, one per group: every round each client's group is drawn afresh from "
      "them (HeteroFL's dynamic a1-b1-... mode; e.g. 0.5,0.5); empty: every client keeps the group of its block",
      Custom(_check_probabilities, parse_probabilities), metavar="P,P,...")
  client_dropout: tuple[float, ...] = setting(
      (), "probability that a sampled client does not answer its round (the round aggregates those that do): one "
      "for every group, or one per group in --groups order (e.g. 0.5,0.2,0: weak devices drop more); empty: every "
      "sampled client answers", Custom(_check_dropout, parse_dropout), metavar="P[,P,...]")
  availability_trace: str | None = setting(
      None, "a CSV file of 'client,round' lines (rounds from 1), each a sampled client that does not answer that "
      "round; with --client-dropout, a client answers when neither drops it", Text(), metavar="PATH")
  malicious_fraction: float = setting(
      0.0, "fraction of all clients that attack, a fixed set drawn from --seed and listed in summary.json and "
      "partition.txt (0: no attack; FedFA's experiments: 0.01, 0.2)", Number(minimum=0, maximum=1))
  backdoor_scale: float = setting(
      20.0, "lambda of FedFA's Eq. 1: a malicious client uploads its update plus lambda times the update of a copy "
      "trained on its labels shuffled", Number(minimum=0))
  backdoor_delta: str = setting(
      "update", "what lambda multiplies: 'update' (the label-shuffled copy's own update) or 'difference' (the "
      "copy's update minus the clean one)", OneOf(READINGS))
  backdoor_leaves: str = setting(
      "all", "which parameters lambda multiplies, the others taking lambda 1: 'all', 'kernels' (leaves of two or "
      "more axes: convolution and dense kernels, those FedFA rescales) or 'others' (biases, BatchNorm's scales and "
      "offsets); an ablation of where the boosted update does its damage", OneOf(BACKDOOR_LEAVES))
  malicious_group: str = setting(
      "any", "which clients --malicious-fraction draws from: 'any' (each keeps the group of its block) or the "
      "'largest' architecture's group, the global model's (FedFA's premise: attackers pick the largest network)",
      OneOf(MALICIOUS_GROUPS))

  def __post_init__(self):
    validate(self)


def check_federation(federation: FederationConfig, num_clients: int, group_names: Sequence[str],
                     method: Any = None) -> None:
  """Raises ValueError, naming the flags, if the clients, architecture groups and cohort size do not fit
  together, or (given the built ``method``, a `methods.Method`) do not fit the method: one group for a method
  that trains one, two clients per round for the stacked sharing (FedCross)."""
  clients_flag, per_round_flag = in_messages("--num-clients"), cli_name(FederationConfig, "clients_per_round")
  groups_flag, per_round = in_messages("--groups"), federation.clients_per_round
  if num_clients < len(group_names):
    raise ValueError(f"{clients_flag} {num_clients} is fewer than the {len(group_names)} architecture groups of "
                     f"{groups_flag}; every group needs a client")
  if per_round > num_clients:
    raise ValueError(f"{per_round_flag} {per_round} exceeds {clients_flag} {num_clients}")
  fraction = federation.malicious_fraction
  if fraction > 0 and num_malicious(num_clients, fraction) == 0:
    raise ValueError(f"{cli_name(FederationConfig, 'malicious_fraction')} {fraction} of {clients_flag} "
                     f"{num_clients} rounds to no malicious client; pass at least {0.5 / num_clients:g}, or 0 for a "
                     "clean run")
  draw = federation.group_draw
  if draw and len(draw) != len(group_names):
    raise ValueError(f"{cli_name(FederationConfig, 'group_draw')} needs one probability per architecture group "
                     f"({len(group_names)}), got {len(draw)}")
  dropout = federation.client_dropout
  if len(dropout) > 1 and len(dropout) != len(group_names):
    raise ValueError(f"{cli_name(FederationConfig, 'client_dropout')} takes one probability, or one per architecture "
                     f"group ({len(group_names)}), got {len(dropout)}")
  if method is None:
    return
  if method.one_group and len(group_names) != 1:
    raise ValueError(f"{method.name} trains one architecture group, got {len(group_names)} "
                     f"({', '.join(group_names)}) {method.one_group}; pass one (e.g. --groups cnn)")
  if method.sharing.stacked and (any(dropout) or federation.availability_trace is not None):
    flag = cli_name(FederationConfig, 'client_dropout' if any(dropout) else 'availability_trace')
    raise ValueError(f"{flag}: {method.name} trains one middleware model per client of a round and cross-aggregates "
                     "them all; a client that does not answer would leave its model out of the round")
  if method.sharing.stacked and per_round < 2:
    raise ValueError(f"{per_round_flag} must be >= 2 for {method.name}: it cross-aggregates one middleware model "
                     f"per client of a round, got {per_round}")
