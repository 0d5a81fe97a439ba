"""Divergence guard: reads each round's host-side metrics and says when a run has diverged.

Three signs, each named with its round and architecture group:

- the training loss, or a weight of a server's model after the round, is not finite (the round's row raises
  `rounds.rows.NonFiniteLossError` or `NonFiniteModelError`: such a model is never evaluated into a row,
  saved, or kept as the best);
- a group's training loss rises above ``loss_factor`` times the lowest it has had (a finite blow-up, e.g.
  Adam at a huge learning rate: the loss reached 1e29 while staying finite). Before a group's first round
  the reference is ln C, the cross-entropy of a uniform guess over C classes, so that a blow-up in the
  first round counts too; and it never drops below ln C / 2, since a converged run's losses are small and
  their ordinary noise (healthy runs here rose to 5.8x their lowest) must not count;
- a group's test accuracy sits at chance for ``chance_evals`` evaluations in a row after it had been
  clearly above chance (a collapse, not a slow start).

`DivergenceWatch` is pure host-side bookkeeping over the metrics rows `Simulation.run_round` returns,
so the guard costs nothing on the device. What to do about it (stop, or roll back to the best
checkpoint with a lower learning rate) is the runner's part: `DivergenceConfig.action` (in `fedjax_hetero.config`).
A model that a server's step made non-finite from finite client losses gets no rollback
(`DivergenceError.in_server_step`): that lowers the clients' learning rate, and the server step would break the
model again; the stop names the server side (`server_step_advice`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from fedjax_hetero.config.declare import flag_of
from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.config.run import DivergenceConfig, RunConfig
from fedjax_hetero.config.server import ServerOptimizerConfig
from fedjax_hetero.rounds.rows import NonFiniteLossError, NonFiniteModelError

# The server optimizer's learning rate is tuned on a grid of powers of ten (Reddi et al. 2021): advise the next one.
SERVER_LR_STEP = 10


class DivergenceError(FloatingPointError):
  """A run diverged; the message names the round, the group and the sign. ``in_server_step``: a server's step
  made the model non-finite while the clients' losses were finite (`rounds.rows.NonFiniteModelError`)."""

  def __init__(self, message: str, round_: int, group: str | None, in_server_step: bool = False):
    super().__init__(message)
    self.round = round_
    self.group = group
    self.in_server_step = in_server_step

  @classmethod
  def of_non_finite(cls, error: NonFiniteLossError, round_: int) -> "DivergenceError":
    """The divergence that a non-finite loss or model of round ``round_`` shows."""
    return cls(str(error), round_, None, in_server_step=isinstance(error, NonFiniteModelError))


def diverged_round(error: Exception, default: int) -> int:
  """The round a non-finite value's error names (`rounds.rows.NonFiniteLossError`), else ``default``."""
  return getattr(error, "round", None) or default


def stop_advice(config: RunConfig, rollbacks_tried: int, best: int | None, checkpoint_dir: str,
                error: DivergenceError | None = None) -> str:
  """What the error of a run the guard stopped advises: for a model that the server's step broke (``error``), the
  server side; else a rollback while the run tried none (--on-divergence stop), a lower learning rate once its
  rollbacks ran out (``config`` holds the rate the last one left)."""
  if error is not None and error.in_server_step:
    kept = "" if best is None else f"; the best checkpoint (round {best}) is kept in {checkpoint_dir}"
    return server_step_advice(config) + kept
  guard, rate = config.divergence, config.client.learning_rate
  lower = f"--lr {rate * guard.rollback_lr_factor:g}" + "".join(f" (or {how})" for _, how in server_side(config))
  if best is None and guard.action == "stop":
    return ("no checkpoint was evaluated above chance, so there is nothing to keep: start again with a lower "
            f"learning rate, e.g. {lower} --overwrite, or --on-divergence rollback (from the initial model)")
  kept = ("no checkpoint was evaluated above chance" if best is None else
          f"the best checkpoint (round {best}) is kept in {checkpoint_dir}")
  if guard.action == "stop":
    return (f"{kept}: --on-divergence rollback restarts from it with a lower learning rate" +
            "".join(f", or lower {what} ({how}, --resume)" for what, how in server_side(config)))
  if not rollbacks_tried:
    return (f"{kept}; --divergence-max-rollbacks 0 allows no rollback: raise it, or lower the learning rate "
            f"(e.g. {lower} {'--resume' if best is not None else '--overwrite'})")
  resume = f"{lower} --resume (from the latest checkpoint) or " if best is not None else ""
  return (f"it diverged again after {rollbacks_tried} rollback{'s' if rollbacks_tried != 1 else ''} in this run "
          f"(--divergence-max-rollbacks {guard.max_rollbacks}), the last to learning rate {rate:g}: lower it "
          f"further, e.g. {resume}{lower} --overwrite (from the start); {kept}")


def server_side(config: RunConfig) -> list[tuple[str, str]]:
  """The server-side settings that break a model as the clients' learning rate does, each as (what, the change to
  try): a rollback lowers only the clients' rate. (A server optimizer's step blows a model up too, a finite one at
  chance and then NaN; DP-FedAvg's noise has std z C / m on every element, m about the cohort.)"""
  sides = []
  if config.server.optimizer != "none":
    sides.append(("the server optimizer's learning rate", lower_server_lr(config)))
  privacy = config.privacy
  if privacy.on and privacy.noise_multiplier > 0:
    std = privacy.noise_multiplier * privacy.clip / config.federation.clients_per_round
    sides.append((f"the privacy noise (std about {std:.3g} per element)",
                  f"a lower {flag_of(PrivacyConfig, 'noise_multiplier')} or more --clients-per-round"))
  return sides


def lower_server_lr(config: RunConfig) -> str:
  """The next server learning rate to try, as a flag: a tenth of the run's, and at most the default (a rate far
  above it, 1e30, would otherwise be advised as 1e29)."""
  lr = min(config.server.lr / SERVER_LR_STEP, ServerOptimizerConfig().lr)
  return f"{flag_of(ServerOptimizerConfig, 'lr')} {lr:g}"


def server_step_advice(config: RunConfig) -> str:
  """What to do about a model that the server's step made non-finite from finite client losses."""
  none_tried = ", so none was tried" if config.divergence.action == "rollback" else ""
  said = ("the server's step made the model non-finite from finite client losses, which a rollback to a lower "
          f"client learning rate (--lr) would not mend{none_tried}")
  if config.server.optimizer != "none":
    return (f"{said}: lower the server optimizer's learning rate (e.g. {lower_server_lr(config)} --resume), or "
            "check the method's server steps")
  return f"{said}: check the method's server step (a user's method), or its server-side settings"


def at_chance(accuracy: float, num_classes: int) -> bool:
  """Within a fifth of a class of guessing (10 classes: below 12%)."""
  return accuracy < 1.2 / num_classes


def ranked(accuracy: float | None, num_classes: int) -> bool:
  """Whether an evaluated model may be kept as the best one, the rollback target: above chance (a model at chance,
  e.g. one a blown-up step left finite but useless, is no better than the initial one)."""
  return accuracy is not None and not at_chance(accuracy, num_classes)


def clearly_learning(accuracy: float, num_classes: int) -> bool:
  """At least twice chance (10 classes: 20%)."""
  return accuracy >= 2.0 / num_classes


@dataclasses.dataclass
class DivergenceWatch:
  """The guard's memory over a run's metrics rows; `check` returns the first sign of divergence in a row.

  Rebuild it from the rows kept when a run resumes (`replay`), so the signs count across segments.
  """

  config: DivergenceConfig
  num_classes: int
  lowest_loss: dict[str, float] = dataclasses.field(default_factory=dict)
  chance_streak: dict[str, int] = dataclasses.field(default_factory=dict)
  learned: dict[str, bool] = dataclasses.field(default_factory=dict)

  def _loss_reference(self, group: str) -> tuple[float, str]:
    """What a group's loss is compared with, and how a message names it: ln C before its first round (an
    untrained model's loss, a uniform guess's), then its lowest loss, but never less than ln C / 2: a converged
    run's losses are small, and its ordinary round-to-round noise would otherwise count."""
    uniform = math.log(self.num_classes)
    lowest = self.lowest_loss.get(group)
    if lowest is None:
      return uniform, f"ln {self.num_classes} = {uniform:.4g}, a uniform guess's loss"
    if lowest < uniform / 2:
      return uniform / 2, f"ln {self.num_classes} / 2 = {uniform / 2:.4g}, the floor under its lowest ({lowest:.4g})"
    return lowest, f"its lowest ({lowest:.4g})"

  def replay(self, rows: list[Mapping[str, Any]]) -> None:
    """Takes rows already accepted (a resumed run's history), raising nothing."""
    for row in rows:
      self.check(row)

  def check(self, row: Mapping[str, Any]) -> DivergenceError | None:
    """Takes one round's metrics; returns the first sign of divergence in them, if any."""
    r, error = row["round"], None
    for group, loss in row.get("train_loss_per_group", {}).items():
      reference, named = self._loss_reference(group)
      if error is None and loss > self.config.loss_factor * reference:
        error = DivergenceError(f"round {r}: training loss of group {group} rose to {loss:.4g}, above "
                                f"{self.config.loss_factor * reference:.4g} = {self.config.loss_factor:g} x "
                                f"({named}) (--divergence-loss-factor)", r, group)
      self.lowest_loss[group] = min(self.lowest_loss.get(group, math.inf), loss)
    for group, accuracy in (row.get("test_accuracy") or {}).items():
      if group == "mean":
        continue
      self.learned[group] = self.learned.get(group, False) or clearly_learning(accuracy, self.num_classes)
      streak = self.chance_streak.get(group, 0) + 1 if at_chance(accuracy, self.num_classes) else 0
      self.chance_streak[group] = streak
      if error is None and self.learned[group] and streak >= self.config.chance_evals:
        error = DivergenceError(f"round {r}: test accuracy of group {group} is {100 * accuracy:.1f}%, at chance "
                                f"for {streak} evaluations in a row (--divergence-chance-evals)", r, group)
    return error
