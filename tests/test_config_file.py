"""``--config FILE`` reads strictly: a setting it cannot place is an error naming the key and its line, never a
note before a run with the defaults (`fedjax_hetero.cli.config_file`)."""

from __future__ import annotations

import json

import pytest

from fedjax_hetero.cli.config_file import read_config
from fedjax_hetero.config import RunConfig, as_dict


def written(tmp_path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("name, text, message", [
    # A nested method block beside flag names: those settings were dropped and the run trained with defaults.
    ("mixed.yaml", "method:\n  name: FedProx\nlearning_rate: 0.01\nnum_clients: 10\nrounds: 3\n",
     r"mixes flag names with the nested layout .* 'learning_rate' \(line 3\) belongs at client.learning_rate; "
     r"'num_clients' \(line 4\) belongs at data.num_clients"),
    ("twice.yaml", "rounds: 3\nmethod:\n  name: FedProx\nrounds: 4\n", r"'rounds' is given twice \(lines 1 and 4\)"),
    ("twice.json", '{\n "rounds": 3,\n "client": {"learning_rate": 0.1},\n "rounds": 4\n}',
     r"'rounds' is given twice \(lines 2 and 4\)"),
    # (held-out probe, minor: a nested key given twice on one line named only its leaf, "lines 1 and 1")
    ("inline.json", '{"client": {"learning_rate": 0.01, "learning_rate": 0.02}}',
     r"'client.learning_rate' is given twice \(line 1, columns 13 and 36\)"),
    ("inline.yaml", "client: {learning_rate: 0.01, learning_rate: 0.02}\n",
     r"'client.learning_rate' is given twice \(line 1, columns 10 and 31\)"),
    ("nested.json", '{"client": {"learning_rate": 0.01},\n "method": {"name": "FedProx", "prox": {"mu": 0.1,\n'
     ' "mu": 0.2}}}', r"'method.prox.mu' is given twice \(lines 2 and 3\)"),
    ("unknown.yaml", "rounds: 3\nmethod:\n  name: FedProx\n  prox:\n    muu: 0.1\n",
     r"unknown setting\(s\) 'method.prox.muu' \(line 5\) \(did you mean 'method.prox.mu'\?\)"),
    ("unknown.json", '{\n "rounds": 3,\n "learning_rat": 0.1\n}',
     r"unknown setting\(s\) 'learning_rat' \(line 3\) \(did you mean 'learning_rate'\?\)"),
    # (held-out probe U5: a nested file was offered flat names, which the nested layout then refused, or the
    # client's learning rate for the server's)
    ("nested.yaml", "rounds: 1\nclient: {clients_per_round: 3}\n",
     r"'client.clients_per_round' \(line 2\) \(did you mean 'federation.clients_per_round'\?\)"),
    ("server.yaml", "rounds: 1\nserver: {learning_rate: 0.5}\n",
     r"'server.learning_rate' \(line 2\) \(did you mean 'server.lr'\?\)"),
    ("short.yaml", "client: {lr: 0.5, momentun: 0.9}\n", r"'client.lr' \(line 1\) \(did you mean "
     r"'client.learning_rate'\?\), 'client.momentun' \(line 1\) \(did you mean 'client.momentum'\?\)"),
    ("top.yaml", "client: {momentum: 0.9}\nlr: 0.1\nevaluate_every: 2\n",
     r"'evaluate_every' \(line 3\) \(did you mean 'eval_every'\?\), 'lr' \(line 2\) \(did you mean "
     r"'client.learning_rate'\? --lr is its command-line flag\)"),
    ("spelling.json", '{"lr": 0.02}',
     r"unknown setting\(s\) 'lr' \(line 1\) \(did you mean 'learning_rate'\? --lr is its command-line flag\)"),
    # (held-out probe 7: a dotted key suggested itself)
    ("dotted.json", '{"client.learning_rate": 0.01,\n "method.prox.mu": 0.1}',
     r"'client.learning_rate' \(line 1\) \(a dotted path is not a key: nest it as client: \{learning_rate: \.\.\.\}, "
     r"or use its flag name 'learning_rate'\), 'method.prox.mu' \(line 2\) \(.*method: \{prox: \{mu: \.\.\.\}\}, "
     r"or use its flag name 'prox_mu'\)"),
    # (held-out probes 3 and 55: "prox must be a Proximal, got float"; "'method' must be an object", no line)
    ("section.yaml", "method:\n  name: HeteroProx\n  prox: 0.05\n",
     r"method.prox \(line 3\) must be an object of settings, \{mu: \.\.\.\}, got 0.05"),
    ("method.yaml", "method: FedProx\nclient: {learning_rate: 0.1}\n",
     r"method \(line 1\) must be an object of settings, \{name: \.\.\.\}, got 'FedProx'"),
    # (held-out probe 2: a flat file's null was dropped, and the run trained its default 100 rounds)
    ("null.json", '{"dataset": "synthetic",\n "rounds": null}', r"rounds \(line 2\) must be an integer >= 1, got None"),
    ("broken.yaml", "method:\n  name: [FedProx\nrounds: 3\n", r"not valid YAML \(line 3, column 7: expected ','"),
    ("broken.json", '{\n "rounds": 3,\n}', r"not valid JSON \(line 3, column 1: Expecting property name"),
])
def test_a_file_that_cannot_be_placed_whole_is_an_error_naming_the_key_and_its_line(tmp_path, name, text, message):
  with pytest.raises(ValueError, match=message) as error:
    read_config(written(tmp_path, name, text))
  assert "\n" not in str(error.value), "one line, no parser traceback"


def test_either_layout_whole_reads_and_a_results_folders_config_json_reads_back(tmp_path):
  flat = read_config(written(tmp_path, "flat.json", '{"rounds": 3, "learning_rate": 0.1}'))
  nested = read_config(written(tmp_path, "nested.yaml", "rounds: 3\nclient:\n  learning_rate: 0.1\n"))
  assert (flat.rounds, flat.client.learning_rate) == (nested.rounds, nested.client.learning_rate) == (3, 0.1)
  saved = {**as_dict(RunConfig()), "segments": [], "rollbacks": [], "processes": 1}
  assert read_config(written(tmp_path, "config.json", json.dumps(saved, indent=2))) == RunConfig()


def test_a_path_in_a_file_may_start_with_the_home_folder(tmp_path, monkeypatch):
  """Held-out probe 57: output: {dir: ~/x} made a folder named '~' in the working directory."""
  monkeypatch.setenv("HOME", str(tmp_path))
  config = read_config(written(tmp_path, "home.yaml", "output: {dir: ~/runs/a}\ndata: {data_dir: ~/data}\n"))
  assert (config.output.dir, config.data.data_dir) == (str(tmp_path / "runs" / "a"), str(tmp_path / "data"))


def test_a_files_folder_actions_are_left_to_the_command(tmp_path):
  """Held-out probe 6: a file's output.resume_unchecked asked for --resume, and with --resume asked again (a file's
  resume is the command's to give, so it was always dropped)."""
  config = read_config(written(tmp_path, "actions.yaml", "output: {resume: true, resume_unchecked: true, "
                                                           "repair_metrics: true}\nrounds: 2\n"))
  assert config.rounds == 2 and not (config.output.resume or config.output.resume_unchecked
                                     or config.output.repair_metrics)


def test_yaml_reads_exponents_as_numbers_and_the_extension_in_any_case(tmp_path):
  """Held-out probes 1 and 42: learning_rate: 1e-3 was the text '1e-3' (PyYAML wants 1.0e-3), and a file named
  .YAML was read as JSON; another name says it was read as JSON."""
  assert read_config(written(tmp_path, "exp.YAML", "client: {learning_rate: 1e-3}\n")).client.learning_rate == 0.001
  with pytest.raises(ValueError, match=r"not valid JSON .*\(read as JSON: a YAML file's name ends in \.yaml\)"):
    read_config(written(tmp_path, "run.txt", "rounds: 3\n"))


def test_an_unquoted_off_is_read_as_the_choice_off_where_a_setting_has_it(tmp_path):
  """Held-out probe U4: YAML 1.1 reads an unquoted off as false, so divergence: {action: off} was refused as
  "must be one of stop, rollback, off, got False"."""
  assert read_config(written(tmp_path, "off.yaml", "divergence: {action: off}\n")).divergence.action == "off"
  assert read_config(written(tmp_path, "flat.yaml", "on_divergence: OFF\n")).divergence.action == "off"
  with pytest.raises(ValueError, match=r"divergence.action \(line 1\) must be one of stop, rollback, off, got 'false'"):
    read_config(written(tmp_path, "false.yaml", "divergence: {action: false}\n"))  # (false is not a word it lists)
  assert read_config(written(tmp_path, "flag.yaml", "output: {progress: off}\n")).output.progress is False


def test_one_number_where_a_list_is_declared_reads_as_its_flag_reads_it(tmp_path):
  """(A probe survey: client_dropout: 0.3 was refused as "must be a sequence", where --client-dropout 0.3 runs.)"""
  config = read_config(written(tmp_path, "drop.yaml", "federation: {client_dropout: 0.3}\n"))
  flag = RunConfig.from_flags(client_dropout=(0.3,))
  assert config.federation.client_dropout == (0.3,) == flag.federation.client_dropout
  assert read_config(written(tmp_path, "flat.json", '{"client_dropout": 0}')).federation.client_dropout == (0,)


def test_what_a_file_says_of_the_folder_or_of_a_runs_history_is_dropped_with_a_note(tmp_path):
  """Held-out probes S1 and S2: a file's output.overwrite, processes and segments were dropped in silence (the
  rerun then asked for --overwrite; the run used 1 process and the file's first learning rate)."""
  from fedjax_hetero.cli import run as cli
  path = written(tmp_path, "run.yaml", "rounds: 1\noutput: {overwrite: true, resume: false, checkpoint_every: 1}\n"
                 "processes: 3\nsegments: [{from_round: 1, settings: {client.learning_rate: 0.5}}]\n")
  config, _, args, _ = cli.parse(["--config", path, "--output-dir", str(tmp_path / "o")], "synthetic")
  assert not config.output.overwrite and config.output.checkpoint_every == 1 and config.client.learning_rate != 0.5
  assert args.notes == [f"note: --config {path} drops output.overwrite (line 2): the command's flags say what to do "
                        "with the folder (--overwrite); drops processes (line 3): the command's flags say how many "
                        "processes run it (--num-processes); drops segments (line 4): a run's history, which its "
                        "results folder's config.json records (to change a local-training setting from a round on, "
                        "--resume the run with the new value)"]
  flat = written(tmp_path, "flat.json", '{"rounds": 1,\n "resume_or_start": true}')
  _, _, args, _ = cli.parse(["--config", flat, "--output-dir", str(tmp_path / "o")], "synthetic")
  assert args.notes == [f"note: --config {flat} drops resume_or_start (line 2): the command's flags say what to do "
                        "with the folder (--resume-or-start)"]


def test_a_new_run_from_a_resumed_runs_config_json_says_which_value_it_trains_with(tmp_path):
  """Held-out probe S3: a run resumed at round 42 with another learning rate left a config.json whose new run
  trained every round with the later rate, in silence. A results folder's own history and actions pass silently."""
  from fedjax_hetero.cli import run as cli
  folder = tmp_path / "lr1"
  folder.mkdir()
  segments = [{"from_round": 1, "settings": {"client.learning_rate": 0.001, "client.epochs": 1}, "reason": "start"},
              {"from_round": 42, "settings": {"client.learning_rate": 0.01, "client.epochs": 1}, "reason": "resumed"}]
  saved = as_dict(RunConfig.from_flags(dataset="synthetic", learning_rate=0.01, output_dir=str(folder), resume=True))
  path = written(folder, "config.json", json.dumps({**saved, "segments": segments, "rollbacks": [], "processes": 1}))
  history = "(client.learning_rate 0.001 from round 1, 0.01 from round 42)"
  for flags, used in (([], 0.01), (["--lr", "0.05"], 0.05)):
    config, _, args, _ = cli.parse(["--config", path, "--output-dir", str(tmp_path / "new"), *flags], "synthetic")
    assert config.client.learning_rate == used
    assert args.notes == [f"note: --config {path} records a run whose local training changed partway {history}; "
                          f"this run trains every round with client.learning_rate {used}"]
  _, _, args, _ = cli.parse(["--config", path, "--output-dir", str(folder), "--resume"], "synthetic")
  assert args.notes == [], "the run itself, resumed: its history goes on"
  written(folder, "config.json", json.dumps({**saved, "segments": segments[:1], "rollbacks": [], "processes": 1}))
  assert cli.parse(["--config", path, "--output-dir", str(tmp_path / "new")], "synthetic")[2].notes == []
