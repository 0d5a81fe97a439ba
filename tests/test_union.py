"""The union mapping (`rounds.union`): every sampled client trains as a masked member of the largest model, and the
run is the per-group program's to float tolerance; a spec it cannot serve keeps the per-group program, by name."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero import aggregators
from fedjax_hetero.config import LocalConfig
from fedjax_hetero.hetero.maps import extract
from fedjax_hetero.rounds import make_backend, make_simulation
from fedjax_hetero.models import build_model
from fedjax_hetero.rounds.union import (UnionCohorts, _probe_reason, declared_exact, held_mask, held_vectors,
                                        union_reason, uploads_in_layout)
from fedjax_hetero.server import steps
from tests import golden
from tests.golden_setting import golden_spec
from tests.helpers import simulation, tiny_resnet
from tests.test_golden import RECORD, assert_close, expected_runs
from tests.test_round_program import assert_same_run, record

LOCAL = LocalConfig(epochs=1, batch_size=8, learning_rate=1e-2)


class Convs(nn.Module):
  """Two 3x3 convolutions (bias, ReLU), pooling and a head: a width family whose zeros stay zeros."""

  width: float = 1.0
  norm: str = "none"  # "layer": LayerNorm after the first convolution (its statistics see the zeros)

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None, start: str = "input", stop: str = "logits"):
    x = nn.relu(nn.Conv(int(8 * self.width), (3, 3), name="conv1")(x))
    if self.norm == "layer":
      x = nn.LayerNorm(name="norm")(x)
    x = nn.relu(nn.Conv(int(8 * self.width), (3, 3), name="conv2")(x))
    return nn.Dense(4, name="head")(x.mean(axis=(1, 2)))


def width_simulation(method: str = "HeteroAvg", norm: str = "none", round_program: str = "union", **options):
  models = [(f"convs@{w}", Convs(w, norm)) for w in (1.0, 0.5)]
  return simulation(method, models, local=LOCAL, backend="vmap", round_program=round_program, options=options,
                    clients_per_round=4)


def depth_simulation(method: str = "HeteroAvg", round_program: str = "union"):
  models = [(f"resnet{s}", tiny_resnet(s)) for s in ((1, 1), (2, 2))]  # a missing block in each stage
  return simulation(method, models, local=LOCAL, backend="vmap", round_program=round_program, clients_per_round=4)


def per_group(sim):
  return make_simulation(sim.spec, make_backend("vmap"), "fused", sim.rounds_per_call)


def test_held_mask_holds_exactly_the_groups_elements():
  sim = width_simulation()
  union = sim.spec.init_state().models[0]
  for group_map in sim.spec.maps:
    mask = held_mask(group_map, union)
    assert sum(float(m.sum()) for m in jax.tree.leaves(mask["params"])) == group_map.num_owned() - sum(
        np.prod(link.window.shape) for link in group_map.pull if link.client[0] != "params")
    held = extract(jax.tree.map(jnp.multiply, union, mask), group_map)
    jax.tree.map(np.testing.assert_array_equal, held, extract(union, group_map))


@pytest.mark.parametrize("make", [width_simulation, depth_simulation])
def test_the_programs_held_vectors_are_the_held_masks_in_the_slots_layout(make):
  sim = make()
  union, layout = sim.spec.init_state().models[0], sim.cohorts.layout
  for g, group_map in enumerate(sim.spec.maps):
    expected = layout.ravel(held_mask(group_map, union))
    vectors = held_vectors(layout, group_map)
    assert set(vectors) == set(expected) and all(v.dtype == bool for v in vectors.values())
    jax.tree.map(lambda v, e: np.testing.assert_array_equal(v, np.asarray(e) > 0), vectors, expected)
    jax.tree.map(lambda h, v: np.testing.assert_array_equal(np.asarray(h[g]), v), sim.cohorts.arguments().held,
                 vectors)


@pytest.mark.slow
def test_width_groups_on_the_union_are_the_per_group_program():
  sim = width_simulation()
  assert isinstance(sim.cohorts, UnionCohorts) and sim.cohorts.in_program and sim.cohorts.name == "union"
  assert_same_run(per_group(sim), sim, rounds=2)


@pytest.mark.slow
def test_depth_groups_on_the_union_are_the_per_group_program():
  """ResNet depths: a missing block (zero weights) passes its input through; BatchNorm in training mode."""
  sim = depth_simulation()
  assert isinstance(sim.cohorts, UnionCohorts)
  assert_same_run(per_group(sim), sim, rounds=2)


@pytest.mark.slow
@pytest.mark.parametrize("make", [depth_simulation, width_simulation], ids=["depths", "widths"])
def test_heteroavg_on_the_union_is_a_masked_mean_over_the_slots(make, monkeypatch):
  """HeteroAvg's mean comes from the union's slots in its layout: the server sums and embeds no group's deltas
  (the numbers are held to the per-group program's by the tests above)."""
  sim = make()

  def refuse(*args, **kwargs):
    raise AssertionError("the server summed the groups' cut deltas itself")

  monkeypatch.setattr(aggregators, "heterogeneous_sums", refuse)
  state, rows = sim.run_rounds(sim.init_state(), 1, evaluate={1})
  assert np.isfinite(rows[0]["train_loss"]) and state.round == 1


@pytest.mark.slow
def test_the_dissimilarity_metric_is_summed_in_the_unions_layout(monkeypatch):
  """Its term only uploads per-leaf sums of the update (`uploads_in_layout`): the union sums them over its slots in
  its layout, no group is taken back to its shape, HeteroAvg's mean and the groups' delta norms are handed over,
  and the run is the per-group program's (rows, the metric included, and models)."""
  models = [(f"resnet{s}", tiny_resnet(s)) for s in ((1, 1), (2, 2))]
  sim = simulation("HeteroAvg", models, local=LOCAL, backend="vmap", track_dissimilarity=True, round_program="union",
                   clients_per_round=4)
  assert isinstance(sim.cohorts, UnionCohorts) and uploads_in_layout(sim.spec.trainers[0].terms)
  assert_same_run(per_group(sim), sim, rounds=2)
  rows = [s.run_rounds(s.init_state(), 2, evaluate={2})[1] for s in (per_group(sim), sim)]
  for want, have in zip(*rows):
    for group, values in want["dissimilarity"].items():
      for name, value in values.items():
        np.testing.assert_allclose(*(np.nan if v is None else v for v in (have["dissimilarity"][group][name], value)),
                                   rtol=1e-4, err_msg=f"{group} {name}")

  def refuse(*args, **kwargs):
    raise AssertionError("a group was finished in its shape, or the server summed the groups' deltas")

  monkeypatch.setattr(UnionCohorts, "_group_result", refuse)
  monkeypatch.setattr(aggregators, "heterogeneous_sums", refuse)
  monkeypatch.setattr(steps, "squared_norm", refuse)  # (the groups' delta norms too: summed in the layout)
  _, rows = sim.run_rounds(sim.init_state(), 1, evaluate={1})
  assert set(rows[0]["dissimilarity"]) == {"resnet(1, 1)", "resnet(2, 2)"}


@pytest.mark.slow
def test_an_uploading_term_is_reduced_in_the_groups_shape():
  """FedNova normalizes each client's delta by its steps after the round: the group's own finish runs it."""
  sim = width_simulation("HeteroNova")
  assert isinstance(sim.cohorts, UnionCohorts)
  assert_same_run(per_group(sim), sim, rounds=1)


@pytest.mark.slow
def test_per_architecture_baselines_train_on_the_union_from_their_own_models():
  """FedAvg keeps one federation per group: each client starts from its group's own model in the union layout."""
  sim = width_simulation("FedAvg")
  assert isinstance(sim.cohorts, UnionCohorts) and len(sim.spec.federations) == len(sim.spec.groups) == 2
  assert_same_run(per_group(sim), sim, rounds=2)


def test_a_term_acting_during_training_keeps_the_per_group_program():
  reason = union_reason(width_simulation("HeteroProx", round_program="fused").spec)
  assert "acts during local training" in reason and "loss" in reason
  with pytest.raises(ValueError, match="cannot train as one union model.*--round-program fused"):
    width_simulation("HeteroProx")
  auto = make_simulation(width_simulation("HeteroProx", round_program="fused").spec, make_backend("vmap"), "auto")
  assert not isinstance(auto.cohorts, UnionCohorts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["resnet depths", "resnet widths", "cnn widths"])
def test_the_families_declared_exact_pass_the_numeric_probe(family):
  """`declared_exact` skips the probe for these: hold the declaration to it (train-mode BatchNorm, gradients)."""
  if family == "resnet depths":
    models = [(f"resnet{s}", tiny_resnet(s)) for s in ((1, 1), (1, 2), (2, 2))]
  elif family == "resnet widths":
    models = [(f"resnet@{w}", tiny_resnet((1, 2), width=w)) for w in (1.0, 0.5)]
  else:
    models = [(f"cnn@{w}", build_model("cnn", 4, w)) for w in (1.0, 0.5, 0.25)]
  sim = simulation("HeteroAvg", models, local=LOCAL, round_program="fused", clients_per_round=4)
  assert all(declared_exact(g.model) for g in sim.spec.groups)
  assert _probe_reason(sim.spec) is None


@pytest.mark.slow
def test_a_model_whose_zeros_leak_keeps_the_per_group_program():
  """LayerNorm's statistics see the missing channels: the numeric probe finds the difference."""
  reason = union_reason(width_simulation(norm="layer", round_program="fused").spec)
  assert reason and "differ from the masked union" in reason and "convs@0.5" in reason


def test_a_union_refuses_a_round_with_more_participants_than_its_slots():
  sim = width_simulation()
  assert sim.cohorts.capacity == 4
  object.__setattr__(sim.cohorts, "capacity", 2)  # (as a sampler drawing more than --clients-per-round would)
  with pytest.raises(ValueError, match="has 4 participants; the union mapping holds"):
    sim.run_rounds(sim.init_state(), 1)



UNION_GOLDEN = [golden.RESNET_ENTRY] + [(m, "sequential", f) for m, f in golden.LATER_METHODS if f == "resnet"]


@pytest.mark.slow
@pytest.mark.parametrize("entry", UNION_GOLDEN, ids=lambda e: golden.key(*e))
def test_the_union_reproduces_the_golden_record_or_names_why_not(entry):
  """Every golden method on the ResNet depths trains on the union within the record's tolerance, or keeps the
  per-group program with its reason (the MLP family's depths are not exact: a missing dense layer is not an
  identity; see the next test)."""
  if jax.__version__ != RECORD["jax"]:
    pytest.skip(f"the record was made with jax {RECORD['jax']}; this is {jax.__version__}")
  method, _, family = entry
  spec = golden_spec(method, family)
  reason = union_reason(spec)
  if reason is not None:
    assert method in UNION_REFUSED, f"{method}: {reason}"
    return
  expected = expected_runs(entry)
  rows, compiled = record(make_simulation(spec, make_backend("vmap"), "union", 3))
  for round_index, (want, have) in enumerate(zip(expected, rows), start=1):
    assert_close(want, have, method, f"{golden.key(*entry)} on the union, round {round_index}")
  assert compiled[1:] == [[]] * (golden.ROUNDS - 1), f"later calls compiled {compiled[1:]}"


# The golden methods on the ResNet depths that keep the per-group program: NeFL keeps own copies of leaves, FedIN's
# terms act during training.
UNION_REFUSED = ("NeFL", "FedIN")


def test_the_mlp_depths_keep_the_per_group_program_by_the_probe():
  reason = union_reason(golden_spec("HeteroAvg", "mlp"))
  assert reason and "differ from the masked union" in reason
