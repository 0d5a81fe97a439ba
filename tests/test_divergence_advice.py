"""What a run stopped by a non-finite model says to do: a server step that breaks the model from finite client
updates is not helped by a lower client learning rate, so the guard neither rolls back for it nor advises --lr
(tests/test_recovery.py has the guard's other cases)."""

from __future__ import annotations

import json
import re

import pytest

from fedjax_hetero.run.guard import DivergenceError
from fedjax_hetero.run.runner import run_experiment
from tests.test_recovery import dataset, poisoned  # noqa: F401 - (dataset: the module fixture)
from tests.test_runner import base_config, read_rows

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("server_optimizer", ["none", "adam"])
def test_a_model_broken_by_the_server_step_stops_without_rollback_naming_the_server_side(server_optimizer, dataset,
                                                                                         tmp_path):
  """(Probe P21: it rolled back twice, lowering --lr, then advised "lower it further, e.g. --lr 0.000125".)"""
  out = tmp_path / "run"
  config = base_config(out, method="Poisoned", checkpoint_every=1, eval_every=1, on_divergence="rollback",
                       server_optimizer=server_optimizer)
  with pytest.raises(DivergenceError) as info:
    run_experiment(config, dataset, log=lambda _: None, method=poisoned(4))
  message = str(info.value)
  assert message.startswith("round 4: the model of group(s) ") and "after Poisoned's server step" in message, message
  assert not re.search(r"--lr \d", message) and "--on-divergence rollback" not in message, message
  assert ("the server's step made the model non-finite from finite client losses, which a rollback to a lower client "
          "learning rate (--lr) would not mend, so none was tried: ") in message, message
  if server_optimizer == "adam":
    assert "lower the server optimizer's learning rate (e.g. --server-lr 0.001 --resume)" in message, message
  else:
    assert "check the method's server step (a user's method)" in message, message
  assert "the best checkpoint (round 3) is kept in " in message, message  # (rounds 1-2 are at chance: no best)
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert summary["rollbacks"] == [] and summary["stopped_by_divergence"]["round"] == 4
  assert [r["round"] for r in read_rows(out)] == [1, 2, 3]


def test_a_run_that_diverges_before_any_evaluated_checkpoint_is_advised_a_lower_rate_from_the_start():
  """Held-out probe 17: "nothing to keep or roll back to", and no way forward."""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run.guard import stop_advice

  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp",), learning_rate=0.1, on_divergence="stop")
  advice = stop_advice(config, rollbacks_tried=0, best=None, checkpoint_dir="unused")
  factor = config.divergence.rollback_lr_factor
  assert advice == ("no checkpoint was evaluated above chance, so there is nothing to keep: start again with a lower "
                    f"learning rate, e.g. --lr {0.1 * factor:g} --overwrite, or --on-divergence rollback (from the "
                    "initial model)"), advice


def blown_up_by_the_server(out, **changes):
  """Adam at a server learning rate of 1e30: round 1's model is finite (weights ~1e29) but at chance, round 2's
  training loss NaN."""
  from fedjax_hetero.config import RunConfig
  return RunConfig.from_flags(**{**dict(dataset="synthetic", groups=("mlp",), num_clients=4, clients_per_round=2,
                                        rounds=6, eval_every=1, checkpoint_every=1, progress=False,
                                        output_dir=str(out), server_optimizer="adam", server_lr=1e30), **changes})


def test_a_model_at_chance_is_no_best_checkpoint_and_the_advice_names_the_server_optimizer(tmp_path):
  """(Held-out probe: round 1 at chance with weights ~1e29 was kept as the best and offered for rollback, and the
  advice blamed --lr, which the user never gave.)"""
  from fedjax_hetero.data import synthetic_dataset
  config = blown_up_by_the_server(tmp_path / "stop")
  with pytest.raises(DivergenceError) as info:
    run_experiment(config, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  message = str(info.value)
  assert "no checkpoint was evaluated above chance, so there is nothing to keep" in message, message
  assert "e.g. --lr 0.0005 (or --server-lr 0.01) --overwrite" in message, message
  with open(tmp_path / "stop" / "summary.json") as f:
    assert json.load(f)["stopped_by_divergence"]["best_checkpoint"] is None


def test_a_rollback_with_no_checkpoint_above_chance_restarts_from_the_initial_model(tmp_path):
  """(Held-out probe: every rollback went back to round 1's checkpoint, which was already broken.)"""
  from fedjax_hetero.data import synthetic_dataset
  config = blown_up_by_the_server(tmp_path / "rollback", on_divergence="rollback")
  with pytest.raises(DivergenceError) as info:
    run_experiment(config, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  assert "after 3 rollbacks in this run" in str(info.value) and "--resume" not in str(info.value), str(info.value)
  with open(tmp_path / "rollback" / "summary.json") as f:
    summary = json.load(f)
  assert [r["to_round"] for r in summary["rollbacks"]] == [0, 0, 0]
  assert [s["from_round"] for s in summary["segments"]] == [1]  # (each rollback retrained from round 1)


@pytest.mark.parametrize("changes, advice", [
    (dict(server_optimizer="yogi", server_lr=1e10, rounds=3),
     "--on-divergence rollback restarts from it with a lower learning rate, or lower the server optimizer's learning "
     "rate (--server-lr 0.01, --resume)"),
    (dict(server_optimizer="none", server_lr=0.01, dp_clip=1.0, dp_noise_multiplier=1e6, rounds=3),
     "(or a lower --dp-noise-multiplier or more --clients-per-round) --overwrite"),
])
def test_a_server_side_blow_up_is_advised_on_the_server_side(tmp_path, changes, advice):
  """(Second held-out survey: a server optimizer's or the privacy noise's blow-up advised only the clients' --lr.)"""
  from fedjax_hetero.data import synthetic_dataset
  config = blown_up_by_the_server(tmp_path / "run", **changes)
  with pytest.raises(DivergenceError) as info:
    run_experiment(config, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  assert advice in str(info.value), str(info.value)
