"""Local training: the on-device schedule, masked steps, and LocalConfig."""

from __future__ import annotations

import collections
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_hetero.client.local import LocalTrainer, draw_schedule, masked_cross_entropy
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.data.store import normalize
from fedjax_hetero.models import build_model
from tests.helpers import model_variables, random_batch, tiny_resnet

NUM_CLASSES = 4
MEAN, STD = (0.45,), (0.25,)


# ---------------------------------------------------------------------------------------------- schedule


@functools.partial(jax.jit, static_argnames=("epochs", "batch_size", "num_steps", "drop_last"))
def schedule(index_row, num_examples, key, *, epochs, batch_size, num_steps, drop_last):
  return draw_schedule(index_row, num_examples, key, epochs=epochs, batch_size=batch_size,
                       num_steps=num_steps, drop_last=drop_last)


def client_row(n, max_n, seed=0):
  """A padded index row: n distinct sample ids (>= 100), then zeros."""
  ids = np.random.default_rng(seed).permutation(np.arange(100, 100 + 3 * max_n))[:n]
  row = np.zeros(max_n, np.int32)
  row[:n] = ids
  return row, ids


@pytest.mark.parametrize("n,batch_size,epochs", [(13, 4, 3), (8, 4, 2), (3, 5, 2), (1, 1, 2), (20, 6, 1)])
def test_each_epoch_visits_every_example_once(n, batch_size, epochs):
  max_n = 20
  row, ids = client_row(n, max_n)
  per_epoch = -(-n // batch_size)
  num_steps = epochs * per_epoch + 5  # padded past the client's own count
  got_ids, mask = schedule(jnp.asarray(row), jnp.int32(n), jax.random.key(1), epochs=epochs,
                           batch_size=batch_size, num_steps=num_steps, drop_last=False)
  got_ids, mask = np.asarray(got_ids), np.asarray(mask)
  chex.assert_shape([got_ids, mask], (num_steps, batch_size))
  assert mask.dtype == np.bool_
  orders = []
  for e in range(epochs):
    steps = slice(e * per_epoch, (e + 1) * per_epoch)
    visited = got_ids[steps][mask[steps]]
    assert collections.Counter(visited.tolist()) == collections.Counter(ids.tolist()), f"epoch {e}"
    orders.append(visited)
    # Only the epoch's last batch may be partial, and its real slots come first.
    np.testing.assert_array_equal(mask[steps].sum(axis=1)[:-1], batch_size)
    assert mask[steps][-1].sum() == n - (per_epoch - 1) * batch_size
  assert not mask[epochs * per_epoch:].any(), "steps past the client's count must be fully masked"
  assert mask.sum() == epochs * n
  if n >= 8 and epochs > 1:
    assert not np.array_equal(orders[0], orders[1]), "epochs should be fresh permutations"


@pytest.mark.parametrize("n,batch_size,epochs", [(13, 4, 3), (8, 4, 2), (3, 5, 2), (11, 11, 1)])
def test_drop_last_keeps_only_full_batches(n, batch_size, epochs):
  max_n = 16
  row, ids = client_row(n, max_n, seed=1)
  per_epoch = n // batch_size
  num_steps = max(epochs * per_epoch, 1) + 3
  got_ids, mask = schedule(jnp.asarray(row), jnp.int32(n), jax.random.key(2), epochs=epochs,
                           batch_size=batch_size, num_steps=num_steps, drop_last=True)
  got_ids, mask = np.asarray(got_ids), np.asarray(mask)
  assert mask[:epochs * per_epoch].all(), "kept batches are full"
  assert not mask[epochs * per_epoch:].any()
  for e in range(epochs):
    visited = got_ids[e * per_epoch:(e + 1) * per_epoch].ravel()
    assert len(set(visited.tolist())) == len(visited) == per_epoch * batch_size, "no repeats within an epoch"
    assert set(visited.tolist()) <= set(ids.tolist())


def test_schedule_of_an_empty_client_is_fully_masked():
  row = np.zeros(10, np.int32)
  for drop_last in (False, True):
    _, mask = schedule(jnp.asarray(row), jnp.int32(0), jax.random.key(0), epochs=2, batch_size=4,
                       num_steps=6, drop_last=drop_last)
    assert not np.asarray(mask).any()


def test_schedule_is_a_function_of_the_key():
  row, _ = client_row(13, 20)
  args = dict(epochs=2, batch_size=4, num_steps=8, drop_last=False)
  a = schedule(jnp.asarray(row), jnp.int32(13), jax.random.key(5), **args)
  b = schedule(jnp.asarray(row), jnp.int32(13), jax.random.key(5), **args)
  c = schedule(jnp.asarray(row), jnp.int32(13), jax.random.key(6), **args)
  chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(np.asarray(a[0])[np.asarray(a[1])], np.asarray(c[0])[np.asarray(c[1])])


# ------------------------------------------------------------------------------------------ train step


def batch(seed, size):
  return random_batch(seed, size, NUM_CLASSES)


def assert_trees_differ(a, b):
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def resnet_trainer():
  model = tiny_resnet((1,), num_classes=NUM_CLASSES)  # BatchNorm in the stem and the block: enough here
  variables = model_variables(model, jnp.zeros((1, 8, 8, 1)), seed=0)
  trainer = LocalTrainer(model, LocalConfig(batch_size=8, optimizer="adam", learning_rate=0.1), MEAN, STD)
  return trainer, variables, jax.jit(trainer.train_step)


def test_all_masked_step_is_a_no_op_with_batch_norm(resnet_trainer):
  trainer, variables, step = resnet_trainer
  assert "batch_stats" in variables
  images, labels = batch(0, 8)
  state0 = trainer.init_state(variables)
  state1 = step(state0, images, labels, jnp.ones(8, bool))
  # The real step changed everything the masked step must keep.
  assert_trees_differ(state1.variables["params"], state0.variables["params"])
  assert_trees_differ(state1.variables["batch_stats"], state0.variables["batch_stats"])
  assert_trees_differ(state1.opt_state, state0.opt_state)
  assert float(state1.num_examples) == 8 and float(state1.loss_sum) > 0

  other_images, other_labels = batch(1, 8)
  state2 = step(state1, other_images, other_labels, jnp.zeros(8, bool))
  chex.assert_trees_all_equal(state2, state1)  # params, batch_stats, adam mu/nu/count, counters
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state2))


def test_partially_masked_batch_norm_step_uses_only_real_rows(resnet_trainer):
  """Masked rows must not enter the loss, the gradient or the BN batch statistics."""
  trainer, variables, step = resnet_trainer
  images, labels = batch(2, 8)
  mask = np.array([1, 0, 1, 1, 0, 1, 0, 1], bool)
  junk_images = images.at[~mask].set(255)
  masked = step(trainer.init_state(variables), junk_images, labels, jnp.asarray(mask))
  real = np.flatnonzero(mask)
  # The real rows, padded with copies of real rows under a mask, so the batch shape (and program) is shared.
  order = np.concatenate([real, real[:8 - len(real)]])
  pad_mask = np.arange(8) < len(real)
  reference = step(trainer.init_state(variables), images[order], labels[order], jnp.asarray(pad_mask))
  chex.assert_trees_all_close(masked, reference, rtol=1e-4, atol=1e-5)
  assert float(masked.num_examples) == len(real)


@pytest.fixture(scope="module")
def cnn_trainer():
  model = build_model("cnn", NUM_CLASSES, 1.0, channels=(4, 8), hidden=8)
  variables = model_variables(model, jnp.zeros((1, 8, 8, 1)), seed=1)
  trainer = LocalTrainer(model, LocalConfig(batch_size=8, optimizer="sgd", learning_rate=0.5), MEAN, STD)
  return trainer, variables, jax.jit(trainer.train_step)


def test_partially_masked_step_equals_training_on_the_real_rows(cnn_trainer):
  trainer, variables, step = cnn_trainer
  images, labels = batch(3, 8)
  mask = np.array([0, 1, 1, 0, 1, 1, 0, 1], bool)
  real = np.flatnonzero(mask)
  junk_images = images.at[~mask].set(255)
  junk_labels = labels.at[~mask].set(0)
  got = step(trainer.init_state(variables), junk_images, junk_labels, jnp.asarray(mask))

  # Independent reference: one plain SGD step on the mean cross-entropy of the real rows only.
  x = normalize(images[real], MEAN, STD)

  def loss(params):
    logits = trainer.model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels[real]).mean()

  value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
  expected = jax.tree.map(lambda p, g: p - 0.5 * g, variables["params"], grads)
  assert_trees_differ(expected, variables["params"])
  chex.assert_trees_all_close(got.variables["params"], expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(float(got.loss_sum), len(real) * float(value), rtol=1e-5)
  assert float(got.num_examples) == len(real)


def test_all_masked_step_is_a_no_op_with_momentum():
  model = build_model("mlp", NUM_CLASSES, 1.0, hidden=(16,))
  variables = model_variables(model, jnp.zeros((1, 8, 8, 1)), seed=2)
  config = LocalConfig(batch_size=4, optimizer="sgd", learning_rate=0.1, momentum=0.9, weight_decay=1e-2)
  trainer = LocalTrainer(model, config, MEAN, STD)
  step = jax.jit(trainer.train_step)
  images, labels = batch(4, 4)
  state1 = step(trainer.init_state(variables), images, labels, jnp.ones(4, bool))
  state2 = step(state1, *batch(5, 4), jnp.zeros(4, bool))
  chex.assert_trees_all_equal(state2, state1)
  state3 = step(state1, *batch(5, 4), jnp.ones(4, bool))
  assert_trees_differ(state3.opt_state, state1.opt_state)


def test_masked_cross_entropy():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
  labels = jnp.asarray([0, 2, 1, 1, 0])
  mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0])
  mean, total = jax.jit(masked_cross_entropy)(logits, labels, mask)
  logp = jax.nn.log_softmax(logits)
  per = -np.asarray(logp)[np.arange(5), np.asarray(labels)]
  np.testing.assert_allclose(float(total), per[[0, 2, 3]].sum(), rtol=1e-6)
  np.testing.assert_allclose(float(mean), per[[0, 2, 3]].mean(), rtol=1e-6)
  mean0, total0 = masked_cross_entropy(logits, labels, jnp.zeros(5))
  assert float(mean0) == 0.0 and float(total0) == 0.0


# ------------------------------------------------------------------------------------------ LocalConfig


@pytest.mark.parametrize("kwargs,message", [
    (dict(optimizer="rmsprop"), r"--optimizer must be one of sgd, adam, got 'rmsprop'"),
    (dict(epochs=0), r"--epochs must be an integer >= 1, got 0"),
    (dict(batch_size=0), r"--batch-size must be an integer >= 1, got 0"),
    (dict(batch_size=-3), r"--batch-size must be an integer >= 1, got -3"),
    (dict(batch_size=2.5), r"--batch-size must be an integer >= 1, got 2.5"),
    (dict(steps_per_call=0), r"--steps-per-call must be an integer >= 1, got 0"),
    (dict(learning_rate=0.0), r"--lr must be a finite number > 0, got 0.0"),
    (dict(learning_rate=-1e-3), r"--lr must be a finite number > 0, got -0.001"),
    (dict(learning_rate=float("nan")), r"--lr must be a finite number > 0, got nan"),
    (dict(learning_rate=float("inf")), r"--lr must be a finite number > 0, got inf"),
    (dict(momentum=1.0), r"--momentum must be a finite number in \[0, 1\), got 1.0"),
    (dict(weight_decay=-5.0), r"--weight-decay must be a finite number >= 0, got -5.0"),
    (dict(drop_last="no"), r"--drop-last must be true or false, got 'no'"),
])
def test_local_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    LocalConfig(**kwargs)


def test_local_config_step_counts():
  c = LocalConfig(epochs=2, batch_size=4, steps_per_call=3)
  assert c.steps_per_epoch(13) == 4 and c.num_steps(13) == 8
  assert c.steps_per_epoch(12) == 3 and c.num_steps(12) == 6
  assert c.num_steps(0) == 0
  d = LocalConfig(epochs=2, batch_size=4, steps_per_call=3, drop_last=True)
  assert d.steps_per_epoch(13) == 3 and d.num_steps(13) == 6
  assert d.num_steps(3) == 0  # a client smaller than one batch trains no step
