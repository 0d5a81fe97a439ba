"""`python -m experiments.compare`: the table and plot over finished runs."""

from __future__ import annotations

import json
import os
import re
from unittest import mock

import numpy as np
import pytest

from fedjax_hetero.analysis import runs as run_stats, tables
from fedjax_hetero.cli import compare
from fedjax_hetero.config import RunConfig
from fedjax_hetero.run.runner import run_experiment

pytestmark = pytest.mark.slow  # end to end (`pytest -m "not slow"` leaves it out)


def test_compare_tables_and_plots_two_runs(tmp_path):
  dirs = []
  for method in ("FedAvg", "HeteroAvg"):
    out = str(tmp_path / method)
    run_experiment(RunConfig.from_flags(dataset="synthetic", method=method, groups=("mlp@0.5", "mlp"), num_clients=4,
                                        clients_per_round=2, rounds=2, eval_every=1, output_dir=out, progress=False),
                   log=lambda m: None)
    dirs.append(out)
  plot = str(tmp_path / "cmp.png")
  text = compare.main(dirs + ["--labels", "a,b", "--output", plot, "--last", "2"])
  rows = text.splitlines()
  assert len(rows) == 4 and rows[2].startswith("| a | FedAvg | 2 |") and rows[3].startswith("| b | HeteroAvg | 2 |")
  assert os.path.getsize(plot) > 1000
  cut = compare.main(dirs + ["--up-to-round", "1"]).splitlines()
  assert cut[2].startswith(f"| {os.path.basename(dirs[0])} | FedAvg | 1 |")
  with pytest.raises(SystemExit, match="--up-to-round must be at least 1, got 0"):
    compare.main(dirs + ["--up-to-round", "0"])
  with pytest.raises(SystemExit, match="2 labels for 1 runs"):
    compare.main(dirs[:1] + ["--labels", "a,b"])
  with pytest.raises(SystemExit, match="not found"):
    compare.main([str(tmp_path)])


def fake_run(method, seed, accuracies, dissimilarity=None, groups=None):
  """A run's (label, summary, rows); ``groups``: group name -> its accuracy per round, beside the mean."""
  groups = groups or {}
  rows = [{"round": r, "round_seconds": 1.0,
           "test_accuracy": None if a is None else {**{g: acc[r - 1] for g, acc in groups.items()}, "mean": a},
           **({"dissimilarity": {"g": {"low": dissimilarity, "high": 2 * dissimilarity}}} if dissimilarity else {})}
          for r, a in enumerate(accuracies, start=1)]
  return f"{method}_s{seed}", {"method": method, "config": {"federation": {"seed": seed}}}, rows


# Baseline A against B, seeds 0 and 1, rounds 1-5. Per-round differences B - A (points):
#   seed 0: +10, 0, -5, +10, +5;  seed 1: -10, +20, (round 3: A has no evaluation), 0, +20.
# Groups (seed 0 only; seed 1 logged only the mean): "small" differs by +10, 0, -10, +10, +20; "big" by 0 at
# every round; B's "tiny" has no counterpart in A.
SMALL_A, SMALL_B = [0.4, 0.5, 0.6, 0.7, 0.7], [0.5, 0.5, 0.5, 0.8, 0.9]
BIG = [0.6, 0.7, 0.8, 0.9, 0.9]


def paired_runs():
  return [fake_run("A", 0, [0.50, 0.60, 0.70, 0.80, 0.80], groups={"small": SMALL_A, "big": BIG}),
          fake_run("A", 1, [0.50, 0.50, None, 0.70, 0.70]),
          fake_run("B", 0, [0.60, 0.60, 0.65, 0.90, 0.85], groups={"small": SMALL_B, "big": BIG, "tiny": BIG}),
          fake_run("B", 1, [0.40, 0.70, 0.95, 0.70, 0.90])]


def write_run(folder, label, summary, rows):
  path = folder / label
  path.mkdir()
  (path / "summary.json").write_text(json.dumps(summary))
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_main_prints_the_paired_tables_from_results_folders(tmp_path):
  dirs = [write_run(tmp_path, *run) for run in paired_runs()]
  text = compare.main(dirs + ["--baseline", "A", "--window", "2"])
  assert "| B | +5.00 | +1.67 | +12.50 |" in text
  assert "per architecture group" not in text and "per seed (best" not in text  # only with --per-group, --target
  text = compare.main(dirs + ["--baseline", "A", "--per-group", "--target", "0.85"])
  assert "per window of rounds:\n| method - A, rounds | 1-2 | 3-4 | 5 |" in text
  assert "| B | small | 1 | +6.00" in text and "| B | 1 | 90.00 | 70.00 | +20.00 | 5 | not reached |" in text
  with pytest.raises(SystemExit, match="--window must be at least 1"):
    compare.main(dirs + ["--baseline", "A", "--window", "0"])
  for flag in ("--last", "--up-to-round"):  # (--last -2 divided by zero; --last 0 averaged every evaluation)
    for value in ("0", "-2"):
      with pytest.raises(SystemExit, match=f"error: {flag} must be at least 1, got {value}"):
        compare.main(dirs + [flag, value])


def test_the_paired_plot_draws_every_seed_and_their_mean_per_method(tmp_path, capsys):
  from fedjax_hetero.run.plot import figure

  made = []

  def kept(*args, **kwargs):
    made.append(figure(*args, **kwargs))
    return made[-1]

  dirs = [write_run(tmp_path, *run) for run in paired_runs() + [fake_run("C", 0, [0.4, 0.5, 0.6, 0.7, 0.7])]]
  with mock.patch("fedjax_hetero.analysis.plots._figure", side_effect=kept):
    compare.main(dirs + ["--baseline", "A", "--paired-output", str(tmp_path / "paired")])
  assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 'paired.png'}\n") and (tmp_path / "paired.png").exists()
  [fig] = made
  panels = [ax for ax in fig.axes if ax.get_visible()]
  # B: the seeds' means +4 and +7.5 (see paired_runs); C: seed 0 only, -10 at every round.
  assert [ax.get_title() for ax in panels] == ["B − A: +5.75 [-16.49, +27.99], 2 seeds", "C − A: -10.00, 1 seed"]
  lines = [[(line.get_label(), line.get_xydata().tolist()) for line in ax.get_lines()
            if not line.get_label().startswith("_")] for ax in panels]
  assert [label for label, _ in lines[0]] == ["seed 0", "seed 1", "mean over seeds"]
  np.testing.assert_allclose(lines[0][2][1], [[1, 0], [2, 10], [4, 5], [5, 12.5]], atol=1e-9)  # (round 3: 1 seed)
  np.testing.assert_allclose(lines[1][1][1], [[r, -10] for r in range(1, 6)], atol=1e-9)


def test_variants_spread_over_seeds_few_evaluations_and_runs_that_share_no_round(tmp_path):
  """A sweep's runs are variants of their method (not merged, not refused), with mean ± std over their seeds;
  "last 3" says when it had fewer; a baseline no run pairs with says so instead of an empty table."""
  def swept(mu, seed, accuracies):
    label, summary, rows = fake_run("FedProx", seed, accuracies)
    summary["config"] = {"federation": {"seed": seed}, "method": {"prox": {"mu": mu}}}
    return label + f"_mu{mu}", summary, rows
  runs = run_stats.with_variants([swept(0.1, 0, [0.5, 0.6]), swept(0.1, 1, [0.5, 0.7]), swept(0.3, 0, [0.4, 0.5]),
                                swept(0.3, 1, [0.6, 0.8]), fake_run("FedAvg", 0, [0.5, 0.5])])
  assert [run_stats.method_of(s) for _, s, _ in runs][:3] == ["FedProx [method.prox.mu=0.1]"] * 2 + [
      "FedProx [method.prox.mu=0.3]"]
  spread = tables.seeds_table(runs).splitlines()
  assert spread[2] == "| FedProx [method.prox.mu=0.1] | 2 | 65.00 ± 7.07 | 65.00 ± 7.07 |", spread
  assert spread[3] == "| FedProx [method.prox.mu=0.3] | 2 | 65.00 ± 21.21 | 65.00 ± 21.21 |", spread
  assert "| 55.00 (of 2) |" in tables.table(runs, last=3)
  lines = tables.paired_table(runs, "FedAvg").splitlines()
  assert [line.split(" | ")[0] for line in lines[2:]] == ["| FedProx [method.prox.mu=0.1]",
                                                          "| FedProx [method.prox.mu=0.3]"]
  apart = [fake_run("FedAvg", 0, [0.5, None]), fake_run("FedProx", 0, [None, 0.6])]  # no round both evaluated
  for label, summary, rows in apart:
    folder = tmp_path / label
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = compare.main([str(tmp_path / label) for label, _, _ in apart] + ["--baseline", "FedAvg"])
  assert "no run pairs with FedAvg's: none has the seed of one of its runs and a round both evaluated" in text


def test_a_single_shared_round_has_no_interval_and_nothing_prints_nan(tmp_path):
  """One round pair has no spread: the interval says so instead of [+nan, +nan] (probe 107), in the paired and
  the per-group table; two seeds sharing one round each are two pairs, which do have an interval."""
  one = [fake_run("A", 0, [0.5], groups={"small": [0.4]}), fake_run("B", 0, [0.6], groups={"small": [0.45]})]
  assert tables.paired_table(one, "A").splitlines()[2] == (
      "| B | 1 | +10.00 [n/a: 1 shared round] | 100% of 1 | +10.00 | +10.00 [n/a: 1 seed] | s0: +10.00 |")
  assert tables.group_table(one, "A").splitlines()[2] == (
      "| B | small | 1 | +5.00 [n/a: 1 shared round] | 100% of 1 | +5.00 | +5.00 [n/a: 1 seed] |")
  two_seeds = one + [fake_run("A", 1, [0.5]), fake_run("B", 1, [0.7])]
  # (over the seeds, +10 and +20: 15 -/+ 12.706 x 7.071 / sqrt(2) = 63.53)
  assert "+15.00 [+5.20, +24.80] | 100% of 2 | +15.00 | +15.00 [-48.53, +78.53] |" in tables.paired_table(
      two_seeds, "A")
  apart_in_time = [fake_run("A", 0, [0.5, None, 0.6]), fake_run("B", 0, [None, 0.7, 0.8])]  # share round 3 only
  dirs = [write_run(tmp_path, *run) for run in apart_in_time]
  text = compare.main(dirs + ["--baseline", "A", "--per-group", "--target", "0.55"])
  assert "| B | 1 | +20.00 [n/a: 1 shared round] | 100% of 1 | +20.00 | +20.00 [n/a: 1 seed] | s0: +20.00 |" in text
  assert "n/a: 1 shared round" in text and "nan" not in text and "inf" not in text


def test_an_unwritable_plot_folder_a_closed_stdout_and_an_unfinished_run_are_one_line_each(tmp_path, capsys):
  """(Probes: a plot into a missing folder and `compare ... | head -1` ended in tracebacks after the table; a
  killed run's folder asked whether it was a results folder, with no way forward.)"""
  import subprocess
  import sys
  dirs = [write_run(tmp_path, *fake_run("A", 0, [0.5, 0.6])), write_run(tmp_path, *fake_run("B", 0, [0.4, 0.7]))]
  made = tmp_path / "new" / "sub" / "plot.png"
  compare.main(dirs + ["--output", str(made)])
  assert made.exists(), "the plot's folder is made, as a run's --output-dir is"
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit, match=r"^error: --output '.*file/plot.png': .*\(E(NOTDIR|EXIST)"):
    compare.main(dirs + ["--output", str(tmp_path / "file" / "plot.png")])
  with pytest.raises(SystemExit, match=r"^error: --output '/proc/plot.png': "):  # (probe 60: no file goes there)
    compare.main(dirs + ["--output", "/proc/plot.png"])
  piped = subprocess.run(f"{sys.executable} -m fedjax_hetero.cli compare {' '.join(dirs)} --output "
                         f"{tmp_path / 'p.png'} | head -1", shell=True, capture_output=True, text=True)
  assert "Traceback" not in piped.stderr and (tmp_path / "p.png").exists(), piped.stderr
  killed = tmp_path / "killed"
  killed.mkdir()
  (killed / "metrics.jsonl").write_text(json.dumps({"round": 1}) + "\n")
  with pytest.raises(SystemExit, match=r"killed' has rows \(metrics.jsonl\) but neither summary.json nor "
                                       "config.json, .*: it cannot be compared or resumed"):
    compare.main([dirs[0], str(killed)])  # (no config.json either: not a run compare can read, nor resume)


def test_an_unfinished_run_is_compared_up_to_its_last_row_with_a_note(tmp_path):
  """Held-out probe 68: a run still training (or killed) could not be compared until it finished."""
  label, summary, rows = fake_run("A", 0, [0.5, 0.6, 0.7])
  summary["config"]["method"] = {"name": "A"}  # (as a real summary.json's config)
  finished = write_run(tmp_path, label, summary, rows)
  label, summary, rows = fake_run("B", 0, [0.4, 0.65])
  running = tmp_path / "running"
  running.mkdir()
  (running / "config.json").write_text(json.dumps({**summary["config"], "method": {"name": "B"}, "rollbacks": [],
                                                   "segments": [{"from_round": 1}], "processes": 1}))
  (running / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = compare.main([finished, str(running), "--baseline", "A"])
  assert "| running | B | 2 | 65.00 | 65.00 |" in text
  assert "note: running has not finished (no summary.json): its rows up to round 2 are compared" in text
  assert "| B | 1 | -2.50 [" in text, "paired with A at the two rounds both evaluated"
  (running / "config.json").write_text(json.dumps({**summary["config"], "method": {"name": "A"}, "rollbacks": [],
                                                   "segments": [{"from_round": 1}], "processes": 1}))
  assert "| running | A | 2 |" in compare.main([finished, str(running)]), (
      "the folder's history (segments, rollbacks) made its run a variant of its method (held-out probe 53)")


def test_runs_that_end_at_different_rounds_get_a_note_naming_the_cut_that_equals_them(tmp_path):
  """Held-out probes 66 and 69: a 5-round run beside a 3-round run showed final and best accuracies of different
  rounds side by side, with nothing saying so."""
  runs = [fake_run("A", 0, [0.5, 0.6, 0.7, 0.8, 0.9]), fake_run("B", 0, [0.6, 0.7, 0.75])]
  dirs = [write_run(tmp_path, *run) for run in runs]
  text = compare.main(dirs)
  assert ("note: the runs end at different rounds (A_s0 5, B_s0 3): their final, best and last columns are not at "
          "the same rounds; --up-to-round 3 compares them at equal rounds") in text
  assert "note:" not in compare.main(dirs + ["--up-to-round", "3"])


def test_runs_of_different_datasets_get_a_note(tmp_path):
  """Held-out probe 31: a Fashion-MNIST run paired with a synthetic one printed a difference with no word."""
  runs = [fake_run("A", 0, [0.5, 0.6]), fake_run("B", 0, [0.6, 0.7])]
  for (_, summary, _), dataset in zip(runs, ("fashion_mnist", "synthetic")):
    summary["config"]["data"] = {"dataset": dataset}
  text = compare.main([write_run(tmp_path, *run) for run in runs] + ["--baseline", "A"])
  assert "note: the runs trained on different datasets (A_s0 fashion_mnist, B_s0 synthetic)" in text


def test_the_plot_has_a_panel_per_group_with_per_group_and_wraps_into_rows(tmp_path):
  from matplotlib.image import imread

  from fedjax_hetero.analysis.plots import plot_accuracy_per_round

  groups = {"narrow": [0.2, 0.3], "mid": [0.4, 0.5], "wide": [0.5, 0.7]}
  runs = [fake_run("A", 0, [0.4, 0.5], dissimilarity=0.5, groups=groups)]
  mean_only = imread(plot_accuracy_per_round(runs, str(tmp_path / "a.png"), "t", [{}]))
  per_group = imread(plot_accuracy_per_round(runs, str(tmp_path / "b.png"), "t", [{}], list(groups)))
  # 1 + 2 dissimilarity panels in a row; 1 + 3 groups + 2 in two rows of three, as wide
  assert per_group.shape[1] == mean_only.shape[1] and per_group.shape[0] == 2 * mean_only.shape[0]


def test_runs_that_share_no_evaluated_round_get_a_cut_both_evaluated_or_none(tmp_path):
  """Held-out probe U9: the note suggested --up-to-round 1 for a run evaluated at rounds 2-3 beside a one-round run,
  and that cut then failed ("has no evaluation in the rounds compared")."""
  apart = [fake_run("A", 0, [None, 0.6, 0.7]), fake_run("B", 0, [0.5])]
  assert "no round was evaluated by all of them, so no --up-to-round compares them" in tables.length_note(apart)
  later = [fake_run("A", 0, [0.5, None, 0.7, 0.8]), fake_run("B", 0, [0.5, 0.6, None])]
  note = tables.length_note(later)
  assert "--up-to-round 1 compares them at equal rounds (the last round all of them evaluated)" in note, note
  dirs = [write_run(tmp_path, *run) for run in later]
  assert "| A_s0 | A | 1 |" in compare.main(dirs + ["--up-to-round", "1"]), "the cut it names works"


@pytest.mark.parametrize("value, message", [("87", r"--target 87 is a fraction of 1 \(0.87 for 87%\)$"),
                                            ("2", r"--target 2 is a fraction of 1 \(0.02 for 2%\)$"),
                                            ("0", r"--target 0 is a fraction of 1 \(0.87 for 87%\)$")])
def test_a_target_above_one_is_refused_as_a_percentage(tmp_path, value, message):
  """Held-out probe S8: --target 87 was accepted and every run showed "not reached"."""
  dirs = [write_run(tmp_path, *fake_run("A", 0, [0.5, 0.9]))]
  with pytest.raises(SystemExit, match=f"^error: {message}"):
    compare.main(dirs + ["--target", value])
  assert "| 2 |" in compare.main(dirs + ["--target", "1"]).splitlines()[2]


def test_runs_stopped_by_divergence_or_a_signal_get_a_note(tmp_path):
  """Held-out probes S9 and S10: a run the divergence guard stopped, and one a SIGTERM interrupted (its summary.json
  written), showed as ordinary finished runs of fewer rounds."""
  diverged, interrupted, finished, timed = (fake_run(m, 0, a) for m, a in
                                            (("A", [0.5]), ("B", [0.5, 0.6]), ("C", [0.7]), ("D", [0.4])))
  diverged[1].update(stopped_by_divergence={"round": 2, "group": None, "best_checkpoint": 1,
                                            "reason": "round 2: training loss of group mlp is nan"})
  interrupted[1].update(interrupted={"signal": "SIGTERM", "completed_round": 2})
  interrupted[1]["config"]["rounds"] = 40
  finished[1].update(interrupted={"signal": "SIGTERM", "completed_round": 1})  # (after its last round)
  finished[1]["config"]["rounds"] = 1
  timed[1].update(stopped_after={"seconds": 60, "completed_round": 1})
  text = compare.main([write_run(tmp_path, *run) for run in (diverged, interrupted, finished, timed)])
  assert [line for line in text.splitlines() if line.startswith("note: ") and "different rounds" not in line] == [
      "note: A_s0 was stopped at round 2, when it diverged (training loss of group mlp is nan): its rows up to "
      "round 1 are compared",
      "note: B_s0 has not finished (SIGTERM after round 2): its rows up to round 2 are compared",
      "note: D_s0 has not finished (--stop-after 60 s after round 1): its rows up to round 1 are compared"]


def test_the_table_gives_each_private_runs_epsilon_at_the_last_row_compared():
  private = fake_run("A", 0, [0.5, 0.6])
  private[2][-1]["privacy"] = {"epsilon": 3.21456, "delta": 1e-5, "rounds_spent": 2}
  unbounded = fake_run("B", 0, [0.5, 0.6])
  unbounded[2][-1]["privacy"] = {"epsilon": None, "delta": 1e-5, "rounds_spent": 2}
  lines = tables.table([private, unbounded, fake_run("C", 0, [0.5, 0.6])], last=2).splitlines()
  assert "| privacy spent: epsilon (delta) |" in lines[0]
  assert "| 3.21 (1e-05) |" in lines[2] and "| no bound (1e-05) |" in lines[3] and "| - | 1.0 |" in lines[4]


@pytest.mark.parametrize("flags, message", [
    (["--output", "x.xyz"], r"--output 'x.xyz': matplotlib does not write .xyz; use one of .*\.pdf, .*\.png, .*\.svg"),
    (["--cost-output", "c.XYZ"], r"--cost-output 'c.XYZ': matplotlib does not write .xyz; use one of \.avif"),
    (["--output", "TMP"], r"--output 'TMP' is a folder: give a file, e.g. 'TMP/compare.png'$"),
    (["--per-group"], r"--per-group adds every group to --baseline's tables and to --output's plot: give either$"),
    (["--paired-output", "d.png"], r"--paired-output plots the differences from --baseline's runs: give --baseline$"),
    (["--labels", ","], r"--labels ',': label 1 is empty \(give one name per run\)$"),
    (["--labels", "a, "], "--labels .a, .: label 2"),
    (["--labels", "a,a"], r"--labels 'a,a': 'a' names 2 runs \(give each its own\)$")])
def test_plot_names_per_group_and_labels_are_refused_before_the_table(tmp_path, capsys, flags, message):
  """Held-out probes 2: T5 (a matplotlib traceback after the table), S9 (a folder as --output wrote FOLDER.png and
  said it wrote FOLDER), S7 (--per-group alone did nothing), S8 (empty labels named runs '')."""
  dirs = [write_run(tmp_path, *fake_run("A", 0, [0.5, 0.6])), write_run(tmp_path, *fake_run("B", 0, [0.4, 0.7]))]
  with pytest.raises(SystemExit, match="^error: " + message.replace("TMP", re.escape(str(tmp_path)))):
    compare.main(dirs + [f.replace("TMP", str(tmp_path)) for f in flags])
  assert capsys.readouterr().out == "", "nothing is printed before the error"
  compare.main(dirs + ["--output", str(tmp_path / "plot")])
  assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 'plot.png'}\n")
  assert (tmp_path / "plot.png").exists(), "a name without an extension gets the .png matplotlib adds, and says so"


def test_the_mean_over_a_methods_runs_counts_every_run(tmp_path):
  """(Fourth probe survey: two runs of one seed, e.g. of two --sample-seed values, counted once; a folder given
  twice counted once there and twice in the first table.)"""
  same_seed = [fake_run("A", 0, [0.4, 0.5]), fake_run("A", 0, [0.4, 0.7]), fake_run("A", 1, [0.4, 0.6])]
  assert "| A | 3 | 60.00 ± 10.00 | 60.00 ± 10.00 |" in tables.seeds_table(same_seed)
  first, other = (write_run(tmp_path, *fake_run(m, 0, [0.5, 0.6])) for m in "AB")
  for again in (first, first + "/"):
    with pytest.raises(SystemExit, match=r"A_s0/?' is given twice \(also as '.*A_s0'\): each run counts once"):
      compare.main([first, other, again])


def test_runs_in_folders_of_one_name_are_named_by_their_paths(tmp_path):
  """(Fifth probe survey: two runs named alike were two indistinguishable rows.)"""
  (tmp_path / "x").mkdir(), (tmp_path / "y").mkdir()
  a = write_run(tmp_path / "x", "run", *fake_run("A", 0, [0.5, 0.6])[1:])
  b = write_run(tmp_path / "y", "run", *fake_run("B", 0, [0.4, 0.7])[1:])
  table = compare.main([a, b])
  assert f"| {a} | A |" in table and f"| {b} | B |" in table, table


def test_the_baseline_is_named_in_any_case_and_what_cannot_pair_says_why(tmp_path):
  """(A probe survey: ``--baseline fedavg`` was refused though ``--method fedavg`` runs FedAvg; runs of the
  baseline alone were told to share seeds; --per-group with no shared group, and --paired-output with no pair,
  printed nothing about it.)"""
  a_runs = [write_run(tmp_path, *fake_run("FedAvg", s, [0.5, 0.6], groups={"cnn@1": [0.5, 0.6]})) for s in (0, 1)]
  b_run = write_run(tmp_path, *fake_run("HeteroAvg", 0, [0.6, 0.7], groups={"resnet10": [0.6, 0.7]}))
  text = compare.main(a_runs + [b_run, "--baseline", "fedavg", "--per-group"])
  assert "| HeteroAvg | +10.00 |" in text, text
  assert "per architecture group: no group is shared by a run and its FedAvg pair" in text
  text = compare.main(a_runs + ["--baseline", "FedAvg"])
  assert "no run pairs with FedAvg's: every run given is one of its runs; add runs of another method" in text, text
  with pytest.raises(SystemExit, match="no run of the baseline 'FedProx'; methods: FedAvg, HeteroAvg"):
    compare.main(a_runs + [b_run, "--baseline", "FedProx"])
  late = write_run(tmp_path, *fake_run("FedProx", 5, [0.6, 0.7]))  # (seed 5: no FedAvg run to pair with)
  text = compare.main(a_runs + [late, "--baseline", "FedAvg", "--paired-output", str(tmp_path / "p.png")])
  assert "no run pairs with FedAvg's" in text and "--paired-output not written" in text
  assert not os.path.exists(tmp_path / "p.png")
  assert "note: --up-to-round 9: every run ends before it" in compare.main(a_runs + ["--up-to-round", "9"])
  assert "--up-to-round" not in compare.main(a_runs + ["--up-to-round", "2"])


def test_files_among_the_runs_are_passed_over_and_a_window_needs_a_baseline(tmp_path):
  """(Eighth probe survey: `compare runs/repro/fedin/*` stopped at the first log beside the runs, a --window without
  --baseline did nothing, and runs evaluated at different intervals were paired on rounds one never evaluated.)"""
  dirs = [write_run(tmp_path, *run) for run in paired_runs()]
  log = tmp_path / "A_s0.log"
  log.write_text("training...\n")
  text = compare.main(dirs + [str(log), "--baseline", "A", "--target", "0.85"])
  assert f"note: passed over 1 file(s) given with the runs, not results folders: {log}" in text
  assert "note: the runs evaluated different rounds: each run's rounds to 85% count" in text  # (A s1 skipped round 3)
  with pytest.raises(SystemExit, match=r"is a file, not a results folder"):
    compare.main([str(log)])
  with pytest.raises(SystemExit, match=r"is a file, not a results folder"):
    compare.main([dirs[0], str(log), "--labels", "a,b"])
  with pytest.raises(SystemExit, match=r"^error: --window .* give --baseline"):
    compare.main(dirs + ["--window", "2"])


def test_one_file_given_by_two_paths_is_one_experiment():
  """(The InCo one-factor runs: one split given as inco_split.npz and as /tmp/clone/inco_split.npz read as two
  variants of each method, and compare found no baseline run.)"""
  from fedjax_hetero.analysis.runs import experiment_differences, with_variants
  runs = [fake_run("A", 0, [0.5]), fake_run("A", 1, [0.6]), fake_run("B", 0, [0.7]), fake_run("B", 1, [0.6])]
  for i, (_, summary, _) in enumerate(runs):
    summary["config"]["data"] = {"partition_file": "split.npz" if i % 2 else "/tmp/clone/split.npz"}
  assert [summary["method"] for _, summary, _ in with_variants(runs)] == ["A", "A", "B", "B"]
  assert experiment_differences(runs, "A") == {}
  runs[3][1]["config"]["data"] = {"partition_file": "other.npz"}
  assert experiment_differences(runs, "A") == {"B": ["data.partition_file"]}
