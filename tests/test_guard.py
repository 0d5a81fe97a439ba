"""The divergence guard alone (`run.guard.DivergenceWatch`): its two signs of a diverged run, its replay of a
history on resume, and the checks of its settings. In a run: tests/test_recovery.py."""

from __future__ import annotations

import math

import pytest

from fedjax_hetero.config import DivergenceConfig
from fedjax_hetero.run.guard import DivergenceWatch


def row(r, loss=None, accuracy=None, group="g"):
  return {"round": r, "train_loss_per_group": {} if loss is None else {group: loss},
          "test_accuracy": None if accuracy is None else {group: accuracy, "mean": accuracy}}


def test_the_loss_sign_counts_from_a_uniform_guess_then_from_the_lowest_loss_above_a_floor():
  watch = DivergenceWatch(DivergenceConfig(loss_factor=10), num_classes=10)
  assert watch.check(row(1, loss=2.0)) is None
  error = watch.check(row(2, loss=20.5))
  assert (error.round, error.group) == (2, "g")
  assert "round 2: training loss of group g rose to 20.5, above 20 = 10 x (its lowest (2))" in str(error)
  assert watch.check(row(3, loss=0.05)) is None
  floor = math.log(10) / 2
  assert watch.check(row(4, loss=10 * floor - 0.01)) is None, "a converged run's noise is measured from the floor"
  error = watch.check(row(5, loss=10 * floor + 0.01))
  assert f"above {10 * floor:.4g} = 10 x (ln 10 / 2 = {floor:.4g}, the floor under its lowest (0.05))" in str(error)
  first = DivergenceWatch(DivergenceConfig(loss_factor=10), num_classes=10).check(row(1, loss=1e29))
  assert f"ln 10 = {math.log(10):.4g}, a uniform guess's loss" in str(first)


def test_the_accuracy_sign_needs_a_collapse_not_a_slow_start():
  watch = DivergenceWatch(DivergenceConfig(chance_evals=3), num_classes=10)
  for r in range(1, 6):  # at chance from the start: not learning yet, not diverged
    assert watch.check(row(r, accuracy=0.1)) is None
  assert watch.check(row(6, accuracy=0.45)) is None
  assert watch.check(row(7, accuracy=0.1)) is None
  assert watch.check(row(8, accuracy=0.11)) is None
  error = watch.check(row(9, accuracy=0.1))
  assert (error.round, error.group) == (9, "g") and "at chance for 3 evaluations in a row" in str(error)
  assert watch.check(row(10)) is None, "a round without evaluation neither counts nor resets"


def test_replay_takes_a_history_without_raising_and_keeps_counting():
  watch = DivergenceWatch(DivergenceConfig(chance_evals=2), num_classes=10)
  watch.replay([row(1, loss=1.0, accuracy=0.5), row(2, loss=50.0, accuracy=0.1)])
  assert watch.lowest_loss == {"g": 1.0}
  assert watch.check(row(3, accuracy=0.1)) is not None


@pytest.mark.parametrize("changes, message", [
    (dict(action="retry"), "--on-divergence"), (dict(loss_factor=1.0), "--divergence-loss-factor"),
    (dict(loss_factor=math.inf), "--divergence-loss-factor"), (dict(chance_evals=0), "--divergence-chance-evals"),
    (dict(rollback_lr_factor=1.5), "--divergence-rollback-lr-factor"),
    (dict(max_rollbacks=-1), "--divergence-max-rollbacks")])
def test_guard_settings_are_checked(changes, message):
  with pytest.raises(ValueError, match=message):
    DivergenceConfig(**changes)
