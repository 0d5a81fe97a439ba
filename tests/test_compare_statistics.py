"""The statistics and tables of `experiments.compare` (`analysis.runs`, `analysis.tables`) on runs made in memory;
tests/test_compare.py runs the command on results folders."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_hetero.analysis import runs as run_stats, tables
from tests.test_compare import fake_run, paired_runs


def test_paired_statistics_rounds_to_target_and_dissimilarity_columns():
  runs = [fake_run("A", 0, [0.5, 0.6, 0.7]), fake_run("A", 1, [0.5, None, 0.75]),
          fake_run("B", 0, [0.6, 0.6, 0.9], dissimilarity=0.5), fake_run("B", 1, [0.25, 0.9, 1.0], dissimilarity=1.5)]
  lines = tables.paired_table(runs, "A").splitlines()
  # Pairs at rounds both evaluated: seed 0: +10, 0, +20; seed 1: -25, +25 (round 2 of A_s1 has no evaluation).
  diffs = np.array([10, 0, 20, -25, 25])
  half = 1.96 * diffs.std(ddof=1) / np.sqrt(5)
  # Best at the rounds both evaluated: seed 0: 90 - 70; seed 1 (rounds 1 and 3): 100 - 75; mean +22.50.
  # Over the seeds: means +10 and 0, so +5 with a t interval of 12.706 (t at 97.5%, 1 degree of freedom)
  # x std 7.071 / sqrt(2) = 63.53 either side.
  assert lines[2] == (f"| B | 2 | +6.00 [{6 - half:+.2f}, {6 + half:+.2f}] | 60% of 5, 20% tied | +22.50 | "
                      "+5.00 [-58.53, +68.53] | s0: +10.00, s1: +0.00 |")
  assert len(lines) == 3  # no row for the baseline itself
  with pytest.raises(SystemExit, match="no run of the baseline 'C'"):
    tables.paired_table(runs, "C")
  rows = tables.table(runs, last=2, target=0.8).splitlines()
  assert "rounds to 80% |" in rows[0] and "dissimilarity low / high" in rows[0]
  assert rows[2].endswith("| not reached | - / - | 1.0 | 2.0 |") and rows[5].endswith("| 2 | 1.50 / 3.00 | 1.0 | 2.0 |")


def test_runs_that_would_be_merged_in_a_paired_table_are_an_error():
  from fedjax_hetero.analysis.runs import check_unique
  summary = {"method": "FedFA", "config": {"federation": {"seed": 0, "malicious_fraction": 0.2, "backdoor_scale": 1}}}
  check_unique([("a", summary, []), ("b", {**summary, "method": "FlexiFed"}, [])])
  with pytest.raises(ValueError, match=r"a and b are both FedFA \[backdoor 20% x1\] with seed 0"):
    check_unique([("a", summary, []), ("b", summary, [])])


def test_paired_pooled_interval_best_and_rounds_ahead():
  [pairing] = run_stats.pairings(paired_runs(), "A")
  assert pairing.method == "B" and pairing.seeds == [0, 1]
  assert [r.tolist() for r in pairing.rounds] == [[1, 2, 3, 4, 5], [1, 2, 4, 5]]
  np.testing.assert_allclose(pairing.pooled, [10, 0, -5, 10, 5, -10, 20, 0, 20], atol=1e-9)
  np.testing.assert_allclose(pairing.best, [10, 20], atol=1e-9)  # seed 1: B's 95 at round 3 is not paired
  diffs = np.array([10, 0, -5, 10, 5, -10, 20, 0, 20])
  mean, low, high = run_stats.interval(pairing.pooled)
  half = 1.96 * diffs.std(ddof=1) / 3
  assert (mean, low, high) == pytest.approx((50 / 9, 50 / 9 - half, 50 / 9 + half))
  line = tables.paired_table(paired_runs(), "A").splitlines()[2]
  # Over the seeds: means +4 and +7.5: +5.75 [5.75 -/+ 12.706 x 2.475 / sqrt(2) = 22.24].
  assert line == (f"| B | 2 | +5.56 [{50 / 9 - half:+.2f}, {50 / 9 + half:+.2f}] | 56% of 9, 22% tied | +15.00 | "
                  "+5.75 [-16.49, +27.99] | s0: +4.00, s1: +7.50 |")
  assert run_stats.interval(np.array([3.0])) == (3.0, None, None)  # one pair: no spread, no interval


def test_the_interval_over_seeds_counts_each_seed_once():
  """Three seeds' means 1, 2, 3: mean 2, std 1, t at 97.5% with 2 degrees of freedom 4.3027: 2 -/+ 2.484; a
  seed's number of rounds does not narrow it (the pooled interval does)."""
  from fedjax_hetero.analysis.runs import seed_interval
  assert seed_interval(np.array([1.0, 2.0, 3.0])) == pytest.approx((2.0, 2 - 2.4841, 2 + 2.4841), abs=1e-4)
  assert seed_interval(np.array([3.0])) == (3.0, None, None)
  few = [fake_run("A", s, [0.5] * 4) for s in range(3)] + [fake_run("B", s, [0.5 + 0.01 * (s + 1)] * 4)
                                                           for s in range(3)]
  many = [fake_run("A", s, [0.5] * 40) for s in range(3)] + [fake_run("B", s, [0.5 + 0.01 * (s + 1)] * 40)
                                                             for s in range(3)]
  cells = [tables.paired_table(runs, "A").splitlines()[2].split(" | ") for runs in (few, many)]
  assert cells[0][5] == cells[1][5] == "+2.00 [-0.48, +4.48]"
  assert cells[0][2] != cells[1][2]  # (the pooled interval narrows with the rounds)


def test_windowed_means():
  [pairing] = run_stats.pairings(paired_runs(), "A")
  # Rounds 1-2: +10, 0, -10, +20; rounds 3-4: -5, +10, 0; round 5: +5, +20.
  assert run_stats.windowed_means(pairing.rounds, pairing.diffs, 2, 5) == pytest.approx([5, 5 / 3, 12.5])
  # A window without a pair is None; windows run up to last_round.
  assert run_stats.windowed_means([np.array([1, 2])], [np.array([1.0, 3.0])], 1, 4) == [1.0, 3.0, None, None]
  assert run_stats.windowed_means(pairing.rounds, pairing.diffs, 5, 5) == pytest.approx([50 / 9])
  lines = tables.window_table(paired_runs(), "A", window=2).splitlines()
  assert lines == ["| method - A, rounds | 1-2 | 3-4 | 5 |", "|---|---|---|---|", "| B | +5.00 | +1.67 | +12.50 |"]
  assert run_stats.default_window(5) == 2 and run_stats.default_window(200) == 50 and run_stats.default_window(1) == 1
  assert tables.window_table(paired_runs(), "A").splitlines()[0] == "| method - A, rounds | 1-2 | 3-4 | 5 |"


def test_per_group_paired_statistics():
  assert run_stats.groups_of(paired_runs()) == ["small", "big", "tiny"]
  lines = tables.group_table(paired_runs(), "A").splitlines()
  small = np.array([10, 0, -10, 10, 20])
  half = 1.96 * small.std(ddof=1) / np.sqrt(5)
  assert lines[2] == (f"| B | small | 1 | +6.00 [{6 - half:+.2f}, {6 + half:+.2f}] | 60% of 5, 20% tied | +20.00 | "
                      "+6.00 [n/a: 1 seed] |")
  assert lines[3] == "| B | big | 1 | +0.00 [+0.00, +0.00] | 0% of 5, 100% tied | +0.00 | +0.00 [n/a: 1 seed] |"
  assert len(lines) == 4  # no row for "tiny", which only B logged
  assert tables.group_table([fake_run("A", 0, [0.5]), fake_run("B", 0, [0.6])], "A") == ""


def test_per_seed_best_and_rounds_to_target():
  lines = tables.seed_table(paired_runs(), "A", 0.85).splitlines()
  assert lines[0] == ("| method | seed | best (%) | A best (%) | best - best (points) | rounds to 85% | "
                      "A rounds to 85% |")
  assert lines[2] == "| B | 0 | 90.00 | 80.00 | +10.00 | 4 | not reached |"
  # (B reached it in round 3, which A did not evaluate: a run evaluated less often could not have seen it there)
  assert lines[3] == "| B | 1 | 90.00 | 70.00 | +20.00 | 5 | not reached |"


def test_a_statistic_without_values_shows_a_dash_not_a_number():
  """A one-round run has no "rounds 2+" seconds (probe 114: it showed 0), and a run that logged no gradient
  dissimilarity beside one that did has no mean of it (it showed nan / nan): both show "-", as missing values
  do elsewhere in the tables."""
  lines = tables.table([fake_run("A", 0, [0.5]), fake_run("B", 0, [0.6, 0.7])], last=3).splitlines()
  assert lines[2] == "| A_s0 | A | 1 | 50.00 | 50.00 | 50.00 (of 1) | 1.0 | - |"
  assert lines[3] == "| B_s0 | B | 2 | 70.00 | 70.00 | 65.00 (of 2) | 1.0 | 1.0 |"
  spread = tables.table([fake_run("A", 0, [0.5]), fake_run("B", 0, [0.6], dissimilarity=0.5)], last=3)
  assert "| 50.00 (of 1) | - / - | 1.0 | - |" in spread and "| 60.00 (of 1) | 0.50 / 1.00 | 1.0 | - |" in spread


def test_a_setting_newer_than_a_runs_folder_counts_as_its_default_not_as_a_variant():
  """(A run made before the privacy settings existed read as a variant, "[privacy.delta=1e-05, ...]", of the same
  method run since.)"""
  from fedjax_hetero.analysis.runs import with_variants
  from fedjax_hetero.config import as_dict
  from fedjax_hetero.config.run import RunConfig

  new = as_dict(RunConfig())
  old = {k: v for k, v in new.items() if k != "privacy"}
  swept = {**new, "server": {**new["server"], "optimizer": "adam"}}
  runs = [("old", {"method": "HeteroAvg", "config": old}, []), ("new", {"method": "HeteroAvg", "config": new}, []),
          ("adam", {"method": "HeteroAvg", "config": swept}, [])]
  assert [summary["method"] for _, summary, _ in with_variants(runs)] == [
      "HeteroAvg [server.optimizer=none]", "HeteroAvg [server.optimizer=none]", "HeteroAvg [server.optimizer=adam]"]


def test_rounds_to_a_target_stop_at_the_last_round_both_evaluated():
  """(Fourth probe survey: a run longer than the baseline 'reached' a target the baseline had no rounds for.)"""
  longer = fake_run("B", 0, [0.3, 0.4, 0.45, 0.9])  # reaches 85% at round 4, after the baseline's last round
  text = tables.seed_table([fake_run("A", 0, [0.5, 0.6]), longer], "A", 0.85)
  assert "| B | 0 | 40.00 | 60.00 | -20.00 | not reached | not reached |" in text


def test_a_note_names_the_settings_where_a_method_trained_another_experiment_than_the_baseline():
  """(Fourth probe survey: a baseline of other groups and data paired silently.)"""
  other = fake_run("B", 0, [0.6, 0.7])
  other[1]["config"].update(groups=["cnn@0.25"], data={"alpha": 100.0})
  assert tables.experiment_note([fake_run("A", 0, [0.5, 0.6]), other], "A") == (
      "\nnote: B's runs differ from A's of the same seed in data.alpha, groups: the same seed does not give them the "
      "same data and training clients, so the differences are not the method's alone")
  assert tables.experiment_note([fake_run("A", 0, [0.5, 0.6]), fake_run("B", 0, [0.6, 0.7])], "A") == ""
  cohorts = fake_run("B", 0, [0.6, 0.7])
  cohorts[1]["config"]["federation"]["sample_seed"] = 7
  assert "in federation.sample_seed:" in tables.experiment_note([fake_run("A", 0, [0.5, 0.6]), cohorts], "A")
  cohorts[1]["config"]["federation"]["sample_seed"] = 0  # (the seed's own cohorts, given explicitly)
  assert tables.experiment_note([fake_run("A", 0, [0.5, 0.6]), cohorts], "A") == ""


def test_a_run_stopped_before_its_first_evaluation_is_named_with_why():
  """(Fourth probe survey: a run the guard stopped in round 1 ended compare with no word of the guard.)"""
  label, summary, rows = fake_run("B", 0, [None])
  summary["stopped_by_divergence"] = {"round": 1, "reason": "round 1: training loss is nan"}
  with pytest.raises(SystemExit, match=r"^error: run 'B_s0' has no evaluation in the rounds compared \(the "
                                       r"divergence guard stopped it at round 1, before it evaluated\): leave it out$"):
    tables.table([fake_run("A", 0, [0.5]), (label, summary, rows)], 3)
  label, summary, rows = fake_run("B", 0, [None, None, 0.5])  # (stopped at round 3: --up-to-round 2 cut it)
  summary["stopped_by_divergence"] = {"round": 3, "reason": "round 3: accuracy at chance"}
  with pytest.raises(SystemExit, match=r"^error: run 'B_s0' has no evaluation in the rounds compared$"):
    tables.table([fake_run("A", 0, [0.5]), (label, summary, rows[:2])], 3)


def test_an_attack_on_some_leaves_is_its_own_variant():
  federation = {"seed": 0, "malicious_fraction": 0.2, "backdoor_scale": 20, "backdoor_leaves": "kernels"}
  assert run_stats.attack_of({"config": {"federation": federation}}) == "backdoor 20% x20 kernels only"
  assert run_stats.attack_of({"config": {"federation": {**federation, "backdoor_leaves": "all"}}}) == "backdoor 20% x20"
