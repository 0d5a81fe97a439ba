"""Client availability (`fedjax_hetero.sampling.availability`, ``--client-dropout``, ``--availability-trace``):
who drops against the seeded draw written out, the round aggregating those that answered (a trace of the same
absences gives the same run), both drivers alike, resume, a job of seeds, and the refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedjax_hetero.analysis import tables
from fedjax_hetero.config import RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.data.store import sample_clients
from fedjax_hetero.run.jobs import run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.sampling.availability import availability, read_trace
from tests.helpers import measured, run_alone
from tests.test_runner import read_rows

QUIET = dict(log=lambda _: None)
pytestmark = pytest.mark.xdist_group("availability")  # (one worker sets up the module's fixtures)


def test_who_drops_is_the_seeded_uniform_draw_against_the_groups_probability():
  p, seed, n = np.array([0.7, 0.1]), 5, 40
  answering = availability(tuple(p), [], 2, n, seed)
  group = np.arange(n) % 2
  dropped = 0
  for r in range(200):
    clients = np.sort(np.random.default_rng(r).choice(n, 10, replace=False))
    answered = answering.answers(clients, group[clients], r)
    u = np.random.default_rng([seed, r, 3]).random(n)[clients]  # written out: one uniform per client and round
    np.testing.assert_array_equal(answered, u >= p[group[clients]])
    dropped += (~answered).sum()
  rate = dropped / 2000  # expected (0.7 + 0.1) / 2 = 0.4, binomial std 0.011
  assert abs(rate - 0.4) < 0.05, rate


def test_a_clients_draw_does_not_depend_on_who_else_was_sampled():
  answering = availability((0.5,), [], 1, 30, 0)
  alone = answering.answers(np.array([7]), np.zeros(1, int), 3)
  among = answering.answers(np.array([1, 7, 20]), np.zeros(3, int), 3)
  assert alone[0] == among[1]


def test_a_trace_drops_exactly_its_pairs(tmp_path):
  trace = tmp_path / "absent.csv"
  trace.write_text("client,round\n# weak phones at night\n3,1\n\n5, 2\n")
  pairs = read_trace(str(trace), 10)
  assert pairs == [(3, 1), (5, 2)]
  answering = availability((), pairs, 1, 10, 0)
  assert answering.answers(np.array([3, 5]), np.zeros(2, int), 0).tolist() == [False, True]
  assert answering.answers(np.array([3, 5]), np.zeros(2, int), 1).tolist() == [True, False]
  trace.write_text("\ufeffclient,round\r\n3,1\r\n", encoding="utf-8")  # (a spreadsheet's "CSV UTF-8": a BOM)
  assert read_trace(str(trace), 10) == [(3, 1)]


@pytest.mark.parametrize("text, message", [
    ("3;1\n", r"line 1: expected two integers 'client,round', got '3;1'"),
    ("1,1\n12,2\n", r"line 2: client 12 is not one of the run's 10 clients \(0 to 9\)"),
    ("1,0\n", r"line 1: round 0; rounds count from 1"),
])
def test_a_trace_line_that_does_not_fit_is_named(tmp_path, text, message):
  trace = tmp_path / "absent.csv"
  trace.write_text(text)
  with pytest.raises(ValueError, match=message):
    read_trace(str(trace), 10)


def config(out, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=8, clients_per_round=4, rounds=4,
               checkpoint_every=2, eval_every=1, progress=False, output_dir=str(out), batch_size=16,
               dissimilarity=False, method="HeteroAvg", client_dropout=(0.6, 0.2))
  return RunConfig.from_flags(**{**flags, **changes})


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> RunConfig:
  """`config`'s run of four rounds with dropouts, trained once for the tests that read it."""
  run = config(tmp_path_factory.mktemp("straight") / "run")
  run_experiment(run, synthetic_dataset(num_train=240, num_test=64, seed=0), **QUIET)
  return run


def test_a_runs_rows_count_the_dropped_clients_of_each_group_and_train_the_others(straight):
  run = straight
  rows = read_rows(run.output.dir)
  group = np.repeat([0, 1], 4)  # contiguous blocks of the 8 clients
  for r, row in enumerate(rows):
    drawn = sample_clients(8, 4, 0, r)
    u = np.random.default_rng([0, r, 3]).random(8)
    expected = drawn[u[drawn] < np.array([0.6, 0.2])[group[drawn]]]
    assert row["clients"] == drawn.tolist() and row["dropped"] == expected.tolist()
    for g, name in enumerate(("mlp@1", "mlp@0.5")):
      assert row["dropped_per_group"][name] == int((group[expected] == g).sum())
      assert row["clients_per_group"][name] + row["dropped_per_group"][name] == int((group[drawn] == g).sum())
  with open(os.path.join(run.output.dir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["clients_dropped"] == sum(len(row["dropped"]) for row in rows) > 0
  assert summary["clients_dropped_per_group"] == {name: sum(row["dropped_per_group"][name] for row in rows)
                                                  for name in ("mlp@1", "mlp@0.5")}
  shown = tables.table([("run", summary, rows)], 3)
  assert "sampled clients dropped" in shown and f"| {summary['clients_dropped']} of {4 * len(rows)} |" in shown


@pytest.mark.slow
def test_the_same_absences_from_a_trace_give_the_same_run_on_both_drivers(tmp_path):
  """The round aggregates the clients that answered, whichever way their absence is given or the round is run."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  drawn = config(tmp_path / "drawn", rounds=3)
  run_experiment(drawn, dataset, **QUIET)
  trace = tmp_path / "absent.csv"
  trace.write_text("".join(f"{c},{row['round']}\n" for row in read_rows(drawn.output.dir) for c in row["dropped"]))
  traced = config(tmp_path / "traced", rounds=3, client_dropout=(), availability_trace=str(trace),
                  round_program="fused")
  run_experiment(traced, dataset, **QUIET)
  assert measured(traced.output.dir) == measured(drawn.output.dir)
  everyone = config(tmp_path / "everyone", rounds=3, client_dropout=())
  run_experiment(everyone, dataset, **QUIET)
  assert [r["train_loss"] for r in read_rows(everyone.output.dir)] != [r["train_loss"] for r in
                                                                       read_rows(drawn.output.dir)]


@pytest.mark.slow
def test_a_run_with_dropouts_resumes_bit_for_bit(tmp_path, straight):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  halves = config(tmp_path / "halves", rounds=2)
  run_experiment(halves, dataset, **QUIET)
  run_experiment(halves.replace(rounds=4, resume=True), dataset, **QUIET)
  assert measured(halves.output.dir) == measured(straight.output.dir)


@pytest.mark.slow
@pytest.mark.default_emitters
def test_a_job_of_seeds_with_dropouts_equals_its_runs_alone(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(config(tmp_path / "job", round_program="fused", rounds=3), [0, 1])
  run_together(runs, dataset, **QUIET)
  for run in runs:
    alone = run_alone(run, dataset)
    assert measured(run.output.dir) == measured(alone)
  assert measured(runs[0].output.dir) != measured(runs[1].output.dir)


def test_settings_that_do_not_fit_are_refused_naming_the_flag(tmp_path):
  with pytest.raises(ValueError, match=r"--client-dropout takes probabilities in \[0, 1\], got 1.5"):
    RunConfig.from_flags(client_dropout=(1.5,))
  with pytest.raises(ValueError, match=r"--client-dropout takes one probability, or one per architecture group "
                                       r"\(2\), got 3"):
    RunConfig.from_flags(groups=("mlp@1", "mlp@0.5"), client_dropout=(0.1, 0.2, 0.3))
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  with pytest.raises(ValueError, match=r"--client-dropout: FedCross trains one middleware model per client"):
    run_experiment(config(tmp_path / "cross", method="FedCross", groups=("mlp@1",), client_dropout=(0.2,)), dataset,
                   **QUIET)
  with pytest.raises(ValueError, match=r"--availability-trace '.*missing.csv': cannot be read: No such file"):
    run_experiment(config(tmp_path / "missing", availability_trace=str(tmp_path / "missing.csv")), dataset, **QUIET)


def test_a_users_method_gets_availability_and_a_dropped_clients_memory_waits():
  """FedAvgM declared outside the library drops clients like any method; under SCAFFOLD a dropped client's
  control variate (its memory) is left as it was, a client that answered has a new one."""
  import jax

  from tests.helpers import mlp_groups, simulation, tiny_federation
  from tests.test_custom_method import fedavgm

  data = tiny_federation()
  for method in (fedavgm(), "SCAFFOLD"):
    sim = simulation(method, mlp_groups((1.0,), (16,), data[0].num_classes), data, clients_per_round=4,
                     client_dropout=(0.5,))
    state, rows, dropped = sim.init_state(), [], set()
    while not dropped:
      before = state
      state, (row,) = sim.run_rounds(state, 1)
      rows.append(row)
      dropped = set(row["dropped"])
    answered = sorted(set(row["clients"]) - dropped)
    assert sum(row["clients_per_group"].values()) == len(answered)
    if method == "SCAFFOLD":
      rows_of = lambda tree, ids: jax.tree.map(lambda x: np.asarray(x)[sorted(ids)], tree)
      jax.tree.map(np.testing.assert_array_equal, rows_of(state.memory, dropped), rows_of(before.memory, dropped))
      changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), rows_of(state.memory, answered),
                                             rows_of(before.memory, answered)))
      assert answered and any(changed)
