"""The researcher's workflow: a method of one's own through the whole runner, interruption, --config, --seeds,
--resume-or-start, the metric writers and the plain progress lines, an offline tfds dataset."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from fedjax_hetero.analysis import runs as run_stats
from fedjax_hetero.cli import compare
from fedjax_hetero.cli import run as cli
from fedjax_hetero.config import RunConfig, as_dict
from fedjax_hetero.methods import METHODS, build_method, register_method
from fedjax_hetero.run.reporting import scalars
from fedjax_hetero.run.runner import run_experiment
from tests.helpers import FMNIST_FILE, REPO
from tests.test_docs import blocks_of

pytestmark = pytest.mark.slow  # end to end (`pytest -m "not slow"` leaves it out)

# A tiny synthetic run through the command line. Its subprocesses use the session's compilation cache
# ($FEDJAX_HETERO_CACHE_DIR, tests/conftest.py), so they load the programs the same runs compiled before.
TINY = ["--dataset", "synthetic", "--groups", "mlp@0.5,mlp", "--num-clients", "4", "--clients-per-round", "2",
        "--batch-size", "16", "--eval-every", "1", "--no-progress"]


def rows_of(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def same_training(a: list[dict], b: list[dict]) -> None:
  assert [r["round"] for r in a] == [r["round"] for r in b]
  for key in ("train_loss", "train_loss_per_group", "test_accuracy", "clients"):
    assert [r[key] for r in a] == [r[key] for r in b], key


def readme_method_script() -> str:
  [(_, code, _)] = [block for block in blocks_of("python") if block[0] == "README.md" and "def fedavgm" in block[1]]
  return code


@pytest.mark.skipif(not os.path.exists(FMNIST_FILE), reason="Fashion-MNIST Debian package not installed")
def test_the_readme_method_resumes_and_compares_beside_a_catalog_method(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  scope = {"__name__": "__readme__"}
  exec(compile(readme_method_script(), "README.md", "exec"), scope)  # the script exactly as the README has it
  config, fedavgm = scope["config"], scope["fedavgm"]
  out = config.output.dir
  assert {"config.json", "metrics.jsonl", "summary.json", "accuracy.png", "checkpoints"} <= set(os.listdir(out))
  resumed = run_experiment(config.replace(resume=True, overwrite=False, rounds=4), method=fedavgm(), log=print)
  assert resumed["method"] == "FedAvgM" and [r["round"] for r in rows_of(out)] == [1, 2, 3, 4]
  with pytest.raises(ValueError, match="method.name: 'FedAvgM' -> 'FedAvg'"):  # resume checks the method
    run_experiment(config.replace(resume=True, overwrite=False, method="FedAvg", rounds=5))
  # (The README's 3 rounds: compare pairs the runs at the rounds both evaluated; a fourth round only trained.)
  run_experiment(config.replace(method="FedAvg", output_dir="runs/fedavg"))
  text = compare.main([out, "runs/fedavg", "--baseline", "FedAvg"])
  assert "FedAvgM" in text and "| FedAvg" in text


def test_a_registered_method_runs_and_resumes_from_the_command_line(tmp_path):
  import optax
  from fedjax_hetero.config import Averaging
  from fedjax_hetero.methods import PER_GROUP, Method
  from fedjax_hetero.server import apply_delta, mean_delta

  def fedavgm(averaging):
    assert averaging.aggregate == "deltas"
    return Method("FedAvgM2", "test", "FedAvg with server momentum",
                  server=(mean_delta(), apply_delta(optax.sgd(1.0, momentum=0.9))), sharing=PER_GROUP)

  register_method("FedAvgM2", fedavgm, options=(Averaging,), summary="FedAvg with server momentum")
  try:
    assert build_method("fedavgm2").name == "FedAvgM2"
    out = str(tmp_path / "run")
    cli.main("synthetic", TINY + ["--method", "FedAvgM2", "--rounds", "2", "--output-dir", out])
    summary = cli.main("synthetic", TINY + ["--method", "FedAvgM2", "--rounds", "3", "--output-dir", out, "--resume"])
    assert summary["method"] == "FedAvgM2" and [r["round"] for r in rows_of(out)] == [1, 2, 3]
    with pytest.raises(SystemExit):
      cli.main("synthetic", TINY + ["--method", "FedAvgM2", "--prox-mu", "0.3", "--output-dir", str(tmp_path / "x")])
  finally:
    METHODS.pop("fedavgm2")


def interrupt(argv: list[str], out: str, signum: int, after_rows: int = 2) -> subprocess.CompletedProcess:
  """``python -m experiments.fmnist ARGV``, sent ``signum`` once ``after_rows`` rounds are in metrics.jsonl."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-m", "experiments.fmnist", *argv], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(os.path.join(out, "metrics.jsonl")) and len(rows_of(out)) >= after_rows:
      proc.send_signal(signum)
      break
    time.sleep(0.05)
  stdout, stderr = proc.communicate(timeout=300)
  return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


SIGNALLED = TINY + ["--rounds", "60"]  # (a run still training when the signal comes)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
  """The metrics of `SIGNALLED`'s command run without a signal, once for both signals' tests."""
  out = str(tmp_path_factory.mktemp("uninterrupted") / "run")
  cli.main("synthetic", SIGNALLED + ["--output-dir", out])
  return rows_of(out)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_cleanly_and_resume_reaches_the_uninterrupted_metrics(signum, status, tmp_path, uninterrupted):
  argv = SIGNALLED
  out = str(tmp_path / "stopped")
  proc = interrupt(argv + ["--output-dir", out], out, signum)
  assert proc.returncode == status, proc.stderr
  assert "Traceback" not in proc.stdout + proc.stderr
  assert "rerun the same command with --resume" in proc.stdout
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  done = summary["interrupted"]["completed_round"]
  assert summary["interrupted"]["signal"] == signal.Signals(signum).name and 2 <= done < 60
  assert summary["final_round"] == done and os.path.exists(os.path.join(out, "accuracy.png"))
  cli.main("synthetic", argv + ["--output-dir", out, "--resume"])
  same_training(rows_of(out), uninterrupted)


def test_resume_needs_a_run_unless_resume_or_start(tmp_path, capsys):
  out = str(tmp_path / "job")
  with pytest.raises(SystemExit) as info:
    cli.main("synthetic", TINY + ["--rounds", "1", "--output-dir", out, "--resume"])
  assert info.value.code == 2 and "--resume: " in capsys.readouterr().err and not os.path.exists(out)
  cli.main("synthetic", TINY + ["--rounds", "1", "--output-dir", out, "--resume-or-start"])
  summary = cli.main("synthetic", TINY + ["--rounds", "2", "--output-dir", out, "--resume-or-start"])
  assert summary["final_round"] == 2 and summary["segments"][0]["reason"] == "start"


def test_config_files_round_trip_and_flags_override_them(tmp_path, capsys):
  out = str(tmp_path / "first")
  cli.main("synthetic", TINY + ["--rounds", "1", "--method", "HeteroProx", "--prox-mu", "0.3", "--output-dir", out])
  saved = os.path.join(out, "config.json")
  with pytest.raises(SystemExit):
    cli.parse(["--config", saved], "fashion_mnist")  # (not the advice to --overwrite that run)
  assert re.search(r"holds the settings of the run in .* pass --output-dir for a new run", capsys.readouterr().err)
  config, *_ = cli.parse(["--config", saved, "--output-dir", str(tmp_path / "second")], "fashion_mnist")
  with open(saved) as f:
    tree = json.load(f)
  as_json = json.loads(json.dumps(as_dict(config)))  # (tuples as JSON lists)
  as_json["output"]["dir"] = out
  assert as_json == {k: v for k, v in tree.items() if k in as_json}  # config.json is a valid input
  yaml_file = tmp_path / "run.yaml"
  yaml_file.write_text(yaml.safe_dump({"method": {"name": "FedProx", "prox": {"mu": 0.05}}, "rounds": 7}))
  config, *_ = cli.parse(["--config", str(yaml_file), "--rounds", "3"], "fashion_mnist")
  assert (config.method.name, config.method.prox.mu, config.rounds) == ("FedProx", 0.05, 3)
  assert config.groups == RunConfig().groups  # what the file leaves out keeps the library's default


def test_seeds_run_into_sibling_folders_that_compare_pairs(tmp_path):
  base = str(tmp_path / "sweep")
  for method in ("FedAvg", "HeteroAvg"):
    summaries = cli.main("synthetic", TINY + ["--rounds", "2", "--method", method, "--seeds", "0,1",
                                              "--output-dir", f"{base}-{method}"])
    assert [s["config"]["federation"]["seed"] for s in summaries] == [0, 1]
  folders = [f"{base}-{m}_s{s}" for m in ("FedAvg", "HeteroAvg") for s in (0, 1)]
  assert all(os.path.exists(os.path.join(f, "summary.json")) for f in folders)
  runs = [(os.path.basename(f), *run_stats.load_run(f)) for f in folders]
  [pairing] = run_stats.pairings(runs, "FedAvg")
  assert pairing.method == "HeteroAvg" and pairing.seeds == [0, 1] and all(len(r) == 2 for r in pairing.rounds)
  assert "| HeteroAvg | 2 |" in compare.main(folders + ["--baseline", "FedAvg"])


def tensorboard_scalars(directory: str) -> dict[str, dict[int, float]]:
  """The scalars of TensorBoard event files, read back record by record (TFRecord framing, Event protos)."""
  out: dict[str, dict[int, float]] = {}
  for name in os.listdir(directory):
    for event in tensorboard_events(os.path.join(directory, name)):
      for value in event.summary.value:
        out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def tensorboard_events(path: str) -> list:
  from tensorboardX.proto import event_pb2

  with open(path, "rb") as f:
    data = f.read()
  events, position = [], 0
  while position < len(data):
    (length,) = struct.unpack("<Q", data[position:position + 8])
    events.append(event_pb2.Event.FromString(data[position + 12:position + 12 + length]))
    position += 16 + length
  return events


def test_metric_writers_get_the_same_scalars_as_metrics_jsonl(tmp_path, monkeypatch):
  pytest.importorskip("tensorboardX", reason="tensorboardX not installed (pip install -e '.[logging]')")
  writers = "csv,tensorboard,wandb"
  try:
    import wandb  # noqa: F401
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
  except ImportError:
    writers = "csv,tensorboard"  # W&B is checked below where it is installed
  out = str(tmp_path / "logged")
  cli.main("synthetic", TINY + ["--rounds", "3", "--log", writers, "--output-dir", out])
  rows = rows_of(out)
  events = tensorboard_scalars(os.path.join(out, "tensorboard"))
  tag = lambda name: re.sub(r"[^-/\w.]", "_", name)  # TensorBoard's tags allow no "@" (mlp@0.5: mlp_0.5)
  for row in rows:
    assert events["train_loss"][row["round"]] == pytest.approx(row["train_loss"], rel=1e-6)
    for group, accuracy in row["test_accuracy"].items():
      assert events[tag(f"test_accuracy/{group}")][row["round"]] == pytest.approx(accuracy, rel=1e-6)
  with open(os.path.join(out, "metrics.csv")) as f:
    header, *lines = [line.rstrip("\n").split(",") for line in f]
  table = [dict(zip(header, line)) for line in lines]
  assert [float(t["test_accuracy/mean"]) for t in table] == pytest.approx([r["test_accuracy"]["mean"] for r in rows])
  if "wandb" in writers:  # the offline run's record (a binary log of protobuf records) holds every scalar name
    [record] = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    with open(record, "rb") as f:
      logged = f.read()
    for name in scalars(rows[-1]):
      assert name.encode() in logged, name


def test_a_resume_that_adds_tensorboard_writes_the_earlier_rounds_once(tmp_path):
  """(A probe survey: the event files of a run resumed with --log tensorboard held only the rounds after the
  resume, silently; CSV had them all.)"""
  pytest.importorskip("tensorboardX", reason="tensorboardX not installed (pip install -e '.[logging]')")
  from fedjax_hetero.run.reporting import logged_scalars

  out = str(tmp_path / "run")
  cli.main("synthetic", TINY + ["--rounds", "2", "--output-dir", out])
  os.makedirs(os.path.join(out, "tensorboard", "plugins.tfevents"))  # (another tool's folder: passed over)
  with open(os.path.join(out, "tensorboard", "events.out.tfevents.0.other"), "wb") as f:
    f.write(struct.pack("<Q", 3) + b"\0" * 4 + b"\xff\xff\xff" + b"\0" * 4)  # (a record that does not parse)
  cli.main("synthetic", TINY + ["--rounds", "3", "--resume", "--log", "tensorboard", "--output-dir", out])
  cli.main("synthetic", TINY + ["--rounds", "4", "--resume", "--log", "tensorboard", "--output-dir", out])
  folder = os.path.join(out, "tensorboard")
  files = [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith("events.out.tfevents.")
           and not name.endswith(".other")]
  logged = [event for path in files for event in tensorboard_events(path) if event.summary.value]
  losses = {event.step: event.summary.value[0].simple_value for event in logged
            if event.summary.value[0].tag == "train_loss"}
  assert losses == pytest.approx({row["round"]: row["train_loss"] for row in rows_of(out)}, rel=1e-6)
  assert sorted(event.step for event in logged if event.summary.value[0].tag == "train_loss") == [1, 2, 3, 4]
  assert {step for _, step in logged_scalars(folder)} == {1, 2, 3, 4}


def test_wandb_is_tested_where_it_is_installed():
  pytest.importorskip("wandb", reason="wandb not installed (pip install -e '.[logging]'): its writer is untested here")


def test_wandb_keeps_the_rounds_a_rollback_trains_again(tmp_path, monkeypatch):
  """(W&B drops a row logged at a step lower than one before it: a rollback's retrained rounds were lost.)"""
  pytest.importorskip("wandb", reason="wandb not installed (pip install -e '.[logging]')")
  from fedjax_hetero.run.reporting import WandbWriter
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  writer = WandbWriter(str(tmp_path), RunConfig.from_flags(dataset="synthetic", groups=("mlp",)))
  losses = [(1, 0.1125), (2, 0.2225), (3, 0.3325), (2, 0.2275), (3, 0.3375), (4, 0.4475)]  # rounds 2, 3 again
  rows = []
  for round_, loss in losses:
    rows = [r for r in rows if r["round"] < round_]  # (a rollback keeps the rows before the round it restores)
    rows.append({"round": round_, "train_loss": loss})
    writer.add(rows)
  writer.close()
  [record] = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
  with open(record, "rb") as f:
    logged = f.read()
  assert [loss for _, loss in losses if str(loss).encode() not in logged] == []


def test_progress_without_a_terminal_is_one_plain_line_per_evaluation(tmp_path):
  for extra in ([], ["--no-progress"]):
    argv = [a for a in TINY if a != "--no-progress"] + ["--rounds", "3", "--eval-every", "2", *extra,
                                                       "--output-dir", str(tmp_path / f"p{len(extra)}")]
    proc = subprocess.run([sys.executable, "-m", "experiments.fmnist", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 2/3", "round 3/3"], proc.stdout
    assert "mean accuracy" in lines[0] and "samples/s" in lines[0]


def test_standard_output_to_a_file_gets_the_lines_while_the_terminal_shows_the_bar(tmp_path):
  """(Fifth probe survey: with stderr a terminal, `... > run.log` got no line, and a terminal of no size, as a new
  pty has, an empty bar.)"""
  import pty

  terminal, their_end = pty.openpty()  # (0 x 0, as a pty whose size nobody set)
  argv = [a for a in TINY if a != "--no-progress"] + ["--rounds", "3", "--eval-every", "2", "--output-dir",
                                                      str(tmp_path / "run")]
  try:
    proc = subprocess.run([sys.executable, "-m", "experiments.fmnist", *argv], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=their_end, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    os.close(their_end)
    shown = b""
    while True:
      try:
        chunk = os.read(terminal, 65536)
      except OSError:  # (the pty is drained)
        break
      if not chunk:
        break
      shown += chunk
  finally:
    os.close(terminal)
  assert proc.returncode == 0, shown.decode(errors="replace")
  lines = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
  assert [line.split(":")[0] for line in lines] == ["round 2/3", "round 3/3"], proc.stdout
  assert b"3/3 [" in shown, shown  # (tqdm's bar: its counter and its time)


def test_an_offline_tfds_dataset_fails_within_seconds_and_leaves_nothing(tmp_path):
  home, out = tmp_path / "home", tmp_path / "run"
  env = {**os.environ, "HOME": str(home), "HTTPS_PROXY": "http://127.0.0.1:9", "JAX_PLATFORMS": "cpu"}
  env.pop("TFDS_DATA_DIR", None)
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "experiments.cifar10", "--rounds", "1", "--compile-cache", "off",
                         "--output-dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert time.monotonic() - start < 30
  assert proc.returncode == 2 and "is not prepared" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
  assert not out.exists() and not (home / "tensorflow_datasets").exists()


def test_the_summary_says_a_run_was_not_interrupted(tmp_path):
  out = str(tmp_path / "plain")
  summary = cli.main("synthetic", TINY + ["--rounds", "1", "--output-dir", out])
  assert summary["interrupted"] is None and np.isfinite(summary["best_mean_accuracy"])
  assert dataclasses.is_dataclass(cli.parse(TINY + ["--output-dir", out + "2"], "synthetic")[0])
