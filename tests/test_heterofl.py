"""HeteroFL (Diao et al., ICLR 2021): the Scaler, static BatchNorm, masked logits and two-round runs."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.client.terms import StepContext
from fedjax_hetero.compilation import CompileLog
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.methods import build_method
from fedjax_hetero.methods.heterofl import absent_class_logits, static_batch_norm_evaluation
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds import Simulation
from tests.helpers import (method_options, model_variables, random_batch, run_rounds, simulation, tiny_federation,
                           tiny_resnet, tiny_simulation)


# ---------------------------------------------------------------------------------------------- the Scaler


def test_scaler_divides_hidden_outputs_by_the_width_in_training_only():
  images, _ = random_batch(0, 5)
  x = images.astype(jnp.float32) / 255.0
  plain, scaled = build_model("mlp", 4, 0.5, hidden=(8,)), build_model("mlp", 4, 0.5, hidden=(8,), scaler=True)
  variables = model_variables(plain, x, 1)
  p = variables["params"]
  hidden = jax.nn.relu((x.reshape(5, -1) @ p["hidden1"]["kernel"] + p["hidden1"]["bias"]) / 0.5)
  expected = hidden @ p["head"]["kernel"] + p["head"]["bias"]
  out = scaled.apply(variables, x, train=True)
  chex.assert_shape(out, (5, 4))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(out, plain.apply(variables, x, train=True), atol=1e-3)
  np.testing.assert_array_equal(scaled.apply(variables, x, train=False), plain.apply(variables, x, train=False))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_scaler_is_the_identity_at_full_width(name):
  images, _ = random_batch(1, 4)
  x = images.astype(jnp.float32) / 255.0
  plain, scaled = build_model(name, 4, 1.0), build_model(name, 4, 1.0, scaler=True)
  variables = model_variables(plain, x, 2)
  np.testing.assert_array_equal(scaled.apply(variables, x, train=True), plain.apply(variables, x, train=True))


def test_scaler_divides_by_the_width_relative_to_the_global_models():
  """The authors' rate is a group's width over the global model's: groups @0.5 and @0.25 take rates 1 and 0.5
  (a simulation sets ``scaler_of``), where width alone gave 2 and 4 (and the driver refused a widest group below 1)."""
  images, _ = random_batch(0, 5)
  x = images.astype(jnp.float32) / 255.0
  sim = tiny_simulation("HeteroFL", "sequential", (0.5, 0.25), 3)
  narrow, wide = sorted((g.model for g in sim.spec.groups), key=lambda m: m.width)
  assert (wide.scaler_of, narrow.scaler_of) == (0.5, 0.5) and wide.scaler and narrow.scaler
  for model, rate in ((wide, 1.0), (narrow, 0.5)):
    plain = model.clone(scaler=False)
    variables = model_variables(plain, x, 1)
    p = variables["params"]
    hidden = jax.nn.relu((x.reshape(5, -1) @ p["hidden1"]["kernel"] + p["hidden1"]["bias"]) / rate)
    np.testing.assert_allclose(model.apply(variables, x, train=True), hidden @ p["head"]["kernel"] + p["head"]["bias"],
                               rtol=1e-5, atol=1e-6)
  assert all(not g.model.scaler for g in tiny_simulation("HeteroAvg", "sequential", (0.5, 0.25), 3).spec.groups)
  # Through a term's wrapper (MOON's projection head keeps the model as ``base``): the same rates.
  from fedjax_hetero.methods.moon import model_contrastive
  wrapped = tiny_simulation(build_method("HeteroFL").with_terms(model_contrastive(1.0, 0.5)), "sequential",
                            (0.5, 0.25), 3)
  assert {g.model.base.width: g.model.base.scaler_of for g in wrapped.spec.groups} == {0.5: 0.5, 0.25: 0.5}
  # The driver builds such a run (it refused a widest group below width 1).
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run.build import build_simulation
  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp@0.5", "mlp@0.25"), method="HeteroFL", num_clients=4,
                                clients_per_round=2, rounds=1, progress=False, dissimilarity=False)
  built, _ = build_simulation(config, log=lambda _: None)
  assert [(g.model.scaler, g.model.scaler_of) for g in built.spec.groups] == [(True, 0.5), (True, 0.5)]


@pytest.mark.slow
def test_resnet_scaler_scales_what_batch_norm_sees():
  """The stem's BN sees the conv output / width: its batch mean doubles at width 0.5 (BN's output barely
  moves, as BN is scale-invariant up to eps); at evaluation and at width 1 nothing changes."""
  images, _ = random_batch(2, 6)
  x = images.astype(jnp.float32) / 255.0
  for width, ratio in ((0.5, 2.0), (1.0, 1.0)):
    plain, scaled = tiny_resnet(width=width), tiny_resnet(width=width, scaler=True)
    variables = model_variables(plain, x, 3)
    zeros = {**variables, "batch_stats": jax.tree.map(jnp.zeros_like, variables["batch_stats"])}
    _, a = plain.apply(zeros, x, train=True, mutable=["batch_stats"])
    _, b = scaled.apply(zeros, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(b["batch_stats"]["stem_bn"]["mean"], ratio * a["batch_stats"]["stem_bn"]["mean"],
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(scaled.apply(variables, x), plain.apply(variables, x))


# ------------------------------------------------------------------------------------------- masked logits


def test_masked_logits_zero_absent_classes_before_the_cross_entropy():
  term = absent_class_logits()
  logits = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  ctx = StepContext(None, None, jnp.zeros(()), None, jnp.array([2, 0, 2, -1]))  # classes 0 and 2; -1: padding
  masked = term.logits(logits, ctx)
  np.testing.assert_array_equal(masked, [[1.0, 0.0, 3.0, 0.0]])
  loss = optax.softmax_cross_entropy_with_integer_labels(masked, jnp.array([2]))[0]
  np.testing.assert_allclose(loss, -3.0 + np.log(np.e + 1.0 + np.e**3 + 1.0), rtol=1e-6)
  grad = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(term.logits(z, ctx),
                                                                            jnp.array([2]))[0])(logits)
  np.testing.assert_array_equal(grad[0, [1, 3]], 0.0)
  assert np.all(np.abs(grad[0, [0, 2]]) > 0)


@pytest.mark.parametrize("masked", [True, False])
def test_absent_classes_get_no_gradient_in_local_training(masked):
  """A client holding classes 0 and 1 of 4: with the mask, the head's rows of classes 2 and 3 stay put."""
  images, _ = random_batch(3, 8)
  labels = jnp.array([0, 1] * 4, jnp.int32)
  model = build_model("mlp", 4, 1.0, hidden=(8,))
  variables = model_variables(model, images.astype(jnp.float32), 4)
  config = LocalConfig(batch_size=4, optimizer="sgd", learning_rate=0.5)
  trainer = LocalTrainer(model, config, (0.5,), (0.25,), (absent_class_logits(),) if masked else ())
  ids, mask = trainer.schedule(jnp.arange(8), jnp.asarray(8), jax.random.key(0), 2)
  chex.assert_shape((ids, mask), (2, 4))
  state = trainer.run_steps(trainer.init_state(variables), images, labels, ids, mask, jnp.int32(0), 2)
  moved = np.abs(state.variables["params"]["head"]["bias"] - variables["params"]["head"]["bias"]) > 0
  assert moved[:2].all()
  assert (not moved[2:].any()) if masked else moved[2:].all()


# ---------------------------------------------------------------------------------------------- static BN


def test_static_bn_re_estimates_statistics_on_training_samples():
  """With the Scaler on and width 0.5: the stem BN's statistics are the mean over batches of the batch mean
  and biased variance of the stem conv's (unscaled) output on the chosen samples."""
  ds, store = tiny_federation(4, 48, 8, "iid")
  model = tiny_resnet(width=0.5, scaler=True)
  variables = model_variables(tiny_resnet(width=0.5), jnp.zeros((1, 8, 8, 1)), 5)
  out = static_batch_norm_evaluation(num_samples=40, batch_size=20)(model, variables, store)
  chex.assert_trees_all_equal_shapes(out, variables)
  ids = np.sort(np.random.default_rng(0).permutation(48)[:40])
  x = (np.asarray(ds.train_images, np.float32)[ids] / 255.0 - np.asarray(ds.mean)) / np.asarray(ds.std)
  conv = nn.Conv(2, (3, 3), padding=((1, 1), (1, 1)), use_bias=False)
  y = np.asarray(conv.apply({"params": variables["params"]["stem_conv"]}, jnp.asarray(x)))
  batches = y.reshape(2, 20, -1, y.shape[-1])
  np.testing.assert_allclose(out["batch_stats"]["stem_bn"]["mean"], batches.mean(axis=(1, 2)).mean(0), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(out["batch_stats"]["stem_bn"]["var"], batches.var(axis=(1, 2)).mean(0), rtol=1e-4,
                             atol=1e-5)
  chex.assert_trees_all_equal(out["params"], variables["params"])


def resnet_simulation(method: str, backend: str = "sequential", widths=(1.0, 0.5), **options) -> Simulation:
  models = [(f"resnet@{w}", tiny_resnet((1,), width=w)) for w in widths]  # one stage: BatchNorm, less to compile
  return simulation(method, models, tiny_federation(4, 48, 8, "iid"), LocalConfig(batch_size=16), backend, options,
                    clients_per_round=4)


@pytest.mark.slow
def test_static_bn_keeps_no_running_statistics_in_training():
  sim = resnet_simulation("HeteroFL")
  assert all(group.model.scaler for group in sim.spec.groups)
  start = sim.init_state()
  state, metrics = run_rounds(sim, 2)
  chex.assert_trees_all_equal(state.models[0]["batch_stats"], start.models[0]["batch_stats"])
  kernel = lambda s: s.models[0]["params"]["stem_conv"]["kernel"]
  assert not np.allclose(kernel(state), kernel(start))
  accs = sim.evaluate(state)
  assert 0.0 <= accs["mean"] <= 1.0
  # Without sBN the averaged running statistics move (the check can fail): two rounds of the width-1 group alone
  # (every client then trains the whole stem BN), from the same start (no second initialization to compile).
  without = resnet_simulation("HeteroFL", widths=(1.0,), heterofl_static_bn=False)
  plain = start._replace(memory=start.memory[:1])  # the second group's (empty) client memory dropped
  assert jax.tree.structure(without.spec.state_shapes) == jax.tree.structure(plain)
  for _ in range(2):
    plain, (_,) = without.run_rounds(plain, 1)
  stem_mean = lambda s: s.models[0]["batch_stats"]["stem_bn"]["mean"]
  assert plain.round == 2 and not np.allclose(stem_mean(plain), stem_mean(start))


# ------------------------------------------------------------------------------------------ two-round runs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_heterofl_two_rounds_compile_nothing_after_the_first(backend):
  sim = tiny_simulation("HeteroFL", backend=backend, widths=(1.0, 0.5))
  state = sim.init_state()
  state, (_,) = sim.run_rounds(state, 1)
  sim.evaluate(state)
  with CompileLog() as log:
    state, (_,) = sim.run_rounds(state, 1)
  assert log.names == []
  accs = sim.evaluate(state)
  assert set(accs) == {"mlp@1.0", "mlp@0.5", "mean"}
  chex.assert_tree_all_finite(state.models[0])


def test_heterofl_switches_and_their_checks():
  method = build_method("HeteroFL")
  assert [t.name for t in method.terms] == ["scaler", "static_bn", "label_mask"]
  assert method.evaluation_variables is not None
  off = build_method("HeteroFL", method_options(heterofl_scaler=False, heterofl_static_bn=False,
                                               heterofl_mask_logits=False))
  assert off.terms == () and off.evaluation_variables is None
  with pytest.raises(ValueError, match="HeteroFL"):
    build_method("HeteroAvg", method_options(heterofl_scaler=False))
  with pytest.raises(ValueError, match="bn-samples"):
    build_method("HeteroFL", method_options(heterofl_static_bn=False, heterofl_bn_samples=10))
  with pytest.raises(ValueError, match="scaler"):
    method.wrap_model(build_model("vgg16", 4, 0.5))


def test_help_lists_heterofl_under_the_fedfa_paper_and_flags_reach_the_method():
  from fedjax_hetero.cli import run as cli
  from fedjax_hetero.config import RunConfig

  text = cli.methods_help()
  heading = text.index("FedFA (Park & Joe-Wong, ECML-PKDD 2024)")
  lines = [line for line in text.splitlines() if line.startswith("    HeteroFL ")]
  assert len(lines) == 1 and heading < text.index(lines[0]) < text.index("FedRolex (Alam et al., NeurIPS 2022)")
  config = RunConfig.from_flags(method="HeteroFL", heterofl_scaler=False, heterofl_bn_samples=64)
  assert config.method.heterofl.scaler is False and config.method.heterofl.bn_samples == 64
  with pytest.raises(ValueError, match="heterofl-bn-samples"):
    RunConfig.from_flags(method="HeteroFL", heterofl_bn_samples=0)
