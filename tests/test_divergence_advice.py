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
    run_experiment(config, dataset, log=lambda _: None, method=poisoned(3))
  message = str(info.value)
  assert message.startswith("round 3: the model of group(s) ") and "after Poisoned's server step" in message, message
  assert not re.search(r"--lr \d", message) and "--on-divergence rollback" not in message, message
  assert ("the server's step made the model non-finite from finite client losses, which a rollback to a lower client "
          "learning rate (--lr) would not mend, so none was tried: ") in message, message
  if server_optimizer == "adam":
    assert "lower the server optimizer's learning rate (e.g. --server-lr 0.001 --resume)" in message, message
  else:
    assert "check the method's server step (a user's method)" in message, message
  assert "the best checkpoint (round 2) is kept in " in message, message
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert summary["rollbacks"] == [] and summary["stopped_by_divergence"]["round"] == 3
  assert [r["round"] for r in read_rows(out)] == [1, 2]


def test_a_run_that_diverges_before_any_evaluated_checkpoint_is_advised_a_lower_rate_from_the_start():
  """Held-out probe 17: "nothing to keep or roll back to", and no way forward."""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run.guard import stop_advice

  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp",), learning_rate=0.1, on_divergence="rollback")
  advice = stop_advice(config, rollbacks_tried=0, best=None, checkpoint_dir="unused")
  factor = config.divergence.rollback_lr_factor
  assert advice.endswith(f"start again with a lower learning rate, e.g. --lr {0.1 * factor:g} --overwrite"), advice
