"""A round's metrics row, written in one place whichever mapping ran the round (the host loop or a device program).

A row is what ``metrics.jsonl`` holds per round: the training loss (mean over the groups that trained, and per
group), the drawn clients, the examples seen, the round's seconds and samples/s, the server steps' metrics,
the gradient dissimilarity when tracked, the clients and examples of every group, the sampled clients that did
not answer (under client availability), and the test accuracy of evaluation rounds (with per-client evaluation
also every client's accuracy on its held-out samples, `client_eval.accuracy_row`). A run's rows also hold
their costs (`rounds.costs`, added by the runner).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import jax
import numpy as np

from fedjax_hetero.rounds.client_eval import accuracy_row
from fedjax_hetero.rounds.inputs import Call

if TYPE_CHECKING:
  from fedjax_hetero.rounds.body import RoundOutputs
  from fedjax_hetero.rounds.spec import RoundSpec


class NonFiniteLossError(FloatingPointError):
  """Local training diverged; names the round (``round``, 1-based) and architecture group (``group``: its name; a
  non-finite model: its federation's groups, comma-separated)."""

  def __init__(self, message: str, round_: int | None = None, group: str | None = None):
    super().__init__(message)
    self.round = round_
    self.group = group


class NonFiniteModelError(NonFiniteLossError):
  """A server's model has a non-finite weight after a round, or one above `LARGEST_WEIGHT` (its server step
  diverged, a user's step broke it, or its clients' training blew the weights up with finite losses); the model is
  neither evaluated into a row nor saved. ``losses``: the round's training loss per group that trained."""

  def __init__(self, message: str, round_: int | None = None, group: str | None = None,
               losses: Mapping[str, float] | None = None):
    super().__init__(message, round_, group)
    self.losses = dict(losses or {})


# The largest weight a server's model may hold: the square root of float32's largest (about 1.8e19), so that the
# product of two weights (a layer's input times its kernel, a logit in the loss) is finite. A model beyond it computes
# inf and NaN the round after, or, as a user's step that scaled the weights by 1e30 did, a finite but useless
# prediction above chance, which would be kept as the best checkpoint. Healthy models' weights are many orders below.
LARGEST_WEIGHT = float(np.sqrt(np.finfo(np.float32).max))


def host_metrics(tree: Any) -> Any:
  """Device metrics as Python floats; NaN (e.g. nothing to average this round) as None."""
  def value(x):
    x = float(x)
    return x if math.isfinite(x) else None
  return jax.tree.map(value, jax.device_get(tree))


def merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
  """Deep-merges nested metric dicts (per-federation entries of one metric side by side)."""
  for k, v in new.items():
    if isinstance(v, dict) and isinstance(into.get(k), dict):
      merge(into[k], v)
    else:
      into[k] = v


def group_loss(round_index: int, group: str, loss_sum: float, num_examples: float) -> float:
  """A group's mean training loss in round ``round_index`` (0-based); `NonFiniteLossError` if it is not finite."""
  loss = float(loss_sum) / max(float(num_examples), 1.0)
  if not math.isfinite(loss):
    raise NonFiniteLossError(f"round {round_index + 1}: training loss of group {group} is {loss}", round_index + 1,
                             group)
  return loss


def round_row(round_index: int, losses: Mapping[str, float], draws: np.ndarray, examples: float, seconds: float,
              server_metrics: Mapping[str, Any]) -> dict[str, Any]:
  """The metrics row of round ``round_index`` (0-based) from its groups' losses (groups that took a local step
  only; None for a round in which none did, and no speed either: a 0 would read as a measurement)."""
  row = {"round": round_index + 1, "train_loss": sum(losses.values()) / len(losses) if losses else None,
         "train_loss_per_group": dict(losses), "clients": [int(c) for c in draws], "examples": int(examples),
         "round_seconds": seconds, "samples_per_s": examples / seconds if examples else None, **server_metrics}
  return row


def accuracies(correct: Sequence[int], groups: Sequence[str], num_test: int) -> dict[str, float]:
  """Every group's test accuracy from its count of correct predictions, and their mean under ``"mean"``."""
  accs = {name: int(c) / num_test for name, c in zip(groups, correct)}
  accs["mean"] = float(np.mean(list(accs.values())))
  return accs


def call_row(spec: "RoundSpec", call: Call, i: int, outputs: "RoundOutputs", seconds: float,
             evaluate: Collection[int]) -> dict[str, Any]:
  """The metrics row of the call's round ``i`` from its outputs (host values); `NonFiniteLossError` if a group
  that trained has a non-finite loss, `NonFiniteModelError` if a server's model has a non-finite weight or one above
  `LARGEST_WEIGHT`."""
  r, names = call.first + i, [g.name for g in spec.groups]
  chosen, cohorts, _, dropped = call.drawn[i]
  trained = [g for g in range(len(spec.groups)) if len(cohorts[g])]
  losses = {names[g]: group_loss(r, names[g], outputs.loss_sum[g], outputs.num_examples[g]) for g in trained
            if float(outputs.num_examples[g]) > 0}  # (a group whose clients took no step has no loss)
  for f, largest in zip(spec.federations, outputs.largest_weight):
    largest = float(largest)
    if not largest <= LARGEST_WEIGHT:
      what = "non-finite weights" if not math.isfinite(largest) else (
          f"weights up to {largest:.3g}, above {LARGEST_WEIGHT:.3g} (the square root of float32's largest: products "
          "of two overflow)")
      members = ", ".join(names[g] for g in f.members)
      own = {names[g]: losses[names[g]] for g in f.members if names[g] in losses}
      largest_loss = f", up to {max(own.values()):.3g}" if own else ""
      raise NonFiniteModelError(f"round {r + 1}: the model of group(s) {members} has {what} after "
                                f"{spec.method.name}'s server step (the losses were finite{largest_loss})", r + 1,
                                members, own)
  server: dict[str, Any] = {}
  for f in spec.federations:
    if any(len(cohorts[g]) for g in f.members):
      merge(server, {**host_metrics(outputs.server_metrics[f.index]),
                     **{k: v for p in call.plans[i] for k, v in p.log.items()}})
  examples = sum(float(outputs.num_examples[g]) for g in trained)
  row = round_row(r, losses, chosen.draws, examples, seconds, server)
  # (what the run's cost accounting reads: `rounds.costs.costed_row`)
  row["clients_per_group"] = {names[g]: len(cohorts[g]) for g in range(len(names))}
  row["examples_per_group"] = {names[g]: round(float(outputs.num_examples[g])) if len(cohorts[g]) else 0
                               for g in range(len(names))}
  if spec.availability.on:
    groups = spec.groups_of_round(r)[dropped]
    row["dropped"] = [int(c) for c in dropped]
    row["dropped_per_group"] = {names[g]: int((groups == g).sum()) for g in range(len(names))}
  row["test_accuracy"] = accuracies(outputs.correct, names, len(spec.test_labels)) if r + 1 in evaluate else None
  if spec.client_eval is not None:
    row["client_accuracy"] = accuracy_row(spec, outputs.client_correct) if r + 1 in evaluate else None
  return row
