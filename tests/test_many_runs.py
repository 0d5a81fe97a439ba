"""Many runs in one program (`fedjax_hetero.rounds.many`, `fedjax_hetero.run.jobs`): run r of a batched job equals
the same run alone on the golden setting, and the runs' folders are the folders they would write alone (and resume
and compare). What cannot be swept is refused before any compute: tests/test_many_runs_refusals.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal

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
from fedjax_hetero.run.interruption import Interrupted
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


@pytest.mark.slow
def test_a_batched_job_writes_resumes_and_compares_as_its_runs_alone(tmp_path):
  from fedjax_hetero.cli import compare
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", groups=("mlp",), rounds=2)  # (one group: see `seeds_job`)
  runs = runs_of(config, [0, 1], [("client.learning_rate", (1e-3, 3e-3))])
  run_together(runs, dataset, log=lambda _: None, max_runs_per_program=2)  # two chunks of 2
  logs = []
  resumed = [r.replace(rounds=4, resume=True) for r in runs]
  summaries = run_together(resumed, dataset, log=logs.append, max_runs_per_program=2)  # (the same program)
  assert any("4 runs, at most 2 per program, swept per run: client.learning_rate" in line for line in logs), logs
  assert [s["final_round"] for s in summaries] == [4] * 4
  alone = resumed[3].replace(output_dir=str(tmp_path / "alone"), resume=False)  # lr 3e-3, seed 1
  run_experiment(alone, dataset, log=lambda _: None)
  same_rows(rows_of(resumed[3].output.dir), rows_of(alone.output.dir))
  table = compare.main([r.output.dir for r in resumed])  # reads the folders as they are
  assert all(os.path.basename(r.output.dir) in table for r in resumed), table


# ------------------------------------------------------------------------------- a run of the job goes wrong


def summary_of(folder) -> dict:
  with open(os.path.join(folder, "summary.json")) as f:
    return json.load(f)


@pytest.mark.slow
def test_a_run_that_diverges_in_a_job_rolls_back_as_it_would_alone_and_the_others_go_on(tmp_path):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", groups=("mlp",), rounds=2, eval_every=1,  # (one group: see `seeds_job`)
                       checkpoint_every=1)
  runs = runs_of(config, None, [("client.learning_rate", (1e-3, 2e-3))])
  run_together(runs, dataset, log=lambda _: None)
  shutil.copytree(runs[1].output.dir, tmp_path / "alone")
  guard = dict(rounds=4, resume=True, on_divergence="rollback", divergence_rollback_lr_factor=1e-9)
  resumed = [runs[0].replace(**guard), runs[1].replace(**guard, learning_rate=1e6)]  # run 1 diverges in round 3
  logs = []
  summaries = run_together(resumed, dataset, log=logs.append)
  assert [s["final_round"] for s in summaries] == [4, 4]
  assert summaries[0]["rollbacks"] == [], "the healthy run goes on"
  [rollback] = summaries[1]["rollbacks"]
  assert rollback["diverged_round"] == 3 and rollback["learning_rate"] == [1e6, pytest.approx(1e-3)]
  assert not any("continues alone" in line for line in logs), "the rolled-back run stays in the program"
  alone = resumed[1].replace(output_dir=str(tmp_path / "alone"))
  summary = run_experiment(alone, dataset, log=lambda _: None)
  assert [(r["diverged_round"], r["to_round"]) for r in summary["rollbacks"]] == [(3, rollback["to_round"])]
  same_rows(rows_of(resumed[1].output.dir), rows_of(alone.output.dir))


def seeds_job(output_dir, **changes) -> list[RunConfig]:
  """The runs of ``--seeds 0,1`` over 3 rounds, a call and an evaluation per round (one group: what the tests below
  check of a job does not depend on its groups, and one group compiles fewer programs)."""
  config = tiny_config(output_dir, groups=("mlp",), rounds=3, rounds_per_call=1, eval_every=1, **changes)
  return runs_of(config, [0, 1])


@pytest.fixture(scope="module")
def straight_seeds_job(tmp_path_factory) -> list[list[dict]]:
  """The rows of `seeds_job`'s runs trained uninterrupted, once for the tests that stop and resume it."""
  runs = seeds_job(tmp_path_factory.mktemp("straight") / "job")
  run_together(runs, synthetic_dataset(num_train=240, num_test=64, seed=0), log=lambda _: None)
  return [rows_of(run.output.dir) for run in runs]


@pytest.mark.slow
def test_ctrl_c_in_a_job_stops_every_run_after_the_call_and_resume_reaches_the_uninterrupted_rows(
    tmp_path, monkeypatch, straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job")
  train_one_call = ManyRuns.run

  def ctrl_c_after_the_first_call(self, *args, **kwargs):
    results = train_one_call(self, *args, **kwargs)
    signal.raise_signal(signal.SIGINT)  # what the terminal sends the process on Ctrl-C
    return results

  monkeypatch.setattr(ManyRuns, "run", ctrl_c_after_the_first_call)
  logs = []
  with pytest.raises(Interrupted) as info:
    run_together(runs, dataset, log=logs.append)
  monkeypatch.undo()
  assert info.value.completed_round == 1 and info.value.exit_status == 130
  assert "SIGINT: stopping after round 1 (Ctrl-C again to stop at once)" in logs, logs
  for run in runs:
    assert summary_of(run.output.dir)["interrupted"] == {"signal": "SIGINT", "completed_round": 1}
    assert [r["round"] for r in rows_of(run.output.dir)] == [1]
  summaries = run_together([r.replace(resume=True) for r in runs], dataset, log=lambda _: None)
  assert [s["final_round"] for s in summaries] == [3, 3]
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_ctrl_c_while_a_jobs_program_compiles_stops_its_runs_before_the_call(tmp_path, monkeypatch,
                                                                              straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job")
  compiled, sent = ManyRuns._compiled, []

  def ctrl_c_while_compiling(self, *args, **kwargs):
    if not sent:
      sent.append(signal.raise_signal(signal.SIGINT))  # (its handler records it; the call sees it once compiled)
    return compiled(self, *args, **kwargs)

  monkeypatch.setattr(ManyRuns, "_compiled", ctrl_c_while_compiling)
  with pytest.raises(Interrupted) as info:
    run_together(runs, dataset, log=lambda _: None)
  monkeypatch.undo()
  assert info.value.completed_round == 0
  for run in runs:
    assert summary_of(run.output.dir)["interrupted"] == {"signal": "SIGINT", "completed_round": 0}
    assert rows_of(run.output.dir) == []
  run_together([r.replace(resume=True) for r in runs], dataset, log=lambda _: None)
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_stop_after_ends_every_run_of_a_job_at_the_call_and_resume_reaches_the_uninterrupted_rows(
    tmp_path, straight_seeds_job):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = seeds_job(tmp_path / "job", stop_after=1e-6)
  summaries = run_together(runs, dataset, log=lambda _: None)
  assert [s["stopped_after"] for s in summaries] == [{"seconds": 1e-6, "completed_round": 1}] * 2
  for run in runs:
    assert [r["round"] for r in rows_of(run.output.dir)] == [1]
  summaries = run_together([r.replace(resume=True, stop_after=None) for r in runs], dataset, log=lambda _: None)
  assert [s["final_round"] for s in summaries] == [3, 3]
  for run, want in zip(runs, straight_seeds_job, strict=True):
    same_rows(rows_of(run.output.dir), want)


@pytest.mark.slow
def test_a_job_cuts_its_calls_where_a_server_step_changes_stage_as_a_run_alone_does(tmp_path):
  """FedCross's warmup ends after round 1: one call of three rounds would train rounds 2 and 3 as warmup."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  config = tiny_config(tmp_path / "job", method="FedCross", groups=("mlp",), rounds=3, eval_every=1,
                       checkpoint_every=3, fedcross_warmup_rounds=1)
  runs = runs_of(config, [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  alone = runs[1].replace(output_dir=str(tmp_path / "alone"))
  run_experiment(alone, dataset, log=lambda _: None)
  same_rows(rows_of(runs[1].output.dir), rows_of(alone.output.dir))


@pytest.mark.slow
def test_fedgen_runs_of_a_job_read_their_own_partitions_label_counts(tmp_path):
  """FedGen's generator and its clients' label priors come from the run's partition (seeds split differently)."""
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  runs = runs_of(tiny_config(tmp_path / "job", method="FedGen", groups=("mlp",), rounds=1, eval_every=1,
                             fedgen_noise_dim=4, fedgen_hidden_dim=16, fedgen_ensemble_epochs=2,
                             fedgen_n_teacher_iters=1, fedgen_gen_batch_size=8), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  alone = runs[1].replace(output_dir=str(tmp_path / "alone"))
  run_experiment(alone, dataset, log=lambda _: None)
  have, want = rows_of(runs[1].output.dir), rows_of(alone.output.dir)
  same_rows(have, want)
  for a, b in zip(have, want):
    for name, losses in b["fedgen_generator"].items():  # (per federation: the generator's losses)
      assert a["fedgen_generator"][name] == pytest.approx(losses, rel=1e-5), (a["round"], name)


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


def test_an_error_about_one_run_of_a_job_names_that_run(tmp_path, capsys):
  """(Second held-out survey: a job's divergence or partition error did not say which run it was about.)"""
  from fedjax_hetero.cli import run as cli
  out = str(tmp_path / "job")
  with pytest.raises(SystemExit):
    cli.main("synthetic", ["--groups", "mlp", "--num-clients", "8", "--clients-per-round", "2", "--rounds", "2",
                           "--no-progress", "--output-dir", out, "--seeds", "0,2", "--alpha", "0.1",
                           "--client-eval-fraction", "0.92", "--batch-size", "4"])
  assert capsys.readouterr().err.startswith(f"error: {out}_s2: --client-eval-fraction 0.92: client 4 holds 10 ")


def test_a_run_the_guard_stops_in_a_job_of_runs_one_after_another_leaves_the_others_to_run(tmp_path, capsys):
  """(Fourth probe survey: the first run's divergence ended a job of --sweep runs on the host loop; its later runs
  never started, where runs in one program finish.) The job still ends as the stopped run alone would."""
  from fedjax_hetero.cli import run as cli
  out = str(tmp_path / "job")
  with pytest.raises(SystemExit) as stopped:
    cli.main("synthetic", ["--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2",
                           "--no-progress", "--output-dir", out, "--round-program", "host", "--optimizer", "sgd",
                           "--sweep", "client.learning_rate=1e6,0.01"])
  assert stopped.value.code == 2
  captured = capsys.readouterr()
  assert captured.err.startswith(f"error: {out}_client.learning_rate=1e+06: round 1: ")
  assert "the job goes on with its other runs" in captured.out
  with open(f"{out}_client.learning_rate=0.01/summary.json") as f:
    summary = json.load(f)
  assert summary["final_round"] == 2 and summary["stopped_by_divergence"] is None
