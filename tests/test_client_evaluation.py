"""Per-client evaluation (``--client-eval-fraction``, `fedjax_hetero.rounds.client_eval`): the seeded split, every
client's accuracy against its group's model applied by hand to its held-out samples, both drivers alike, a user's
own method, resume, a job of seeds, the row, summary, compare and plot, and nothing changed when it is off."""

from __future__ import annotations

import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.analysis import plots, tables
from fedjax_hetero.config import FederationConfig, MethodConfig, RunConfig
from fedjax_hetero.data import hold_out, partition, synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.methods import Method, build_method
from fedjax_hetero.rounds import ArchGroup, RoundSpec, assign_groups, make_backend, make_simulation
from fedjax_hetero.rounds.body import RoundData
from fedjax_hetero.rounds.client_eval import summary
from fedjax_hetero.rounds.many import ManyRuns
from fedjax_hetero.run.jobs import run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from tests.helpers import TINY_LOCAL, TrainedAlone, measured, mlp_groups
from tests.test_runner import read_rows

QUIET = dict(log=lambda _: None)
NUM_CLIENTS = 6
pytestmark = pytest.mark.xdist_group("client_evaluation")  # (one worker sets up the module's fixtures)


def noisy_dataset():
  """Synthetic images noisy enough that clients' accuracies spread (the default noise is learnt perfectly)."""
  return synthetic_dataset(num_train=240, num_test=64, seed=0, noise_std=180.0)


def held_out_simulation(method="HeteroAvg", seed: int = 0, fraction: float = 0.25, round_program: str = "auto",
                        backend: str = "sequential"):
  """Two MLP width groups over 6 clients of unequal sizes, ``fraction`` of each client's samples held out: the
  simulation and the clients' full parts."""
  ds = noisy_dataset()
  parts = partition(ds.train_labels, "iid_imbalanced", NUM_CLIENTS, seed)
  train, held = hold_out(parts, fraction, seed)
  store = FederatedStore.build(ds.train_images, ds.train_labels, train, ds.num_classes, ds.mean, ds.std)
  groups = [ArchGroup(name, model, clients) for (name, model), clients in
            zip(mlp_groups((1.0, 0.5), (16,), ds.num_classes), assign_groups(NUM_CLIENTS, 2))]
  if isinstance(method, str):
    method = build_method(method, MethodConfig(), TINY_LOCAL)
  spec = RoundSpec.build(groups, store, TINY_LOCAL, method, FederationConfig(clients_per_round=3, seed=seed),
                         jnp.asarray(ds.test_images), jnp.asarray(ds.test_labels), held)
  return make_simulation(spec, make_backend(backend), round_program, 2), parts


def by_hand(sim, state, parts) -> dict[str, list[float]]:
  """Every client's accuracy, computed apart from the library's evaluation: its held-out samples are those of its
  partition the training store does not list, its group's model (as the method evaluates it) applied to them."""
  spec = sim.spec
  images, labels = np.asarray(spec.store.images), np.asarray(spec.store.labels)
  table = np.asarray(spec.store.index_table)
  mean, std = np.float32(spec.store.mean), np.float32(spec.store.std)
  out = {}
  for g, group in enumerate(spec.groups):
    variables = spec.evaluated_variables(spec.group_variables(state, g), g)
    accuracies = []
    for c in group.clients:
      held = np.setdiff1d(parts[c], table[c, :spec.store.sizes[c]])
      assert len(held) == math.ceil(0.25 * len(parts[c]) - 1e-9)
      x = (images[held].astype(np.float32) / np.float32(255.0) - mean) / std
      logits = np.asarray(group.model.apply(variables, jnp.asarray(x), train=False))
      accuracies.append(float(np.mean(logits.argmax(-1) == labels[held])))
    out[group.name] = accuracies
  return out


def test_the_split_holds_out_a_seeded_ceil_of_every_clients_samples_once():
  parts = [np.arange(10), np.arange(10, 13), np.arange(13, 43)]
  train, held = hold_out(parts, 0.1, seed=3)
  assert [len(h) for h in held] == [1, 1, 3]  # ceil(1.0), ceil(0.3), ceil(3.0) (not 4: 0.1 * 30 rounds up to 3)
  for part, t, h in zip(parts, train, held):
    assert not set(t) & set(h) and sorted([*t, *h]) == part.tolist()
    assert list(t) == sorted(t) and list(h) == sorted(h)  # (each keeps the client's order)
  again, other = hold_out(parts, 0.1, seed=3)[1], hold_out(parts, 0.1, seed=4)[1]
  assert all(np.array_equal(a, b) for a, b in zip(held, again))
  assert any(not np.array_equal(a, b) for a, b in zip(held, other))
  other_clients = hold_out([np.arange(100, 105), np.arange(3), parts[2]], 0.1, seed=3)[1]
  assert np.array_equal(other_clients[2], held[2]), "a client's draw depends on its own samples, seed and id alone"
  with pytest.raises(ValueError, match=r"--client-eval-fraction 0.5: client 1 holds 1 sample; holding out 1 of "
                                       r"them leaves it none to train on"):
    hold_out([np.arange(4), np.arange(4, 5)], 0.5, seed=0)
  # (Fifth probe survey: a fraction that holds out nothing stopped the run later with no flag named.)
  with pytest.raises(ValueError, match=r"^--client-eval-fraction 1e-12 holds out none of client 0's 4 samples "):
    hold_out([np.arange(4), np.arange(4, 5)], 1e-12, seed=0)


def test_every_clients_accuracy_equals_its_groups_model_applied_by_hand():
  sim, parts = held_out_simulation()
  state, rows = sim.run_rounds(sim.init_state(), 2, evaluate={2})
  assert rows[0]["client_accuracy"] is None and rows[0]["test_accuracy"] is None
  row = rows[1]["client_accuracy"]
  expected = by_hand(sim, state, parts)
  every = []
  for name, accuracies in expected.items():
    assert row[name]["clients"] == accuracies
    a = np.array(accuracies)
    assert row[name]["mean"] == pytest.approx(a.mean()) and row[name]["std"] == pytest.approx(a.std())
    assert row[name]["worst_10pct"] == pytest.approx(a.min())  # 3 clients: the lowest one
    every += accuracies
  assert row["all"] == pytest.approx({"mean": np.mean(every), "worst_10pct": min(every), "std": np.std(every)})
  assert len(set(every)) > 1, "the clients' accuracies should spread on noisy data"
  assert sim.client_accuracy(state) == {"client_accuracy": row}  # (the runner's evaluation of a finished run)


def test_the_worst_tenth_is_the_mean_of_the_lowest_tenth_and_at_least_one_client():
  accuracies = np.arange(25) / 25.0
  assert summary(accuracies)["worst_10pct"] == pytest.approx(np.mean([0, 1 / 25]))  # 2 of 25
  assert summary(np.array([0.5, 0.9]))["worst_10pct"] == 0.5


@pytest.mark.parametrize("backend", ["sequential", "vmap"])
def test_the_host_loop_and_the_round_program_count_the_same(backend):
  host, _ = held_out_simulation(round_program="host", backend=backend)
  program, _ = held_out_simulation(round_program="fused", backend=backend)
  assert not host.cohorts.in_program and program.cohorts.in_program
  evaluate = {1, 3}
  _, host_rows = host.run_rounds(host.init_state(), 3, evaluate=evaluate)
  _, rows = program.run_rounds(program.init_state(), 3, evaluate=evaluate)
  assert [r["client_accuracy"] for r in rows] == [r["client_accuracy"] for r in host_rows]


def test_a_users_own_method_gets_it_with_no_code_of_its_own():
  from tests.test_custom_method import fedavgm

  method: Method = fedavgm()
  for round_program in ("host", "fused"):
    sim, parts = held_out_simulation(method, round_program=round_program)
    state, rows = sim.run_rounds(sim.init_state(), 2, evaluate={2})
    assert {k: v["clients"] for k, v in rows[1]["client_accuracy"].items() if k != "all"} == by_hand(sim, state, parts)


@pytest.fixture(scope="module")
def two_seeds_alone():
  """The round programs of seeds 0 and 1 and their rows of two rounds alone, computed once for both mappings."""
  sims = [held_out_simulation(seed=seed, round_program="fused", backend="vmap")[0] for seed in (0, 1)]
  return sims, [sim.run_rounds(sim.init_state(), 2, evaluate={1, 2})[1] for sim in sims]


@pytest.mark.parametrize("mapping", ["map", "vmap"])
def test_runs_of_one_program_count_as_each_run_alone(mapping, two_seeds_alone):
  """Each seed has its own split (another number of held-out samples per group: padded in the program)."""
  sims, alone_rows = two_seeds_alone
  assert [h.ids.shape for h in sims[0].spec.client_eval.held] != [h.ids.shape for h in sims[1].spec.client_eval.held]
  batch = ManyRuns(sims, mapping=mapping)
  together = batch.run([0, 1], [s.init_state() for s in sims], 2, {1, 2})
  for (_, rows), alone in zip(together, alone_rows, strict=True):
    assert [r["client_accuracy"] for r in rows] == [r["client_accuracy"] for r in alone]


def test_off_by_default_nothing_is_held_out_or_reported():
  assert RunConfig().data.client_eval_fraction == 0
  from tests.helpers import tiny_simulation

  sim = tiny_simulation("HeteroAvg", widths=(1.0, 0.5))
  assert sim.spec.client_eval is None and RoundData.of(sim.spec).held_out == ()
  _, (row,) = sim.run_rounds(sim.init_state(), 1, evaluate={1})
  assert "client_accuracy" not in row and sim.client_accuracy(sim.init_state()) == {}
  with pytest.raises(ValueError, match=r"--client-eval-fraction must be a finite number in \[0, 1\), got 1"):
    RunConfig.from_flags(client_eval_fraction=1)


# ------------------------------------------------------------------------------------------- through the runner


def config(out, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=NUM_CLIENTS, clients_per_round=3,
               rounds=4, checkpoint_every=2, eval_every=2, progress=False, output_dir=str(out), batch_size=16,
               dissimilarity=False, method="HeteroAvg", partition="iid", client_eval_fraction=0.2)
  return RunConfig.from_flags(**{**flags, **changes})


@pytest.fixture(scope="module")
def trained_alone(tmp_path_factory) -> TrainedAlone:
  return TrainedAlone(tmp_path_factory, noisy_dataset)


@pytest.mark.slow
def test_a_run_reports_it_in_its_rows_summary_plot_and_compare(tmp_path):
  run = config(tmp_path / "run")
  summary_ = run_experiment(run, noisy_dataset(), **QUIET)
  rows = read_rows(run.output.dir)
  assert [r["client_accuracy"] is not None for r in rows] == [False, True, False, True]
  assert len(rows[-1]["client_accuracy"]["mlp@1"]["clients"]) == 3
  final = {name: {k: v for k, v in values.items() if k != "clients"}
           for name, values in rows[-1]["client_accuracy"].items()}
  assert summary_["final_client_accuracy"] == final
  with open(os.path.join(run.output.dir, "summary.json")) as f:
    assert json.load(f)["final_client_accuracy"] == final
  shown = tables.table([("run", summary_, rows)], 3)
  assert "clients' held-out acc: mean / worst 10% (%)" in shown
  assert f"| {100 * final['all']['mean']:.2f} / {100 * final['all']['worst_10pct']:.2f} |" in shown
  assert os.path.exists(os.path.join(run.output.dir, "accuracy.png"))
  with open(os.path.join(run.output.dir, "partition.txt")) as f:
    report = f.read()  # (fifth probe survey: the held-out samples looked unassigned)
  assigned, total = map(int, re.search(r"samples assigned: (\d+) / (\d+)", report).groups())
  held = int(re.search(r"held out for per-client evaluation \(--client-eval-fraction\): (\d+) samples", report)[1])
  assert assigned + held == total
  plotted = plots.plot_accuracy_per_round([("run", summary_, rows)], str(tmp_path / "compare.png"), "t", [{}])
  assert os.path.exists(plotted)


@pytest.mark.slow
def test_a_run_resumes_bit_for_bit_on_both_drivers(tmp_path, trained_alone):
  dataset = noisy_dataset()
  for program in ("host", "fused"):
    straight = trained_alone(config(tmp_path / f"straight_{program}", round_program=program))
    halves = config(tmp_path / f"halves_{program}", rounds=2, round_program=program)
    run_experiment(halves, dataset, **QUIET)
    run_experiment(halves.replace(rounds=4, resume=True), dataset, **QUIET)
    assert measured(halves.output.dir) == measured(straight)


@pytest.mark.slow
@pytest.mark.default_emitters
def test_a_job_of_seeds_equals_its_runs_alone(tmp_path, trained_alone):
  """(Seed 0 alone is the straight run of the resume test above, trained once.)"""
  dataset = noisy_dataset()
  runs = runs_of(config(tmp_path / "job", round_program="fused"), [0, 1])
  run_together(runs, dataset, **QUIET)
  for run in runs:
    assert measured(run.output.dir) == measured(trained_alone(run))
  assert measured(runs[0].output.dir)[-1]["client_accuracy"] != measured(runs[1].output.dir)[-1]["client_accuracy"]


def test_a_client_too_small_to_split_is_refused_naming_the_flag(tmp_path):
  with pytest.raises(ValueError, match=r"--client-eval-fraction 0.99: client 0 holds 40 samples; holding out 40 of "
                                       r"them leaves it none to train on"):
    run_experiment(config(tmp_path / "run", client_eval_fraction=0.99), noisy_dataset(), **QUIET)
