"""Client terms: activations at cut points, several gradients combined by a rule, and the checks."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.client.terms import ClientTerm, Loss
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.data.store import normalize
from fedjax_hetero.models import build_model
from tests.helpers import model_variables, random_batch

MEAN, STD = (0.45,), (0.25,)
CONFIG = LocalConfig(batch_size=8, optimizer="sgd", learning_rate=0.1)


@pytest.fixture(scope="module")
def resnet():
  model = build_model("resnet10", 4, 1.0, base_channels=4, stage_sizes=(1, 1))  # stages 1-2: the terms read stage 2
  return model, model_variables(model, jnp.zeros((1, 8, 8, 1)), 0)


def feature_penalty(weight: float, gradient: str = "local", cut: str = "stage2") -> ClientTerm:
  """``weight * mean(h^2)`` of the activation at ``cut``: reads the training forward's activations."""
  penalty = Loss(lambda v, s, p, out, ctx: weight * jnp.mean(out.activations[cut] ** 2), gradient=gradient)
  return ClientTerm(f"penalty_{gradient}", loss=penalty, cuts=(cut,))


@pytest.mark.slow
def test_a_term_reads_the_activations_of_the_training_forward(resnet):
  model, variables = resnet
  images, labels = random_batch(0, 8, 4)
  # A term that keeps the last step's activation at stage 2 (an [8, 1, 1, 8] array for 8x8 images) in its state.
  spy = ClientTerm("spy", init=lambda r: jnp.zeros((8, 1, 1, 8)), update=lambda s, out, ctx: out.activations["stage2"],
                   cuts=("stage2",))
  trainer = LocalTrainer(model, CONFIG, MEAN, STD, terms=(spy,))
  state = jax.jit(trainer.train_step)(trainer.init_state(variables), images, labels, jnp.ones(8, bool))
  x = normalize(images, MEAN, STD)
  want, _ = model.apply(variables, x, train=True, mask=jnp.ones(8, bool), stop="stage2", mutable=["batch_stats"])
  assert float(jnp.abs(want).max()) > 0
  # Eager and jitted programs sum the tiny-map convolutions' products in different orders (1e-6 relative),
  # which the batch normalisation after them can amplify tenfold.
  np.testing.assert_allclose(np.asarray(state.terms[0]), np.asarray(want), rtol=1e-4, atol=1e-5)
  # Splitting the forward at the cut changes nothing: same step as without the term.
  plain = LocalTrainer(model, CONFIG, MEAN, STD)
  want_step = jax.jit(plain.train_step)(plain.init_state(variables), images, labels, jnp.ones(8, bool))
  chex.assert_trees_all_close(state.variables, want_step.variables, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_gradients_combined_by_a_linear_rule_equal_one_gradient_of_the_weighted_sum(resnet):
  model, variables = resnet
  batch = (*random_batch(1, 8, 4), jnp.ones(8, bool))
  two = LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(1.0, "aux"),),
                     combine=lambda g: jax.tree.map(lambda a, b: a + 0.5 * b, g["local"], g["aux"]))
  one = LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(0.5),))
  got = jax.jit(two.train_step)(two.init_state(variables), *batch)
  want = jax.jit(one.train_step)(one.init_state(variables), *batch)
  chex.assert_trees_all_close(got.variables, want.variables, rtol=1e-5, atol=1e-6)
  assert float(got.loss_sum) == pytest.approx(float(want.loss_sum))  # the logged loss is the data loss alone


@pytest.mark.slow
def test_a_nonlinear_rule_sees_each_gradient(resnet):
  model, variables = resnet
  batch = (*random_batch(2, 8, 4), jnp.ones(8, bool))
  seen = {}

  def keep_local_only(grads):
    seen.update(grads)
    return grads["local"]

  two = LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(3.0, "aux"),), combine=keep_local_only)
  plain = LocalTrainer(model, CONFIG, MEAN, STD)
  got = two.train_step(two.init_state(variables), *batch)
  want = plain.train_step(plain.init_state(variables), *batch)
  chex.assert_trees_all_close(got.variables, want.variables, rtol=1e-5, atol=1e-6)
  assert set(seen) == {"local", "aux"}
  head = seen["aux"]["head"]["kernel"]  # the penalty on stage 2 gives no gradient after it
  assert float(jnp.abs(head).max()) == 0 and float(jnp.abs(seen["local"]["head"]["kernel"]).max()) > 0


def test_term_checks():
  model = build_model("mlp", 4, hidden=(8,))
  with pytest.raises(ValueError, match="reads cut point 'stage2', which MLP does not have"):
    LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(1.0),))
  with pytest.raises(ValueError, match="a rule to combine them is needed"):
    LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(1.0, "aux", cut="hidden1"),))
  with pytest.raises(ValueError, match="client term names must be unique"):
    LocalTrainer(model, CONFIG, MEAN, STD, terms=(feature_penalty(1.0, cut="hidden1"),) * 2)
