"""Tests of ``python -m experiments.analyze`` on tiny real results folders."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fedjax_hetero import analysis
from fedjax_hetero.cli import analyze
from fedjax_hetero.config import RunConfig, as_dict
from fedjax_hetero.models import build_model, evaluation
from fedjax_hetero.models.evaluation import batch_norm_keep, zero_start_statistics
from fedjax_hetero.run.runner import run_experiment

# One worker runs the module, so its two module-scoped runs train once (under xdist each worker would train its own).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("analyze")]

TINY = dict(dataset="synthetic", steps_per_call=1, num_clients=4, clients_per_round=2, rounds=2,
            max_train_samples=128, max_test_samples=64, progress=False, dissimilarity=False)


def quiet(_):
  pass


def is_png(path) -> bool:
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def inco_run(tmp_path_factory):
  """(run_dir, config) of a 2-round InCoAvg run of ResNet10/ResNet14 (4 cross-layer pairs)."""
  config = RunConfig.from_flags(method="InCoAvg", groups=("resnet10@0.125", "resnet14@0.125"),
                                output_dir=str(tmp_path_factory.mktemp("inco")), **TINY)
  run_experiment(config, log=quiet)
  return config.output.dir, config


@pytest.fixture(scope="module")
def fedcross_run(tmp_path_factory):
  config = RunConfig.from_flags(method="FedCross", groups=("mlp",),
                                output_dir=str(tmp_path_factory.mktemp("fedcross")), **TINY)
  run_experiment(config, log=quiet)
  return config.output.dir, config


@pytest.fixture(scope="module")
def heterofl_run(tmp_path_factory):
  """(run_dir, config) of a 2-round HeteroFL run of two ResNet10 widths: static BatchNorm (statistics re-estimated
  for each evaluation, never kept in training) and the Scaler."""
  config = RunConfig.from_flags(method="HeteroFL", groups=("resnet10@0.125", "resnet10@0.0625"),
                                output_dir=str(tmp_path_factory.mktemp("heterofl")), **TINY)
  run_experiment(config, log=quiet)
  return config.output.dir, config


def last_accuracies(run_dir) -> dict:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f][-1]["test_accuracy"]


def recording(seen):
  """`plot_update_histograms` that also keeps its deltas in `seen`."""
  plot = analysis.plot_update_histograms

  def record(deltas_by_round, path, **kwargs):
    seen.update(deltas_by_round)
    return plot(deltas_by_round, path, **kwargs)

  return record


def snapshot(run_dir):
  """metrics.jsonl, summary.json and the checkpoint files with their sizes and mtimes."""
  files = {}
  for root, _, names in os.walk(run_dir):
    for name in names:
      path = os.path.join(root, name)
      if path.endswith(".png"):
        continue
      stat = os.stat(path)
      files[os.path.relpath(path, run_dir)] = (stat.st_size, stat.st_mtime_ns)
  return files


def test_read_config_round_trips(inco_run):
  run_dir, config = inco_run
  got = analyze.read_config(run_dir)
  assert got == config.replace(overwrite=False, resume=False)
  assert isinstance(got.groups, tuple)


@pytest.mark.parametrize("layout", ["tree", "flat"])  # this version's config.json / older versions' flat one
@pytest.mark.parametrize("saved_in", ["config.json", "summary.json"])  # a run in progress / an older run
def test_read_config_ignores_unknown_fields_and_takes_data_dir(tmp_path, capsys, saved_in, layout):
  config = RunConfig.from_flags(groups=("cnn@1", "cnn@0.5"), learning_rate=0.01)
  saved = dict(as_dict(config) if layout == "tree" else config.flags(), from_the_future=1)
  with open(tmp_path / saved_in, "w") as f:
    json.dump(saved if saved_in == "config.json" else {"config": saved}, f)
  got = analyze.read_config(str(tmp_path), data_dir="/data")
  assert got.groups == ("cnn@1", "cnn@0.5") and got.client.learning_rate == 0.01
  assert got.data.data_dir == "/data" and got.output.dir == str(tmp_path)
  assert "from_the_future" in capsys.readouterr().err


def test_cka(inco_run, capsys):
  run_dir, _ = inco_run
  written = analyze.main(["cka", run_dir, "--num-examples", "32"])
  assert written == [os.path.join(run_dir, "cka.png"), os.path.join(run_dir, "cka.json")]
  assert capsys.readouterr().out.split() == written
  assert is_png(written[0])
  with open(written[1]) as f:
    record = json.load(f)
  assert record["groups"] == ["resnet10@0.125", "resnet14@0.125"]
  assert record["method"] == "InCoAvg" and record["round"] == 2 and record["num_examples"] == 32
  assert list(record["cuts"]) == ["stem", "stage1", "stage2", "stage3", "stage4", "features"]
  for cut, entry in record["cuts"].items():
    matrix = np.asarray(entry["matrix"])
    chex.assert_shape(matrix, (2, 2))
    chex.assert_trees_all_close(np.diag(matrix), np.ones(2), atol=1e-5)
    chex.assert_trees_all_close(matrix, matrix.T, atol=1e-6)
    assert np.all((matrix >= 0) & (matrix <= 1 + 1e-6)), cut
    assert entry["layer_similarity"] == pytest.approx(matrix[0, 1])


def test_a_run_analyzed_on_other_data_than_its_own_is_warned_of(fedcross_run, tmp_path, capsys):
  """(A probe survey: a folder whose --max-test-samples subset was drawn the old way was analyzed on the new one
  without a word.)"""
  run_dir = str(tmp_path / "copy")
  shutil.copytree(fedcross_run[0], run_dir)
  analyze.load_run(run_dir)
  assert "warning" not in capsys.readouterr().err
  path = os.path.join(run_dir, "data_fingerprint.json")
  with open(path) as f:
    recorded = json.load(f)
  with open(path, "w") as f:
    json.dump({**recorded, "test_labels": {**recorded["test_labels"], "blake2b": "0" * 32}}, f)
  analyze.load_run(run_dir)
  err = capsys.readouterr().err
  assert f"warning: {run_dir}: the data differ from those its run trained and evaluated on (test_labels" in err, err
  with open(path, "w") as f:
    f.write("{half")
  analyze.load_run(run_dir)
  assert f"warning: {run_dir}: the data cannot be checked against the run's ({path} is not valid JSON" in \
      capsys.readouterr().err


def test_recalibrate_bn(inco_run, capsys):
  run_dir, _ = inco_run
  before = snapshot(run_dir)
  written = analyze.main(["recalibrate-bn", run_dir, "--num-examples", "40", "--batch-size", "16"])
  assert written == [os.path.join(run_dir, "recalibrated_bn.json")]
  assert capsys.readouterr().out.split() == written
  with open(written[0]) as f:
    record = json.load(f)
  assert record["method"] == "InCoAvg" and record["round"] == 2 and record["num_examples"] == 40
  assert list(record["groups"]) == ["resnet10@0.125", "resnet14@0.125"]
  run = analyze.load_run(run_dir)
  stored = [evaluation.accuracy(g.model, run.sim.spec.group_variables(run.state, i), run.sim.spec.test_images,
                                run.sim.spec.test_labels, run.sim.spec.store.mean, run.sim.spec.store.std)
            for i, g in enumerate(run.sim.spec.groups)]
  assert [g["stored"] for g in record["groups"].values()] == pytest.approx(stored)
  for key in ("stored", "recalibrated"):
    assert record["mean"][key] == pytest.approx(np.mean([g[key] for g in record["groups"].values()]))
    assert all(0 <= g[key] <= 1 for g in record["groups"].values())
  after = snapshot(run_dir)
  assert {k: v for k, v in after.items() if k != "recalibrated_bn.json"} == before


def test_analyses_of_a_static_batch_norm_run_read_the_model_it_evaluated(heterofl_run, tmp_path):
  """(Fifth probe survey: recalibrate-bn and landscape read HeteroFL's initial statistics, never kept in training,
  and re-estimated them with the Scaler on: a narrow group's accuracy fell to chance.)"""
  run_dir, config = heterofl_run
  reported = last_accuracies(run_dir)
  analyze.main(["recalibrate-bn", run_dir, "--num-examples", "128", "--batch-size", "32"])
  with open(os.path.join(run_dir, "recalibrated_bn.json")) as f:
    record = json.load(f)
  assert {name: g["stored"] for name, g in record["groups"].items()} == pytest.approx(
      {name: reported[name] for name in config.groups})
  for i, name in enumerate(config.groups):
    out = str(tmp_path / f"group{i}.png")
    analyze.main(["landscape", run_dir, "--group", str(i), "--grid", "3", "--num-examples", "64", "--output", out])
    with np.load(out.replace(".png", ".npz")) as npz:
      assert npz["accuracy"][0, 1, 1] == pytest.approx(reported[name])  # (the grid's centre: the model itself)


def test_statistics_are_re_estimated_with_the_scaler_off():
  model = build_model("resnet10", 10, 0.5).clone(scaler=True, scaler_of=1.0)  # (a Scaler rate of 0.5)
  x = jax.random.normal(jax.random.key(0), (8, 28, 28, 1))
  variables = model.init(jax.random.key(1), x)
  got = analysis.recalibrate_batch_stats(model, variables, [x])["batch_stats"]
  plain = model.clone(scaler=False)
  want = zero_start_statistics(plain, variables, x, batch_norm_keep(plain, variables, x))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  scaled = zero_start_statistics(model, variables, x, batch_norm_keep(model, variables, x))
  assert not np.allclose(jnp.ravel(scaled["stem_bn"]["mean"]), jnp.ravel(want["stem_bn"]["mean"]))


def test_recalibrate_bn_needs_batch_norm(fedcross_run):
  with pytest.raises(SystemExit, match="no BatchNorm"):
    analyze.main(["recalibrate-bn", fedcross_run[0]])


def test_landscape(inco_run, fedcross_run, tmp_path):
  (inco_dir, _), (fedcross_dir, _) = inco_run, fedcross_run
  written = analyze.main(["landscape", inco_dir, fedcross_dir, "--grid", "3", "--span", "0.5",
                          "--num-examples", "16"])
  assert written == [os.path.join(inco_dir, "loss_landscape.png"), os.path.join(inco_dir, "loss_landscape.npz")]
  assert is_png(written[0])
  with np.load(written[1]) as npz:
    assert npz["names"].tolist() == ["InCoAvg", "FedCross"]
    assert npz["groups"].tolist() == ["resnet10@0.125", "mlp"]
    chex.assert_trees_all_close(npz["alphas"], np.array([-0.5, 0.0, 0.5]))
    chex.assert_trees_all_close(npz["betas"], npz["alphas"])
    chex.assert_shape([npz["loss"], npz["accuracy"]], (2, 3, 3))
    chex.assert_tree_all_finite(npz["loss"])
    assert np.all(npz["loss"] > 0)
    assert np.all((npz["accuracy"] >= 0) & (npz["accuracy"] <= 1))
    assert npz["num_examples"].tolist() == [16, 16]
    fedcross_loss = npz["loss"][1]
  # --output elsewhere; the same seed gives the same directions, hence the same surface.
  out = str(tmp_path / "figs" / "fc.png")
  assert analyze.main(["landscape", fedcross_dir, "--grid", "3", "--span", "0.5", "--num-examples", "16",
                       "--output", out]) == [out, str(tmp_path / "figs" / "fc.npz")]
  with np.load(str(tmp_path / "figs" / "fc.npz")) as npz:
    chex.assert_trees_all_close(npz["loss"][0], fedcross_loss, rtol=1e-5)


def test_landscape_names_duplicate_methods_by_folder():
  assert analyze._unique_names(["FedAvg", "FedCross", "FedAvg"], ["runs/a", "runs/b", "runs/c/"]) == [
      "FedAvg (a)", "FedCross", "FedAvg (c)"]


def test_histogram_layers_are_the_inco_pairs(inco_run):
  run = analyze.load_run(inco_run[0])
  layers = analyze.tracked_layers(run.sim.spec, run.state)
  # ResNet14's pairs: stage3/4 block1 conv1, conv2 <- the stage's block0 conv2.
  expected = [(("params", f"stage{s}_block{b}", c, "kernel"), role) for s in (3, 4)
              for b, c, role in ((0, "conv2", "source"), (1, "conv1", "target"), (1, "conv2", "target"))]
  assert [path for path, _ in layers] == [path for path, _ in expected]
  assert [label for _, label in layers] == [f"{'/'.join(path)} ({role})" for path, role in expected]


def test_histograms_continue_the_run_in_memory(fedcross_run, monkeypatch):
  run_dir, _ = fedcross_run
  before = snapshot(run_dir)
  seen = {}
  monkeypatch.setattr(analysis, "plot_update_histograms", recording(seen))
  written = analyze.main(["histograms", run_dir, "--rounds", "2", "--layers", "2"])
  assert written == [os.path.join(run_dir, "update_histograms.png")]
  assert is_png(written[0])
  assert snapshot(run_dir) == before  # no checkpoint or metrics row added
  assert list(seen) == [3, 4]
  run = analyze.load_run(run_dir)
  global_model = traverse_util.flatten_dict(run.sim.spec.server_variables(run.state))
  kernels = [path for path, leaf in global_model.items() if leaf.ndim == 2]  # the dense kernels, not the biases
  for layers in seen.values():
    assert list(layers) == ["/".join(p) for p in kernels[:2]]
    for path, delta in zip(kernels, layers.values()):
      chex.assert_shape(delta, global_model[path].shape)
      chex.assert_tree_all_finite(delta)
      assert np.any(delta != 0)


def test_tracking(inco_run, fedcross_run):
  (inco_dir, _), (fedcross_dir, _) = inco_run, fedcross_run
  assert analyze.main(["tracking", inco_dir]) == [os.path.join(inco_dir, "inco_tracking.png")]
  assert analyze.main(["tracking", fedcross_dir]) == [os.path.join(fedcross_dir, "similarity_tracking.png")]
  assert is_png(os.path.join(inco_dir, "inco_tracking.png"))
  assert is_png(os.path.join(fedcross_dir, "similarity_tracking.png"))


def test_tracking_without_records_is_an_error(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"round": 1, "train_loss": 1.0}) + "\n")
  with pytest.raises(SystemExit, match=r"error: .*metrics.jsonl has no 'inco' \(InCo methods\) or "
                     r"'middleware_similarity'"):
    analyze.main(["tracking", str(tmp_path)])


def test_plot_inco_tracking_with_gaps(tmp_path):
  rows = [{"round": 1, "inco": {"params/a/kernel": {"theta": 0.5, "frac_b_positive": 0.25, "covered": 1.0}}},
          {"round": 2},
          {"round": 3, "inco": {"params/a/kernel": {"theta": None, "frac_b_positive": None, "covered": None},
                                "params/b/kernel": {"theta": 1.0, "frac_b_positive": 0.5, "covered": 0.5}}}]
  path = str(tmp_path / "t.png")
  assert analysis.plot_inco_tracking(rows, path) == path
  assert is_png(path)


def test_bubbles(inco_run, capsys):
  run_dir, _ = inco_run
  assert analyze.main(["bubbles", run_dir, "--clients", "3"]) == [os.path.join(run_dir, "client_bubbles.png")]
  assert is_png(os.path.join(run_dir, "client_bubbles.png"))
  assert "differs" not in capsys.readouterr().err  # the rebuilt partition is the run's (partition.txt)


def test_errors(inco_run, fedcross_run, tmp_path):
  with pytest.raises(SystemExit, match=r"error: .*has no config.json or summary.json"):
    analyze.main(["cka", str(tmp_path)])
  moved = tmp_path / "moved"  # (held-out probe 54: a bare "[Errno 2] No such file or directory")
  moved.mkdir()
  config = RunConfig.from_flags(dataset="synthetic", groups=("mlp",), partition_file=str(tmp_path / "gone.json"))
  (moved / "config.json").write_text(json.dumps(as_dict(config)))
  with pytest.raises(SystemExit, match=r"error: .*moved: its run read its clients from '.*gone.json' \(data."
                                       r"partition_file in its config.json\), which is gone: put the file back"):
    analyze.main(["cka", str(moved)])
  with pytest.raises(SystemExit, match=r"error: .*CKA compares architecture groups, but this FedCross run has "
                     r"one \(mlp\)"):
    analyze.main(["cka", fedcross_run[0]])
  with pytest.raises(SystemExit, match=r"error: .*--group 1 is out of range; the run has 1"):
    analyze.main(["landscape", fedcross_run[0], "--group", "1", "--grid", "2"])
  with pytest.raises(SystemExit):  # argparse: --grid must be >= 2
    analyze.main(["landscape", inco_run[0], "--grid", "1"])
