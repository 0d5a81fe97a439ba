"""NeFL (Kang et al., arXiv 2308.07761): step sizes, the skip readings, per-group inconsistent parameters on a
hand-made two-group tree, and two-round runs (engine and experiment driver)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import aggregators
from fedjax_hetero.compilation import CompileLog
from fedjax_hetero.config import LocalConfig, RunConfig
from fedjax_hetero.hetero import OWN, build_group_map, complete, extract, separate
from fedjax_hetero.hetero.maps import flatten
from fedjax_hetero.methods import build_method
from fedjax_hetero.methods.nefl import inconsistent_leaves
from fedjax_hetero.models import build_model
from fedjax_hetero.run.build import run_method
from tests.helpers import method_options, model_variables, random_batch, simulation, tiny_federation, tiny_resnet

X = jnp.zeros((1, 8, 8, 1))


def shapes_of(model):
  return jax.eval_shape(model.init, jax.random.key(0), X)


def normalized(seed, size=6):
  images, labels = random_batch(seed, size)
  return images.astype(jnp.float32) / 255.0, labels


# ---------------------------------------------------------------------------------------------- step sizes


@pytest.mark.slow
def test_step_sizes_start_at_one_and_leave_the_model_unchanged():
  x, _ = normalized(0)
  plain, stepped = tiny_resnet((2, 2)), tiny_resnet((2, 2), step_sizes=True)
  variables = stepped.init(jax.random.key(1), x)
  steps = [v["step"]["scale"] for v in variables["params"].values() if "step" in v]
  assert len(steps) == 4 and all(s.shape == () and float(s) == 1.0 for s in steps)
  without = {c: {k: {n: p for n, p in v.items() if n != "step"} for k, v in tree.items()}
             for c, tree in variables.items()}
  chex.assert_trees_all_equal_structs(without, plain.init(jax.random.key(1), x))
  np.testing.assert_array_equal(stepped.apply(variables, x), plain.apply(without, x))
  train = lambda m, v: m.apply(v, x, train=True, mutable=["batch_stats"])
  chex.assert_trees_all_equal(train(stepped, variables), train(plain, without))


@pytest.mark.slow
def test_a_step_size_scales_its_residual_branch_and_zero_skips_the_block():
  """x_{j+1} = relu(x_j + s_j F_j(x_j)): s = 0 in stage 1's second block gives stage 1 of the one-block model
  (NeFL's code runs a skipped block with s = 0); s = 2 doubles the branch; the loss has a gradient in s."""
  x, labels = normalized(2)
  deep, shallow = tiny_resnet((2, 1), step_sizes=True), tiny_resnet((1, 1), step_sizes=True)
  variables = model_variables(deep, x, 3)
  block = ("params", "stage1_block1", "step", "scale")

  def with_step(value):
    flat = flatten(variables)
    flat[block] = jnp.float32(value)
    return traverse_util.unflatten_dict(flat)

  one_block = {c: {k: v for k, v in tree.items() if k != "stage1_block1"} for c, tree in variables.items()}
  np.testing.assert_allclose(deep.apply(with_step(0.0), x, stop="stage1"),
                             shallow.apply(one_block, x, stop="stage1"), rtol=1e-6, atol=1e-6)
  before = shallow.apply(one_block, x, stop="stage1")
  branch = deep.apply(with_step(1.0), x, stop="stage1")  # relu(before + F)
  doubled = deep.apply(with_step(2.0), x, stop="stage1")
  # Where both outputs are positive, relu is the identity, so (doubled - before) = 2 (branch - before).
  both = (branch > 0) & (doubled > 0)
  assert both.mean() > 0.3
  np.testing.assert_allclose(np.where(both, doubled - before, 0), np.where(both, 2 * (branch - before), 0),
                             rtol=1e-4, atol=1e-5)

  def loss(s):
    logits = deep.apply(with_step(s), x)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(labels)), labels])

  grad = jax.grad(loss)(1.0)
  assert np.isfinite(grad) and abs(float(grad)) > 0


def test_skip_readings_name_a_stage_last_block_so_the_default_map_aligns_it():
  middle = lambda sizes: tiny_resnet(sizes, skip="middle")
  assert middle((1, 2)).stage_blocks() == ((("stage1_block0",),), (("stage2_block0",), ("stage2_block_last",)))
  assert tiny_resnet((1, 2)).stage_blocks() == ((("stage1_block0",),), (("stage2_block0",), ("stage2_block1",)))
  # A stage of 2 of 3 blocks: blocks 0 and 2 under "middle", 0 and 1 under "last".
  for model, deep, held in ((middle((1, 2)), middle((1, 3)), {"stage2_block0", "stage2_block_last"}),
                            (tiny_resnet((1, 2)), tiny_resnet((1, 3)), {"stage2_block0", "stage2_block1"})):
    group_map = build_group_map(shapes_of(deep), shapes_of(model))
    assert {link.global_[1] for link in group_map.pull if link.global_[1].startswith("stage2")} == held
  assert middle((1, 3)).cross_layer_pairs()[0] == (("params", "stage2_block1", "conv1", "kernel"),
                                                   ("params", "stage2_block0", "conv2", "kernel"))
  with pytest.raises(ValueError, match="unknown skip 'first'"):
    tiny_resnet((1, 1), skip="first").init(jax.random.key(0), X)


def test_inconsistent_leaves_are_batch_norm_and_step_sizes_found_by_module_type():
  model = tiny_resnet((1, 2), step_sizes=True)
  found = inconsistent_leaves(model, X)
  flat = flatten(shapes_of(model))
  assert found <= set(flat)
  assert {p for p in flat if p[0] == "batch_stats"} <= found  # every BatchNorm statistic
  modules = {p[-2] for p in found}
  assert modules == {"stem_bn", "bn1", "bn2", "downsample_bn", "step"}
  assert not any(p[-2].startswith("conv") or p[-2] in ("head", "stem_conv", "downsample_conv") for p in found)


def test_nefl_options_are_checked_and_reach_the_models():
  method = build_method("NeFL")
  wrapped = method.wrap_model(build_model("resnet10", 10, 0.5))
  assert wrapped.step_sizes and wrapped.skip == "middle"
  last = build_method("NeFL", method_options(nefl_skip="last", nefl_step_sizes=False)).wrap_model(build_model("cnn", 10))
  assert last == build_model("cnn", 10)  # nothing to change: any model
  with pytest.raises(ValueError, match="--nefl-skip must be one of last, middle"):
    method_options(nefl_skip="first")
  with pytest.raises(ValueError, match="^--nefl-skip applies to NeFL, not HeteroFL$"):
    build_method("HeteroFL", method_options(nefl_skip="last"))
  with pytest.raises(ValueError, match="need a ResNet"):
    method.wrap_model(build_model("cnn", 10))
  with pytest.raises(ValueError, match="--groups, group cnn@0.5: NeFL's skip and step_sizes need a ResNet"):
    run_method(RunConfig.from_flags(method="NeFL", groups=("cnn@0.5", "cnn")))


# ------------------------------------------------------------------- inconsistent parameters, by hand


def test_consistent_leaves_average_over_holders_and_inconsistent_ones_per_group():
  """Two width groups of a tree with a kernel (consistent) and a BN scale (inconsistent). The narrow group 0
  (weight 1) holds the kernel's leading 2 columns and its own 2-element scale; the full group 1 (weight 3)
  keeps its scale in place."""
  full = {"params": {"dense": {"kernel": jnp.zeros((2, 3))}, "bn": {"scale": jnp.ones(3)}}}
  narrow = {"params": {"dense": {"kernel": jnp.zeros((2, 2))}, "bn": {"scale": jnp.ones(2)}}}
  base = [build_group_map(full, narrow, "narrow"), build_group_map(full, full, "full")]
  own = [{("params", "bn", "scale")}] * 2
  maps = separate(base, own, keep=1, group_names=["narrow", "full"])
  copy = (OWN, "group0", "params", "bn", "scale")
  assert dict(maps[0].global_shapes)[copy] == (2,) and dict(maps[1].global_shapes)[copy] == (2,)
  start = {"params": {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3)}, "bn": {"scale": jnp.array([1., 2., 3.])}}}
  model = complete(start, base, maps)
  np.testing.assert_array_equal(model[OWN]["group0"]["params"]["bn"]["scale"], [1., 2.])  # from its slice
  chex.assert_trees_all_equal(extract(model, maps[0]), extract(start, base[0]))
  # Weighted delta sums: group 0 uploads 1 * (ones), group 1 uploads 3 * (5 * ones).
  sums = [jax.tree.map(jnp.ones_like, narrow), jax.tree.map(lambda x: 15 * jnp.ones_like(x), full)]
  num, den = aggregators.heterogeneous_sums(sums, [jnp.float32(1), jnp.float32(3)], maps, model)
  delta = aggregators.masked_mean(num, den, jax.tree.map(jnp.zeros_like, model))
  np.testing.assert_allclose(delta["params"]["dense"]["kernel"], [[4, 4, 5], [4, 4, 5]])  # (1 + 15) / 4; 15 / 3
  np.testing.assert_allclose(delta["params"]["bn"]["scale"], [5, 5, 5])  # the full group's alone
  np.testing.assert_allclose(delta[OWN]["group0"]["params"]["bn"]["scale"], [1, 1])  # the narrow group's alone
  with pytest.raises(ValueError, match="narrow: cannot keep params/bn/bias as its own"):
    separate(base, [{("params", "bn", "bias")}, set()], keep=1, group_names=["narrow", "full"])


# ------------------------------------------------------------------------------------------ two-round runs


def resnet_simulation(method="NeFL", **options):
  """Two groups: ResNet (1, 1) at width 0.5 and ResNet (1, 2) at width 1 (stage 2's block_last is shared)."""
  return simulation(method, [("small", tiny_resnet((1, 1), 0.5)), ("large", tiny_resnet((1, 2), 1.0))],
                    tiny_federation(4, 48, 8, "iid"),
                    LocalConfig(batch_size=16, optimizer="sgd", learning_rate=0.1), options=options,
                    clients_per_round=4)


@pytest.mark.slow
def test_nefl_two_rounds_keep_each_group_its_own_step_sizes_and_batch_norm():
  sim = resnet_simulation()
  state = sim.init_state()
  own = state.models[0][OWN]["group0"]
  assert set(own) == {"params", "batch_stats"} and "step" in own["params"]["stage2_block0"]
  assert "stage2_block_last" in state.models[0]["params"]  # the large group's middle-skipping layout
  state, (_,) = sim.run_rounds(state, 1)
  with CompileLog() as log:
    state, (metrics,) = sim.run_rounds(state, 1)
  assert log.names == [] and np.isfinite(metrics["train_loss"])
  model = state.models[0]
  small = sim.spec.group_variables(state, 0)
  # The small group sees its own copies, which differ from the (kept) large group's leading slices.
  np.testing.assert_array_equal(small["params"]["stem_bn"]["scale"], model[OWN]["group0"]["params"]["stem_bn"]["scale"])
  assert not np.allclose(small["params"]["stem_bn"]["scale"], model["params"]["stem_bn"]["scale"][:2])
  steps = [float(model[OWN]["group0"]["params"]["stage1_block0"]["step"]["scale"]),
           float(model["params"]["stage1_block0"]["step"]["scale"])]
  assert all(s != 1.0 for s in steps) and steps[0] != steps[1]  # learnt, and per group
  # The consistent stem kernel is one shared leaf that the small group reads a slice of.
  np.testing.assert_array_equal(small["params"]["stem_conv"]["kernel"], model["params"]["stem_conv"]["kernel"][..., :2])
  accs = sim.evaluate(state)
  assert set(accs) == {"small", "large", "mean"} and 0 <= accs["mean"] <= 1


def test_help_lists_nefl_under_the_fedfa_paper():
  from fedjax_hetero.cli import run as cli

  text = cli.methods_help()
  lines = [line for line in text.splitlines() if line.startswith("    NeFL ")]
  assert len(lines) == 1
  assert text.index("FedFA (Park & Joe-Wong, ECML-PKDD 2024)") < text.index(lines[0]) < text.index("FedRolex (Alam")
  assert RunConfig.from_flags(method="NeFL", groups=("resnet10",), nefl_skip="last").method.nefl.skip == "last"
  with pytest.raises(ValueError, match="--nefl-step-sizes"):
    method_options(nefl_step_sizes="yes")
