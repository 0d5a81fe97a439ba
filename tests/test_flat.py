"""`client.flat.FlatLayout`: variables as one vector per collection, read back with known or traced offsets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.client.flat import FlatLayout


def _variables():
  key = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda shape: jax.random.normal(next(key), shape)
  return {"params": {"a": {"kernel": normal((3, 3, 2, 4)), "bias": normal((4,))},
                     "b": {"kernel": normal((3, 3, 2, 4))}},
          "batch_stats": {"a": {"mean": normal((4,)), "var": normal((4,))}}}


def _close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_ravel_is_one_vector_per_collection_in_the_layouts_order():
  variables = _variables()
  layout = FlatLayout.of(variables)
  flat = layout.ravel(variables)
  assert set(flat) == {"params", "batch_stats"}
  assert flat["params"].shape == (2 * 72 + 4,) and flat["batch_stats"].shape == (8,)
  # each leaf starts at its offset within its collection's vector
  for (path, shape), start in zip(layout.leaves, layout.offsets):
    leaf = variables
    for name in path:
      leaf = leaf[name]
    np.testing.assert_array_equal(flat[path[0]][start:start + leaf.size], np.ravel(leaf))
  assert set(layout.ravel({"batch_stats": variables["batch_stats"]})) == {"batch_stats"}


@pytest.mark.parametrize("traced", [False, True])
def test_unravel_inverts_ravel_with_leading_axes(traced):
  variables = _variables()
  layout = FlatLayout.of(variables)
  stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), layout.ravel(variables))

  def unravel(flat, starts):
    return (layout.at(starts) if traced else layout).unravel(flat)

  back = jax.jit(unravel)(stacked, layout.offsets)
  _close(back, jax.tree.map(lambda a: jnp.stack([a, 2 * a]), variables))


def test_gradient_through_traced_offsets_is_the_sliced_one():
  variables = _variables()
  layout = FlatLayout.of(variables)
  flat = layout.ravel(variables)["params"]
  weights = jax.tree.map(lambda a: jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape), variables["params"])

  def loss(vector, starts, traced):
    view = layout.at(starts) if traced else layout
    params = view.unravel({"params": vector})["params"]
    return sum(jnp.sum(jnp.sin(p) * w) for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(weights)))

  grads = [jax.jit(jax.grad(loss), static_argnums=2)(flat, layout.offsets, t) for t in (False, True)]
  np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(grads[0]), rtol=1e-6)
  vmapped = jax.vmap(jax.grad(loss), in_axes=(0, None, None))(jnp.stack([flat, flat]), layout.offsets, True)
  np.testing.assert_allclose(np.asarray(vmapped[1]), np.asarray(grads[0]), rtol=1e-6)


def test_equal_layouts_are_equal_whatever_they_read_at():
  variables = _variables()
  layout = FlatLayout.of(variables)
  assert layout == FlatLayout.of(jax.eval_shape(lambda: variables))
  assert layout.at(layout.offsets) == layout and hash(layout.at(layout.offsets)) == hash(layout)
