"""Sub-model maps of every kind on hand-made trees: extract, embed, coverage, and the mean over holders.

Kinds: identity, leading slice (HeteroFL), rolling window (FedRolex), depth grafting (FedFA: one client
layer feeding several global layers), and several client layers pulling one global layer. Then the same
maps inside the engine: a rolling window that moves with the round, and groups redrawn every round.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.config import FederationConfig
from fedjax_hetero.hetero import (Link, SubmodelMap, Window, build_group_map, coverage, embed, extract, graft,
                                  identity_map)
from fedjax_hetero.methods import build_method
from tests.helpers import tiny_simulation


def arange_tree(shapes, start=0.0):
  out, offset = {}, start
  for name, shape in shapes.items():
    size = int(np.prod(shape))
    out[name] = jnp.arange(offset, offset + size, dtype=jnp.float32).reshape(shape)
    offset += size
  return {"params": out}


# ------------------------------------------------------------------------------------------------ identity


def test_identity_map_is_the_identity():
  tree = arange_tree({"w": (2, 3), "b": (3,)})
  ident = identity_map(tree)
  chex.assert_trees_all_equal(extract(tree, ident), tree)
  chex.assert_trees_all_equal(embed(tree, ident, tree), tree)
  chex.assert_trees_all_equal(coverage(ident, tree), jax.tree.map(jnp.ones_like, tree))


# ------------------------------------------------------------------------------------------- leading slice


def test_leading_slice_by_hand():
  glob = arange_tree({"w": (3, 4)})  # [[0..3], [4..7], [8..11]]
  small = build_group_map(glob, {"params": {"w": jnp.zeros((2, 2))}}, "small")
  np.testing.assert_array_equal(extract(glob, small)["params"]["w"], [[0, 1], [4, 5]])
  placed = embed({"params": {"w": jnp.full((2, 2), 7.0)}}, small, glob)["params"]["w"]
  np.testing.assert_array_equal(placed, [[7, 7, 0, 0], [7, 7, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(coverage(small, glob)["params"]["w"], [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
  # Two small clients sent deltas summing to 2 (weight 2), one full client sent 5 (weight 1):
  new = aggregators.hetero_avg(jax.tree.map(jnp.zeros_like, glob),
                          [{"params": {"w": jnp.full((2, 2), 2.0)}}, {"params": {"w": jnp.full((3, 4), 5.0)}}],
                          [jnp.float32(2), jnp.float32(1)], [small, identity_map(glob)])["params"]["w"]
  np.testing.assert_allclose(new, [[7 / 3, 7 / 3, 5, 5], [7 / 3, 7 / 3, 5, 5], [5, 5, 5, 5]], rtol=1e-6)


# ----------------------------------------------------------------------------------------- rolling window


def test_rolling_window_by_hand():
  glob = arange_tree({"w": (4, 6), "b": (5,), "out": (6, 3)})
  client = {"params": {"w": jnp.zeros((2, 3)), "b": jnp.zeros((2,)), "out": jnp.zeros((3, 3))}}
  rolling = build_group_map(glob, client, "rolex", rolling=True)
  # Narrower axes roll, the full-width class axis of "out" does not.
  assert {link.client[-1]: link.window.rolled for link in rolling.pull} == {"w": (0, 1), "b": (0,), "out": (0,)}
  got = jax.jit(extract, static_argnums=1)(glob, rolling, 3)["params"]  # rows 3, 0 of 4; columns 3, 4, 5 of 6
  np.testing.assert_array_equal(got["w"], np.arange(24).reshape(4, 6)[np.ix_([3, 0], [3, 4, 5])])
  np.testing.assert_array_equal(got["b"], 24 + np.array([3, 4]))
  np.testing.assert_array_equal(got["out"], (29 + np.arange(18).reshape(6, 3))[[3, 4, 5]])
  placed = embed({"params": jax.tree.map(jnp.ones_like, got)}, rolling, glob, 3)["params"]
  mask = coverage(rolling, glob, offset=3)["params"]
  want_w = np.zeros((4, 6))
  want_w[np.ix_([3, 0], [3, 4, 5])] = 1
  np.testing.assert_array_equal(placed["w"], want_w)
  np.testing.assert_array_equal(mask["w"], want_w)
  np.testing.assert_array_equal(mask["b"], [0, 0, 0, 1, 1])
  # Offset 4 wraps around the 5 biases: elements 4 and 0.
  np.testing.assert_array_equal(coverage(rolling, glob, offset=4)["params"]["b"], [1, 0, 0, 0, 1])
  chex.assert_trees_all_equal(extract(embed({"params": got}, rolling, glob, 3), rolling, 3)["params"], got)


def test_rolling_window_mean_over_holders_and_one_program_for_every_offset():
  glob = {"params": {"b": jnp.zeros((4,))}}
  rolling = build_group_map(glob, {"params": {"b": jnp.zeros((2,))}}, "rolex", rolling=True)
  full = identity_map(glob)

  @jax.jit
  def round_update(glob, offset):
    sums = [{"params": {"b": jnp.array([3.0, 3.0])}}, {"params": {"b": jnp.full((4,), 1.0)}}]
    return aggregators.hetero_avg(glob, sums, [jnp.float32(1), jnp.float32(1)], [rolling, full], offset)

  # Offset 2: elements 2 and 3 are held by both clients, (3 + 1) / 2; the rest by the full client only.
  np.testing.assert_allclose(round_update(glob, 2)["params"]["b"], [1, 1, 2, 2])
  np.testing.assert_allclose(round_update(glob, 3)["params"]["b"], [2, 1, 1, 2])
  assert round_update._cache_size() == 1  # the window moves without recompiling


# -------------------------------------------------------------------------------------------- depth graft


def blocks(depth, value=None):
  return {"params": {f"block{i}": {"w": jnp.full((2,), float(i + 1 if value is None else value))}
                     for i in range(depth)} | {"head": {"w": jnp.full((2,), 10.0)}}}


def test_graft_copies_the_last_block_into_every_deeper_slot():
  glob, shallow = blocks(3), blocks(1)
  plain = build_group_map(glob, shallow, "shallow")
  grafted = graft(plain, [(("block1",), ("block0",)), (("block2",), ("block0",))], "shallow")
  chex.assert_trees_all_equal(extract(glob, grafted), extract(glob, plain))  # what the client receives is unchanged
  sent = blocks(1, value=5.0)
  placed = embed(sent, grafted, glob)["params"]
  for name in ("block0", "block1", "block2"):
    np.testing.assert_array_equal(placed[name]["w"], [5, 5])
    np.testing.assert_array_equal(coverage(grafted, glob)["params"][name]["w"], [1, 1])
  np.testing.assert_array_equal(embed(sent, plain, glob)["params"]["block2"]["w"], [0, 0])
  # The shallow client (weight 1, all 5) and a deep client (weight 3, block i = i + 1): every block is
  # averaged over both, because the graft makes the shallow client a holder of blocks 1 and 2.
  deep = blocks(3)
  new = aggregators.hetero_avg_weights(glob, [sent, jax.tree.map(lambda x: 3 * x, deep)],
                                       [jnp.float32(1), jnp.float32(3)], [grafted, identity_map(glob)])["params"]
  for i, name in enumerate(("block0", "block1", "block2")):
    np.testing.assert_allclose(new[name]["w"], (5 + 3 * (i + 1)) / 4)


def test_graft_rejects_a_client_block_with_no_global_counterpart():
  plain = build_group_map(blocks(3), blocks(1), "shallow")
  with pytest.raises(ValueError, match="shallow: cannot graft params/block0/w onto params/block7/w"):
    graft(plain, [(("block7",), ("block0",))], "shallow")
  with pytest.raises(ValueError, match="shallow: the client model has no block block2 to graft"):
    graft(plain, [(("block1",), ("block2",))], "shallow")


# ----------------------------------------------------------------------------- one global layer to several


def test_several_client_layers_pulling_one_global_layer():
  glob = {"params": {"g": jnp.array([1.0, 2.0])}}
  window = Window((2,))
  links = (Link(("params", "a"), ("params", "g"), window), Link(("params", "b"), ("params", "g"), window))
  shared = SubmodelMap(pull=links, push=links, global_shapes=((("params", "g"), (2,)),))
  got = extract(glob, shared)
  np.testing.assert_array_equal(got["params"]["a"], [1, 2])
  np.testing.assert_array_equal(got["params"]["b"], [1, 2])
  np.testing.assert_array_equal(coverage(shared, glob)["params"]["g"], [2, 2])
  new = aggregators.hetero_avg_weights(glob, [{"params": {"a": jnp.array([3.0, 3.0]), "b": jnp.array([5.0, 7.0])}}],
                                       [jnp.float32(1)], [shared])
  np.testing.assert_allclose(new["params"]["g"], [4, 5])  # the mean of the two layers that came from g
  assert shared.num_owned() == 4


# ------------------------------------------------------------------------------------------------ engine


def fedrolex_like():
  """HeteroAvg with FedRolex's rolling windows instead of leading slices."""
  return dataclasses.replace(build_method("HeteroAvg"), submodel=functools.partial(build_group_map, rolling=True))


def test_a_rolling_window_moves_with_the_round_in_the_engine():
  sim = tiny_simulation(fedrolex_like(), widths=(0.5, 1.0), clients_per_round=6)
  state = sim.init_state()
  narrow = lambda s: np.asarray(sim.spec.group_variables(s, 0)["params"]["hidden1"]["bias"])
  full = lambda s: np.asarray(s.models[0]["params"]["hidden1"]["bias"])
  assert narrow(state).shape == (8,) and full(state).shape == (16,)
  np.testing.assert_array_equal(narrow(state._replace(round=5)), np.roll(full(state), -5)[:8])  # units 5..12
  # Round 1 (offset 0) and round 2 (offset 1): the narrow clients train the window of their round.
  for _ in range(2):
    before = full(state)
    state, (metrics,) = sim.run_rounds(state, 1)
    assert set(metrics["train_loss_per_group"]) == {"mlp@0.5", "mlp@1.0"}
  assert state.round == 2 and not np.array_equal(before, full(state))
  plain = tiny_simulation("HeteroAvg", widths=(0.5, 1.0), clients_per_round=6)
  plain_state = plain.init_state()
  for _ in range(2):
    plain_state, (_,) = plain.run_rounds(plain_state, 1)
  # Round 1 is the same for both (offset 0); round 2 is not.
  assert not np.array_equal(full(state), full(plain_state))


def test_groups_redrawn_every_round():
  sim = tiny_simulation("HeteroAvg", widths=(0.5, 1.0), clients_per_round=4, group_draw=(0.5, 0.5))
  draws = [sim.spec.groups_of_round(r) for r in range(4)]
  assert all(set(d.tolist()) <= {0, 1} for d in draws)
  assert any(not np.array_equal(draws[0], d) for d in draws[1:])
  state, rows = sim.init_state(), []
  for _ in range(3):
    state, (metrics,) = sim.run_rounds(state, 1)
    rows.append(metrics)
  for r, row in enumerate(rows):  # each round's groups are the draw of that round
    groups = {("mlp@0.5", "mlp@1.0")[g] for g in draws[r][row["clients"]]}
    assert set(row["train_loss_per_group"]) == groups
  with pytest.raises(ValueError, match="--group-draw must be non-negative probabilities summing to 1"):
    FederationConfig(group_draw=(0.5, 0.6))
  with pytest.raises(ValueError, match="needs one probability per architecture group"):
    tiny_simulation("HeteroAvg", widths=(0.5, 1.0), group_draw=(1.0,))
  with pytest.raises(ValueError, match="per-client memory"):
    tiny_simulation("HeteroScaffold", widths=(0.5, 1.0), group_draw=(0.5, 0.5))
