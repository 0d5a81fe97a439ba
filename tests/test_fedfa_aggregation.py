"""FedFA's scalable aggregation (Alg. 1, `aggregators.fedfa_aggregate`): hand-worked cases and a plain-numpy reference
with width and depth groups."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.hetero import build_group_map, graft, identity_map
from tests.test_fedfa import params

def test_trimmed_norm_by_hand():
  w = jnp.asarray([[3.0, -4.0], [0.0, 100.0]])  # the 95th percentile of |w| drops the 100
  np.testing.assert_allclose(aggregators.trimmed_norm(w), 5.0)
  np.testing.assert_allclose(aggregators.trimmed_norm(w, norm="rms"), 5.0 / np.sqrt(3))
  np.testing.assert_allclose(aggregators.trimmed_norm(w, percentile=100.0), np.sqrt(9 + 16 + 10000))


def test_scalable_aggregation_by_hand():
  glob = params(layer={"kernel": np.zeros((2, 2)), "bias": np.zeros(2)})
  one = params(layer={"kernel": [[3, 4], [0, 100]], "bias": [1, 2]})  # ||M_95|| = 5
  two = params(layer={"kernel": [[6, 8], [0, -50]], "bias": [3, 4]})  # ||M_95|| = 10
  ident = identity_map(glob)
  new, stats = aggregators.fedfa_aggregate(glob, [one, two], [1.0, 3.0], [ident, ident])
  # mean norm 7.5: alpha = 1.5 and 0.75; kernel = (1 * 1.5 * M_1 + 3 * 0.75 * M_2) / 4, bias unscaled.
  np.testing.assert_allclose(new["params"]["layer"]["kernel"], [[4.5, 6.0], [0.0, 9.375]], rtol=1e-6)
  np.testing.assert_allclose(new["params"]["layer"]["bias"], [2.5, 3.5], rtol=1e-6)
  np.testing.assert_allclose([stats["alpha_min"], stats["alpha_max"], stats["fallbacks"]], [0.75, 1.5, 0])


def test_median_center_is_not_pulled_up_by_an_outsized_upload():
  glob = params(layer={"kernel": np.zeros((2, 2))})
  small = params(layer={"kernel": [[3, 4], [0, 100]]})  # ||M_95|| = 5
  same = params(layer={"kernel": [[4, 3], [0, 100]]})  # 5
  huge = params(layer={"kernel": [[300, 400], [0, 9000]]})  # 500
  ident = identity_map(glob)
  clients, weights = [small, same, huge], [1.0, 1.0, 1.0]
  _, by_mean = aggregators.fedfa_aggregate(glob, clients, weights, [ident] * 3)
  new, by_median = aggregators.fedfa_aggregate(glob, clients, weights, [ident] * 3, center="median")
  # mean 170: the honest kernels are scaled up 34x; the median, 5, leaves them as they are and shrinks the huge one.
  np.testing.assert_allclose([by_mean["alpha_min"], by_mean["alpha_max"]], [0.34, 34.0], rtol=1e-6)
  np.testing.assert_allclose([by_median["alpha_min"], by_median["alpha_max"]], [0.01, 1.0], rtol=1e-6)
  np.testing.assert_allclose(new["params"]["layer"]["kernel"], [[10 / 3, 11 / 3], [0.0, 290 / 3]], rtol=1e-6)
  with pytest.raises(ValueError, match="center must be one of mean, median"):
    aggregators.fedfa_aggregate(glob, clients, weights, [ident] * 3, center="mode")


def np_trimmed_norm(x, percentile, norm):
  a = np.abs(np.asarray(x, np.float64)).ravel()
  kept = a[a <= np.quantile(a, percentile / 100)]
  value = np.sqrt(np.sum(kept ** 2))
  return value / np.sqrt(len(kept)) if norm == "rms" else value


def np_fedfa(old, clients, weights, percentile, norm):
  """Alg. 1 lines 12-22 on plain dicts: ``clients`` are {global leaf: client array} after grafting (a
  leading slice of the global leaf); 'kernel' leaves are scaled, zero norms get alpha 1 and no vote."""
  out = {}
  for path, g in old.items():
    holders = [(c[path], w) for c, w in zip(clients, weights) if path in c]
    if path[-1] == "kernel":
      norms = [np_trimmed_norm(m, percentile, norm) for m, _ in holders]
      mu = np.mean([n for n in norms if n > 0]) if any(n > 0 for n in norms) else 0.0
      alphas = [mu / n if n > 0 else 1.0 for n in norms]
    else:
      alphas = [1.0] * len(holders)
    num, den = np.zeros(g.shape), np.zeros(g.shape)
    for (m, w), alpha in zip(holders, alphas):
      index = tuple(slice(0, s) for s in m.shape)
      num[index] += w * alpha * m
      den[index] += w
    out[path] = np.where(den > 0, num / np.where(den > 0, den, 1), g)
  return out


GLOBAL = {"stem": (3, 4), "b0": (4, 4), "b1": (4, 4), "b2": (4, 4), "head": (4, 2)}


def hand_model(rng, width=4, blocks=3, zero=()):
  leaves = {"stem": {"kernel": (3, width)}, "head": {"kernel": (width, 2), "bias": (2,)}}
  leaves.update({f"b{j}": {"kernel": (width, width), "bias": (width,)} for j in range(blocks)})
  return params(**{name: {k: np.zeros(s) if (name, k) in zero else rng.normal(size=s) * (1 + 3 * rng.random())
                          for k, s in leaf.items()} for name, leaf in leaves.items()})


def as_global_leaves(client, pairs=()):
  flat = {(name, k): np.asarray(v) for name, leaf in client["params"].items() for k, v in leaf.items()}
  for target, source in pairs:  # grafting by hand: a copy under the deeper block's name
    flat.update({(target, k): v for (name, k), v in list(flat.items()) if name == source})
  return flat


@pytest.mark.slow
@pytest.mark.parametrize("norm, percentile", [("l2", 95.0), ("rms", 95.0), ("l2", 80.0)])
def test_scalable_aggregation_matches_numpy_with_width_and_depth(norm, percentile):
  rng = np.random.default_rng(0)
  glob = hand_model(rng)
  full, thin, shallow, thin2 = hand_model(rng), hand_model(rng, width=2), hand_model(rng, blocks=1), \
      hand_model(rng, width=2)
  pairs = [("b1", "b0"), ("b2", "b0")]
  maps = [build_group_map(glob, full), build_group_map(glob, thin),
          graft(build_group_map(glob, shallow), [((t,), (s,)) for t, s in pairs], "shallow")]
  clients, weights = [full, thin, shallow, thin2], [2.0, 1.0, 3.0, 0.5]
  new, stats = aggregators.fedfa_aggregate(glob, clients, weights, [maps[0], maps[1], maps[2], maps[1]],
                                           percentile, norm)
  expected = np_fedfa(as_global_leaves(glob), [as_global_leaves(c, p) for c, p in
                                               zip(clients, [(), (), pairs, ()])], weights, percentile, norm)
  got = as_global_leaves(new)
  assert got.keys() == expected.keys()
  for path in expected:
    np.testing.assert_allclose(got[path], expected[path], rtol=2e-5, atol=1e-6, err_msg=str(path))
  assert float(stats["alpha_min"]) < 1 < float(stats["alpha_max"])

  # The engine's form: the two thin clients summed inside their group first give the same model.
  parts = [aggregators.fedfa_client_parts(c, percentile, norm) for c in clients]
  scale = lambda tree, w: jax.tree.map(lambda x: w * x, tree)
  add = lambda a, b: jax.tree.map(jnp.add, a, b)
  groups = [[0], [1, 3], [2]]
  total = lambda i, field: (scale(getattr(parts[i], field), weights[i]) if field else scale(clients[i], weights[i]))
  sums = {field: [total(g[0], field) if len(g) == 1 else add(total(g[0], field), total(g[1], field))
                  for g in groups] for field in ("", "scaled", "fallback")}
  norms = [jax.tree.map(lambda *n: jnp.stack(n + (0.0,)), *[parts[i].norms for i in g]) for g in groups]
  valid = [jnp.arange(len(g) + 1) < len(g) for g in groups]  # a padding row of zeros, as the engine sends
  sums_of = jax.jit(aggregators.fedfa_scalable_sums, static_argnums=1)
  num, den, group_stats = sums_of(glob, tuple(maps), sums[""], [sum(weights[i] for i in g) for g in groups],
                                  sums["scaled"], sums["fallback"], norms, valid)
  summed = aggregators.masked_mean(num, den, glob)
  chex.assert_trees_all_close(summed, new, rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(group_stats, stats, rtol=1e-5)


def test_zero_norm_kernel_falls_back_to_alpha_one():
  rng = np.random.default_rng(1)
  glob, full = hand_model(rng), hand_model(rng)
  zeros = hand_model(rng, zero=[("b1", "kernel")])  # uploaded zeros for one kernel
  spiky = hand_model(rng)  # 15 of 16 zeros: its trimmed norm is 0, but the spike is real
  spike = np.zeros((4, 4))
  spike[1, 2] = 7.0
  spiky["params"]["b2"]["kernel"] = jnp.asarray(spike, jnp.float32)
  ident = identity_map(glob)
  new, stats = aggregators.fedfa_aggregate(glob, [full, zeros, spiky], [1.0, 1.0, 2.0], [ident] * 3)
  for leaf in jax.tree.leaves(new):
    chex.assert_tree_all_finite(leaf)
  assert int(stats["fallbacks"]) == 2
  expected = np_fedfa(as_global_leaves(glob), [as_global_leaves(c) for c in (full, zeros, spiky)], [1, 1, 2], 95.0,
                      "l2")
  for path, value in as_global_leaves(new).items():
    np.testing.assert_allclose(value, expected[path], rtol=2e-5, atol=1e-6, err_msg=str(path))
  # With the full client alone beside each: alpha = 1 for both (the zero norm does not enter the mean), so
  # b1 is the full kernel over 2 (the zero upload counts in the mean) and b2 keeps the spike unscaled.
  alone, _ = aggregators.fedfa_aggregate(glob, [full, zeros], [1.0, 1.0], [ident] * 2)
  np.testing.assert_allclose(alone["params"]["b1"]["kernel"], full["params"]["b1"]["kernel"] / 2, rtol=1e-6)
  alone, _ = aggregators.fedfa_aggregate(glob, [full, spiky], [1.0, 2.0], [ident] * 2)
  np.testing.assert_allclose(alone["params"]["b2"]["kernel"], (full["params"]["b2"]["kernel"] + 2 * spike) / 3,
                             rtol=1e-6)


def test_scalable_sums_check_their_inputs():
  glob = params(layer={"kernel": np.zeros((2, 2))})
  ident = identity_map(glob)
  with pytest.raises(ValueError, match="norms\\[0\\]"):
    aggregators.fedfa_scalable_sums(glob, [ident], [glob], [1.0], [glob], [glob], [{"params": {}}],
                                    [jnp.ones(1, bool)])
  with pytest.raises(ValueError, match="norm must be one of l2, rms"):
    aggregators.trimmed_norm(jnp.ones(3), norm="l1")
