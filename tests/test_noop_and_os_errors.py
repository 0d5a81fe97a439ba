"""Settings that would do nothing (or do something else) are refused, and every OS error is one line.

`NO_OPS` and `OS_ERRORS` are tables of command-line arguments (``{tmp}`` is a fresh folder) and a fragment the
CLI's one ``error:`` line must hold; the CLI runs in this process and must exit with the given status,
without a traceback and before any compute.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from fedjax_hetero import os_errors
from fedjax_hetero.cli import run as cli
from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.run.runner import run_experiment
from tests.helpers import REPO
from tests.test_bad_input import BASE_ARGS
from tests.test_runner import base_config

MLP_ARGS = BASE_ARGS.replace("cnn@0.5,cnn@0.25", "mlp@0.5,mlp@0.25")
WITHOUT_SUBSET = MLP_ARGS.replace("--max-train-samples 200 ", "")  # (a partition file excludes a subset)


def partition_file(tmp_path) -> str:
  path = tmp_path / "parts.json"
  path.write_text(json.dumps([list(range(c * 20, c * 20 + 20)) for c in range(10)]))
  return str(path)


# (arguments, fragment of the error line)
NO_OPS = [
    ("--lr 1e-50", "--lr 1e-50 is 0 in float32 training arithmetic (below 1.18e-38, the smallest normal float32"),
    ("--lr 1e-40", "--lr 1e-40 is 0 in float32 training arithmetic"),
    ("--lr 1e39", "--lr 1e+39 is beyond float32's range (largest 3.403e+38)"),
    ("--server-optimizer adam --server-lr 1e39", "--server-lr 1e+39 is beyond float32's range"),
    ("--dp-clip 1e30 --dp-noise-multiplier 1e10", "--dp-noise-multiplier 1e+10 x --dp-clip 1e+30, the noise's standard "
                                                  "deviation, is beyond float32's range"),
    ("--batch-size 100000", "--batch-size 100000 exceeds the largest client's 26 samples: every batch is padded to "
                            "100000 rows for the result a batch size of 26 gives (over 2x the work); pass at most 26"),
    ("--drop-last --batch-size 150", "no client would take a local step (fewer than --batch-size 150 samples with "
                                     "--drop-last; the largest client has"),
    ("--partition-file {parts} --alpha 0.1", "--alpha 0.1 has no effect with --partition-file: the file gives every "
                                             "client its samples; drop it"),
    ("--partition-file {parts} --partition shards", "--partition shards has no effect with --partition-file"),
    # (second held-out survey: a flag given at its default value that the file overrides was accepted in silence)
    ("--partition-file {parts} --partition dirichlet", "--partition dirichlet has no effect with --partition-file"),
    ("--partition-file {parts} --classes-per-client 3", "--classes-per-client 3 has no effect with --partition-file"),
    ("--groups cnn@0.25 --image-size 1", "--image-size 1 is too small for group cnn@0.25: ZeroDivisionError: division "
                                         "by zero; the smallest size it takes is 4"),
    ("--groups cnn_cifar@0.25 --image-size 8", "--image-size 8 is too small for group cnn_cifar@0.25"),
    ("--resume-unchecked", "--resume-unchecked applies to --resume; add it"),
    # settings that act only beside another choice (preflight.ACTS_ONLY_WITH)
    ("--momentum 0.9", "--momentum 0.9 has no effect without --optimizer sgd (Adam has no momentum setting)"),
    ("--alpha 0.1 --partition iid", "--alpha 0.1 has no effect without --partition dirichlet"),
    ("--classes-per-client 5", "--classes-per-client 5 has no effect without --partition shards"),
    ("--backdoor-scale 5", "--backdoor-scale 5.0 has no effect without --malicious-fraction above 0"),
    ("--divergence-max-rollbacks 5", "--divergence-max-rollbacks 5 has no effect without --on-divergence rollback"),
    ("--on-divergence off --divergence-chance-evals 9", "--divergence-chance-evals 9 has no effect without "
                                                        "--on-divergence stop or rollback"),
    ("--method FedCross --groups cnn --weighting num_samples", "--weighting num_samples has no effect without a "
                                                                "method that weighs its clients (FedCross weighs every "
                                                                "client's middleware model 1)"),
    ("--round-program host --rounds-per-call 5", "--rounds-per-call 5 has no effect without --round-program fused, "
                                                 "union or auto (host runs every round from the host loop)"),
    # a method's options without the method (the build step's `methods.check_options`)
    ("--moon-temperature 0.1", "--moon-temperature applies to MOON, HeteroMOON, InCoMOON, not HeteroAvg"),
    ("--fedcross-alpha 0.5", "--fedcross-alpha applies to FedCross, not HeteroAvg"),
    ("--fedimpro-noise 0.1", "--fedimpro-noise applies to FedImpro, not HeteroAvg"),
    ("--clusamp-similarity L2", "--clusamp-similarity applies to CluSamp, not HeteroAvg"),
    ("--fedgen-preset cifar100", "--fedgen-preset cifar100 applies to FedGen, not HeteroAvg"),
    ("--method FedProx --fedgen-preset cifar10", "--fedgen-preset cifar10 applies to FedGen, not FedProx"),
    # a class-balanced test subset needs a sample of each class (10 in Fashion-MNIST)
    ("--max-test-samples 9", "--max-test-samples 9 is fewer than the 10 classes of fashion_mnist: a class-balanced "
                             "test subset needs at least one sample of each; pass at least 10"),
    ("--repair-metrics", "--repair-metrics applies to --resume; add it"),
]

# (arguments, fragment, exit status)
OS_ERRORS = [
    ("--output-dir /proc/fedjax_hetero_test/run", "--output-dir '/proc/fedjax_hetero_test/run' cannot be created: "
                                                  "'/proc/fedjax_hetero_test': No such file or directory (ENOENT)", 2),
    ("--output-dir {tmp}/" + "x" * 300, "cannot be created: ", 2),
    ("--output-dir {tmp}/link", "--output-dir '{tmp}/link' is a symbolic link to '{tmp}/nowhere', which does not exist",
     2),
]


def run_cli(tmp_path, base: str, args: str) -> int:
  argv = shlex.split(f"{base} {args}".format(tmp=tmp_path, parts=partition_file(tmp_path)))
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  return info.value.code


def one_error_line(err: str) -> str:
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  return lines[0]


@pytest.mark.parametrize("args, fragment", NO_OPS, ids=[a for a, _ in NO_OPS])
def test_a_setting_that_would_do_nothing_is_refused(args, fragment, tmp_path, capsys, no_compute):
  base = WITHOUT_SUBSET if "--partition-file" in args else MLP_ARGS
  assert run_cli(tmp_path, base, args) == 2
  assert fragment.format(tmp=tmp_path) in one_error_line(capsys.readouterr().err)


def test_a_setting_is_named_where_it_came_from_and_a_presets_value_is_never_the_users(tmp_path, capsys, monkeypatch):
  """A preset's --alpha beside --partition iid is the preset's, not the user's to drop; a config file's value is
  named with the file; a file's method options go with its method when --method chooses another."""
  config, _, args, _ = cli.parse(shlex.split("--preset inco-cpu --partition iid"), "fashion_mnist")
  cli.check_settings(config, args.setting_sources)
  assert config.data.alpha == 0.5  # (what the preset set, recorded; nothing reads it)
  file = tmp_path / "run.yaml"
  file.write_text("data: {partition: iid, alpha: 0.1}\nmethod: {name: FedProx, prox: {mu: 0.05}}\n")
  config, _, args, _ = cli.parse(["--config", str(file)], "fashion_mnist")
  with pytest.raises(ValueError, match=rf"^data.alpha 0.1 \(from --config {file}\) has no effect without --partition "
                                       "dirichlet; add that, or remove it from that file$"):
    cli.check_settings(config, args.setting_sources)
  config, _, args, _ = cli.parse(["--config", str(file), "--method", "FedAvg", "--partition", "dirichlet"],
                                 "fashion_mnist")
  assert config.method.name == "FedAvg" and config.method.prox.mu == type(config.method.prox)().mu
  cli.check_settings(config, args.setting_sources)
  assert run_cli(tmp_path, MLP_ARGS, "--partition iid --alpha 0.1") == 2  # (given as a flag: the user's)
  assert "--alpha 0.1 has no effect without --partition dirichlet; add that, or drop it" in capsys.readouterr().err


@pytest.mark.parametrize("args, fragment, status", OS_ERRORS, ids=[a[:40] for a, _, _ in OS_ERRORS])
def test_an_os_error_on_the_output_folder_is_one_line(args, fragment, status, tmp_path, capsys, no_compute):
  os.symlink(tmp_path / "nowhere", tmp_path / "link")
  assert run_cli(tmp_path, MLP_ARGS, args) == status
  assert fragment.format(tmp=tmp_path) in one_error_line(capsys.readouterr().err)


@pytest.mark.slow
def test_an_immutable_metrics_file_ends_a_resume_in_one_line(tmp_path, capsys):
  out = tmp_path / "out"
  args = f"--groups mlp@0.5 --num-clients 4 --clients-per-round 2 --no-progress --compile-cache off --output-dir {out}"
  assert cli.main("synthetic", shlex.split(args + " --rounds 1"))["final_round"] == 1
  capsys.readouterr()
  if subprocess.run(["chattr", "+i", str(out / "metrics.jsonl")], capture_output=True).returncode:
    pytest.skip("chattr +i is not available here (needs root on a file system with attributes)")
  try:
    with pytest.raises(SystemExit) as info:
      cli.main("synthetic", shlex.split(args + " --resume --rounds 2"))
  finally:
    subprocess.run(["chattr", "-i", str(out / "metrics.jsonl")], capture_output=True)
  assert info.value.code == 1
  assert one_error_line(capsys.readouterr().err) == (
      f"error: '{out / 'metrics.jsonl'}': Operation not permitted (EPERM; check the permissions (and for chattr +i: "
      "lsattr))")


def test_an_errno_in_the_text_of_a_tensorstore_error_is_named_like_an_os_error():
  """orbax's array writer fails a full disk with a ValueError whose text carries the errno."""
  wrapped = ValueError('Error writing "ocdbt.process_0/d/5e.." in OCDBT database at local file "/runs/x/": '
                       "Failed to write 61759 bytes to file 14: No space left on device [os_error_code='28']")
  assert os_errors.reason(wrapped) == "No space left on device (ENOSPC; free some space or choose another --output-dir)"
  assert os_errors.reason(ValueError("shapes differ")) == "shapes differ"


def test_a_batch_somewhat_larger_than_every_client_is_a_warning(tmp_path):
  logs = []
  # (One group: the warning is about the clients' data, and a second group's programs only added compile time.)
  run_experiment(base_config(tmp_path / "out", rounds=1, batch_size=64, groups=("mlp@0.5",)),
                 synthetic_dataset(num_train=240, num_test=64), log=logs.append)
  assert any(line.startswith("warning: --batch-size 64 exceeds the largest client's") and "x the work)" in line
             for line in logs), logs


def test_clients_without_a_step_are_named_in_a_warning(tmp_path, capsys):
  dataset = synthetic_dataset(num_train=240, num_test=64, seed=0)
  logs = []
  config = base_config(tmp_path / "out", rounds=1, drop_last=True, batch_size=30, partition="iid_imbalanced",
                       groups=("mlp@0.5",))  # (one group, as above)
  run_experiment(config, dataset, log=logs.append)
  warning = [line for line in logs if "take no local step" in line]
  assert len(warning) == 1 and ("(fewer than --batch-size 30 samples with --drop-last): a sampled one uploads a "
                                "zero update, which counts in the mean with its --weighting uniform weight"
                                in warning[0]), logs
  assert warning[0].endswith("a round that samples only them changes nothing"), logs


def test_a_round_without_a_local_step_reports_no_loss_or_speed_and_a_collapsed_width_warns():
  """(Such a round logged loss 0.0000 and 0 samples/s as if measured; cnn@0.01, 90 parameters, trained in silence.)"""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run import preflight
  from fedjax_hetero.run.reporting import evaluation_line

  from fedjax_hetero.rounds.rows import round_row

  row = {**round_row(2, {}, np.zeros(0, np.int64), 0, 1.0, {}), "test_accuracy": {"g": 0.1, "mean": 0.1}}
  assert (row["train_loss"], row["train_loss_per_group"], row["samples_per_s"]) == (None, {}, None), \
      "metrics.jsonl logged a loss of 0.0 or a speed of 0 samples/s"
  assert evaluation_line(row, 10) == "round 3/10: no local step taken, mean accuracy 10.00% (g 10.00)"
  logs = []
  preflight._warn_collapsed_layers(RunConfig.from_flags(groups=("cnn@0.01", "cnn@0.5")), (28, 28, 1), 10, logs.append)
  assert logs == ["warning: group cnn@0.01: width 0.01 leaves 3 layer(s) with a single unit (['params']['conv1'], "
                  "['params']['conv2'], ['params']['fc1']); its model has 90 parameters and may not learn at all"]


def test_static_batch_norm_settings_warn_where_no_model_has_batch_norm():
  """(--heterofl-bn-samples 64 or --fedfa-static-bn over CNNs was recorded in config.json and changed nothing.)"""
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.run import preflight

  def warnings(**flags):
    logs = []
    preflight._warn_static_bn_without_batch_norm(RunConfig.from_flags(**flags), (28, 28, 1), 10, logs.append)
    return logs

  assert warnings(method="HeteroFL", groups=("cnn@1", "mlp@0.5"), heterofl_bn_samples=64) == [
      "warning: --heterofl-bn-samples 64: no group's model has BatchNorm (cnn@1, mlp@0.5), so static BN changes "
      "nothing"]
  assert warnings(method="FedFA", groups=("cnn@1",), fedfa_static_bn=True)[0].startswith(
      "warning: --fedfa-static-bn:")
  assert warnings(method="HeteroFL", groups=("mlp",), heterofl_static_bn=False)[0].startswith(
      "warning: --no-heterofl-static-bn:")
  assert warnings(method="HeteroFL", groups=("cnn@1", "resnet10@0.5"), heterofl_bn_samples=64) == []
  assert warnings(method="HeteroFL", groups=("cnn@1",)) == []  # (the defaults: nothing said)


def test_a_broken_pipe_names_the_pipe_not_the_output_folder():
  """(A closed stdout read "Broken pipe (EPIPE) (writing in --output-dir ...)": the folder was never at fault.)"""
  line = os_errors.describe(BrokenPipeError(32, "Broken pipe"), "(writing in --output-dir '/runs/x')")
  assert "--output-dir" not in line and line.startswith("Broken pipe (EPIPE; the reader of a pipe went away"), line


@pytest.mark.slow
def test_a_run_whose_stdout_is_closed_stops_after_its_round_and_resumes(tmp_path):
  """``... | head -1``: the reader goes away after the first line. The run stops after the round in progress as on
  a signal (exit status 141, SIGPIPE's), says so on stderr, and --resume finishes it."""
  out = tmp_path / "out"
  program = "import sys; from fedjax_hetero.cli.run import main; main('synthetic', sys.argv[1:])"
  args = shlex.split(f"--groups mlp@0.5 --num-clients 4 --clients-per-round 2 --no-progress --eval-every 1 "
                     f"--checkpoint-every 1 --output-dir {out} --rounds 4")
  command = [sys.executable, "-c", program, *args]
  reader = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert reader.stdout.readline().startswith("synthetic: ")
  reader.stdout.close()  # (head -1 exits)
  err = reader.stderr.read()
  assert reader.wait(timeout=300) == 141, err
  assert "Traceback" not in err and "--output-dir" not in err and "Exception ignored" not in err, err
  assert "stdout was closed (broken pipe): stopping after this call, as on SIGPIPE" in err, err
  assert "(SIGPIPE); to continue, rerun the same command with --resume" in err, err
  summary = json.loads((out / "summary.json").read_text())
  assert summary["interrupted"]["signal"] == "SIGPIPE", summary
  # (The same command in this process: the resume's process is not under test, and this one spares an interpreter.)
  assert cli.main("synthetic", args + ["--resume"])["final_round"] == 4
  assert json.loads((out / "summary.json").read_text())["final_round"] == 4


def test_rounds_per_call_is_named_as_doing_nothing_where_auto_runs_the_host_loop(tmp_path, capsys):
  """--round-program auto resolves after the settings' checks (on this CPU: the host loop), so the setup line says
  that --rounds-per-call does nothing there instead of recording it in silence."""
  cli.main("fashion_mnist", shlex.split(f"{MLP_ARGS} --rounds-per-call 5".format(tmp=tmp_path)))
  out = capsys.readouterr()
  assert ("rounds as a host loop (--rounds-per-call 5 has no effect there: --round-program (default) auto runs no "
          "round program for this run on cpu)") in out.out + out.err
