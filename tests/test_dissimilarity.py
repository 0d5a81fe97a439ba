"""The gradient-dissimilarity metric: its formula, the low/high parameter split, and its logging in the engine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero.compilation import CompileLog
from fedjax_hetero.config import RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods.dissimilarity import gradient_dissimilarity
from fedjax_hetero.models import build_model, parameter_split
from fedjax_hetero.models.projection import with_projection_head
from fedjax_hetero.run.runner import run_experiment
from tests.helpers import tiny_simulation


def test_matches_the_direct_formula_on_hand_made_updates():
  """sum_c p_c ||d_c - d_bar||^2 / ||d_bar||^2 per part, from the cohort's weighted sums alone."""
  rng = np.random.default_rng(0)
  deltas = [{"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4), "c": rng.normal(size=5)} for _ in range(4)]
  weights = np.array([1.0, 2.0, 0.5, 3.0])
  p = weights / weights.sum()
  for part in ("ab", "c"):
    flat = [np.concatenate([np.ravel(d[k]) for k in part]) for d in deltas]
    norm_sum = sum(w * np.sum(f ** 2) for w, f in zip(weights, flat))
    delta_norm = np.sum(sum(w * f for w, f in zip(weights, flat)) ** 2)
    got, got_spread = gradient_dissimilarity(jnp.asarray(weights.sum()), norm_sum, delta_norm)
    mean = sum(pc * f for pc, f in zip(p, flat))
    spread = sum(pc * np.sum((f - mean) ** 2) for pc, f in zip(p, flat))
    np.testing.assert_allclose(got_spread, spread, rtol=1e-5)
    np.testing.assert_allclose(got, spread / np.sum(mean ** 2), rtol=1e-5)
  own = np.sum(np.ravel(deltas[0]["c"]) ** 2)
  identical = gradient_dissimilarity(jnp.float32(3.0), 3 * own, 9 * own)  # 3 x the same update
  # One client (or identical updates): no dissimilarity to measure, so no value rather than rounding's ~1e-7.
  assert all(np.isnan(identical))


def test_parameter_split_of_the_cnn_and_of_moon_projection():
  x = jnp.zeros((1, 28, 28, 1))
  low, high = (traverse_util.flatten_dict(t) for t in parameter_split(build_model("cnn", 10, 0.5), x, "conv2"))
  assert {p[0] for p, v in low.items() if v} == {"conv1", "conv2"}
  assert {p[0] for p, v in high.items() if v} == {"fc1", "head"}
  low, high = (traverse_util.flatten_dict(t)
               for t in parameter_split(with_projection_head(build_model("cnn", 10, 0.5)), x, "features"))
  assert {p[1] for p, v in high.items() if v} == {"head"}
  assert not low[("projection_out", "kernel")] and not high[("projection_out", "kernel")]


@pytest.mark.parametrize("method", ["FedAvg", "HeteroNova"])
def test_engine_logs_it_per_group_and_compiles_it_in_the_first_round(method):
  # 1 client per round over 2 groups: the first round leaves one group out, so its program must still compile then.
  sim = tiny_simulation(method, widths=(1.0, 0.5), clients_per_round=1, track_dissimilarity=True)
  state, logged = sim.init_state(), set()
  for r in range(6):
    with CompileLog() as log:
      state, (metrics,) = sim.run_rounds(state, 1)
    if r:
      assert not log.names, f"round {r + 1} compiled {log.names}"
    # The group that trained; in a shared federation also the others, with no values (nobody trained them).
    trained, = metrics["train_loss_per_group"]
    assert trained in metrics["dissimilarity"]
    for group, values in metrics["dissimilarity"].items():
      assert set(values) == {"low", "high", "low_spread", "high_spread"}
      assert all(v is None for v in values.values())  # one client: no point, rather than a 0.0 on a log axis
    logged.add(trained)
  assert logged == {g.name for g in sim.spec.groups}


@pytest.mark.slow
def test_runs_log_it_by_default_and_the_flag_turns_it_off(tmp_path):
  dataset = synthetic_dataset(num_train=160, num_test=32, seed=0)
  base = RunConfig.from_flags(dataset="synthetic", method="HeteroAvg", groups=("mlp@0.5", "mlp"), num_clients=6,
                              clients_per_round=4, rounds=1, batch_size=16, progress=False)
  on = run_experiment(base.replace(output_dir=str(tmp_path / "on")), dataset, log=lambda _: None)
  off = run_experiment(base.replace(output_dir=str(tmp_path / "off"), dissimilarity=False), dataset,
                       log=lambda _: None)
  rows = {name: (tmp_path / name / "metrics.jsonl").read_text() for name in ("on", "off")}
  assert '"dissimilarity"' in rows["on"] and '"dissimilarity"' not in rows["off"]
  assert on["config"]["dissimilarity"] and not off["config"]["dissimilarity"]
