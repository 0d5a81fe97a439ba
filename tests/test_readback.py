"""What a resume (and `compare`) reads back is checked: metrics.jsonl one row per round (or rebuilt with
--repair-metrics), config.json a run's settings (or --resume-unchecked), the data the run's own, and each
checkpoint's recorded round its folder's name. Each error names the file (and line) before any compute."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import chex
import pytest

from fedjax_hetero.data import synthetic_dataset
from fedjax_hetero.run import metrics_log
from fedjax_hetero.run.runner import run_experiment
from experiments import compare
from tests.test_runner import base_config, read_rows, restore

# One worker runs the module, so its module-scoped runs train once (scripts/test.sh: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("readback")


@pytest.fixture(scope="module")
def dataset():
  return synthetic_dataset(num_train=240, num_test=64, seed=0)


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
  """An uninterrupted run of the four rounds the resumes below end at."""
  config = base_config(tmp_path_factory.mktemp("straight"), checkpoint_every=1)
  run_experiment(config, dataset, log=lambda _: None)
  return config


@pytest.fixture(scope="module")
def two_rounds(dataset, tmp_path_factory):
  """The first two rounds of `straight`'s run (checkpoints 1 and 2); each test resumes a copy."""
  out = tmp_path_factory.mktemp("two_rounds") / "run"
  run_experiment(base_config(out, rounds=2, checkpoint_every=1), dataset, log=lambda _: None)
  return out


def copy_of(two_rounds, out, **changes):
  shutil.copytree(two_rounds, out)
  return base_config(out, checkpoint_every=1, resume=True, **changes)


def edit_lines(path, edit):
  lines = path.read_text().splitlines()
  path.write_text("".join(line + "\n" for line in edit(lines)))


def same_history(config, straight, dataset):
  rows, want = read_rows(config.output.dir), read_rows(straight.output.dir)
  assert [r["round"] for r in rows] == [1, 2, 3, 4]
  assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in want]
  assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in want]
  chex.assert_trees_all_equal(restore(config, dataset)[0].models, restore(straight, dataset)[0].models)


# (name, edit of the metrics.jsonl lines, regex of the error)
BAD_METRICS = [
    ("deleted", None, r"metrics.jsonl does not exist, but the checkpoint resumed from is of round 2"),
    ("emptied", lambda lines: [], r"metrics.jsonl holds no row, but the checkpoint resumed from is of round 2"),
    ("first row missing", lambda lines: lines[1:], r"metrics.jsonl, line 1, holds round 2, but round 1 is missing"),
    ("last row missing", lambda lines: lines[:1], r"metrics.jsonl holds the rows of rounds 1-1, but the checkpoint "
                                                  r"resumed from is of round 2: the history of rounds 2-2 is missing"),
    ("a row twice", lambda lines: [lines[0], *lines], r"metrics.jsonl, line 2, holds round 1 again"),
    ("a line 42", lambda lines: [lines[0], "42", lines[1]], r"metrics.jsonl, line 2, is not a metrics row but 42"),
    ("a line {}", lambda lines: [*lines, "{}"], r"metrics.jsonl, line 3, is not a metrics row: it has no round"),
    ("rows reversed", lambda lines: lines[::-1], r"metrics.jsonl, line 1, holds round 2, but round 1 is missing"),
    ("a round of text", lambda lines: [lines[0].replace('"round": 1', '"round": "1"'), lines[1]],
     r"metrics.jsonl, line 1, holds round \"1\", which is not a round number"),
]


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [c[1:] for c in BAD_METRICS], ids=[c[0] for c in BAD_METRICS])
def test_a_damaged_metrics_file_is_an_error_naming_it_and_the_line(dataset, two_rounds, tmp_path, edit, message):
  config = copy_of(two_rounds, tmp_path / "run", rounds=3)
  path = tmp_path / "run" / "metrics.jsonl"
  if edit is None:
    path.unlink()
  else:
    edit_lines(path, edit)
  before = path.read_bytes() if path.exists() else None
  with pytest.raises(metrics_log.MetricsError, match=message + r".*--repair-metrics"):
    run_experiment(config, dataset, log=lambda _: None)
  assert (path.read_bytes() if path.exists() else None) == before, "the file is left as it was"


@pytest.mark.parametrize("edit", [lambda lines: [lines[0], "42", lines[0], lines[1]], None],
                         ids=["a foreign and a repeated row", "deleted"])
def test_repair_metrics_rebuilds_the_history_of_an_uninterrupted_run(dataset, straight, two_rounds, tmp_path, edit):
  config = copy_of(two_rounds, tmp_path / "run", repair_metrics=True)
  path = tmp_path / "run" / "metrics.jsonl"
  if edit is None:
    path.unlink()
  else:
    edit_lines(path, edit)
  logs = []
  run_experiment(config, dataset, log=logs.append)
  notes = [line for line in logs if line.startswith("note: --repair-metrics")]
  if edit is None:
    assert "kept no row" in notes[0] and "moved the checkpoints of rounds 1, 2" in notes[1], notes
    assert notes[1].endswith("resumes from the start (no checkpoint is left)"), notes
  else:
    assert "kept the rows of rounds 1-2; dropped line 2 (is not a metrics row but 42); line 3 (round 1 again)" \
        in notes[0], notes
  same_history(config, straight, dataset)


def test_repair_metrics_says_which_checkpoint_the_run_goes_on_from(dataset, straight, two_rounds, tmp_path):
  """(A probe survey: with no checkpoint left at or before the rows kept, it said the run resumed "from the latest
  checkpoint up to round 1", then retrained from round 0.)"""
  config = copy_of(two_rounds, tmp_path / "run", repair_metrics=True)
  edit_lines(tmp_path / "run" / "metrics.jsonl", lambda lines: [lines[0], "42"])
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "1")
  logs = []
  run_experiment(config, dataset, log=logs.append)
  [kept, moved] = [line for line in logs if line.startswith("note: --repair-metrics")]
  assert "kept the rows of rounds 1-1" in kept and "moved the checkpoints of rounds 2" in moved, logs
  assert moved.endswith("resumes from the start (no checkpoint is left); rounds 1-1 are trained again too, their "
                        "kept rows replaced"), moved
  same_history(config, straight, dataset)


# (name, content of config.json, regex of the error)
BAD_CONFIGS = [
    ("empty", "", r"config.json is empty"),
    ("half-written", None, r"config.json is not valid JSON \(.*; half-written\?\)"),
    ("a list", "[]", r"config.json holds list \[\], not a JSON object"),
    ("a number for data", '{"data": 5}', r"config.json does not hold a run's settings \(ValueError: 'data' must be an "
                                         r"object of settings"),
    ("segments of text", '{"segments": "many"}', r"config.json: 'segments' is not a list of objects"),
]


@pytest.mark.parametrize("content, message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_an_unreadable_config_json_is_named_before_compute(dataset, two_rounds, tmp_path, no_compute, content,
                                                           message):
  config = copy_of(two_rounds, tmp_path / "run", rounds=3)
  path = tmp_path / "run" / "config.json"
  path.write_text(path.read_text()[:len(path.read_text()) // 2] if content is None else content)
  with pytest.raises(ValueError, match=rf"^cannot resume: {re.escape(str(tmp_path))}.*{message}.*"
                                       r"pass --resume-unchecked to continue"):
    run_experiment(config, dataset, log=lambda _: None)


def test_without_its_settings_a_folder_resumes_only_unchecked(dataset, straight, two_rounds, tmp_path, no_compute):
  config = copy_of(two_rounds, tmp_path / "run", seed=1)
  for name in ("config.json", "summary.json"):
    os.remove(tmp_path / "run" / name)
  with pytest.raises(ValueError, match=r"holds checkpoints or metrics but no config.json \(or summary.json\).*"
                                       r"--resume-unchecked"):
    run_experiment(config, dataset, log=lambda _: None)


def test_resume_unchecked_continues_and_sets_an_unreadable_config_aside(dataset, straight, two_rounds, tmp_path):
  config = copy_of(two_rounds, tmp_path / "run", resume_unchecked=True)
  (tmp_path / "run" / "config.json").write_text("{half")
  logs = []
  run_experiment(config, dataset, log=logs.append)
  assert any(line.startswith("warning: --resume-unchecked: ") and "config.json is not valid JSON" in line
             for line in logs), logs
  assert (tmp_path / "run" / "config.json.unreadable").read_text() == "{half"
  # (A probe survey: the readable summary.json beside it was called unreadable too.)
  assert (tmp_path / "run" / "summary.json.set-aside").exists() and any(
      line.endswith("summary.json.set-aside; this command's settings are used unchecked") for line in logs), logs
  same_history(config, straight, dataset)


def test_a_resume_from_summary_json_alone_keeps_the_runs_segments(dataset, straight, two_rounds, tmp_path):
  """(A probe survey: with config.json gone, the resume read the settings from summary.json but dropped the
  segments it records, so the new summary began at the resume.)"""
  config = copy_of(two_rounds, tmp_path / "run")
  os.remove(tmp_path / "run" / "config.json")
  summary = run_experiment(config, dataset, log=lambda _: None)
  assert [(s["from_round"], s["reason"], s["rounds"]) for s in summary["segments"]] == [(1, "start", [1, 4])]
  with open(tmp_path / "run" / "config.json") as f:
    assert [s["from_round"] for s in json.load(f)["segments"]] == [1]
  same_history(config, straight, dataset)


def test_a_summary_older_than_the_metrics_is_not_read_as_the_runs_history(dataset, two_rounds, tmp_path):
  """(A review: a summary.json written before a later session that was killed would have credited that session's
  rounds to the settings before it.)"""
  config = copy_of(two_rounds, tmp_path / "run")
  os.remove(tmp_path / "run" / "config.json")
  path = tmp_path / "run" / "summary.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), "final_round": 1}))  # (as if round 2 came after it)
  logs = []
  summary = run_experiment(config, dataset, log=logs.append)
  assert f"note: {path} holds no record of the run's segments up to round 2 (config.json is gone); the record " \
         "starts again at this resume" in logs, logs
  assert [(s["from_round"], s["rounds"]) for s in summary["segments"]] == [(3, [3, 4])]


def test_a_damaged_summary_beside_a_good_config_does_not_stop_a_resume(dataset, straight, two_rounds, tmp_path):
  config = copy_of(two_rounds, tmp_path / "run")
  (tmp_path / "run" / "summary.json").write_text('{"method": "Het')
  run_experiment(config, dataset, log=lambda _: None)
  same_history(config, straight, dataset)


def test_a_resume_on_other_data_is_refused(two_rounds, tmp_path, dataset):
  config = copy_of(two_rounds, tmp_path / "run", rounds=3)
  other = synthetic_dataset(num_train=240, num_test=64, seed=1)
  with pytest.raises(ValueError, match=r"cannot resume: the data differ from those the run .* trained on \(.*"
                                       r"train_images: the same size \(240x8x8x1 uint8\), other content.*; was "
                                       r"--data-dir pointed at other files\?"):
    run_experiment(config, other, log=lambda _: None)
  recorded = json.loads((tmp_path / "run" / "data_fingerprint.json").read_text())
  assert set(recorded) == {"train_images", "train_labels", "client_index_table", "test_images", "test_labels"}
  run_experiment(config, dataset, log=lambda _: None)  # the run's own data (a copy elsewhere is the same)


def test_a_checkpoint_whose_round_is_not_its_folder_name_is_skipped_as_damaged(dataset, straight, two_rounds,
                                                                                tmp_path):
  config = copy_of(two_rounds, tmp_path / "run", rounds=4)
  checkpoints = tmp_path / "run" / "checkpoints"
  os.rename(checkpoints / "2", checkpoints / "3")
  logs = []
  run_experiment(config, dataset, log=logs.append)
  assert any("checkpoints/3 cannot be restored (ValueError: it records round 2, but its folder is named 3)" in line
             for line in logs), logs
  assert "resumed from round 1" in logs
  same_history(config, straight, dataset)


@pytest.mark.parametrize("leftover", ["3.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1795791056"])
def test_the_unfinished_save_of_a_killed_run_is_removed_quietly_on_resume(dataset, straight, two_rounds, tmp_path,
                                                                          caplog, leftover):
  """(kill -9 during a save leaves orbax's temporary folder, as below; the resume printed orbax's warnings about it.)"""
  config = copy_of(two_rounds, tmp_path / "run", rounds=4)
  unfinished = tmp_path / "run" / "checkpoints" / leftover
  (unfinished / "default.orbax-checkpoint-tmp").mkdir(parents=True)
  (unfinished / "_CHECKPOINT_METADATA").write_text('{"item_handlers": null, "metrics": {}, "custom_metadata": {}}')
  logs = []
  with caplog.at_level("WARNING"):
    run_experiment(config, dataset, log=logs.append)
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], "orbax warned"
  assert not unfinished.exists()
  assert logs[1:3] == [f"removed {unfinished}: a checkpoint save that did not finish (the process ended during it)",
                      "resumed from round 2"], logs
  same_history(config, straight, dataset)


@pytest.mark.parametrize("edit, message", [
    (lambda lines: [lines[0], "42", *lines[1:]], r"metrics.jsonl, line 2, is not a metrics row but 42$"),
    (lambda lines: [lines[0], *lines], r"metrics.jsonl, line 2, holds round 1 again \(a row per round is expected: "
                                       r"round 2 was due\)$")])
def test_compare_names_a_damaged_metrics_line(two_rounds, tmp_path, edit, message):
  shutil.copytree(two_rounds, tmp_path / "run")
  edit_lines(tmp_path / "run" / "metrics.jsonl", edit)
  with pytest.raises(SystemExit, match=r"^error: .*" + message):
    compare.main([str(tmp_path / "run"), "--output", str(tmp_path / "c.png")])


def test_compare_names_a_damaged_summary(two_rounds, tmp_path):
  shutil.copytree(two_rounds, tmp_path / "run")
  (tmp_path / "run" / "summary.json").write_text("")
  with pytest.raises(SystemExit, match=r"^error: .*summary.json is empty$"):
    compare.main([str(tmp_path / "run"), "--output", str(tmp_path / "c.png")])


_CLOSED_LOOP = (
    'Traceback (most recent call last):\n'
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
    '    self._check_closed()\n'
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 519, in _check_closed\n'
    "    raise RuntimeError('Event loop is closed')\n"
    'RuntimeError: Event loop is closed\n')


def test_a_failed_restores_late_reads_print_nothing_and_every_other_line_passes():
  """(A resume that skipped a damaged checkpoint printed these tracebacks, from tensorstore's threads, two of them
  interleaved line by line.) Written in pieces of any size, they are dropped; a real traceback, and progress text
  without a newline, pass as they come."""
  import io

  from fedjax_hetero.run.checkpoints import _ClosedLoopNoiseDropped
  lines = _CLOSED_LOOP.splitlines(keepends=True)
  interleaved = "".join(a + b for a, b in zip(lines, lines))
  real = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: real\n'
  for size in (1, 7, 37, len(interleaved)):
    out = io.StringIO()
    stream = _ClosedLoopNoiseDropped(out)
    text = _CLOSED_LOOP + interleaved + real
    for i in range(0, len(text), size):
      stream.write(text[i:i + size])
    assert out.getvalue() == real, size
    stream.write("\rround 3/10")
    assert out.getvalue().endswith("\rround 3/10")


def test_a_resume_on_a_rewritten_partition_file_names_the_file(tmp_path, dataset):
  """(Second held-out survey: the refusal asked whether --data-dir was pointed at other files.)"""
  parts = tmp_path / "parts.json"
  blocks = [list(range(c * 60, c * 60 + 60)) for c in range(4)]
  parts.write_text(json.dumps(blocks))
  config = base_config(tmp_path / "run", rounds=1, checkpoint_every=1, num_clients=4, partition_file=str(parts))
  run_experiment(config, dataset, log=lambda _: None)
  parts.write_text(json.dumps(blocks[::-1]))
  with pytest.raises(ValueError, match=r"client_index_table: .*; was --partition-file pointed at other files\?"):
    run_experiment(config.replace(rounds=2, resume=True), dataset, log=lambda _: None)
