"""Many runs in one program (`fedjax_hetero.rounds.many`, `fedjax_hetero.run.jobs`): run r of a batched job equals
the same run alone on the golden setting, and every number a method reads is traced in a job's program. The runs'
folders (written, resumed, interrupted, gone wrong): tests/test_many_runs_folders.py; what cannot be swept is refused
before any compute: tests/test_many_runs_refusals.py."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_hetero.client.local import make_optimizer
from fedjax_hetero.compilation import CompileLog
from fedjax_hetero.config import LocalConfig, MethodConfig, RunConfig, declare
from fedjax_hetero.config.declare import substituted, value_at
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import METHODS, build_method
from fedjax_hetero.rounds.many import ManyRuns
from fedjax_hetero.run.jobs import parse_sweep, run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from tests import golden
from tests.golden_setting import TINY_FEDGEN, golden_simulation
from tests.helpers import tiny_simulation
from tests.test_round_program import FUSED_GOLDEN, fused
from tests.test_runner import restore

ROUNDS = golden.ROUNDS
pytestmark = pytest.mark.xdist_group("many_runs")  # (one worker sets up the module's fixtures)


def golden_runs(method: str, swept: str, value: float, backend: str = "vmap", family: str = "mlp"):
  """The golden setting's runs of seeds 0, 1, 2 as device programs, the last with ``swept`` set to ``value``: the
  simulations, every run's value of ``swept`` and how a program makes a run's spec from the first's with it."""
  base = golden_simulation(method, backend, family)
  options = MethodConfig(fedgen=TINY_FEDGEN) if method == "FedGen" else MethodConfig()
  section, path = swept.split(".", 1)
  sims, values = [], []
  for seed in range(3):
    local, run_options = base.spec.local, options
    if seed == 2:
      local = dataclasses.replace(local, **{path: value}) if section == "client" else local
      run_options = substituted(options, {path: value}) if section == "method" else options
    sims.append(fused(base, rounds_per_call=ROUNDS, local=local, method=build_method(method, run_options, local),
                      config=dataclasses.replace(base.spec.config, seed=seed)))
    values.append({swept: value if seed == 2 else float(golden_value(base, options, swept))})

  def specialize(spec, traced):
    local = substituted(spec.local, {p.split(".", 1)[1]: v for p, v in traced.items() if p.startswith("client.")})
    run_options = substituted(options, {p.split(".", 1)[1]: v for p, v in traced.items() if p.startswith("method.")})
    return spec.with_values(local=local, method=build_method(method, run_options, local, checked=False))

  return sims, values, specialize


def golden_value(sim, options, path: str):
  section, rest = path.split(".", 1)
  tree = sim.spec.local if section == "client" else options
  for part in rest.split("."):
    tree = getattr(tree, part)
  return tree


def group_sums(sim, state) -> list[float]:
  return [golden.fingerprint(sim.spec.group_variables(state, g))["sum"] for g in range(len(sim.spec.groups))]


# In CI one method: a method option swept through the method made in the program (FedProx's mu), on both ways of
# mapping runs. FEDJAX_HETERO_ALL_MANY_RUNS=1 checks every method of the round program's golden entries (about 25
# minutes on 2 cores), each with its own option or, without one, the learning rate.
OPTION = {"Prox": ("method.prox.mu", 0.3), "MOON": ("method.moon.temperature", 0.7),
          "FedCross": ("method.fedcross.alpha", 0.9), "FedImpro": ("method.fedimpro.weight", 0.3),
          "FedIN": ("method.fedin.lam", 0.3), "InclusiveFL": ("method.inclusivefl.beta", 0.5)}
ALL = [(m, b, f) for m, b, f in FUSED_GOLDEN if b == "vmap" or f == "resnet" or m in dict(golden.LATER_METHODS)]
EQUIVALENCE = ([(m, *next((v for k, v in OPTION.items() if k in m), ("client.learning_rate", 3e-3)), b, f)
                for m, b, f in ALL] if os.environ.get("FEDJAX_HETERO_ALL_MANY_RUNS") else
               [("FedProx", "method.prox.mu", 0.3, "vmap", "mlp")])


@pytest.fixture(scope="module")
def golden_runs_alone():
  """`golden_runs` of a setting and what each of its runs computes alone (final state, rows), computed once for both
  mappings: ``of(method, swept, value, backend, family)``."""
  computed = {}

  def of(*setting):
    if setting not in computed:
      sims, values, specialize = golden_runs(*setting)
      alone = [sim.run_rounds(sim.init_state(), ROUNDS, evaluate=set(range(1, ROUNDS + 1))) for sim in sims]
      computed[setting] = sims, values, specialize, alone
    return computed[setting]

  return of


@pytest.mark.slow
@pytest.mark.parametrize("mapping", ["map", "vmap"])
@pytest.mark.parametrize("method, swept, value, backend, family", EQUIVALENCE, ids=[e[0] for e in EQUIVALENCE])
def test_run_r_of_a_batched_job_equals_the_run_alone(method, swept, value, backend, family, mapping,
                                                     golden_runs_alone):
  """Mapped one after another (a CPU's way), a run computes what it computes alone, bit for bit (a traced setting
  leaves the last bits free); side by side (an accelerator's way), to float tolerance."""
  sims, values, specialize, alone = golden_runs_alone(method, swept, value, backend, family)
  batch = ManyRuns(sims, values, specialize, mapping=mapping)
  evaluate = set(range(1, ROUNDS + 1))
  together = batch.run([0, 1, 2], [s.init_state() for s in sims], ROUNDS, evaluate)
  for r, (sim, (state, rows), (alone_state, alone_rows)) in enumerate(zip(sims, together, alone, strict=True)):
    for want, have in zip(alone_rows, rows, strict=True):
      assert (have["clients"], have["examples"]) == (want["clients"], want["examples"]), f"run {r}"
      if method in golden.CPU_SENSITIVE:  # (last bits amplified: held to the first round, see tests/golden.py)
        break
      assert have["test_accuracy"] == want["test_accuracy"], f"run {r}"
      assert have["train_loss"] == pytest.approx(want["train_loss"], rel=golden.TOLERANCE["loss"]), f"run {r}"
    else:
      assert group_sums(sim, state) == pytest.approx(group_sums(sim, alone_state),
                                                     rel=golden.TOLERANCE["parameter_sum"])
  assert together[0][1][-1]["train_loss"] != together[1][1][-1]["train_loss"], "the seeds differ"


@pytest.mark.parametrize("mapping", ["map", "vmap"])
def test_a_jobs_evaluation_compiles_once_beside_its_rounds_program(mapping):
  """As a run alone (tests/test_round_program.py): the runs' evaluation is a program of its own, compiled in a thread
  while the rounds' program compiles, each once in the first call that evaluates; a later call compiles nothing."""
  base = fused(tiny_simulation("HeteroAvg", "vmap", widths=(1.0, 0.5)))
  sims = [fused(base, config=dataclasses.replace(base.spec.config, seed=seed)) for seed in (0, 1)]
  batch, states = ManyRuns(sims, mapping=mapping), [s.init_state() for s in sims]
  with CompileLog() as log:
    together = batch.run([0, 1], states, 3, {1, 3})
  programs = [name for name in log.names if name in ("jit(mapped)", "jit(one_run)")]  # (as each mapping names them)
  assert len(programs) == 2 and batch._compiling[2].done(), log.names  # the rounds' and the evaluation's
  assert [[row["test_accuracy"] is None for row in rows] for _, rows in together] == [[False, True, False]] * 2
  with CompileLog() as log:
    batch.run([0, 1], [state for state, _ in together], 3, {5})
  assert log.names == []


def test_a_jobs_first_call_compiles_only_its_own_programs():
  """The runs' data, values and states are stacked on the host or in one program: stacked by jax operations, every
  leaf shape compiled a program of its own (on an accelerator, a compilation each)."""
  base = fused(tiny_simulation("HeteroAvg", "vmap", widths=(1.0, 0.5), hidden=(11,)))  # (shapes no other test has)
  sims = [fused(base, config=dataclasses.replace(base.spec.config, seed=seed)) for seed in (0, 1)]
  states = [s.init_state() for s in sims]
  with CompileLog() as log:
    ManyRuns(sims, mapping="map").run([0, 1], states, 2, set())
  assert set(log.names) <= {"jit(mapped)", "jit(_stack_on_device)", "jit(unstack)"}, log.names


def tiny_config(output_dir, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=6, clients_per_round=3, rounds=4,
               checkpoint_every=2, eval_every=2, progress=False, output_dir=str(output_dir), batch_size=16,
               dissimilarity=False, round_program="fused", rounds_per_call=4, method="FedProx")
  return RunConfig.from_flags(**{**flags, **changes})


# ---------------------------------------------------------------------------------------------- the job


def rows_of(folder) -> list[dict]:
  with open(os.path.join(folder, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in ("round_seconds", "samples_per_s")} for line in f]


def same_rows(have: list[dict], want: list[dict]) -> None:
  for a, b in zip(have, want, strict=True):
    assert (a["round"], a["clients"], a["test_accuracy"]) == (b["round"], b["clients"], b["test_accuracy"])
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)



def test_a_swept_weight_decay_reaches_optax_traced():
  """A job's program makes each run's optimizer from its config with the swept values traced."""
  sgd = LocalConfig(optimizer="sgd")

  def step(decay, params):
    optimizer = make_optimizer(substituted(sgd, {"weight_decay": decay}))  # (as a job's program makes it)
    return optimizer.update({"w": jnp.zeros(2)}, optimizer.init(params), params)[0]

  updates = jax.jit(jax.vmap(step, in_axes=(0, None)))(jnp.asarray([0.3, 0.6]), {"w": jnp.ones(2)})["w"]
  np.testing.assert_allclose(updates, -sgd.learning_rate * np.array([[0.3, 0.3], [0.6, 0.6]]), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.default_emitters
def test_a_job_of_seeds_equals_its_runs_alone_bit_for_bit(tmp_path):
  """On a CPU the runs of a program go one after another (`rounds.many.runs_mapping`), each computing exactly what
  it computes alone: the rows and the final models of ``--seeds 0,1`` are the runs' own, bit for bit."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(tiny_config(tmp_path / "job", method="HeteroAvg", groups=("cnn@0.25", "cnn@0.125"), rounds=2,
                             eval_every=1, checkpoint_every=2), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  for run in runs:
    alone = run.replace(output_dir=run.output.dir + "_alone")
    run_experiment(alone, dataset, log=lambda _: None)
    assert rows_of(run.output.dir) == rows_of(alone.output.dir)
    jax.tree.map(np.testing.assert_array_equal, restore(run, dataset)[0].models, restore(alone, dataset)[0].models)


@pytest.mark.slow
def test_a_swept_moon_temperature_runs_and_changes_the_runs(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", method="MOON", groups=("mlp",), rounds=2, eval_every=1)
  runs = runs_of(config, None, [parse_sweep("method.moon.temperature=0.3,0.7", config)])
  logs = []
  summaries = run_together(runs, dataset, log=logs.append)
  assert any("swept per run: method.moon.temperature" in line for line in logs), logs
  assert [s["final_round"] for s in summaries] == [2, 2]
  assert rows_of(runs[0].output.dir)[-1]["train_loss"] != rows_of(runs[1].output.dir)[-1]["train_loss"]


NUMBERS_OF = {entry.name: [f"method.{leaf.path}" for leaf in declare.leaves(MethodConfig())
                           if isinstance(leaf.setting.check, declare.Number)
                           and type(value_at(MethodConfig(), leaf.path.rsplit(".", 1)[0])) in entry.options]
              for entry in METHODS.values()}
# FedAvg (the client's numbers), and every method with numbers of its own (Hetero* and InCo* read their base's).
PROGRAM_METHODS = [(m, family) for m, family in [(m, "mlp") for m in golden.METHODS] + list(golden.LATER_METHODS)
                   if m == "FedAvg" or (NUMBERS_OF[m] and not m.startswith(("Hetero", "InCo")))]


@pytest.mark.slow
@pytest.mark.parametrize("method, family", PROGRAM_METHODS, ids=[m for m, _ in PROGRAM_METHODS])
def test_every_number_a_method_reads_is_traced_in_its_program(method, family):
  """Every numeric setting `run.jobs.sweep_refusal` lets --sweep take reaches the program as a traced value: the
  client's numbers and every number of the method's option families, all swept at once, trace."""
  base = golden_simulation(method, "vmap" if family == "mlp" else "sequential", family, "fused", rounds_per_call=1)
  options = MethodConfig(fedgen=TINY_FEDGEN) if method == "FedGen" else MethodConfig()
  paths = ["client.learning_rate", "client.momentum", "client.weight_decay"] + NUMBERS_OF[method]
  concrete = {p: float(value_at(options, p.split(".", 1)[1]) if p.startswith("method.") else
                       value_at(base.spec.local, p.split(".", 1)[1])) for p in paths}

  def specialize(spec, traced):
    local = substituted(spec.local, {p.split(".", 1)[1]: v for p, v in traced.items() if p.startswith("client.")})
    run_options = substituted(options, {p.split(".", 1)[1]: v for p, v in traced.items() if p.startswith("method.")})
    return spec.with_values(local=local, method=build_method(method, run_options, local, checked=False))

  batch = ManyRuns([base, base], [concrete, concrete], specialize)
  states = [base.init_state(), base.init_state()]
  calls, statics = batch.plan([0, 1], states, 1, {1})
  values, server, memory, inputs, count, data = batch.arguments([0, 1], [0, 1], calls, states, 1)
  carry, outputs = jax.eval_shape(batch.program(statics), values, server, memory, inputs, count, data)
  assert outputs.loss_sum[0].shape == (2, 1)
  correct, _ = jax.eval_shape(batch._evaluation(2), values, np.int32(1), carry[:2], data)  # (its own program)
  assert correct.shape == (2, len(base.spec.groups))
