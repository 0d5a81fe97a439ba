"""Divergence guard: reads each round's host-side metrics and says when a run has diverged.

Three signs, each named with its round and architecture group:

- the training loss, or a weight of a server's model after the round, is not finite, or the weight is so large
  that products of two overflow (the round's row raises `rounds.rows.NonFiniteLossError` or
  `NonFiniteModelError`: such a model is never evaluated into a row, saved, or kept as the best);
- a group's training loss rises above ``loss_factor`` times the lowest it has had (a finite blow-up, e.g.
  Adam at a huge learning rate: the loss reached 1e29 while staying finite). Before a group's first round
  the reference is ln C, the cross-entropy of a uniform guess over C classes, so that a blow-up in the
  first round counts too; and it never drops below ln C / 2, since a converged run's losses are small and
  their ordinary noise (healthy runs here rose to 5.8x their lowest) must not count;
- a group's test accuracy sits at chance for ``chance_evals`` evaluations in a row after it had been
  clearly above chance (a collapse, not a slow start).

`DivergenceWatch` is pure host-side bookkeeping over the metrics rows `Simulation.run_round` returns,
so the guard costs nothing on the device. What to do about it (stop, or roll back to the best
checkpoint with a lower learning rate: `rolled_back`) is the runner's part: `DivergenceConfig.action` (in
`fedjax_hetero.config`). Two divergences get no rollback, since a lower learning rate would not mend them and the
stop names the server side instead: a model that a server's step broke from finite client losses below the loss
bound (`DivergenceError.in_server_step`; above it the clients' loss is the sign), and one that diverges again in
the round it diverged in before the last rollback, with the same loss (`repeated`): the rates that rollback lowered
are not what sets it (the privacy noise, or a server step, is). But where that rollback restored the round just
before, the restored model sets that loss (`in_restored_model`), and the next rollback goes back to the initial
model instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from fedjax_hetero.config.declare import flag_of
from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.config.run import DivergenceConfig, RunConfig
from fedjax_hetero.config.server import ServerOptimizerConfig
from fedjax_hetero.rounds.rows import NonFiniteLossError, NonFiniteModelError

# The server optimizer's learning rate is tuned on a grid of powers of ten (Reddi et al. 2021): advise the next one.
SERVER_LR_STEP = 10
# A divergence in the round the last rollback went back before, with a loss within this fraction of the one it had
# then, is the same divergence: the learning rates that rollback lowered do not set it. Halving the clients' rate
# halves their steps, which moves a loss they blew up by a large fraction of itself; a loss set by something the rates
# do not reach (the privacy noise, std z C / m on every weight; a server step) comes back equal to float precision
# (1e-7 in the held-out probe). 1% sits far from both.
SAME_LOSS = 0.01


class DivergenceError(FloatingPointError):
  """A run diverged; the message names the round, the group and the sign. ``in_server_step``: a server's step
  broke the model while the clients' losses were finite and below the loss bound
  (`rounds.rows.NonFiniteModelError`)."""

  def __init__(self, message: str, round_: int, group: str | None, in_server_step: bool = False,
               loss: float | None = None):
    super().__init__(message)
    self.round = round_
    self.group = group
    self.in_server_step = in_server_step
    self.loss = loss  # the group's training loss, when that is the sign (rose above its reference)

  @classmethod
  def of_non_finite(cls, error: NonFiniteLossError, round_: int) -> "DivergenceError":
    """The divergence that a non-finite loss or model of round ``round_`` shows."""
    return cls(str(error), round_, getattr(error, "group", None), in_server_step=isinstance(error, NonFiniteModelError))


def diverged_round(error: Exception, default: int) -> int:
  """The round a non-finite value's error names (`rounds.rows.NonFiniteLossError`), else ``default``."""
  return getattr(error, "round", None) or default


def stop_advice(config: RunConfig, rollbacks_tried: int, best: int | None, checkpoint_dir: str,
                error: DivergenceError | None = None, repeated_rollback: Mapping[str, Any] | None = None) -> str:
  """What the error of a run the guard stopped advises: for a model that the server's step broke (``error``), the
  server side; for a divergence the last rollback left as it was (``repeated_rollback``, its record: `repeated`),
  the server side that rollback did not lower; else a rollback while the run tried none (--on-divergence stop),
  the privacy noise first where there is one; lower rates once its rollbacks ran out (``config`` holds the rates the
  last one left)."""
  kept = ("no checkpoint was evaluated above chance" if best is None else
          f"the best checkpoint (round {best}) is kept in {checkpoint_dir}")
  if error is not None and error.in_server_step:
    return server_step_advice(config) + ("" if best is None else f"; {kept}")
  if repeated_rollback is not None:
    return f"{not_the_rates(config, repeated_rollback)}; {kept}"
  guard, rate = config.divergence, config.client.learning_rate
  if guard.action == "stop":
    noise = "".join(f"{what} may be what breaks the model, which no lower learning rate mends: start again with {how} "
                    f"{restart}; if not, " for what, how, restart in noise_side(config))
    if best is None:
      return (f"no checkpoint was evaluated above chance, so there is nothing to keep: {noise}start again with a lower "
              f"learning rate, e.g. {lower_rates(config, noise=False)} --overwrite, or --on-divergence rollback (from "
              "the initial model)")
    lower = "lower learning rates (the clients' and the server's)" if server_lr_side(config) else \
        "a lower learning rate"
    return (f"{noise}{kept}: --on-divergence rollback restarts from it with {lower}" +
            "".join(f", or lower {what} ({how} --overwrite: the checkpoints that --resume starts from may hold a "
                    "model it blew up already)" for what, how, _ in server_lr_side(config)))
  if not rollbacks_tried:
    restart = "--resume" if best is not None else "--overwrite"
    return (f"{kept}; --divergence-max-rollbacks 0 allows no rollback: raise it, or lower the learning rate "
            f"(e.g. {lower_rates(config, noise=best is None)} {restart})")
  resume = f"{lower_rates(config, noise=False)} --resume (from the latest checkpoint) or " if best is not None else ""
  rates, them = ((f"learning rate {rate:g}", "it") if config.server.optimizer == "none" else
                 (f"learning rate {rate:g} and server learning rate {config.server.lr:g}", "them"))
  return (f"it diverged again after {rollbacks_tried} rollback{'s' if rollbacks_tried != 1 else ''} in this run "
          f"(--divergence-max-rollbacks {guard.max_rollbacks}), the last to {rates}: lower {them} further, e.g. "
          f"{resume}{lower_rates(config, noise=True)} --overwrite (from the start); {kept}")


def lower_rates(config: RunConfig, noise: bool) -> str:
  """The next clients' learning rate to try, as a flag, with the server side's settings as alternatives (``noise``:
  the privacy noise's too, which only a new run may change)."""
  sides = server_side(config) if noise else server_lr_side(config)
  return f"--lr {config.client.learning_rate * config.divergence.rollback_lr_factor:g}" + "".join(
      f" (or {how})" for _, how, _ in sides)


def not_the_rates(config: RunConfig, rollback: Mapping[str, Any]) -> str:
  """What to do about a divergence that the last rollback (its record) left as it was: the rates it lowered do not set
  the loss, the server side it did not lower may."""
  lowered = said_changes({key: rollback[key] for key in RATE_NAMES if key in rollback}, to_only=True)
  which = "learning rates it lowered are" if "server_lr" in rollback else "learning rate is"
  said = (f"it diverged in round {rollback['diverged_round']} again with the same loss (within {SAME_LOSS:.0%} of "
          f"{rollback['diverged_loss']:.4g}) after the rollback to {lowered}, so the {which} not the cause and no "
          "further rollback was tried")
  untried = [side for side in server_side(config) if not (side in server_lr_side(config) and "server_lr" in rollback)]
  if not untried:
    return f"{said}: check the method's server steps (a user's method), or its server-side settings"
  return f"{said}: lower " + ", or ".join(f"{what}: {how} {restart}" for what, how, restart in untried)


def server_side(config: RunConfig) -> list[tuple[str, str, str]]:
  """The server-side settings that break a model as the clients' learning rate does, each as (what, the change to
  try, how to restart with it): a server optimizer's step blows a model up too, a finite one at chance and then NaN
  (a rollback lowers its rate with the clients'); DP-FedAvg's noise has std z C / m on every element, m about the
  cohort (a resume may not change it: the run's privacy accounting follows it)."""
  return server_lr_side(config) + noise_side(config)


def server_lr_side(config: RunConfig) -> list[tuple[str, str, str]]:
  """`server_side`'s entry for the server optimizer's learning rate ([] without one)."""
  if config.server.optimizer == "none":
    return []
  return [("the server optimizer's learning rate", lower_server_lr(config), "--resume")]


def noise_side(config: RunConfig) -> list[tuple[str, str, str]]:
  """`server_side`'s entry for the privacy noise ([] without any)."""
  privacy = config.privacy
  if not (privacy.on and privacy.noise_multiplier > 0):
    return []
  std = privacy.noise_multiplier * privacy.clip / config.federation.clients_per_round
  return [(f"the privacy noise (std about {std:.3g} per element)",
           f"a lower {flag_of(PrivacyConfig, 'noise_multiplier')} or more --clients-per-round", "--overwrite")]


def lowered_server_lr(config: RunConfig) -> float:
  """The next server learning rate to try: a tenth of the run's (`SERVER_LR_STEP`), and at most the default (a rate
  far above it, 1e30, would otherwise be lowered to 1e29)."""
  return min(config.server.lr / SERVER_LR_STEP, ServerOptimizerConfig().lr)


def lower_server_lr(config: RunConfig) -> str:
  """`lowered_server_lr` as a flag."""
  return f"{flag_of(ServerOptimizerConfig, 'lr')} {lowered_server_lr(config):g}"


def server_step_advice(config: RunConfig) -> str:
  """What to do about a model that the server's step broke (non-finite, or too large: `rounds.rows.LARGEST_WEIGHT`)
  from finite client losses."""
  none_tried = ", so none was tried" if config.divergence.action == "rollback" else ""
  said = ("the server's step broke the model from finite client losses, which a rollback to a lower client learning "
          f"rate (--lr) would not mend{none_tried}")
  if config.server.optimizer != "none":
    return (f"{said}: lower the server optimizer's learning rate (e.g. {lower_server_lr(config)} --resume), or "
            "check the method's server steps")
  return f"{said}: check the method's server step (a user's method), or its server-side settings"


# How a rollback's record names the rates it lowered, and how messages say them.
RATE_NAMES = {"learning_rate": "learning rate", "server_lr": "server learning rate"}


def rolled_back(config: RunConfig, lower: bool = True) -> tuple[RunConfig, dict[str, list[float]]]:
  """The config a rollback goes on with, and its rates as the rollback's record holds them, each ``[before,
  after]``: the clients' learning rate times ``rollback_lr_factor`` (``learning_rate``) and, under a server
  optimizer, whose step blows a model up as the clients' do, its rate as the advice lowers it (`lowered_server_lr`;
  ``server_lr``). Unless ``lower``: the same rates (a rollback past a broken checkpoint, `in_restored_model`)."""
  factor = config.divergence.rollback_lr_factor if lower else 1.0
  client = dataclasses.replace(config.client, learning_rate=config.client.learning_rate * factor)
  changes = {"learning_rate": [config.client.learning_rate, client.learning_rate]}
  server = config.server
  if server.optimizer != "none":
    server = dataclasses.replace(server, lr=lowered_server_lr(config) if lower else server.lr)
    changes["server_lr"] = [config.server.lr, server.lr]
  return dataclasses.replace(config, client=client, server=server), changes


def said_changes(changes: Mapping[str, Sequence[float]], to_only: bool = False) -> str:
  """``learning rate 0.001 -> 0.0005, server learning rate 1e+10 -> 0.01`` (``to_only``: ``learning rate 0.0005 and
  server learning rate 0.01``)."""
  if to_only:
    return " and ".join(f"{RATE_NAMES[key]} {after:g}" for key, (_, after) in changes.items())
  return ", ".join(f"{RATE_NAMES[key]} {before:g} -> {after:g}" for key, (before, after) in changes.items())


def rollback_reason(error: DivergenceError, to_round: int, changes: Mapping[str, Sequence[float]],
                    past: Mapping[str, Any] | None = None) -> str:
  """Why and how the run rolls back (its log line, its new segment's reason); ``past``: the last rollback's record,
  whose restored checkpoint holds the divergence (`in_restored_model`)."""
  if past is None:
    return f"rollback to round {to_round}: {error}; {said_changes(changes)}"
  return (f"rollback to round {to_round}: {error}; as before the rollback to round {past['to_round']}, whose model "
          f"sets this loss (the rates it lowered could not change it): going back to the initial model with "
          f"{said_changes(changes, to_only=True)}")


def rollback_record(error: DivergenceError, to_round: int, changes: Mapping[str, list[float]]) -> dict[str, Any]:
  """A rollback as the run's history records it (`run.history`): the round that diverged, the one it went back to,
  why, the rates it lowered and, for a loss that rose, the group and its loss (what `repeated` compares)."""
  loss = {} if error.loss is None else {"diverged_group": error.group, "diverged_loss": error.loss}
  return {"diverged_round": error.round, "to_round": to_round, "reason": str(error), **changes, **loss}


def repeated(error: DivergenceError, rollbacks: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
  """The last rollback's record if ``error`` is the divergence it went back before, as it was: the same round and
  group, and a loss within `SAME_LOSS` of the one it had then (the rates it lowered do not set it); else None."""
  last = rollbacks[-1] if rollbacks else {}
  before = last.get("diverged_loss")
  if error.loss is None or before is None:
    return None
  same_place = (last["diverged_round"], last.get("diverged_group")) == (error.round, error.group)
  return last if same_place and abs(error.loss - before) <= SAME_LOSS * abs(before) else None


def in_restored_model(past: Mapping[str, Any], error: DivergenceError) -> bool:
  """Whether a divergence that the last rollback (``past``) left as it was (`repeated`) is in the checkpoint that
  rollback restored: it went back to the round just before the diverged one, and a round's training loss is taken
  in local steps that start from the model before it (the round's server step comes after), so the model restored
  sets it, whatever the rates (as when the server optimizer's step blew up the model kept as the best, 1e9 weights
  still above chance). The initial model is the one to go back to then."""
  return 0 < past["to_round"] == error.round - 1


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

  def loss_rise(self, r: int, group: str, loss: float) -> DivergenceError | None:
    """The sign a group's training loss of round ``r`` gives, if it rose above its reference (changes nothing)."""
    reference, named = self._loss_reference(group)
    if loss <= self.config.loss_factor * reference:
      return None
    return DivergenceError(f"round {r}: training loss of group {group} rose to {loss:.4g}, above "
                           f"{self.config.loss_factor * reference:.4g} = {self.config.loss_factor:g} x ({named}) "
                           "(--divergence-loss-factor)", r, group, loss=loss)

  def replay(self, rows: list[Mapping[str, Any]]) -> None:
    """Takes rows already accepted (a resumed run's history), raising nothing."""
    for row in rows:
      self.check(row)

  def check(self, row: Mapping[str, Any]) -> DivergenceError | None:
    """Takes one round's metrics; returns the first sign of divergence in them, if any."""
    r, error = row["round"], None
    for group, loss in row.get("train_loss_per_group", {}).items():
      error = error or self.loss_rise(r, group, loss)
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
