"""FedGen pieces (Zhu et al. 2021): generator, server objective and training, client regularizer."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.config import FedGenConfig
from fedjax_hetero.methods import fedgen_generator as fedgen
from fedjax_hetero.models import CNN
from tests.helpers import model_variables

NUM_CLASSES, LATENT, K = 5, 6, 3


def linear_head(variables, feats):
  return feats @ variables["w"] + variables["b"]


def _heads(seed: int = 0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(K, LATENT, NUM_CLASSES)), jnp.float32),
          "b": jnp.asarray(0.1 * rng.normal(size=(K, NUM_CLASSES)), jnp.float32)}


@pytest.fixture(scope="module")
def generator():
  return fedgen.Generator(num_classes=NUM_CLASSES, latent_dim=LATENT, noise_dim=4, hidden_dim=16)


@pytest.fixture(scope="module")
def state(generator):
  return fedgen.init_generator(generator, jax.random.key(0))


def _np_log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_generator_shapes(generator, state):
  labels = jnp.array([0, 3, 4, 1])
  feats, noise, stats = fedgen.generate(generator, state.variables, labels, jax.random.key(1))
  chex.assert_shape(feats, (4, LATENT))
  chex.assert_shape(noise, (4, 4))
  assert float(noise.min()) >= 0.0 and float(noise.max()) < 1.0
  chex.assert_trees_all_equal(stats, state.batch_stats)  # inference mode leaves the statistics alone
  _, _, new_stats = fedgen.generate(generator, state.variables, labels, jax.random.key(1), train=True)
  chex.assert_trees_all_equal_shapes(new_stats, state.batch_stats)
  embedded = fedgen.Generator(num_classes=NUM_CLASSES, latent_dim=LATENT, noise_dim=4, hidden_dim=16,
                              embedding=True)
  variables = embedded.init(jax.random.key(0), labels, jnp.zeros((4, 4)))
  chex.assert_shape(embedded.apply(variables, labels, jnp.zeros((4, 4))), (4, LATENT))


def test_label_weights_and_probs_match_numpy():
  counts = np.array([[3, 0, 1, 0, 0], [1, 0, 0, 0, 2], [0, 0, 5, 0, 0]])
  for pseudo in (0.0, 1.0):
    expected = (counts + pseudo) / np.maximum((counts + pseudo).sum(0, keepdims=True), 1e-30)
    expected[:, (counts + pseudo).sum(0) == 0] = 0.0
    np.testing.assert_allclose(fedgen.ensemble_label_weights(counts, pseudo), expected, rtol=1e-6)
  weights = fedgen.ensemble_label_weights(counts, 1.0, valid=np.array([True, True, False]))
  np.testing.assert_allclose(weights[2], 0.0)
  np.testing.assert_allclose(weights.sum(0), 1.0, rtol=1e-6)
  np.testing.assert_allclose(fedgen.present_label_probs(counts), [1 / 3, 0, 1 / 3, 0, 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(fedgen.present_label_probs(np.zeros(4)), 0.25)


def test_generator_loss_matches_numpy(generator, state):
  heads = _heads()
  counts = np.random.default_rng(1).integers(0, 9, (K, NUM_CLASSES))
  weights = fedgen.ensemble_label_weights(counts)
  labels = jnp.array([0, 1, 2, 3, 4, 2, 2, 0])
  key = jax.random.key(2)
  loss, (_, parts) = jax.jit(functools.partial(fedgen.generator_loss, teacher_weight=1.0, diversity_weight=0.5),
                             static_argnums=(1, 2))(state.params, generator, linear_head, heads, weights, labels, key,
                                                    batch_stats=state.batch_stats)
  feats, noise, _ = jax.jit(fedgen.generate, static_argnums=(0, 4))(generator, state.variables, labels, key, True)
  feats, noise = np.asarray(feats, np.float64), np.asarray(noise, np.float64)
  y, w = np.asarray(labels), np.asarray(weights)
  teacher = 0.0
  for k in range(K):
    logp = _np_log_softmax(feats @ np.asarray(heads["w"][k]) + np.asarray(heads["b"][k]))
    teacher += np.mean(w[k, y] * -logp[np.arange(len(y)), y])
  noise_d = ((noise[:, None] - noise[None]) ** 2).mean(-1)
  feat_d = np.abs(feats[:, None] - feats[None]).mean(-1)
  diversity = np.exp(-(noise_d * feat_d).mean())
  np.testing.assert_allclose(parts["teacher"], teacher, rtol=1e-5)
  np.testing.assert_allclose(parts["diversity"], diversity, rtol=1e-5)
  np.testing.assert_allclose(loss, teacher + 0.5 * diversity, rtol=1e-5)


@pytest.mark.slow
def test_train_generator_decreases_loss_with_fixed_heads(generator, state):
  heads = _heads(3)
  counts = np.random.default_rng(2).integers(0, 9, (K, NUM_CLASSES))
  weights, probs = fedgen.ensemble_label_weights(counts), fedgen.present_label_probs(counts)
  labels = jnp.tile(jnp.arange(NUM_CLASSES), 8)
  evaluate = jax.jit(lambda s: fedgen.generator_loss(s.params, generator, linear_head, heads, weights, labels,
                                                      jax.random.key(9), batch_stats=s.batch_stats)[0])
  new_state, metrics = fedgen.train_generator(state, generator, linear_head, heads, weights, probs,
                                              jax.random.key(4), jnp.float32(1e-2), num_steps=30, batch_size=32)
  for name in ("loss", "teacher", "diversity"):
    chex.assert_shape(metrics[name], (30,))
  chex.assert_tree_all_finite(metrics)
  chex.assert_trees_all_equal_shapes(new_state, state)
  assert float(evaluate(new_state)) < 0.8 * float(evaluate(state))
  assert float(metrics["loss"][-5:].mean()) < float(metrics["loss"][:5].mean())


def test_client_regularizer(generator, state):
  head = jax.tree.map(lambda x: x[0], _heads(5))
  probs = jnp.full(NUM_CLASSES, 1 / NUM_CLASSES)
  real_logits = jnp.asarray(np.random.default_rng(6).normal(size=(6, NUM_CLASSES)), jnp.float32)
  real_labels = jnp.array([0, 1, 2, 3, 4, 0])
  mask = jnp.array([1, 1, 1, 1, 1, 0])

  @jax.jit
  @functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
  def reg(head, gen_vars, logits, alpha, beta):
    return fedgen.client_regularizer(linear_head, head, generator, gen_vars, logits, real_labels, probs,
                                     jax.random.key(7), alpha=alpha, beta=beta, gen_batch_size=8, mask=mask)

  (zero, parts), _ = reg(head, state.variables, real_logits, 0.0, 0.0)
  assert float(zero) == 0.0 and float(parts["teacher"]) > 0 and float(parts["latent"]) > 0
  (loss, parts), grads = reg(head, state.variables, real_logits, 0.2, 0.3)
  assert np.isfinite(float(loss)) and float(loss) > 0
  np.testing.assert_allclose(loss, 0.2 * parts["teacher"] + 0.3 * parts["latent"], rtol=1e-6)
  assert float(jnp.abs(grads[0]["w"]).sum()) > 0  # the head learns from generated features
  assert float(jnp.abs(grads[2][:5]).sum()) > 0 and float(jnp.abs(grads[2][5]).sum()) == 0  # masked row
  assert all(float(jnp.abs(g).sum()) == 0 for g in jax.tree.leaves(grads[1]))  # the generator is frozen


def test_config_schedules_and_presets():
  config = FedGenConfig.preset("cifar100")
  assert (config.ensemble_lr, config.generative_alpha, config.generative_beta) == (1e-4, 10.0, 1.0)
  assert (config.noise_dim, config.hidden_dim, config.batch_size, config.generator_steps) == (100, 512, 128, 50)
  assert fedgen.client_coefficients(config, 0) == (0.0, 0.0)
  np.testing.assert_allclose(fedgen.client_coefficients(config, 1), (10 * 0.98, 0.98))
  assert fedgen.decayed_coefficient(0.2, 10_000) == 1e-4
  assert fedgen.decayed_coefficient(0.0, 3) == 0.0
  np.testing.assert_allclose(config.generator_learning_rate(2), 1e-4 * 0.98 ** 2)
  with pytest.raises(ValueError):
    FedGenConfig.preset("mnist")


def test_round_with_cnn_heads():
  model = CNN(num_classes=NUM_CLASSES, channels=(2, 4), hidden=8)
  sample = jnp.zeros((1, 28, 28, 1))
  assert fedgen.feature_width(model, sample) == 8
  heads = jax.tree.map(lambda *xs: jnp.stack(xs), *[model_variables(model, sample, seed) for seed in range(K)])
  head_apply = fedgen.feature_head(model)
  assert hash(head_apply) == hash(fedgen.feature_head(model))  # a stable jit key across rounds
  config = FedGenConfig(noise_dim=4, hidden_dim=16, batch_size=16, ensemble_epochs=4, n_teacher_iters=2)
  generator = fedgen.Generator(num_classes=NUM_CLASSES, latent_dim=8, noise_dim=config.noise_dim,
                               hidden_dim=config.hidden_dim, embedding=config.embedding)
  state = fedgen.init_generator(generator, jax.random.key(0), config.weight_decay)
  counts = np.array([[4, 0, 0, 2, 0], [0, 3, 0, 0, 0], [1, 1, 0, 0, 9]])
  new_state, metrics = fedgen.train_generator_round(state, config, generator, head_apply, heads, counts,
                                                    learning_rate=np.float32(config.generator_learning_rate(1)),
                                                    key=jax.random.key(1), valid=np.array([True, True, False]))
  chex.assert_shape(metrics["loss"], (4,))
  chex.assert_tree_all_finite((new_state, metrics))
  logits = fedgen.stacked_head_logits(head_apply, heads, jnp.ones((3, 8)))
  chex.assert_shape(logits, (K, 3, NUM_CLASSES))
