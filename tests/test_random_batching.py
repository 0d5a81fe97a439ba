"""`batch_random_draws`: a function's independent draws made together give the function's own values, from a
program with fewer instances of the random hash."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex

from fedjax_hetero import models
from fedjax_hetero.random_batching import batch_random_draws


def _same(a, b) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b) and len(leaves_a) == len(leaves_b)
          and all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                  for x, y in zip(map(np.asarray, leaves_a), map(np.asarray, leaves_b))))


def _draws(fun, *args) -> int:
  """How many fold-ins and bit draws ``fun``'s program makes (nested calls included)."""
  def count(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name in ("random_fold_in", "random_bits")
      n += sum(count(sub.jaxpr if hasattr(sub, "jaxpr") else sub) for sub in jex.jaxprs_in_params(eqn.params))
    return n
  return count(jax.make_jaxpr(fun)(*args).jaxpr)


@pytest.mark.parametrize("name, width", [("mlp", 1.0), ("cnn", 0.5), ("resnet26", 0.125)] + [
    pytest.param(*model, marks=pytest.mark.slow)
    for model in (("resnet18_cifar", 0.125), ("resnet20_preact", 0.25), ("vgg16", 0.125), ("vit", 0.25))])
def test_a_models_initialization_is_model_inits_values_from_fewer_draws(name, width):
  model = models.build_model(name, num_classes=10, width=width)
  shape = (1, 32, 32, 3) if name in ("resnet18_cifar", "resnet20_preact", "vgg16", "vit") else (1, 28, 28, 1)
  sample = np.zeros(shape, np.float32)

  def initialize(seed, x):
    return model.init(jax.random.key(seed), x)

  batched = batch_random_draws(initialize)
  assert _same(jax.jit(initialize)(np.uint32(7), sample), jax.jit(batched)(np.uint32(7), sample))
  draws, plain = _draws(batched, np.uint32(7), sample), _draws(initialize, np.uint32(7), sample)
  assert draws < plain and (plain < 30 or draws <= plain / 4), (draws, plain)


def _mixed(key):
  """Draws of several shapes, kinds and dtypes, from keys folded, split and used twice, with arithmetic between."""
  keys = [jax.random.fold_in(key, i) for i in range(5)]
  a, b = jax.random.split(keys[0])
  out = {"normal": [jax.random.normal(k, (3, 4 + i)) for i, k in enumerate(keys[1:])],
         "uniform": jax.random.uniform(a, (7,)), "ints": jax.random.randint(b, (2, 3), 0, 9),
         "again": jax.random.normal(keys[1], (3, 4)), "half": jax.random.normal(keys[2], (5,), jnp.float16)}
  out["chained"] = jax.random.bernoulli(jax.random.fold_in(a, 3), out["uniform"])
  return out


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("partitionable", [True, False])
def test_mixed_draws_keep_their_values_with_any_key_and_either_threefry_form(impl, partitionable):
  before = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", partitionable)
  try:
    key = jax.random.key(3, impl=impl)
    assert _same(jax.jit(_mixed)(key), jax.jit(batch_random_draws(_mixed))(key))
    batched, plain = _draws(batch_random_draws(_mixed), key), _draws(_mixed, key)
    assert batched < plain if impl == "threefry2x32" else batched == plain  # (rbg's batched draws differ)
  finally:
    jax.config.update("jax_threefry_partitionable", before)


def test_what_the_outputs_do_not_read_is_not_computed_and_a_traced_argument_passes_through():
  def fun(key, x):
    unused = jax.random.normal(jax.random.fold_in(key, 9), (1000,))  # noqa: F841 (dead)
    return jax.random.normal(key, (2,)) * x, x + 1

  batched = batch_random_draws(fun)
  key = jax.random.key(0)
  assert _same(jax.jit(fun)(key, 2.0), jax.jit(batched)(key, 2.0))
  assert _draws(batched, key, 2.0) == 1
  assert jax.grad(lambda x: batched(key, x)[1])(3.0) == 1.0


def test_where_jax_internals_differ_the_draws_are_made_one_by_one_with_a_warning(monkeypatch):
  from fedjax_hetero import random_batching

  def unreadable(closed):
    raise KeyError("a jax whose programs read otherwise")

  monkeypatch.setattr(random_batching, "_flatten", unreadable)
  monkeypatch.setattr(random_batching, "_warned", [])
  key = jax.random.key(1)
  with pytest.warns(RuntimeWarning, match="made one by one"):
    values = jax.jit(batch_random_draws(_mixed))(key)
  assert _same(values, jax.jit(_mixed)(key))


def test_under_vmap_each_key_gets_what_it_gets_alone():
  keys = jax.random.split(jax.random.key(5), 3)
  assert _same(jax.jit(jax.vmap(_mixed))(keys), jax.jit(jax.vmap(batch_random_draws(_mixed)))(keys))


def test_draws_traced_under_another_threefry_form_batches_of_keys_and_effects_keep_their_values():
  """Draws made inside ``jax.threefry_partitionable(False)`` are not cut from a longer draw, draws from a batch of
  keys are left as they are, and an effect without outputs neither breaks the evaluation nor runs twice."""
  calls = []

  def fun(key):
    with jax.threefry_partitionable(False):
      inner = [jax.random.normal(jax.random.fold_in(key, i), (3 + i,)) for i in range(4)]
    keys = jax.random.split(key, 3)
    batch = [jax.vmap(lambda k, n=n: jax.random.normal(k, (n,)))(keys) for n in (5, 7)]
    jax.debug.callback(lambda: calls.append(1))
    return inner, batch, [jax.random.normal(jax.random.fold_in(key, 9 + i), (2 + i,)) for i in range(3)]

  key = jax.random.key(2)
  batched = batch_random_draws(fun)
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)  # (no fallback to the draws one by one)
    values = jax.jit(batched)(key)
  assert _same(values, jax.jit(fun)(key))
  assert len(calls) == 2  # (once a call: the plain function's and the batched one's)
  assert _draws(batched, key) < _draws(fun, key)
