"""FedImpro: the feature estimator (Eq. 7), the synthetic term's stop-gradient (Eq. 6), the server's per-class
mean over holders (Eq. 8), dropped non-finite statistics, resume, bad cut points and a real-data smoke run."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from fedjax_hetero.client.local import masked_cross_entropy
from fedjax_hetero.client.terms import Batch, Outputs, RoundInput, StepContext
from fedjax_hetero.config import FedImproConfig, RunConfig
from fedjax_hetero.config.options import LOSS_MODES
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import fedimpro as fi
from fedjax_hetero.methods.fedimpro import feature_sharing, feature_statistics, shape_classes
from fedjax_hetero.models import build_model, parameter_split
from fedjax_hetero.rounds.cohort import empty_result
from fedjax_hetero.run import checkpoints
from fedjax_hetero.run.build import build_simulation, run_method
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.server.steps import Carry, RoundInputs
from tests.helpers import model_variables, random_batch, run_fmnist_cli, tiny_simulation

C, D = 4, 6


def numpy_class_stats(features, labels, mask, num_classes):
  mean, std, count = np.zeros((num_classes, features.shape[1])), np.zeros((num_classes, features.shape[1])), []
  for c in range(num_classes):
    rows = features[(labels == c) & mask]
    count.append(len(rows))
    if len(rows):
      mean[c] = rows.mean(0)
    if len(rows) > 1:
      std[c] = rows.std(0, ddof=1)
  return mean, std, np.array(count)


def test_batch_class_stats_match_numpy():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(12, D)).astype(np.float32) * 3 + 1
  labels = np.array([0, 0, 0, 1, 1, 2, 0, 1, 3, 3, 3, 1])  # class 2 has one row, class 3 only masked ones
  mask = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1], bool)
  mean, std, count = fi.batch_class_stats(jnp.asarray(features), jnp.asarray(labels), jnp.asarray(mask), C)
  want_mean, want_std, want_count = numpy_class_stats(features, labels, mask, C)
  np.testing.assert_array_equal(count, want_count)
  np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(std, want_std, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("beta,std_max", [(0.0, 0.1), (0.7, 0.1), (0.5, 100.0)])
def test_ema_estimator_matches_a_direct_computation(beta, std_max):
  """Eq. 7 over three batches: classes with a row update the mean, classes with two update the deviation."""
  rng = np.random.default_rng(1)
  start_std = np.full((C, D), 0.05, np.float32)
  start_std[0] = 1.0  # e.g. the prior: clamped even where no batch updates it
  stats = fi.FeatureStats(jnp.asarray(rng.normal(size=(C, D)), jnp.float32), jnp.asarray(start_std),
                          jnp.zeros((C,), jnp.float32))
  mean, std, seen = np.asarray(stats.mean, np.float64), np.asarray(stats.std, np.float64), np.zeros(C)
  for step in range(3):
    features = rng.normal(size=(10, D)).astype(np.float32)
    labels = rng.integers(0, C - 1, 10)  # the last class never appears
    labels[:2] = step % (C - 1)  # some class has at least two rows
    mask = np.ones(10, bool)
    stats = fi.update_estimate(stats, jnp.asarray(features), jnp.asarray(labels), jnp.asarray(mask), beta, std_max)
    batch_mean, batch_std, count = numpy_class_stats(features, labels, mask, C)
    for c in range(C):
      if count[c] >= 1:
        mean[c] = beta * mean[c] + (1 - beta) * batch_mean[c]
        seen[c] = 1
      if count[c] >= 2:
        std[c] = beta * std[c] + (1 - beta) * batch_std[c]
    std = np.minimum(std, std_max)
  np.testing.assert_allclose(stats.mean, mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats.std, std, rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(stats.seen, seen)
  assert seen[C - 1] == 0 and np.all(np.asarray(stats.std) <= std_max + 1e-7)


def test_a_class_seen_one_row_at_a_time_uploads_a_clamped_deviation():
  received = fi.prior_stats(C, D)  # nobody has seen any class yet: sigma = 1
  one_row = fi.update_estimate(received, jnp.ones((1, D)), jnp.array([2]), jnp.array([True]), 0.0, 0.1)
  upload = fi.client_upload(one_row)
  np.testing.assert_array_equal(upload.holders, [0, 0, 1, 0])
  np.testing.assert_allclose(upload.mean_sum[2], 1.0)
  np.testing.assert_allclose(upload.std_sum[2], 0.1)  # the prior's 1, clamped


def test_balanced_labels_spread_the_remainder_by_offset():
  labels = np.asarray(fi.balanced_labels(128, 10, 7))
  assert labels[0] == 7 and labels[1] == 8 and labels[3] == 0
  counts = np.bincount(labels, minlength=10)
  assert counts.max() - counts.min() == 1 and counts[7] == 13 and counts[5] == 12


def test_synthetic_features_follow_the_class_gaussians():
  stats = fi.FeatureStats(jnp.arange(C * D, dtype=jnp.float32).reshape(C, D), jnp.full((C, D), 0.5), jnp.ones(C))
  labels = fi.balanced_labels(4000, C)
  np.testing.assert_array_equal(np.bincount(np.asarray(labels)), [1000] * C)
  features = np.asarray(fi.sample_features(stats, labels, jax.random.key(0)))
  chex.assert_shape(features, (4000, D))
  for c in range(C):
    rows = features[np.asarray(labels) == c]
    np.testing.assert_allclose(rows.mean(0), stats.mean[c], atol=0.05)
    np.testing.assert_allclose(rows.std(0), 0.5, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name,width,kwargs", [("cnn", 0.25, {}),
                                               ("resnet10", 1.0, dict(stage_sizes=(1, 1), base_channels=4, stem="cifar"))])
@pytest.mark.parametrize("loss", LOSS_MODES)
def test_the_synthetic_term_reaches_only_the_high_part(name, width, kwargs, loss):
  """The gradient of the synthetic loss on every low-part parameter is exactly zero (BatchNorm included)."""
  model = build_model(name, C, width, **kwargs)
  images, labels = random_batch(0, 8, C, (12, 12, 1))
  x = images.astype(jnp.float32) / 255.0
  variables = model_variables(model, x, seed=0)
  config = FedImproConfig(loss=loss)
  term = feature_sharing(config)
  cut = term.cuts(model)[0]
  low, high = parameter_split(model, x, cut)
  h = model.apply(variables, x, stop=cut)
  stats = fi.FeatureStats(jnp.zeros((C, int(np.prod(h.shape[1:])))), jnp.ones((C, int(np.prod(h.shape[1:])))),
                          jnp.ones(C))
  mask = jnp.ones(8, bool)
  ctx = StepContext(model, Batch(x, labels, mask, mask.astype(jnp.float32)), jnp.float32(0), None)
  state = term.init(RoundInput(variables, None, stats, jax.random.key(1)))
  synthetic = term.loss.prepare(state, ctx)
  # The real logits as constants: the term's own gradient, not the data loss's.
  outputs = Outputs(jax.lax.stop_gradient(model.apply(variables, x)), {cut: h})

  # The real logits enter as constants: the gradient checked is the synthetic rows' alone (in "concat" mode the
  # term also reweights the real rows' loss, whose gradient reaches every part, as it should).
  grads = jax.grad(lambda p: term.loss.value({**variables, "params": p}, state, synthetic, outputs, ctx))(variables["params"])
  flat, low, high = (traverse_util.flatten_dict(t) for t in (grads, low, high))
  assert any(low.values()) and any(high.values())
  for path, g in flat.items():
    if low[path]:
      assert not np.any(np.asarray(g)), f"low-part parameter {path} got a gradient from the synthetic term"
  assert any(np.any(np.asarray(flat[p])) for p in flat if high[p])


def cnn_step(config, real_rows=8):
  """A CNN, its variables, a batch of 8 rows of which ``real_rows`` are real, and the term's prepared step."""
  model = build_model("cnn", C, 0.25)
  images, labels = random_batch(1, 8, C, (12, 12, 1))
  x = images.astype(jnp.float32) / 255.0
  variables = model_variables(model, x, seed=1)
  mask = jnp.arange(8) < real_rows
  ctx = StepContext(model, Batch(x, labels, mask, mask.astype(jnp.float32)), jnp.float32(3), None)
  h = model.apply(variables, x, stop="conv2")
  size = int(np.prod(h.shape[1:]))
  received = fi.FeatureStats(jnp.zeros((C, size)), jnp.full((C, size), 0.5), jnp.ones(C))
  term = feature_sharing(config)
  state = term.init(RoundInput(variables, None, received, jax.random.key(2)))
  return model, variables, ctx, h, term, state


def test_concat_mode_makes_the_loss_the_mean_over_real_and_synthetic_rows():
  model, variables, ctx, h, term, state = cnn_step(FedImproConfig(loss="concat"), real_rows=6)
  synthetic = term.loss.prepare(state, ctx)
  assert float(synthetic.mask.sum()) == 6  # as many synthetic rows as real ones
  logits = model.apply(variables, ctx.batch.x)
  total = masked_cross_entropy(logits, ctx.batch.labels, ctx.batch.weights)[0] + term.loss.value(
      variables, state, synthetic, Outputs(logits, {"conv2": h}), ctx)
  fake_logits = model.apply(variables, synthetic.features.reshape((-1,) + h.shape[1:]), start="conv2")
  per_row = np.concatenate([np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, ctx.batch.labels))[:6],
                            np.asarray(optax.softmax_cross_entropy_with_integer_labels(fake_logits,
                                                                                       synthetic.labels))[:6]])
  np.testing.assert_allclose(total, per_row.mean(), rtol=1e-5)


def test_local_sampling_draws_from_the_running_estimate_and_noise_keeps_deviations_non_negative():
  _, _, ctx, _, term, state = cnn_step(FedImproConfig(sample_from="local", num_synthetic=40))
  state = state._replace(local=state.local._replace(mean=state.local.mean + 100.0))
  synthetic = term.loss.prepare(state, ctx)
  chex.assert_shape(synthetic.labels, (40,))
  assert float(synthetic.mask.sum()) == 40 and abs(float(synthetic.features.mean()) - 100.0) < 1.0
  noisy = fi.noisy_upload(state.local, jax.random.key(0), 0.5)
  assert np.all(np.asarray(noisy.std) >= 0) and not np.allclose(noisy.mean, state.local.mean)


def upload(means, stds, seen):
  return fi.client_upload(fi.FeatureStats(jnp.asarray(means, jnp.float32), jnp.asarray(stds, jnp.float32),
                                          jnp.asarray(seen, jnp.float32)))


def test_server_mean_is_per_class_over_holders():
  """Eq. 8 per class over the clients that saw it; unseen classes keep their value (the prior at first)."""
  prior = fi.prior_stats(3, 2)
  uploads = [upload([[1, 1], [9, 9], [0, 0]], [[.1, .1], [.9, .9], [0, 0]], [1, 0, 0]),  # saw class 0
             upload([[3, 5], [2, 2], [0, 0]], [[.3, .3], [.2, .2], [0, 0]], [1, 1, 0])]  # saw classes 0 and 1
  summed = jax.tree.map(lambda *xs: sum(xs), *uploads)
  new = fi.server_mean(prior, summed)
  np.testing.assert_allclose(new.mean, [[2, 3], [2, 2], [0, 0]])  # class 1: only the second client's 2
  np.testing.assert_allclose(new.std, [[.2, .2], [.2, .2], [1, 1]])  # class 2: nobody, the prior N(0, 1)
  np.testing.assert_array_equal(new.seen, [1, 1, 0])
  later = fi.server_mean(new, upload(np.zeros((3, 2)), np.zeros((3, 2)), [0, 0, 0]))
  chex.assert_trees_all_equal(later, new)  # a round where nobody saw anything changes nothing


def test_a_client_with_non_finite_statistics_is_dropped_and_counted():
  bad = upload([[np.nan, 1], [0, 0]], [[.1, .1], [0, 0]], [1, 0])
  assert float(bad.dropped) == 1.0 and not np.any(np.asarray(bad.holders))
  assert np.all(np.isfinite(np.asarray(bad.mean_sum)))
  # NaN in a class the client did not see is not its statistic: kept.
  fine = upload([[1, 1], [np.nan, 0]], [[.1, .1], [0, 0]], [1, 0])
  assert float(fine.dropped) == 0.0 and np.all(np.isfinite(np.asarray(fine.mean_sum)))

  sim = tiny_simulation("FedImpro")
  step = feature_statistics(FedImproConfig(), sim.spec.method.terms[0])
  federation = sim.spec.federations[0]
  state = step.init(None, federation)
  num_classes, size = state[0].mean.shape
  good = upload(np.ones((num_classes, size)), np.full((num_classes, size), .1), np.ones(num_classes))
  broken = upload(np.full((num_classes, size), np.nan), np.ones((num_classes, size)), np.ones(num_classes))
  result = empty_result({})._replace(uploads=(jax.tree.map(jnp.add, good, broken),))
  inputs = RoundInputs(None, ({},), (result,), (), (), 0, jax.random.key(0), federation)
  carry, new = step.update(Carry(None), state, inputs, None)
  assert carry.metrics["fedimpro"][federation.name]["dropped_clients"] == 1.0
  np.testing.assert_allclose(new[0].mean, 1.0)  # the good client's statistics alone


def test_cut_point_shapes_decide_which_groups_share_statistics():
  depth = tuple(build_model(n, 10, 0.25) for n in ("resnet10", "resnet18", "resnet26"))
  members, shapes = shape_classes(depth, None, (28, 28, 1))
  assert members == (0, 0, 0) and len(shapes) == 1  # stage 2 of every depth has one shape
  widths = tuple(build_model("cnn", 10, w) for w in (1.0, 0.5, 1.0))
  members, shapes = shape_classes(widths, None, (28, 28, 1))
  assert members == (0, 1, 0) and shapes == ((7, 7, 64), (7, 7, 32))


def test_a_missing_cut_point_is_a_clear_error_listing_the_valid_ones():
  with pytest.raises(ValueError, match="valid cut points: stem, stage1, stage2, stage3, stage4, features"):
    run_method(RunConfig.from_flags(groups=("resnet18@0.25",), method="FedImpro", fedimpro_cut="layer2"))
  with pytest.raises(ValueError, match="cnn@0.5.*valid cut points: conv1, conv2, features"):
    run_method(RunConfig.from_flags(groups=("cnn@0.5",), method="FedImpro", fedimpro_cut="logits"))
  with pytest.raises(ValueError, match="--fedimpro-beta"):
    FedImproConfig(beta=1.0)


@pytest.mark.slow
def test_engine_trains_with_shared_statistics_on_both_backends():
  results = {}
  for backend in ("sequential", "vmap"):
    sim = tiny_simulation("FedImpro", backend, widths=(1.0, 0.5))
    state = sim.init_state()
    for _ in range(2):
      state, (metrics,) = sim.run_rounds(state, 1)
    stats = state.steps[0][-1]
    assert len(stats) == 2  # two widths, two feature shapes
    for s in stats:
      assert np.all(np.isfinite(np.asarray(s.mean))) and np.all(np.asarray(s.std) <= 0.1 + 1e-7)
      assert np.asarray(s.seen).sum() > 0
    results[backend] = (metrics["train_loss"], stats)
  (loss_a, stats_a), (loss_b, stats_b) = results.values()
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-4)
  chex.assert_trees_all_close(stats_a, stats_b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_resume_restores_the_statistics_bit_for_bit(tmp_path):
  dataset = synthetic_dataset(num_train=160, num_test=32, seed=0)
  base = RunConfig.from_flags(dataset="synthetic", method="FedImpro", groups=("mlp",), num_clients=6,
                              clients_per_round=3, rounds=2, checkpoint_every=1, eval_every=1, batch_size=16,
                              progress=False)
  quiet = lambda _: None
  straight = base.replace(output_dir=str(tmp_path / "straight"))
  run_experiment(straight, dataset, log=quiet)
  resumed = base.replace(output_dir=str(tmp_path / "resumed"))
  run_experiment(resumed.replace(rounds=1), dataset, log=quiet)

  sim, _ = build_simulation(resumed, dataset, log=quiet)
  after_one = checkpoints.restore_latest(checkpoints.manager(resumed.output.dir), sim.spec.state_shapes)
  statistics = [s.name for s in sim.spec.method.server].index("fedimpro")  # (the dissimilarity metric's step is last)
  assert after_one.round == 1 and float(after_one.steps[0][statistics][0].seen.sum()) > 0
  run_experiment(resumed.replace(resume=True), dataset, log=quiet)

  def final(config):
    return checkpoints.restore_latest(checkpoints.manager(config.output.dir), sim.spec.state_shapes)

  a, b = final(straight), final(resumed)
  assert a.round == b.round == 2
  chex.assert_trees_all_equal(a.steps, b.steps)  # the statistics of round 2 grew from the restored round 1
  chex.assert_trees_all_equal(a.models, b.models)


@pytest.mark.slow
def test_fedimpro_preset_smoke_run_on_fashion_mnist(tmp_path):
  out = tmp_path / "run"
  proc = run_fmnist_cli("--preset", "fedimpro-cpu", "--rounds", "2", "--max-train-samples", "1500",
                        "--max-test-samples", "500", "--output-dir", str(out), "--no-progress",
                        trains_long=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["round"] for r in rows] == [1, 2]
  for r in rows:
    assert r["fedimpro"]["cnn"]["dropped_clients"] == 0 and r["fedimpro"]["cnn"]["known_classes"] > 0
    assert set(r["dissimilarity"]["cnn"]) == {"low", "high", "low_spread", "high_spread"}
    assert 0 <= r["test_accuracy"]["mean"] <= 1
    assert np.isfinite(r["train_loss"]) and r["examples"] > 0
