"""models.client_conv: clients' kernel gradients as one grouped backward-filter convolution under vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import models
from fedjax_hetero.models import client_conv

NHWC = ("NHWC", "HWIO", "NHWC")


@pytest.fixture
def on_this_platform(monkeypatch):
  """`models.common.convolution` and the stems use `client_convolution` here too (an accelerator's choice)."""
  monkeypatch.delenv(client_conv.KERNEL_GRADIENT_VARIABLE, raising=False)
  monkeypatch.setattr(client_conv, "KERNEL_GRADIENT_BY_BATCH_GROUPS", (jax.default_backend(),))


def conv_loss(convolve):
  return lambda x, k: jnp.sum(jnp.tanh(convolve(x, k, (2, 1), ((1, 0), (1, 1)), dimension_numbers=NHWC)))


def inputs(clients=3):
  x = jax.random.normal(jax.random.key(0), (clients, 2, 6, 5, 3))
  k = 0.3 * jax.random.normal(jax.random.key(1), (clients, 3, 2, 3, 4))
  return x, k


def test_a_vmapped_clients_kernel_gradient_is_one_batch_grouped_convolution_with_jax_own_values():
  x, k = inputs()
  ours = jax.jit(jax.vmap(jax.grad(conv_loss(client_conv.client_convolution), argnums=(0, 1))))
  jaxs = jax.jit(jax.vmap(jax.grad(conv_loss(jax.lax.conv_general_dilated), argnums=(0, 1))))
  assert "batch_group_count = 3" in ours.lower(x, k).as_text()
  assert "batch_group_count = 3" not in jaxs.lower(x, k).as_text()  # (jax's own: feature groups over the batch)
  for a, b in zip(ours(x, k), jaxs(x, k)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_unbatched_its_gradient_is_jax_own_to_the_bit():
  x, k = inputs()
  ours = jax.grad(conv_loss(client_conv.client_convolution), argnums=(0, 1))(x[0], k[0])
  jaxs = jax.grad(conv_loss(jax.lax.conv_general_dilated), argnums=(0, 1))(x[0], k[0])
  for a, b in zip(ours, jaxs):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("in_axes", [(None, 0), (0, None)])
def test_one_side_batched_gives_jax_own_gradients(in_axes):
  x, k = inputs()
  x, k = (x[0] if in_axes[0] is None else x), (k[0] if in_axes[1] is None else k)
  grads = lambda convolve: jax.vmap(jax.grad(conv_loss(convolve), argnums=(0, 1)), in_axes=in_axes)(x, k)
  for a, b in zip(grads(client_conv.client_convolution), grads(jax.lax.conv_general_dilated)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_runs_of_clients_nested_vmaps_give_jax_own_gradients():
  x, k = inputs(4)
  x, k = x.reshape((2, 2) + x.shape[1:]), k.reshape((2, 2) + k.shape[1:])
  grads = lambda convolve: jax.vmap(jax.vmap(jax.grad(conv_loss(convolve), argnums=(0, 1))))(x, k)
  for a, b in zip(grads(client_conv.client_convolution), grads(jax.lax.conv_general_dilated)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def client_gradients(name):
  model = models.build_model(name.split("@")[0], 10, float(name.split("@")[1]))
  x = jax.random.normal(jax.random.key(3), (3, 2, 16, 16, 1))
  variables = jax.vmap(lambda key: model.init(key, x[0], train=False))(jax.random.split(jax.random.key(4), 3))

  def loss(variables, x):
    logits, _ = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return jnp.sum(logits ** 2)

  step = jax.jit(jax.vmap(jax.grad(loss)))
  return step.lower(variables, x).as_text(), step(variables, x)


@pytest.mark.parametrize("name, convolutions", [
    ("cnn@0.25", 2), pytest.param("resnet10@0.125", 4, marks=pytest.mark.slow)])  # (the stem and larger maps')
def test_a_models_clients_train_their_convolutions_by_batch_groups_where_chosen(on_this_platform, name, convolutions):
  text, ours = client_gradients(name)
  assert text.count("batch_group_count = 3") >= convolutions
  client_conv.KERNEL_GRADIENT_BY_BATCH_GROUPS = ()
  default_text, jaxs = client_gradients(name)
  assert "batch_group_count = 3" not in default_text
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(jaxs)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))), err_msg=str(path))


def test_a_cpu_takes_the_canonical_form(monkeypatch):
  monkeypatch.delenv(client_conv.KERNEL_GRADIENT_VARIABLE, raising=False)
  assert "cpu" not in client_conv.KERNEL_GRADIENT_BY_BATCH_GROUPS
  if jax.default_backend() == "cpu":
    assert client_conv.kernel_gradient_form() == "canonical"


def test_the_environment_chooses_the_form_on_any_platform(monkeypatch):
  for choice in ("batch_groups", "canonical", "jax"):
    monkeypatch.setenv(client_conv.KERNEL_GRADIENT_VARIABLE, choice)
    assert client_conv.kernel_gradient_form() == choice
  monkeypatch.setenv(client_conv.KERNEL_GRADIENT_VARIABLE, "fast")
  with pytest.raises(ValueError, match="auto, batch_groups, canonical, jax"):
    client_conv.kernel_gradient_form()


CANONICAL_CASES = [  # (map, kernel, strides, padding): the models' convolutions and odd ones
    (14, 3, (1, 1), "SAME"), (14, 3, (2, 2), "SAME"), (15, 3, (2, 2), "SAME"), (14, 1, (2, 2), "VALID"),
    (28, 7, (2, 2), ((3, 3), (3, 3))), (4, 3, (1, 1), "SAME"), (10, 3, (3, 2), ((0, 2), (2, 0))),
    (6, 5, (1, 1), ((3, 0), (0, 3)))]


@pytest.mark.parametrize("size, window, strides, padding", CANONICAL_CASES)
def test_the_canonical_forms_gradients_are_jax_own_to_the_bit(size, window, strides, padding):
  x = jax.random.normal(jax.random.key(0), (3, size, size, 4))
  k = jax.random.normal(jax.random.key(1), (window, window, 4, 5))

  def grads(convolve, batched=False):
    loss = lambda x, k: jnp.sum(jnp.sin(convolve(x, k, strides, padding)))
    grad = jax.grad(loss, argnums=(0, 1))
    return jax.jit(jax.vmap(grad))(jnp.stack([x, -x]), jnp.stack([k, k])) if batched else jax.jit(grad)(x, k)

  jaxs = lambda x, k, s, p: jax.lax.conv_general_dilated(x, k, s, p, dimension_numbers=NHWC)
  for batched in (False, True):
    for a, b in zip(grads(client_conv.canonical_convolution, batched), grads(jaxs, batched)):
      np.testing.assert_array_equal(a, b)


def test_in_a_loop_the_canonical_form_keeps_xlas_fast_layout():
  """In a while loop's body XLA:CPU kept jax's layout of the kernel gradient (`f01b_i01o->01bf`), which it runs
  about 17x slower than the layout it gives the same convolution outside a loop."""
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  k = jax.random.normal(jax.random.key(1), (3, 3, 3, 5))

  def looped(convolve):
    grad = jax.grad(lambda k, x: jnp.sum(convolve(x, k, (1, 1), "SAME") ** 2))
    program = jax.jit(lambda k, x: jax.lax.fori_loop(0, 2, lambda i, g: g + grad(k, x * i), k * 0))
    return program.lower(k, x).compile().as_text()

  labels = {line.split("dim_labels=")[1].split(",")[0] for line in looped(client_conv.canonical_convolution)
            .splitlines() if " convolution(" in line}
  assert labels == {"b01f_01io->b01f"}


def test_the_benchmark_forms_compute_the_same_layer_and_gradients():
  from benchmarks import client_conv as bench

  bench.check_forms_agree()  # (raises SystemExit naming the form that differs)
  assert {"client_gradients", "client_gradients_batch_groups"} <= set(bench.FORMS)
