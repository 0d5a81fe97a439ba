"""A setting's source travels with it into every message: a value a preset, a config file or a sweep gave is
named as theirs, never as a flag the user did not pass (`fedjax_hetero.config.declare.named_from`); and what a
file or a sweep says is either used or refused, never dropped in silence."""

from __future__ import annotations

import json
import os
import re

import pytest

from fedjax_hetero.cli import run as cli


def fails(capsys, dataset: str, argv: list[str]) -> str:
  with pytest.raises(SystemExit) as exit_:
    cli.main(dataset, argv)
  assert exit_.value.code == 2
  message = capsys.readouterr().err.strip()
  assert message.startswith("error: ") and "\n" not in message, message
  return message


def written(tmp_path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "inco-cpu", "--num-clients", "7"],
     "error: clients_per_round (from --preset inco-cpu) 10 exceeds --num-clients 7"),
    (["--preset", "inco-cpu", "--num-clients", "3"],
     "error: --num-clients 3 is fewer than the 5 architecture groups of groups (from --preset inco-cpu); every group "
     "needs a client"),
])
def test_a_presets_value_is_named_as_the_presets(capsys, tmp_path, no_compute, argv, expected):
  assert fails(capsys, "fashion_mnist", argv + ["--output-dir", str(tmp_path / "o")]) == expected


@pytest.mark.parametrize("argv, expected", [
    # (held-out probes: a default was blamed as a flag the user gave)
    (["--num-clients", "5"], "error: --clients-per-round (default) 10 exceeds --num-clients 5"),
    (["--num-clients", "2", "--clients-per-round", "2"],
     "error: --num-clients 2 is fewer than the 3 architecture groups of --groups (default); every group needs a "
     "client"),
    # (second held-out survey: a default blamed in a check after the flags were parsed; advice to add a flag
    # tagged "(default)")
    (["--dataset", "synthetic", "--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2",
      "--max-train-samples", "4", "--partition", "iid"],
     "error: --batch-size (default) 32 exceeds the largest client's 1 samples: every batch is padded to 32 rows for "
     "the result a batch size of 1 gives (over 2x the work); pass at most 1"),
    (["--dp-noise-multiplier", "2"],
     "error: --dp-noise-multiplier sets differential privacy, which is off: add --dp-clip C"),
    (["--server-lr", "0.1"],
     "error: --server-lr sets the server optimizer, and there is none: add --server-optimizer adam, yogi or adagrad"),
    (["--server-optimizer", "adagrad", "--server-beta2", "0.5"],
     "error: --server-beta2 0.5 has no effect with --server-optimizer adagrad, whose second moment sums the squared "
     "updates (Reddi et al. 2021, Alg. 2): drop it"),
])
def test_a_default_is_named_as_the_default(capsys, tmp_path, no_compute, argv, expected):
  assert fails(capsys, "fashion_mnist", argv + ["--output-dir", str(tmp_path / "o")]) == expected


def test_a_files_values_are_checked_together_with_the_flags_given(capsys, tmp_path, no_compute):
  """(Held-out probe: a file of 4 clients failed on the default 10 per round before the flags that fix it applied.)"""
  path = written(tmp_path, "four.yaml", "data: {dataset: synthetic, num_clients: 4}\ngroups: [mlp]\nrounds: 1\n")
  assert fails(capsys, "fashion_mnist", ["--config", path, "--output-dir", str(tmp_path / "a")]) == (
      f"error: --clients-per-round (default) 10 exceeds data.num_clients (from --config {path}, line 1) 4")
  config, *_ = cli.parse(["--config", path, "--clients-per-round", "3", "--output-dir", str(tmp_path / "b")],
                         "fashion_mnist")
  assert (config.data.num_clients, config.federation.clients_per_round) == (4, 3)
  config, *_ = cli.parse(["--config", path, "--num-clients", "20", "--output-dir", str(tmp_path / "c")],
                         "fashion_mnist")
  assert (config.data.num_clients, config.federation.clients_per_round) == (20, 10)


def test_a_config_files_value_is_named_with_its_line(capsys, tmp_path, no_compute):
  both = written(tmp_path, "both.yaml", "num_clients: 4\nclients_per_round: 9\n")
  assert fails(capsys, "synthetic", ["--config", both]) == (
      f"error: federation.clients_per_round (from --config {both}, line 2) 9 exceeds data.num_clients (from --config "
      f"{both}, line 1) 4")
  one = written(tmp_path, "one.yaml", "federation:\n  clients_per_round: 9\n")
  assert fails(capsys, "synthetic", ["--config", one, "--num-clients", "4", "--output-dir", str(tmp_path / "o")]) == (
      f"error: federation.clients_per_round (from --config {one}, line 2) 9 exceeds --num-clients 4")


@pytest.mark.parametrize("sweep, message", [
    ("client.learning_rate=0.1,-1", r"client.learning_rate \(from --sweep\) must be a finite number > 0, got -1.0"),
    ("data.alpha=0.5,-1", r"data.alpha \(from --sweep\) must be a finite number > 0, got -1.0"),
])
def test_a_swept_value_is_named_as_the_sweeps(capsys, tmp_path, no_compute, sweep, message):
  assert re.fullmatch("error: " + message, fails(capsys, "synthetic", [
      "--output-dir", str(tmp_path / "o"), "--sweep", sweep]))


def test_a_flag_beside_the_sweep_of_its_setting_is_refused_not_ignored(capsys, tmp_path, no_compute):
  assert fails(capsys, "synthetic", ["--output-dir", str(tmp_path / "o"), "--sweep", "client.learning_rate=0.1,0.2",
                                     "--lr", "0.05"]) == (
      "error: --sweep client.learning_rate gives every run its value: drop --lr, or add its value to the sweep's")


def test_the_hosts_integers_sweep_as_docs_many_runs_says(tmp_path):
  from fedjax_hetero.run.jobs import parse_sweep, runs_of
  config, *_ = cli.parse(["--output-dir", str(tmp_path / "o")], "synthetic")
  runs = runs_of(config, None, [parse_sweep("federation.sample_seed=1,2", config),
                                parse_sweep("divergence.max_rollbacks=2,3", config)])
  assert [(r.federation.sample_seed, type(r.federation.sample_seed)) for r in runs] == [(1, int)] * 2 + [(2, int)] * 2
  assert [r.divergence.max_rollbacks for r in runs] == [2, 3, 2, 3]
  with pytest.raises(ValueError, match=r"expected federation.sample_seed=V1,V2,... with integers"):
    parse_sweep("federation.sample_seed=1,2.5", config)


def test_a_files_option_its_method_does_not_read_is_refused_with_its_line(capsys, tmp_path, no_compute):
  nested = written(tmp_path, "nested.yaml", "method:\n  name: HeteroAvg\n  prox:\n    mu: 0.5\n")
  assert fails(capsys, "synthetic", ["--config", nested, "--output-dir", str(tmp_path / "o")]).startswith(
      f"error: method.prox.mu (from --config {nested}, line 4) applies to FedProx, ")
  flat = written(tmp_path, "flat.yaml", "method: HeteroAvg\nprox_mu: 0.5\n")
  assert "method.prox.mu (from --config" in fails(capsys, "synthetic", ["--config", flat, "--output-dir",
                                                                        str(tmp_path / "o")])


@pytest.mark.parametrize("name, text", [("nested.yaml", "method:\n  name: HeteroAvg\n  prox:\n    mu: 0.5\n"),
                                        ("flat.yaml", "method: HeteroAvg\nprox_mu: 0.5\n")])
def test_a_files_option_reaches_the_method_given_as_a_flag_or_is_dropped_saying_so(tmp_path, name, text):
  path = written(tmp_path, name, text)
  config, _, args, _ = cli.parse(["--config", path, "--method", "FedProx", "--output-dir", str(tmp_path / "o")],
                                 "synthetic")
  assert (config.method.name, config.method.prox.mu, args.notes) == ("FedProx", 0.5, [])
  config, _, args, _ = cli.parse(["--config", path, "--method", "FedAvg", "--output-dir", str(tmp_path / "o")],
                                 "synthetic")
  assert config.method.prox.mu == 0.1
  assert args.notes == [f"note: method.prox.mu 0.5 of --config {path} is left at its default 0.1: --method FedAvg "
                        "does not read it"]


@pytest.mark.parametrize("action", [["--resume"], ["--overwrite"], ["--resume-or-start"], []])
def test_a_copied_folders_config_json_asks_which_folder(capsys, tmp_path, no_compute, action):
  original, copy = tmp_path / "original", tmp_path / "copy"
  os.makedirs(copy)
  config, *_ = cli.parse(["--output-dir", str(original)], "synthetic")
  (copy / "config.json").write_text(json.dumps({"output": {"dir": str(original)}, "rounds": config.rounds}))
  (copy / "metrics.jsonl").write_text("")
  os.makedirs(original)
  (original / "metrics.jsonl").write_text("")
  assert fails(capsys, "synthetic", ["--config", str(copy / "config.json"), *action]) == (
      f"error: --config '{copy / 'config.json'}' lies in the run folder '{copy}' but names '{original}' as its "
      f"run's (a copied folder?); pass --output-dir {copy} for the run there, or --output-dir {original} for the "
      "one it names (with --resume to continue it, or another --output-dir for a new run)")
  assert os.listdir(original) == ["metrics.jsonl"], "--overwrite cleared the folder the file names"


def test_a_partial_config_file_keeps_the_datasets_defaults_for_what_it_leaves_out(tmp_path):
  fmnist, *_ = cli.parse(["--output-dir", str(tmp_path / "o")], "fashion_mnist")
  path = written(tmp_path, "part.yaml", "rounds: 1\nclient: {learning_rate: 0.05}\n")
  config, *_ = cli.parse(["--config", path, "--output-dir", str(tmp_path / "o")], "fashion_mnist")
  assert (config.rounds, config.client.learning_rate) == (1, 0.05)
  assert config.replace(rounds=fmnist.rounds, learning_rate=fmnist.client.learning_rate) == fmnist, (
      "the dataset's eval_every and the run's batch size were lost")
  flat = written(tmp_path, "flat.json", '{"dataset": "cifar10", "rounds": 2}')
  config, *_ = cli.parse(["--config", flat, "--output-dir", str(tmp_path / "o")], "fashion_mnist")
  cifar, *_ = cli.parse(["--output-dir", str(tmp_path / "o")], "cifar10")
  assert config == cifar.replace(rounds=2), "the dataset the file names gives the defaults"


def test_a_sweep_over_a_files_value_says_it_replaces_it(capsys, tmp_path, no_compute):
  path = written(tmp_path, "lr.yaml", "client: {learning_rate: 0.05}\n")
  with pytest.raises(AssertionError, match="compute started"):  # (the fixture stops the runs once they start)
    cli.main("synthetic", ["--config", path, "--output-dir", str(tmp_path / "o"), "--num-clients", "10", "--sweep",
                           "client.learning_rate=0.01,0.02"])
  assert f"note: --sweep client.learning_rate replaces its value 0.05 of --config {path}\n" in capsys.readouterr().out


@pytest.mark.parametrize("action", [[], ["--resume"], ["--resume-or-start"]])
def test_a_folder_of_other_files_is_refused_with_advice_that_works(capsys, tmp_path, no_compute, action):
  folder = tmp_path / "notes"
  folder.mkdir()
  (folder / "notes.txt").write_text("mine")
  from fedjax_hetero.run.runner import run_experiment
  config, *_ = cli.parse(["--output-dir", str(folder), *action], "synthetic")
  with pytest.raises(ValueError, match=rf"^output directory '{folder}' holds no run \(no config.json, metrics.jsonl, "
                                       r"checkpoints/\) but notes.txt; a run starts only in an empty folder: move "
                                       r"those away or choose another --output-dir$"):
    run_experiment(config, log=lambda _: None)
  assert os.listdir(folder) == ["notes.txt"]


@pytest.mark.slow
def test_a_resume_keeps_the_learning_rate_an_earlier_resume_gave(tmp_path, capsys):
  out = tmp_path / "out"
  args = ["--groups", "mlp@0.5", "--num-clients", "4", "--clients-per-round", "2", "--no-progress",
          "--output-dir", str(out)]
  cli.main("synthetic", args + ["--rounds", "1"])
  cli.main("synthetic", args + ["--rounds", "2", "--resume", "--lr", "0.003"])
  capsys.readouterr()
  cli.main("synthetic", args + ["--rounds", "3", "--resume"])  # the run's first command again
  assert "keeping --lr 0.003, the run's latest (this command would set 0.001; pass --lr to change it)" in \
      capsys.readouterr().out
  with open(out / "config.json") as f:
    segments = [(s["from_round"], s["settings"]["client.learning_rate"]) for s in json.load(f)["segments"]]
  assert len(segments) == 2 and segments[1] == (2, 0.003), "the third round went back to the first command's rate"


def test_a_run_folders_config_json_accepts_output_dir_abbreviated_as_argparse_does(tmp_path):
  """Held-out probe 59: --output (argparse's abbreviation of --output-dir) was refused with 'pass --output-dir'."""
  original = tmp_path / "original"
  os.makedirs(original)
  (original / "config.json").write_text(json.dumps({"output": {"dir": str(original)}, "rounds": 3}))
  config, *_ = cli.parse(["--config", str(original / "config.json"), "--output", str(tmp_path / "new")], "synthetic")
  assert (config.output.dir, config.rounds) == (str(tmp_path / "new"), 3)


def test_a_partition_error_names_a_swept_alpha_as_the_sweeps(capsys, tmp_path, no_compute):
  """Held-out probe 24: the advice was 'raise alpha (--alpha)', a flag the sweep forbids beside it."""
  assert fails(capsys, "synthetic", ["--groups", "mlp@0.25", "--num-clients", "20", "--clients-per-round", "2",
                                     "--sweep", "data.alpha=0.5,0.001", "--output-dir", str(tmp_path / "o")]
               ).count("raise alpha (data.alpha (from --sweep))") == 1


def test_a_fedgen_preset_beside_a_files_fedgen_settings_is_refused(capsys, tmp_path, no_compute):
  """Held-out probe 56: --fedgen-preset replaced the file's noise_dim and generative_alpha without a word."""
  path = written(tmp_path, "fedgen.yaml", "method: {name: FedGen, fedgen: {noise_dim: 32, generative_alpha: 5.0}}\n")
  assert fails(capsys, "synthetic", ["--config", path, "--fedgen-preset", "cifar10", "--output-dir",
                                     str(tmp_path / "o")]) == (
      f"error: --fedgen-preset cifar10 would replace method.fedgen.generative_alpha, method.fedgen.noise_dim of "
      f"--config {path}: set FedGen's settings in the file or by the preset, not both")


def test_a_partition_file_replaces_a_presets_training_subset_saying_so(tmp_path):
  """Held-out probe 23: --preset fedimpro-cpu --partition-file was refused (the preset's max_train_samples and the
  file exclude each other), and no flag could unset the preset's value."""
  path = written(tmp_path, "parts.json", json.dumps([[3 * i, 3 * i + 1, 3 * i + 2] for i in range(10)]))
  config, _, args, _ = cli.parse(["--preset", "fedimpro-cpu", "--partition-file", path, "--output-dir",
                                  str(tmp_path / "o")], "fashion_mnist")
  assert (config.data.partition_file, config.data.max_train_samples) == (path, None)
  assert args.notes == ["note: --partition-file replaces max_train_samples 12000 of --preset fedimpro-cpu"]


SYNTHETIC = ["--dataset", "synthetic", "--groups", "mlp", "--num-clients", "4", "--clients-per-round", "2"]


@pytest.mark.parametrize("argv, expected", [
    # (second held-out survey: accepted, then nothing trained, the first file or preset dropped, a YAML word misread)
    (SYNTHETIC + ["--client-dropout", "1"],
     "error: --client-dropout 1: no client would ever answer, so no round would train; pass probabilities below 1"),
    (SYNTHETIC + ["--test-first", "3"],
     "error: --test-first 3 is fewer than the 4 classes of synthetic: its accuracy could not see every class; pass "
     "at least 4"),
    (["--preset", "inco-cpu", "--preset", "fedin-cpu"],
     "error: --preset is given 2 times (inco-cpu, fedin-cpu): each holds a whole run; give one"),
    (["--config", "{a}", "--config", "{b}"], "error: --config is given 2 times ({a}, {b}): each holds a whole run; "
                                             "give one"),
    (["--config", "{no}"], "error: --config '{no}': divergence.action (line 2) must be one of stop, rollback, off, "
                           "got 'no'"),
])
def test_what_would_train_nothing_or_drop_a_setting_is_refused(capsys, tmp_path, no_compute, argv, expected):
  files = {name: written(tmp_path, f"{name}.yaml", text) for name, text in (
      ("a", "rounds: 1\n"), ("b", "rounds: 2\n"), ("no", "rounds: 1\ndivergence: {action: no}\n"))}
  argv = [a.format(**files) for a in argv]
  assert fails(capsys, "fashion_mnist", argv + ["--output-dir", str(tmp_path / "o")]) == expected.format(**files)


def test_a_resume_may_spell_no_dropout_as_zero(tmp_path):
  """(Second held-out survey: --resume --client-dropout 0 on a run without dropout was refused as another run.)"""
  argv = SYNTHETIC + ["--eval-every", "1", "--no-progress", "--output-dir", str(tmp_path / "o")]
  cli.main("synthetic", argv + ["--rounds", "1"])
  assert cli.main("synthetic", argv + ["--rounds", "2", "--resume", "--client-dropout", "0"])["final_round"] == 2


def test_seeds_beside_a_files_seed_say_they_replace_it(tmp_path):
  """(Second held-out survey: a file's federation.seed was replaced by --seeds in silence; --seed is refused.)"""
  path = written(tmp_path, "run.yaml", "federation: {seed: 3}\nrounds: 1\n")
  _, _, args, _ = cli.parse(["--config", path, "--seeds", "0,1", "--output-dir", str(tmp_path / "o")], "synthetic")
  assert f"note: --seeds replaces federation.seed 3 of --config {path}" in args.notes, args.notes


def test_a_method_spelled_in_another_case_is_recorded_by_its_name_and_compares_with_its_runs(tmp_path, capsys):
  """(Fifth probe survey: --method fedavg was recorded as typed, so compare told its runs from FedAvg's as a variant
  and could not find the baseline; a resume spelled FEDAVG rewrote config.json.)"""
  from fedjax_hetero.cli import compare

  argv = SYNTHETIC + ["--no-progress", "--rounds", "1"]
  lower, upper = str(tmp_path / "lower"), str(tmp_path / "upper")
  cli.main("synthetic", argv + ["--method", "fedavg", "--output-dir", lower])
  cli.main("synthetic", argv + ["--method", "FEDAVG", "--rounds", "2", "--resume", "--output-dir", lower])
  cli.main("synthetic", argv + ["--method", "FedAvg", "--seed", "1", "--output-dir", upper])
  with open(os.path.join(lower, "config.json")) as f:
    assert json.load(f)["method"]["name"] == "FedAvg"
  table = compare.main([lower, upper, "--baseline", "FedAvg"])
  assert "[method.name" not in table and "| FedAvg | 2 |" in table, table
  capsys.readouterr()
  cli.main("synthetic", argv + ["--method", "fedavg", "--seeds", "0,1", "--output-dir", str(tmp_path / "seeds")])
  assert "RUNS_OF_ANOTHER_METHOD --baseline FedAvg\n" in capsys.readouterr().out


def test_an_unknown_method_is_named_where_its_name_came_from_with_the_way_to_run_ones_own(capsys, tmp_path,
                                                                                          no_compute):
  """(Fifth probe survey: a config file's or a folder's method that no process registered was '--method: unknown'.)"""
  from fedjax_hetero.cli import analyze

  path = written(tmp_path, "run.yaml", "method: {name: FedAvgM}\nrounds: 1\n")
  message = fails(capsys, "synthetic", ["--config", path, "--output-dir", str(tmp_path / "o")])
  assert message.startswith(f"error: method.name (from --config {path}, line 1): unknown method 'FedAvgM'; ")
  assert message.endswith("run it from that script (docs/running.md#your-own-method)"), message
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"method": {"name": "FedAvgM"}, "dataset": "synthetic"}))
  with pytest.raises(SystemExit, match=f"method.name of {folder}'s config.json: unknown method 'FedAvgM'"):
    analyze.main(["cka", str(folder)])


def test_a_run_evaluated_on_the_test_subset_drawn_before_says_why_it_cannot_resume(capsys, tmp_path):
  """(The test subset of a run without --max-train-samples moved when every run of a seed got the same one.)"""
  out = tmp_path / "run"
  argv = SYNTHETIC + ["--max-test-samples", "50", "--no-progress", "--output-dir", str(out)]
  cli.main("synthetic", argv + ["--rounds", "1"])
  record = json.loads((out / "data_fingerprint.json").read_text())
  record["test_images"]["blake2b"] = record["test_labels"]["blake2b"] = "0" * 8  # (as the old draw's)
  (out / "data_fingerprint.json").write_text(json.dumps(record))
  message = fails(capsys, "synthetic", argv + ["--rounds", "2", "--resume"])
  assert "evaluated on another --max-test-samples subset: a run without --max-train-samples now draws" in message
  assert message.endswith("or --resume-unchecked to go on with the new one"), message
