"""Cost accounting (`fedjax_hetero.rounds.costs`): parameters, bytes each way and client FLOPs per group and round,
checked against independent counts; the same on both drivers, after a resume and in a job of many runs; and
`compare`'s columns and plot."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fedjax_hetero.analysis import tables
from fedjax_hetero.cli import compare
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.client.terms import ClientTerm, Upload
from fedjax_hetero.config import LocalConfig, RunConfig
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.methods import Method
from fedjax_hetero.models.mlp import MLP
from fedjax_hetero.rounds import costs
from fedjax_hetero.run.jobs import run_together, runs_of
from fedjax_hetero.run.runner import run_experiment
from fedjax_hetero.server import ServerStep, apply_delta, mean_delta
from tests.helpers import simulation, tiny_federation, tiny_resnet, tiny_simulation
from tests.test_custom_method import feddyn
from tests.test_recovery import healthy, healthy_then_diverging  # noqa: F401 (a fixture)


def numpy_bytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(jax.device_get(tree)))


def test_tree_bytes_counts_every_leaf_at_its_dtype():
  tree = {"a": np.zeros((3, 4), ml_dtypes.bfloat16), "b": np.zeros(5, np.int8), "c": [np.zeros((2, 2), np.float32)]}
  assert costs.tree_bytes(tree) == numpy_bytes(tree) == 3 * 4 * 2 + 5 + 16
  assert costs.tree_bytes(jax.eval_shape(lambda: tree)) == numpy_bytes(tree)


@pytest.mark.parametrize("method, models", [
    ("FedAvg", None),  # one federation per group
    ("HeteroAvg", None),  # sub-models of one global model
    ("HeteroFL", [("r1", tiny_resnet()), ("r.5", tiny_resnet(width=0.5))]),  # BatchNorm statistics
])
def test_bytes_are_the_parameter_count_times_the_dtype_size(method, models):
  """Counted with numpy over the initialized variables a group's clients start from: the parameters, the bytes a
  client receives (parameters and statistics), and the bytes it sends (its update: HeteroFL's static BatchNorm
  sends no statistics, only the parameters)."""
  sim = tiny_simulation(method, widths=(1.0, 0.5)) if models is None else simulation(method, models)
  state, static = sim.init_state(), costs.static_costs(sim.spec)
  for g, group in enumerate(sim.spec.groups):
    variables = jax.device_get(sim.spec.start_variables(state, g))
    count = sum(np.size(x) for x in jax.tree.leaves(variables["params"]))
    cost = static[group.name]
    assert cost.parameters == count
    assert cost.bytes_down == numpy_bytes(variables) >= count * 4
    assert cost.bytes_up == count * 4  # float32 parameters
    assert (cost.bytes_down > cost.bytes_up) == (models is not None)


def test_flops_of_a_dense_layer_match_the_hand_count():
  """One Dense layer, ``in`` x ``out``, trained with SGD: the forward matmul is 2 in out FLOPs per example and the
  backward one the same again (the kernel's gradient; the input's is not taken). XLA's count adds the elementwise
  work (normalization, bias, softmax, the SGD update spread over the batch), under 2% at this size."""
  side, out, batch = 32, 256, 256
  model = MLP(num_classes=out, hidden=())
  trainer = LocalTrainer(model, LocalConfig(batch_size=batch, optimizer="sgd", learning_rate=0.1), (0.5,), (0.25,))
  local = jax.eval_shape(trainer.init_state, jax.eval_shape(model.init, jax.random.key(0),
                                                            jnp.zeros((1, side, side, 1))))
  per_example = costs.step_flops(trainer, local, (side, side, 1), jnp.uint8, jnp.int32, batch) / batch
  matmuls = 2 * (2 * side * side * out)
  assert matmuls <= per_example <= 1.02 * matmuls


def label_counts(num_classes: int = 4) -> Method:
  """A method declared here: FedAvg whose clients also upload how many examples of each class they trained on."""
  seen = ClientTerm("label_counts", init=lambda r: jnp.zeros(num_classes),
                    update=lambda counts, outputs, ctx: counts + ctx.batch.weights @ jax.nn.one_hot(ctx.batch.labels,
                                                                                                    num_classes),
                    upload=Upload(lambda counts, final, memory, share: counts, "sum"))
  read = ServerStep("read_counts", lambda carry, state, inputs, plan: (carry, state), reads=(seen,))
  return Method("LabelCounts", "tests", "FedAvg + label counts", terms=(seen,), server=(mean_delta(), read,
                                                                                         apply_delta()))


def test_client_terms_uploads_and_shares_are_counted():
  """SCAFFOLD's clients receive the control variate beside the model and send its change beside the update;
  FedImpro's statistics go both ways; methods declared outside the library are counted with no code of their own
  (FedDyn's upload, the change of the parameters, is the update: the server has it already); FedCross's uploaded
  model is what the server rebuilds from the update and the model it sent, so it is not counted again."""
  exchanged = {}
  for method in ("FedAvg", "SCAFFOLD", "FedImpro", feddyn(), label_counts(), "FedCross"):
    static = costs.static_costs(tiny_simulation(method, widths=(1.0,)).spec)["mlp@1.0"]
    exchanged[getattr(method, "name", method)] = (static.bytes_down, static.bytes_up, static.derived_uploads)
  model = exchanged["FedAvg"][0]
  assert exchanged["FedAvg"] == (model, model, ())
  assert exchanged["SCAFFOLD"] == (2 * model, 2 * model, ())
  down, up, _ = exchanged["FedImpro"]
  assert down > model and up > model
  assert exchanged["FedDyn"] == (model, model, ("dynamic",))
  assert exchanged["LabelCounts"] == (model, model + 4 * 4, ())  # 4 float32 counts
  assert exchanged["FedCross"] == (model, model, ("cross",))


def test_an_upload_is_rebuilt_from_the_leaves_no_term_changes_in_the_update():
  """FedFA's scaled kernels read only the parameters, which static BatchNorm leaves as the client computed them (it
  sends zeros for the statistics): they are rebuilt, and FedFA sends what HeteroFL sends. An upload of the
  parameters beside a term that halves every leaf of the update cannot be rebuilt, and counts."""
  def static(method, **options):
    models = [(f"resnet@{w}", tiny_resnet((1,), width=w)) for w in (1.0, 0.5)]
    sim = simulation(method, models, tiny_federation(4, 48, 8, "iid"), LocalConfig(batch_size=16), "sequential",
                     options, clients_per_round=4)
    return costs.static_costs(sim.spec)["resnet@1.0"]

  fedfa, heterofl, plain = static("FedFA", fedfa_static_bn=True), static("HeteroFL"), static("FedFA")
  assert fedfa.bytes_up == heterofl.bytes_up < plain.bytes_up == plain.bytes_down
  assert fedfa.derived_uploads == plain.derived_uploads != ()

  halve = ClientTerm("halve", delta=lambda state, final, memory, share: jax.tree.map(lambda d: d / 2, final.delta))
  params = ClientTerm("params", upload=Upload(lambda state, final, memory, share: final.variables["params"]))
  read = ServerStep("read_params", lambda carry, state, inputs, plan: (carry, state), reads=(params,))
  method = Method("HalvedWithParams", "tests", "", terms=(params, halve), server=(mean_delta(), read, apply_delta()))
  halved = costs.static_costs(tiny_simulation(method, widths=(1.0,)).spec)["mlp@1.0"]
  assert halved.derived_uploads == () and halved.bytes_up == 2 * halved.bytes_down
  alone = Method("WithParams", "tests", "", terms=(params,), server=(mean_delta(), read, apply_delta()))
  whole = costs.static_costs(tiny_simulation(alone, widths=(1.0,)).spec)["mlp@1.0"]
  assert whole.derived_uploads == ("params",) and whole.bytes_up == whole.bytes_down


def test_a_rounds_costs_are_its_clients_times_the_static_costs_and_carry_on():
  static = {"a": costs.GroupCost(10, 40, 48, 2.5), "b": costs.GroupCost(5, 20, 20, 1.25)}
  row = {"round": 2, "clients_per_group": {"a": 2, "b": 0}, "examples_per_group": {"a": 30, "b": 0}}
  before = {"costs": {"cumulative": {"bytes_down": 1, "bytes_up": 2, "client_flops": 3, "bytes": 3}}}
  costed = costs.costed_row(row, static, before)["costs"]
  assert costed == {"bytes_down": 80, "bytes_up": 96, "client_flops": 75,
                    "per_group": {"a": {"bytes_down": 80, "bytes_up": 96, "client_flops": 75}},
                    "cumulative": {"bytes_down": 81, "bytes_up": 98, "client_flops": 78, "bytes": 179}}
  assert costs.costed_row(row, static, None)["costs"]["cumulative"]["bytes"] == 176
  assert costs.costed_row(row, static, {"round": 1})["costs"]["cumulative"] is None  # a folder from before costs


# ------------------------------------------------------------------------------------------------- whole runs


def run_config(output_dir, **changes) -> RunConfig:
  flags = dict(dataset="synthetic", groups=("mlp@1", "mlp@0.5"), num_clients=6, clients_per_round=3, rounds=4,
               checkpoint_every=2, eval_every=2, progress=False, output_dir=str(output_dir), batch_size=16,
               steps_per_call=1, dissimilarity=False, method="HeteroAvg")
  return RunConfig.from_flags(**{**flags, **changes})


def costs_of(folder) -> tuple[list[dict], dict]:
  with open(os.path.join(folder, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  with open(os.path.join(folder, "summary.json")) as f:
    summary = json.load(f)
  return rows, summary["costs"]


@pytest.fixture(scope="module")
def dataset():
  return synthetic_dataset(num_train=240, num_test=64, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("round_program", ["host", "fused"])
def test_a_runs_costs_are_its_cohorts_and_a_resume_continues_them_bit_for_bit(dataset, tmp_path, round_program):
  straight = run_config(tmp_path / "straight", round_program=round_program)
  run_experiment(straight, dataset, log=lambda _: None)
  resumed = run_config(tmp_path / "resumed", round_program=round_program, rounds=2)
  run_experiment(resumed, dataset, log=lambda _: None)
  run_experiment(resumed.replace(rounds=4, resume=True), dataset, log=lambda _: None)
  rows, summary = costs_of(straight.output.dir)
  assert [r["costs"] for r in rows] == [r["costs"] for r in costs_of(resumed.output.dir)[0]]
  assert summary == costs_of(resumed.output.dir)[1]
  total = dict.fromkeys(("bytes_down", "bytes_up", "client_flops"), 0)
  for row in rows:  # every round: its groups' clients times the static costs, its examples times the FLOPs
    for name, group in summary["per_group"].items():
      clients, examples = row["clients_per_group"][name], row["examples_per_group"][name]
      assert row["costs"]["per_group"].get(name, {}).get("bytes_up", 0) == clients * group["bytes_up"]
      assert row["costs"]["per_group"].get(name, {}).get("client_flops", 0) == round(
          examples * group["train_flops_per_example"])
    assert sum(row["clients_per_group"].values()) == len(row["clients"])
    total = {k: v + row["costs"][k] for k, v in total.items()}
    assert row["costs"]["cumulative"] == {**total, "bytes": total["bytes_down"] + total["bytes_up"]}
  assert summary["cumulative"] == rows[-1]["costs"]["cumulative"]
  assert summary["per_group"]["mlp@1"]["bytes_down"] == 4 * summary["per_group"]["mlp@1"]["parameters"]


@pytest.mark.slow
def test_the_runs_of_a_job_have_the_costs_of_the_runs_alone_on_both_drivers(dataset, tmp_path):
  runs = runs_of(run_config(tmp_path / "job", round_program="fused", rounds_per_call=4, rounds=2), [0, 1])
  run_together(runs, dataset, log=lambda _: None)
  host = run_config(tmp_path / "alone", round_program="host", rounds=2, seed=1)
  run_experiment(host, dataset, log=lambda _: None)
  (job_rows, job_summary), (rows, summary) = costs_of(runs[1].output.dir), costs_of(host.output.dir)
  assert [r["costs"] for r in job_rows] == [r["costs"] for r in rows] and job_summary == summary
  assert costs_of(runs[0].output.dir)[1]["per_group"] == summary["per_group"]


@pytest.mark.slow
def test_a_rollback_carries_the_totals_of_the_rounds_it_keeps(dataset, healthy, tmp_path):  # noqa: F811
  """The diverged rounds' costs leave with their rows: the totals go on from the round rolled back to."""
  out = tmp_path / "rollback"
  diverging, _ = healthy_then_diverging(out, healthy, on_divergence="rollback", divergence_rollback_lr_factor=1e-9)
  assert run_experiment(diverging, dataset, log=lambda _: None)["rollbacks"]
  rows, summary = costs_of(out)
  total = dict.fromkeys(("bytes_down", "bytes_up", "client_flops"), 0)
  for row in rows:
    total = {k: v + row["costs"][k] for k, v in total.items()}
    assert row["costs"]["cumulative"] == {**total, "bytes": total["bytes_down"] + total["bytes_up"]}
  assert summary["cumulative"] == rows[-1]["costs"]["cumulative"]


def fake_costed_run(method, bytes_per_round, accuracies):
  rows = []
  for r, accuracy in enumerate(accuracies, start=1):
    spent = {"bytes_down": r * bytes_per_round, "bytes_up": r * bytes_per_round, "client_flops": r * 10**9}
    rows.append({"round": r, "round_seconds": 1.0, "test_accuracy": {"mean": accuracy},
                 "costs": {"cumulative": {**spent, "bytes": 2 * r * bytes_per_round}}})
  return method, {"method": method, "config": {"federation": {"seed": 0}}}, rows


def test_compare_shows_each_runs_costs_beside_its_accuracy_and_plots_accuracy_against_them(tmp_path):
  runs = [fake_costed_run("FedAvg", 1_500_000, [0.5, 0.6]), fake_costed_run("SCAFFOLD", 3_000_000, [0.55, 0.62])]
  lines = tables.table(runs, last=2).splitlines()
  assert "| bytes down + up | client FLOPs |" in lines[0] and lines[1].count("---") == lines[0].count(" | ") + 1
  assert lines[2].endswith("| 55.00 | 6 MB | 2 GFLOP | 1.0 | 1.0 |") and "| 12 MB | 2 GFLOP |" in lines[3]
  dirs = []
  for label, summary, rows in runs + [("old", {"method": "old", "config": {"federation": {"seed": 1}}},
                                       [{"round": 1, "round_seconds": 1.0, "test_accuracy": {"mean": 0.5}}])]:
    (tmp_path / label).mkdir()
    (tmp_path / label / "summary.json").write_text(json.dumps(summary))
    (tmp_path / label / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dirs.append(str(tmp_path / label))
  plot = str(tmp_path / "costs.png")
  text = compare.main(dirs + ["--cost-output", plot, "--up-to-round", "1"])
  assert os.path.getsize(plot) > 1000 and "| 3 MB | 1 GFLOP |" in text and "| - | - |" in text  # (old: none)
  with pytest.raises(SystemExit, match="error: --cost-output: none of the runs logged costs"):
    compare.main(dirs[2:] + ["--cost-output", plot])
