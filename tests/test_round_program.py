"""Rounds as a device program (`rounds.mapping.ProgramCohorts`): every method it runs gives the host loop's results to
float tolerance, K rounds in one call equal K calls of one, one device launch per call whatever the
groups, clients and local steps, nothing compiles after the first call, and the runner resumes it."""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.compilation import CompileLog, LaunchCount
from fedjax_hetero.config import FedCrossConfig, FederationConfig, LocalConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import MethodConfig, build_method
from fedjax_hetero.methods import fedgen_generator as fedgen
from fedjax_hetero.rounds import RoundSpec, Simulation, make_backend, make_simulation
from fedjax_hetero.rounds.mapping import HostCohorts
from tests import golden
from tests.golden_setting import TINY_FEDGEN, eval_variables, golden_simulation
from tests.helpers import simulation, tiny_resnet, tiny_simulation
from tests.test_golden import RECORD, assert_close

# The device driver against the golden record and the host loop: end to end (`pytest -m "not slow"` leaves it out).
pytestmark = pytest.mark.slow

# Every method once on the device program, but CluSamp (its sampler keeps host-side state): the first record's
# methods with the vmap backend's mapping, the later methods as recorded (the sequential backend's mapping, lax.map).
FUSED_GOLDEN = ([(m, "vmap", "mlp") for m in golden.METHODS if m != "CluSamp"]
                + [(m, "sequential", family) for m, family in golden.LATER_METHODS])


def fused(sim: Simulation, rounds_per_call: int = 3, round_program: str = "fused", **changes) -> Simulation:
  """``sim``'s setting (with ``changes`` to its spec's inputs) as a device program, its cohorts mapped as ``sim``'s
  backend maps them (``round_program`` "host": on the host loop)."""
  spec = sim.spec
  if changes:
    inputs = dict(groups=spec.groups, store=spec.store, local=spec.local, method=spec.method, config=spec.config,
                  test_images=spec.test_images, test_labels=spec.test_labels)
    spec = RoundSpec.build(**{**inputs, **changes})
  backend = (sim.cohorts.backend if isinstance(sim.cohorts, HostCohorts) else
             make_backend("sequential" if sim.cohorts.mapping == "map" else "vmap"))
  return make_simulation(spec, backend, round_program, rounds_per_call)


def record(sim: Simulation) -> tuple[list[dict], list[list[str]]]:
  """`golden.record`'s rows for ``sim``, one call per round, and the programs each call compiled."""
  state, rows, compiled = sim.init_state(), [], []
  for r in range(golden.ROUNDS):
    with CompileLog() as log:
      state, (row,) = sim.run_rounds(state, 1, evaluate={r + 1})
    compiled.append(log.names)
    rows.append({**{k: row[k] for k in ("train_loss", "train_loss_per_group", "examples", "clients",
                                        "test_accuracy")},
                 "models": {name: golden.fingerprint(v) for name, v in eval_variables(sim, state).items()}})
  return rows, compiled


@pytest.mark.parametrize("entry", FUSED_GOLDEN, ids=lambda e: golden.key(*e))
def test_round_program_reproduces_the_golden_record(entry):
  if jax.__version__ != RECORD["jax"]:
    pytest.skip(f"the record was made with jax {RECORD['jax']}; this is {jax.__version__}")
  method, backend, family = entry
  key = golden.key(*entry)
  expected = golden.expected(RECORD["records"], key, golden.signature())
  rows, compiled = record(golden_simulation(method, backend, family, "fused", rounds_per_call=3))
  for round_index, (want, have) in enumerate(zip(expected, rows), start=1):
    assert_close(want, have, method, f"{key} on the round program, round {round_index}")
  if method in golden.CPU_SENSITIVE:  # (numbers unchecked above: held to the first round's, before amplification)
    np.testing.assert_allclose(rows[0]["train_loss"], expected[0]["train_loss"], rtol=golden.TOLERANCE["loss"])
  assert compiled[0], "the first call compiles the program"
  assert compiled[1:] == [[]] * (golden.ROUNDS - 1), f"later calls compiled {compiled[1:]}"


def width_resnet_simulation(method: str) -> Simulation:
  """Two one-stage tiny ResNets of widths 1 and 0.5 (BatchNorm, HeteroFL's width groups) on `tiny_federation`."""
  models = [(f"resnet@{w}", tiny_resnet((1,), width=w)) for w in (1.0, 0.5)]
  return simulation(method, models, local=LocalConfig(epochs=1, batch_size=8, learning_rate=1e-2), backend="vmap")


def close_rows(host: list[dict], program: list[dict], where: str) -> None:
  for want, have in zip(host, program, strict=True):
    assert (have["clients"], have["examples"]) == (want["clients"], want["examples"]), where
    np.testing.assert_allclose(have["train_loss"], want["train_loss"], rtol=1e-4, err_msg=where)
    assert (have["test_accuracy"] is None) == (want["test_accuracy"] is None), where
    for group, accuracy in (want["test_accuracy"] or {}).items():
      np.testing.assert_allclose(have["test_accuracy"][group], accuracy, atol=1e-9, err_msg=where)


def assert_same_run(host: Simulation, program: Simulation, rounds: int = 1) -> None:
  """Both simulations' rounds (all evaluated): rows and final models within float tolerance (that of
  `golden.TOLERANCE` on parameter sums, elementwise)."""
  evaluate = set(range(1, rounds + 1))
  host_state, host_rows = host.run_rounds(host.init_state(), rounds, evaluate=evaluate)
  state, rows = program.run_rounds(program.init_state(), rounds, evaluate=evaluate)
  close_rows(host_rows, rows, program.spec.method.name)
  for g in range(len(host.spec.groups)):
    chex.assert_trees_all_close(program.spec.group_variables(state, g), host.spec.group_variables(host_state, g),
                                rtol=golden.TOLERANCE["parameter_sum"], atol=1e-5)


def test_round_program_equals_the_host_loop_with_static_batch_norm():
  """HeteroFL's static BatchNorm re-estimates the statistics before every evaluation: inside the program too."""
  host = width_resnet_simulation("HeteroFL")
  assert not host.cohorts.in_program  # auto on CPU: the host loop
  assert_same_run(host, fused(host))


def test_round_program_with_the_backdoor_attack_and_the_dissimilarity_metric():
  config = FederationConfig(clients_per_round=3, seed=0, malicious_fraction=0.34)
  host = tiny_simulation("HeteroScaffold", "vmap", widths=(1.0, 0.5), track_dissimilarity=True)
  host = fused(host, round_program="host", config=config)
  program = fused(host, config=config)
  assert len(program.spec.malicious_clients) == 2
  assert_same_run(host, program, rounds=3)
  _, rows = program.run_rounds(program.init_state(), 3)
  # Every group of the shared federation, with values where two or more of its clients trained (a spread between
  # clients' updates), none elsewhere. (The draw gives a group none, one and more clients in these rounds.)
  trained = [[int((program.spec.group_of_client[row["clients"]] == g).sum()) for g in range(2)] for row in rows]
  assert {0, 1} < {n for counts in trained for n in counts}, trained
  for row, counts in zip(rows, trained):
    assert set(row["dissimilarity"]) == {g.name for g in program.spec.groups}
    for g, group in enumerate(program.spec.groups):
      values = row["dissimilarity"][group.name].values()
      assert all(v is not None for v in values) == (counts[g] >= 2) == any(v is not None for v in values), (
          row["round"], group.name, counts)


@pytest.mark.parametrize("method", ["HeteroScaffold", "FedCross"])
def test_a_call_of_k_rounds_equals_k_calls_of_one(method):
  """The same compiled program either way: bit for bit, client memory and stacked models included. FedCross's
  warm-up stage ends after round 1, so its 3 rounds are two calls, of two programs."""
  options = dict(fedcross=FedCrossConfig(warmup_rounds=1)) if method == "FedCross" else {}
  sim = fused(tiny_simulation(method, "vmap", widths=(1.0,) if method == "FedCross" else (1.0, 0.5), **options))
  assert call_lengths(sim, 0, 3) == ([1, 2] if method == "FedCross" else [3])
  one_call, rows = sim.run_rounds(sim.init_state(), 3, evaluate={2, 3})
  state, single = sim.init_state(), []
  for r in range(3):
    state, row = sim.run_rounds(state, 1, evaluate={2, 3})
    single += row
  chex.assert_trees_all_equal((one_call.models, one_call.steps, one_call.memory),
                              (state.models, state.steps, state.memory))
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ("round_seconds", "samples_per_s")} for r in rows]
  assert strip(rows) == strip(single)


def test_the_evaluation_compiles_once_beside_the_rounds_program():
  """Its own program, compiled in a thread while the round's program compiles: each once, in the first call."""
  sim = fused(tiny_simulation("HeteroAvg", "vmap", widths=(1.0, 0.5)))
  state = sim.init_state()
  with CompileLog() as log:
    state, rows = sim.run_rounds(state, 3, evaluate={1, 3})
  assert sorted(log.names) == ["jit(call)", "jit(evaluation)"]
  assert [r["test_accuracy"] is None for r in rows] == [False, True, False]
  with CompileLog() as log:
    sim.run_rounds(state, 3, evaluate={5})
  assert log.names == []


def call_lengths(sim: Simulation, first: int, count: int) -> list[int]:
  lengths = []
  while sum(lengths) < count:
    lengths.append(sim.call_length(first + sum(lengths), first + count))
  return lengths


def launches_per_call(sim: Simulation, rounds: int = 3) -> int:
  state, _ = sim.run_rounds(sim.init_state(), 1, consume=True)  # compiles
  with LaunchCount() as launches:
    sim.run_rounds(state, rounds, evaluate={2, rounds + 1}, consume=True)
  return launches.count


def test_one_device_launch_per_call_whatever_the_groups_clients_and_steps():
  """The structure a GPU needs, counted on the CPU: the host loop launches programs per group, client and
  step (dozens a round); the round program launches one per call of K rounds, cut after each evaluated round,
  and its evaluation one of its own: rounds 2 to 4 evaluated after 2 and 4 are two pieces and two evaluations."""
  small = tiny_simulation("HeteroScaffold", "vmap", widths=(1.0,), clients_per_round=2)
  local = LocalConfig(epochs=4, batch_size=4, learning_rate=1e-2)  # 4x the steps
  large = tiny_simulation("HeteroScaffold", "vmap", widths=(1.0, 0.5), clients_per_round=6)
  large = fused(large, local=local, method=build_method("HeteroScaffold", MethodConfig(), local))
  assert launches_per_call(fused(small)) == launches_per_call(large) == 4
  assert launches_per_call(small) > 3 * 10


def test_clustered_sampling_runs_the_host_loop():
  sim = tiny_simulation("CluSamp", "vmap")
  assert not sim.cohorts.in_program
  with pytest.raises(ValueError, match=r"CluSamp cannot run as one program per round: .*sampler \(clustered\)"
                                       r".*--round-program host"):
    fused(sim)


def test_rounds_per_call_is_checked():
  with pytest.raises(ValueError, match="--rounds-per-call must be an integer >= 1"):
    fused(tiny_simulation("FedAvg", "vmap"), rounds_per_call=0)


def test_fedgen_client_coefficients_traced_equal_the_host_schedule():
  for round_index in (0, 1, 7, 300):
    host = fedgen.client_coefficients(TINY_FEDGEN, round_index)
    traced = jax.jit(lambda r: fedgen.client_coefficients(TINY_FEDGEN, r))(jnp.int32(round_index))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(host, np.float32), rtol=2e-5)  # float32 powers


# ---------------------------------------------------------------------------------------------- the runner


def runner_config(output_dir, **changes):
  from tests.test_runner import base_config
  return base_config(output_dir, round_program="fused", rounds_per_call=4, method="HeteroScaffold", **changes)


def test_runner_resumes_the_round_program_bit_for_bit(tmp_path):
  """Calls end at checkpoint rounds (every 2 here): 2 rounds, then a resume to 4, equal 4 rounds straight."""
  from fedjax_hetero.run.runner import run_experiment
  from tests.test_runner import quiet, read_rows, restore
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run_experiment(runner_config(straight), dataset, log=quiet)
  run_experiment(runner_config(resumed, rounds=2), dataset, log=quiet)
  logs = []
  run_experiment(runner_config(resumed, resume=True), dataset, log=logs.append)
  assert any("4 rounds per device program" in line for line in logs), logs
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ("round_seconds", "samples_per_s")} for r in rows]
  assert strip(read_rows(straight)) == strip(read_rows(resumed))
  assert [r["test_accuracy"] is not None for r in read_rows(straight)] == [False, True, False, True]
  chex.assert_trees_all_equal(restore(runner_config(straight), dataset)[0], restore(runner_config(resumed), dataset)[0])


def test_runner_stops_a_diverging_round_program_at_the_call_and_keeps_the_good_checkpoint(tmp_path):
  from fedjax_hetero.run.guard import DivergenceError
  from fedjax_hetero.run.runner import run_experiment
  from tests.test_runner import quiet, read_rows
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  good = runner_config(tmp_path, rounds=2, optimizer="sgd", learning_rate=0.05)
  run_experiment(good, dataset, log=quiet)
  with pytest.raises(DivergenceError, match=r"^round 3: training loss of group (mlp@1|mlp@0\.5) is nan"):
    run_experiment(good.replace(rounds=4, resume=True, learning_rate=1e30), dataset, log=quiet)
  assert [r["round"] for r in read_rows(tmp_path)] == [1, 2], "no row of the diverged call"


def test_a_fresh_runs_first_call_compiles_beside_its_setup_and_once(tmp_path):
  """`runner.prepare` starts the first call's program compiling from the server state's shapes while the rest of
  the setup runs; the first call finds it compiled, and the rows are a run's whose first call compiles it."""
  from fedjax_hetero import compilation
  from fedjax_hetero.run import runner
  from tests.test_runner import quiet, read_rows
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  beside, plain = runner_config(tmp_path / "beside", rounds=2), runner_config(tmp_path / "plain", rounds=2)
  with compilation.CompileLog() as log:
    run = runner.prepare(beside, dataset, quiet, runner.run_method(beside))
    run.sim._compiling["first call"].result()
  assert log.names.count("jit(call)") == 1, log.names
  with compilation.CompileLog() as log:
    run.train()
  assert "jit(call)" not in log.names, log.names
  runner.open_run(runner.plan(plain, dataset, quiet, runner.run_method(plain)), quiet).train()
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ("round_seconds", "samples_per_s")} for r in rows]
  assert strip(read_rows(tmp_path / "beside")) == strip(read_rows(tmp_path / "plain"))
