"""What a run stopped by a non-finite model says to do: a server step that breaks the model from finite client
updates is not helped by a lower client learning rate, so the guard neither rolls back for it nor advises --lr
(tests/test_recovery.py has the guard's other cases)."""

from __future__ import annotations

import json
import os
import re

import pytest

from fedjax_hetero.run import continuation
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
  assert ("the server's step broke the model from finite client losses, which a rollback to a lower client "
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


def tiny(out, **changes):
  """A run of one mlp group on 4 clients, evaluated and checkpointed every round."""
  from fedjax_hetero.config import RunConfig
  return RunConfig.from_flags(**{**dict(dataset="synthetic", groups=("mlp",), num_clients=4, clients_per_round=2,
                                        rounds=3, eval_every=1, checkpoint_every=1, progress=False,
                                        output_dir=str(out)), **changes})


def noised(out, **changes):
  """DP-FedAvg's noise at std 5e5 per element (z 1e6, clip 1, 2 clients a round): round 1's model is finite but at
  chance, round 2's training loss 7e12 whatever the clients' learning rate."""
  return tiny(out, dp_clip=1.0, dp_noise_multiplier=1e6, **changes)


def test_a_model_at_chance_is_no_best_checkpoint_and_the_advice_leads_with_the_privacy_noise(dataset, tmp_path):
  """(Held-out probes: round 1 at chance was kept as the best and offered for rollback; the advice blamed --lr
  first under a noise that no learning rate mends.)"""
  with pytest.raises(DivergenceError) as info:
    run_experiment(noised(tmp_path / "stop"), dataset, log=lambda _: None)
  message = str(info.value)
  assert ("no checkpoint was evaluated above chance, so there is nothing to keep: the privacy noise (std about 5e+05 "
          "per element) may be what breaks the model, which no lower learning rate mends: start again with a lower "
          "--dp-noise-multiplier or more --clients-per-round --overwrite; if not, start again with a lower learning "
          "rate, e.g. --lr 0.0005 --overwrite, or --on-divergence rollback (from the initial model)") in message, \
      message
  with open(tmp_path / "stop" / "summary.json") as f:
    assert json.load(f)["stopped_by_divergence"]["best_checkpoint"] is None


def test_a_divergence_a_rollback_left_as_it_was_stops_it_naming_the_server_side(dataset, tmp_path):
  """(Third held-out survey, U4: under a noise of std 5e5 three rollbacks halved --lr to the same loss, 7.088e+12,
  then advised --lr 6.25e-05.) With no checkpoint above chance the rollback goes back to the initial model; the
  same loss in the same round after it says that the learning rate is not the cause."""
  out = tmp_path / "rollback"
  with pytest.raises(DivergenceError) as info:
    run_experiment(noised(out, on_divergence="rollback"), dataset, log=lambda _: None)
  message = str(info.value)
  assert message.startswith("round 2: training loss of group mlp rose to "), message
  assert "; it diverged in round 2 again with the same loss (within 1% of " in message, message
  assert (") after the rollback to learning rate 0.0005, so the learning rate is not the cause and no further rollback "
          "was tried: lower the privacy noise (std about 5e+05 per element): a lower --dp-noise-multiplier or more "
          "--clients-per-round --overwrite; no checkpoint was evaluated above chance") in message, message
  assert not re.search(r"--lr \d", message), message
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert [(r["diverged_round"], r["to_round"], r["learning_rate"]) for r in summary["rollbacks"]] == [
      (2, 0, [1e-3, 5e-4])]
  assert [s["from_round"] for s in summary["segments"]] == [1]  # (the rollback retrained from round 1)


def test_a_rollback_under_a_server_optimizer_lowers_its_rate_too_and_a_resume_keeps_it(dataset, tmp_path):
  """(U5: yogi at --server-lr 1e10: three rollbacks halved only --lr, to the same loss.) Round 1's model, which the
  server's step blew up (1e9 weights) but left above chance, is the best checkpoint: the first rollback goes back to
  it with both rates lowered; round 2's loss, which that model sets, comes back as it was, so the second goes back
  to the initial model, and the run finishes."""
  out, logs = tmp_path / "run", []
  config = tiny(out, server_optimizer="yogi", server_lr=1e10, on_divergence="rollback")
  summary = run_experiment(config, dataset, log=logs.append)
  assert summary["final_round"] == 3 and summary["stopped_by_divergence"] is None
  assert [(r["to_round"], r["learning_rate"], r["server_lr"]) for r in summary["rollbacks"]] == [
      (1, [1e-3, 5e-4], [1e10, 0.01]), (0, [5e-4, 5e-4], [0.01, 0.01])]
  said = [line for line in logs if line.startswith("diverged: rollback to round ")]
  assert said[0].endswith("; learning rate 0.001 -> 0.0005, server learning rate 1e+10 -> 0.01"), said
  assert said[1].endswith("as before the rollback to round 1, whose model sets this loss (the rates it lowered could "
                          "not change it): going back to the initial model with learning rate 0.0005 and server "
                          "learning rate 0.01"), said
  assert [(s["from_round"], s["settings"]["server.lr"]) for s in summary["segments"]] == [(1, 0.01)]
  logs = []  # resumed with the command that started it (what a resume reads before it trains), it keeps them
  resumed, _, changed = continuation.history(config.replace(rounds=4, resume=True), logs.append)
  assert (resumed.server.lr, resumed.client.learning_rate, changed) == (0.01, 5e-4, None)
  assert ("keeping --server-lr 0.01, the last rollback's (--server-lr 1e+10 diverged in this run; pass another "
          "--server-lr to change it)") in logs, logs
  lower, _, changed = continuation.history(config.replace(rounds=4, resume=True, server_lr=1e-3), logs.append)
  assert lower.server.lr == 1e-3 and changed == "server.lr: 0.01 -> 0.001", changed  # (as the advice says)


def test_a_server_step_that_makes_the_weights_too_large_to_compute_with_stops_as_a_non_finite_model(dataset,
                                                                                                  tmp_path):
  """(U6: a user's step scaling the model by 1e30 left it finite and above chance: kept as the best checkpoint,
  round 2's loss NaN, the advice blamed --lr.)"""
  import jax
  from fedjax_hetero.methods import Method
  from fedjax_hetero.server import ServerStep, apply_delta, mean_delta

  def huge(carry, state, inputs, plan):
    return carry._replace(model=jax.tree.map(lambda x: x * 1e30, carry.model)), state
  out = tmp_path / "run"
  method = Method("Huge", "", "", server=(mean_delta(), apply_delta(), ServerStep("huge", huge)))
  with pytest.raises(DivergenceError) as info:
    run_experiment(tiny(out, method="Huge", on_divergence="rollback", rounds=2), dataset, log=lambda _: None,
                   method=method)
  message = str(info.value)
  assert re.match(r"round 1: the model of group\(s\) mlp has weights up to \d\.\d+e\+\d\d, above 1\.84e\+19 \(the "
                  r"square root of float32's largest: products of two overflow\) after Huge's server step",
                  message), message
  assert ("the server's step broke the model from finite client losses, which a rollback to a lower client learning "
          "rate (--lr) would not mend, so none was tried: check the method's server step (a user's method)"
          ) in message, message
  with open(out / "summary.json") as f:
    summary = json.load(f)
  assert summary["rollbacks"] == [] and summary["best_round"] is None and read_rows(out) == []
  assert not (out / "checkpoints").exists() or not any(name.isdigit() for name in os.listdir(out / "checkpoints"))


def test_a_server_optimizers_blow_up_in_stop_mode_is_advised_its_rate_from_the_start(dataset, tmp_path):
  """(Held-out survey, U5a: the advice named --server-lr with --resume, which refused the change, and which starts
  from round 1's checkpoint, whose blown-up model sets round 2's loss.)"""
  config = tiny(tmp_path / "run", server_optimizer="yogi", server_lr=1e10)
  with pytest.raises(DivergenceError) as info:
    run_experiment(config, dataset, log=lambda _: None)
  assert ("the best checkpoint (round 1) is kept in " in str(info.value) and
          ": --on-divergence rollback restarts from it with lower learning rates (the clients' and the server's), or "
          "lower the server optimizer's learning rate (--server-lr 0.01 --overwrite: the checkpoints that --resume "
          "starts from may hold a model it blew up already)") in str(info.value), str(info.value)


def test_clients_that_blow_the_weights_up_with_finite_losses_are_rolled_back_with_a_lower_rate(dataset, tmp_path):
  """(A docs probe: --lr 50 on the CNN took the weights past 1.8e19 in round 1 with finite, huge losses, and the
  guard blamed the server step, tried no rollback and advised against --lr.)"""
  out = tmp_path / "run"
  logs = []
  with pytest.raises(DivergenceError) as info:
    run_experiment(tiny(out, optimizer="sgd", learning_rate=1e15, on_divergence="rollback", rounds=2), dataset,
                   log=logs.append)
  message = str(info.value)
  assert message.startswith("round 1: training loss of group mlp rose to ") and not info.value.in_server_step
  assert "the server's step broke the model" not in message, message
  with open(out / "summary.json") as f:
    rollbacks = json.load(f)["rollbacks"]
  assert [r["learning_rate"][1] for r in rollbacks] == [5e14, 2.5e14, 1.25e14], rollbacks
