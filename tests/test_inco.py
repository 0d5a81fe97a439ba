"""InCo's cross-layer step against a plain-numpy, slice-by-slice reference, and its wiring."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import aggregators
from fedjax_hetero.aggregators import INCO_GRANULARITIES, INCO_VARIANTS, cross_layer_update, inco
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.hetero import build_group_map
from fedjax_hetero.methods import build_method
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds.cohort import empty_result
from tests import helpers
from tests.helpers import aggregate, method_options, tiny_federation

EPS = 1e-7
SHAPE = (3, 3, 4, 5)  # HWIO


def np_update(gk, g0, variant, granularity, theta=None):
  """Reference: loops over the 3x3 slices (or takes the whole tensor) in float64."""
  gk, g0 = np.asarray(gk, np.float64), np.asarray(g0, np.float64)
  if granularity == "kernel" and gk.ndim == 4:
    slices = [(slice(None), slice(None), i, o) for i in range(gk.shape[2]) for o in range(gk.shape[3])]
  else:
    slices = [(Ellipsis,)]
  out = np.empty_like(gk)
  for sl in slices:
    k, z = gk[sl], g0[sl]
    a, b = float(np.sum(z * z)), float(np.sum(z * k))
    nk, n0 = float(np.sqrt(np.sum(k * k))), float(np.sqrt(np.sum(z * z)))
    if variant == "code":
      th = min(max(abs(b) / (a + EPS), 0.0), 5.0) if theta is None else theta
      u = np.clip((k / (nk + EPS) + th * z / (n0 + EPS)) * (nk + n0) / 2, -0.1, 0.1)
    elif variant == "theorem":
      th = (b / a if b < 0 else 0.0) if theta is None else theta
      u = (k / nk - th * z / n0) * (nk + n0) / 2
    elif variant == "paper":
      th = b / a if theta is None else theta
      u = (k / nk - th * z / n0) * (nk + n0) / 2
    elif variant == "no_normalization":
      th = min(abs(b) / (a + EPS), 5.0) if theta is None else theta
      u = k + th * z
    elif variant == "no_optimization":
      th = 1.0 if theta is None else theta
      u = (k / (nk + EPS) + th * z / (n0 + EPS)) * (nk + n0) / 2
    else:  # "none"
      th = 1.0 if theta is None else theta
      u = k + th * z
    out[sl] = u
  return out


def random_pair(seed, shape=SHAPE, scale=0.05):
  rng = np.random.default_rng(seed)
  g0 = rng.normal(size=shape) * scale
  mix = rng.uniform(-1, 1, size=(1, 1) + shape[2:] if len(shape) == 4 else ())  # both signs of b
  gk = rng.normal(size=shape) * scale + mix * g0
  return gk.astype(np.float32), g0.astype(np.float32)


def test_random_pairs_exercise_both_signs_of_b_and_the_clip():
  gk, g0 = random_pair(0)
  b = np.sum(gk * g0, axis=(0, 1))
  assert (b > 0).any() and (b < 0).any()
  code = np_update(gk, g0, "code", "kernel", theta=None)
  assert (np.abs(code) == 0.1).any() and (np.abs(code) < 0.1).any()


@pytest.mark.parametrize("granularity", INCO_GRANULARITIES)
@pytest.mark.parametrize("variant", INCO_VARIANTS)
def test_cross_layer_update_matches_numpy(variant, granularity):
  gk, g0 = random_pair(1)
  got = jax.jit(cross_layer_update, static_argnums=(2, 3))(gk, g0, variant, granularity)
  np.testing.assert_allclose(got, np_update(gk, g0, variant, granularity), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("variant", INCO_VARIANTS)
def test_vectors_use_one_theta_even_at_kernel_granularity(variant):
  gk, g0 = random_pair(2, shape=(16,))
  got = cross_layer_update(gk, g0, variant, "kernel")
  np.testing.assert_allclose(got, np_update(gk, g0, variant, "tensor"), rtol=2e-5, atol=1e-7)


def test_theta_override():
  gk, g0 = random_pair(3)
  for variant in INCO_VARIANTS:
    for granularity in INCO_GRANULARITIES:
      got = cross_layer_update(gk, g0, variant, granularity, theta=0.3)
      np.testing.assert_allclose(got, np_update(gk, g0, variant, granularity, theta=0.3), rtol=2e-5, atol=1e-7)


def test_theorem_leaves_aligned_slices_unmixed():
  # Theorem 3.1: where b >= 0 the target is already in the half-space, θ = 0.
  gk, g0 = random_pair(12)
  got = np.asarray(cross_layer_update(gk, g0, "theorem", "kernel"))
  norm_k, norm_0 = np.linalg.norm(gk, axis=(0, 1)), np.linalg.norm(g0, axis=(0, 1))
  aligned = np.sum(gk * g0, axis=(0, 1)) >= 0
  assert aligned.any() and not aligned.all()
  np.testing.assert_allclose(got[:, :, aligned], (gk / norm_k * (norm_k + norm_0) / 2)[:, :, aligned], rtol=2e-5)


def test_theta_zero_without_normalization_is_the_plain_delta():
  gk, g0 = random_pair(4)
  for variant in ("no_normalization", "none"):
    for granularity in INCO_GRANULARITIES:
      np.testing.assert_array_equal(cross_layer_update(gk, g0, variant, granularity, theta=0.0), gk)


def test_unknown_variant_and_granularity_are_rejected():
  gk, g0 = random_pair(5)
  with pytest.raises(ValueError, match="unknown InCo variant 'foo'; accepted: code, theorem"):
    cross_layer_update(gk, g0, "foo")
  with pytest.raises(ValueError, match="unknown InCo granularity 'layer'"):
    cross_layer_update(gk, g0, "code", "layer")
  with pytest.raises(ValueError, match="shapes differ"):
    cross_layer_update(gk, g0[..., :3], "code")


# ------------------------------------------------------------------------------------------ on a tree

SRC = ("params", "stage1_block0", "conv2", "kernel")
T1 = ("params", "stage1_block1", "conv1", "kernel")
T2 = ("params", "stage1_block1", "conv2", "kernel")
PAIRS = ((T1, SRC), (T2, SRC))


def delta_tree(seed):
  rng = np.random.default_rng(seed)
  gk1, g0 = random_pair(seed)
  gk2, _ = random_pair(seed + 100)
  flat = {SRC: g0, T1: gk1, T2: gk2,
          ("params", "stage1_block0", "conv1", "kernel"): rng.normal(size=SHAPE).astype(np.float32),
          ("params", "head", "kernel"): rng.normal(size=(5, 3)).astype(np.float32),
          ("batch_stats", "stage1_block1", "bn1", "mean"): rng.normal(size=(5,)).astype(np.float32)}
  return traverse_util.unflatten_dict(flat)


@pytest.mark.parametrize("variant", INCO_VARIANTS)
def test_inco_transforms_targets_only(variant):
  delta = delta_tree(6)
  new, stats = jax.jit(functools.partial(inco, pairs=PAIRS, variant=variant))(delta)
  flat, new_flat = traverse_util.flatten_dict(delta), traverse_util.flatten_dict(new)
  assert set(new_flat) == set(flat)
  for path in flat:
    if path in (T1, T2):
      np.testing.assert_allclose(new_flat[path], np_update(flat[path], flat[SRC], variant, "kernel"),
                                 rtol=2e-5, atol=1e-7)
    else:
      np.testing.assert_array_equal(new_flat[path], flat[path])
  assert set(stats) == {"params/stage1_block1/conv1/kernel", "params/stage1_block1/conv2/kernel"}
  b = np.sum(flat[T1] * flat[SRC], axis=(0, 1))
  s = stats["params/stage1_block1/conv1/kernel"]
  np.testing.assert_allclose(s["frac_b_positive"], np.mean(b > 0), rtol=1e-6)
  assert float(s["covered"]) == 1.0
  if variant == "code":
    a = np.sum(flat[SRC].astype(np.float64) ** 2, axis=(0, 1))
    np.testing.assert_allclose(s["theta"], np.mean(np.clip(np.abs(b) / (a + EPS), 0, 5)), rtol=1e-5)
  if variant == "paper":  # reported in the additive convention: -b/a
    a = np.sum(flat[SRC].astype(np.float64) ** 2, axis=(0, 1))
    np.testing.assert_allclose(s["theta"], np.mean(-b / a), rtol=1e-4)


@pytest.mark.parametrize("variant", INCO_VARIANTS)
def test_uncovered_targets_stay_zero(variant):
  delta = traverse_util.flatten_dict(delta_tree(7))
  delta[T2] = np.zeros(SHAPE, np.float32)  # no sampled client owned it
  coverage = {p: np.full(v.shape, 2.0, np.float32) for p, v in delta.items()}
  coverage[T2] = np.zeros(SHAPE, np.float32)
  new, stats = inco(traverse_util.unflatten_dict(delta), PAIRS, variant,
                    coverage=traverse_util.unflatten_dict(coverage))
  new = traverse_util.flatten_dict(new)
  np.testing.assert_array_equal(new[T2], 0.0)
  np.testing.assert_allclose(new[T1], np_update(delta[T1], delta[SRC], variant, "kernel"), rtol=2e-5, atol=1e-7)
  s = stats["params/stage1_block1/conv2/kernel"]
  assert float(s["covered"]) == 0.0 and np.isnan(s["theta"]) and np.isnan(s["frac_b_positive"])


@pytest.mark.parametrize("granularity", INCO_GRANULARITIES)
def test_partially_covered_target_uses_only_its_covered_slice(granularity):
  # Width heterogeneity: only the leading 2x3 channels of the target were averaged.
  delta = traverse_util.flatten_dict(delta_tree(8))
  delta[T1] = np.pad(delta[T1][:, :, :2, :3], ((0, 0), (0, 0), (0, 2), (0, 2)))
  coverage = {p: np.ones(v.shape, np.float32) for p, v in delta.items()}
  coverage[T1] = np.pad(np.ones((3, 3, 2, 3), np.float32), ((0, 0), (0, 0), (0, 2), (0, 2)))
  new, _ = inco(traverse_util.unflatten_dict(delta), PAIRS, "no_optimization", granularity,
                coverage=traverse_util.unflatten_dict(coverage))
  got = traverse_util.flatten_dict(new)[T1]
  want = np_update(delta[T1][:, :, :2, :3], delta[SRC][:, :, :2, :3], "no_optimization", granularity)
  np.testing.assert_allclose(got[:, :, :2, :3], want, rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(got[:, :, 2:], 0.0)
  np.testing.assert_array_equal(got[:, :, :, 3:], 0.0)


def test_check_pairs_rejects_missing_leaves_and_unequal_shapes():
  delta = delta_tree(9)
  with pytest.raises(ValueError, match="params/nope/kernel, which is not a leaf"):
    inco(delta, ((("params", "nope", "kernel"), SRC),))
  with pytest.raises(ValueError, match="unequal shapes"):
    inco(delta, ((("params", "head", "kernel"), SRC),))


# ------------------------------------------------------------------------------- ResNet cross-layer pairs


def resnet_shapes(name, **kw):
  model = build_model(name, 10, base_channels=4, **kw)
  return model, jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 1)))


def test_resnet10_has_no_pairs():
  assert build_model("resnet10", 10).cross_layer_pairs() == ()


def test_resnet26_pairs_are_block_convs_of_equal_shape():
  model, shapes = resnet_shapes("resnet26")
  pairs = model.cross_layer_pairs()
  assert len(pairs) == 16
  flat = traverse_util.flatten_dict(dict(shapes))
  aggregators.check_pairs(pairs, shapes)
  want_targets = {p for p in flat if p[0] == "params" and p[-1] == "kernel" and p[2] in ("conv1", "conv2")
                  and not p[1].endswith("block0")}
  assert {t for t, _ in pairs} == want_targets
  for target, source in pairs:
    assert source == ("params", target[1].split("_")[0] + "_block0", "conv2", "kernel")
    assert flat[target].shape[:2] == (3, 3) and flat[target].shape[2] == flat[target].shape[3]
  assert pairs[0] == (("params", "stage1_block1", "conv1", "kernel"), ("params", "stage1_block0", "conv2", "kernel"))


def test_theta_zero_without_normalization_equals_hetero_avg():
  """The issue's check: InCo with θ = 0 and no normalization is HeteroAvg."""
  names = ("resnet10", "resnet14", "resnet18")
  built = [resnet_shapes(n, width=0.5) for n in names]
  global_model, global_shapes = built[-1]
  maps = [build_group_map(global_shapes, s, n) for n, (_, s) in zip(names, built)]
  rng = np.random.default_rng(10)
  as_arrays = lambda shapes: jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32), shapes)
  global_vars = as_arrays(global_shapes)
  sums = [as_arrays(s) for _, s in built]
  sums[1] = jax.tree.map(jnp.zeros_like, sums[1])  # resnet14 not sampled this round: no client, weight 0, sums 0
  weights = [jnp.float32(2.0), jnp.float32(0.0), jnp.float32(1.0)]
  pairs = global_model.cross_layer_pairs()

  @jax.jit
  def both(global_vars, sums, weights):
    plain = aggregators.hetero_avg(global_vars, sums, weights, maps)
    num, den = aggregators.heterogeneous_sums(sums, weights, maps, global_vars)
    delta = aggregators.masked_mean(num, den, jax.tree.map(jnp.zeros_like, global_vars))
    delta, _ = inco(delta, pairs, "no_normalization", coverage=den, theta=0.0)
    return plain, jax.tree.map(jnp.add, global_vars, delta)

  plain, zero_theta = both(global_vars, sums, weights)
  jax.tree.map(np.testing.assert_array_equal, plain, zero_theta)


# ----------------------------------------------------------------------------------------- the engine


# The presets cut to two stages: ResNet14's second has two blocks, so InCo's pairs (stage 2, block 1 <- block 0).
TWO_STAGES = {"resnet10": (1, 1), "resnet14": (1, 2)}


def simulation(method, names, **options):
  data = tiny_federation(6, 48, 8, "iid")
  small = lambda n: {"base_channels": 4, "stage_sizes": TWO_STAGES[n]} if n.startswith("resnet") else {"hidden": (8,)}
  return helpers.simulation(method, [(n, build_model(n, data[0].num_classes, **small(n))) for n in names], data,
                            LocalConfig(), options=options)


def test_incoavg_needs_a_model_with_cross_layer_pairs():
  with pytest.raises(ValueError, match=r"InCo's cross-layer step needs cross-layer pairs, but the largest model "
                     r"\(MLP\)"):
    simulation("InCoAvg", ["mlp"])


@pytest.mark.parametrize("variant, granularity", [("code", "kernel"), ("no_optimization", "tensor")])
def test_incoavg_aggregate_applies_inco_to_the_mean_delta(variant, granularity):
  sim = simulation("InCoAvg", ["resnet10", "resnet14"], inco_variant=variant, inco_granularity=granularity)
  pairs = build_model("resnet14", 10, stage_sizes=TWO_STAGES["resnet14"]).cross_layer_pairs()
  assert pairs and sim.spec.federations[0].largest.cross_layer_pairs() == pairs
  shapes = [jax.eval_shape(g.model.init, jax.random.key(0), jnp.zeros((1,) + sim.spec.store.images.shape[1:])) for g in sim.spec.groups]
  rng = np.random.default_rng(11)
  as_arrays = lambda tree: jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.05, jnp.float32), tree)
  model = as_arrays(shapes[1])
  # The state's other parts are empty for InCoAvg: built from its shapes, not `init_state` (whose jitted init of
  # the ResNet compiles for ~10 s, for a model replaced here anyway).
  assert not jax.tree.leaves((sim.spec.state_shapes.steps, sim.spec.state_shapes.sampler, sim.spec.state_shapes.memory))
  state = sim.place(sim.spec.state_shapes._replace(round=0, models=(model,)))
  starts = [sim.spec.group_variables(state, i) for i in range(2)]
  sums, weights = [as_arrays(s) for s in shapes], [jnp.float32(1.0), jnp.float32(2.0)]
  results = [empty_result(st)._replace(delta_sum=s, weight_sum=w) for st, s, w in zip(starts, sums, weights)]
  cohorts = [np.array([0]), np.array([3, 4])]
  new, _, metrics = aggregate(sim, state, starts, results, cohorts)

  @jax.jit
  def reference(model, sums, weights):
    delta = aggregators.heterogeneous_mean_delta(sums, weights, sim.spec.maps, model)
    return jax.tree.map(jnp.add, model, inco(delta, pairs, variant, granularity)[0])

  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), new,
               reference(model, sums, weights))
  assert set(metrics["inco"]) == {"/".join(t) for t, _ in pairs}


def test_inco_options_are_checked():
  with pytest.raises(ValueError, match="--inco-variant must be one of code, theorem, paper, .*, got 'nope'"):
    method_options(inco_variant="nope")
  with pytest.raises(ValueError, match="--inco-granularity must be one of kernel, tensor, got 'row'"):
    method_options(inco_granularity="row")
  with pytest.raises(ValueError, match="--inco-variant applies to InCoAvg, InCoProx, InCoScaffold, InCoNova, "
                     "InCoMOON, not HeteroAvg"):
    build_method("HeteroAvg", method_options(inco_variant="theorem"))
