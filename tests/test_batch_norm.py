"""models.batch_norm: flax's training-mode BatchNorm with its gradient written out."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.models import batch_norm as batch_norm_module
from fedjax_hetero.models.batch_norm import batch_norm, fused_batch_norm
from fedjax_hetero.models.resnet import resnet10


def _run(model, variables, x, mask, fused):
  def loss(params):
    logits, new = model.apply({**variables, "params": params}, x, train=True, mask=mask, mutable=["batch_stats"])
    kept = jnp.tanh(logits) if mask is None else jnp.where(mask[:, None], jnp.tanh(logits), 0.0)
    return jnp.sum(kept), (logits, new)

  def program(params):
    if fused:
      with fused_batch_norm():
        return jax.value_and_grad(loss, has_aux=True)(params)
    return jax.value_and_grad(loss, has_aux=True)(params)

  return jax.jit(program)(variables["params"])


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_resnet_computes_flax_batch_norm_with_its_gradient(with_mask, monkeypatch):
  calls = []
  monkeypatch.setattr(batch_norm_module, "batch_norm", lambda *a: calls.append(a[0].shape) or batch_norm(*a))
  model = resnet10(width=0.125)
  x = jax.random.normal(jax.random.key(0), (6, 28, 28, 1))
  variables = model.init(jax.random.key(1), x[:1])
  mask = jnp.arange(6) < 4 if with_mask else None
  (loss, (logits, stats)), grads = _run(model, variables, x, mask, fused=False)
  (f_loss, (f_logits, f_stats)), f_grads = _run(model, variables, x, mask, fused=True)
  np.testing.assert_allclose(f_loss, loss, rtol=1e-5)
  np.testing.assert_allclose(f_logits, logits, rtol=1e-4, atol=1e-5)
  for want, have in zip(jax.tree.leaves((stats, grads)), jax.tree.leaves((f_stats, f_grads))):
    np.testing.assert_allclose(have, want, rtol=1e-3, atol=1e-5 * float(np.max(np.abs(want)) + 1e-6))
  assert jax.tree.map(jnp.shape, f_stats) == jax.tree.map(jnp.shape, stats)
  assert len(calls) == 12  # every BatchNorm of ResNet10 ran as `batch_norm`: the stem's, 2 a block, 3 downsamples


def test_a_masked_example_does_not_move_the_statistics_and_zero_channels_stay_zero():
  bn = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)
  x = jax.random.normal(jax.random.key(0), (4, 3, 3, 5)).at[..., 3:].set(0.0)
  variables = bn.init(jax.random.key(1), x)
  variables = {"params": {"scale": jnp.ones(5).at[3:].set(0.0), "bias": jnp.zeros(5)},
               "batch_stats": variables["batch_stats"]}
  mask = jnp.array([True, True, True, False]).reshape(4, 1, 1, 1)
  with fused_batch_norm():
    y, new = bn.apply(variables, x, mask=mask, mutable=["batch_stats"])
    y_other, new_other = bn.apply(variables, x.at[3].set(100.0), mask=mask, mutable=["batch_stats"])
  np.testing.assert_array_equal(new["batch_stats"]["mean"], new_other["batch_stats"]["mean"])
  np.testing.assert_allclose(new["batch_stats"]["mean"][:3], 0.1 * jnp.mean(x[:3], axis=(0, 1, 2))[:3], rtol=1e-5)
  assert float(jnp.max(jnp.abs(y[..., 3:]))) == 0.0


def test_a_non_boolean_mask_keeps_every_example_it_does_not_zero_as_flax_does():
  bn = nn.BatchNorm(use_running_average=False)
  x = jax.random.normal(jax.random.key(0), (4, 3, 3, 2))
  variables = bn.init(jax.random.key(1), x)
  mask = jnp.array([1.0, 1.0, 0.5, 0.0]).reshape(4, 1, 1, 1)
  want = bn.apply(variables, x, mask=mask, mutable=["batch_stats"])
  with fused_batch_norm():
    have = bn.apply(variables, x, mask=mask, mutable=["batch_stats"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), have, want)


def test_an_empty_mask_gives_finite_numbers():
  bn = nn.BatchNorm(use_running_average=False)
  x = jnp.ones((2, 4, 3))
  variables = bn.init(jax.random.key(0), x)

  def loss(params):
    with fused_batch_norm():
      y, _ = bn.apply({**variables, "params": params}, x, mask=jnp.zeros((2, 1, 1), bool), mutable=["batch_stats"])
    return jnp.sum(y)

  value, grads = jax.value_and_grad(loss)(variables["params"])
  assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_a_call_it_cannot_serve_runs_flax():
  # A mask over features (not per example) and evaluation mode both fall through to flax's own module.
  bn = nn.BatchNorm()
  x = jax.random.normal(jax.random.key(0), (4, 6))
  variables = bn.init(jax.random.key(1), x, use_running_average=False)
  mask = jnp.ones((4, 6), bool).at[:, 0].set(False)
  train = lambda: bn.apply(variables, x, use_running_average=False, mask=mask, mutable=["batch_stats"])
  evaluate = lambda: bn.apply(variables, x, use_running_average=True)
  want = train(), evaluate()
  with fused_batch_norm():
    have = train(), evaluate()
  jax.tree.map(np.testing.assert_array_equal, have, want)


def test_every_local_step_trains_with_it(monkeypatch):
  """`LocalTrainer.train_step` (what the host loop, the per-group and the union programs and the cost accounting
  trace) runs each of a ResNet's training-mode BatchNorms as `batch_norm`."""
  from fedjax_hetero.client.local import LocalTrainer
  from fedjax_hetero.config.client import LocalConfig

  calls = []
  monkeypatch.setattr(batch_norm_module, "batch_norm", lambda *a: calls.append(a[0].shape) or batch_norm(*a))
  model = resnet10(width=0.125)
  trainer = LocalTrainer(model, LocalConfig(batch_size=4), (0.5,), (0.25,))
  state = trainer.init_state(model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1))), (), (), jax.random.key(1))
  images, labels = jnp.zeros((4, 28, 28, 1), jnp.uint8), jnp.arange(4)
  jax.make_jaxpr(trainer.train_step)(state, images, labels, jnp.ones(4, bool))
  norms = [path for path, _ in jax.tree_util.tree_leaves_with_path(state.variables["batch_stats"])
           if path[-1].key == "mean"]
  assert len(norms) > 10 and len(calls) == len(norms), (len(calls), len(norms))
