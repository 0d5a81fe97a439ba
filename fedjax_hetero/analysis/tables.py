"""The markdown tables of `python -m experiments.compare` (fedjax_hetero.cli.compare, whose help says what each
column means): per run, over each method's seeds, paired against a baseline (per method, per window of rounds, per
seed and per architecture group) and the accuracy dropped under an attack. Each returns its table as text ("" where
the runs give it no row)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fedjax_hetero.analysis.runs import (Pairing, Runs, attack_of, base_method_of, cumulative_costs, default_window,
                                         evaluated, experiment_differences, final_pair, groups_of, interval,
                                         last_client_accuracy, last_shared_round, mean_dissimilarity, method_of,
                                         paired_points, pairings, rounds_to, runs_by_method, seed_interval, seed_of,
                                         windowed_means)

STATS_HEADER = ("mean per-round difference (points) [95% interval] | rounds ahead | best - best (points) | "
                "seeds' mean differences: mean [95% t interval]")


def table(runs: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]], last: int,
          target: float | None = None) -> str:
  to = f" rounds to {100 * target:g}% |" if target is not None else ""
  spread = " dissimilarity low / high (mean over rounds) |" if any(r.get("dissimilarity") for _, _, rows in runs
                                                                    for r in rows) else ""
  costs = " bytes down + up | client FLOPs |" if any(cumulative_costs(rows) for _, _, rows in runs) else ""
  dropped = " sampled clients dropped |" if any("dropped" in r for _, _, rows in runs for r in rows) else ""
  clients = (" clients' held-out acc: mean / worst 10% (%) |" if any(last_client_accuracy(rows) for _, _, rows in runs)
             else "")
  private = " privacy spent: epsilon (delta) |" if any(r.get("privacy") for _, _, rows in runs for r in rows) else ""
  header = (f"| run | method | rounds | final mean acc (%) | best (%) | mean of last {last} evals (%) |{costs}{to}"
            f"{spread}{dropped}{clients}{private} round 1 (s, compiling) | rounds 2+, total (s) |")
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for label, summary, rows in runs:
    accs = [a for _, a in evaluated(rows)]
    if not accs:
      diverged = (summary.get("stopped_by_divergence") or {}).get("round")
      why = (f" (the divergence guard stopped it at round {diverged}, before it evaluated): leave it out"
             if diverged and rows and rows[-1]["round"] >= diverged else "")
      raise SystemExit(f"error: run {label!r} has no evaluation in the rounds compared{why}")
    tail = accs[-last:]
    reached = "" if target is None else f" {rounds_to(rows, target) or 'not reached'} |"
    if costs:
      totals = cumulative_costs(rows) or {}
      reached = f" {si(totals.get('bytes'), 'B')} | {si(totals.get('client_flops'), 'FLOP')} |" + reached
    if spread:
      low, high = (shown(mean_dissimilarity(rows, part), ".2f") for part in ("low", "high"))
      reached += f" {low} / {high} |"
    if dropped:
      reached += f" {sum(len(r.get('dropped', ())) for r in rows)} of {sum(len(set(r['clients'])) for r in rows)} |"
    if clients:
      every = (last_client_accuracy(rows) or {}).get("all")
      reached += f" {100 * every['mean']:.2f} / {100 * every['worst_10pct']:.2f} |" if every else " - |"
    if private:  # (at the last row compared; a run without noise has no bound)
      spent = rows[-1].get("privacy")
      epsilon = spent and ("no bound" if spent["epsilon"] is None else f"{spent['epsilon']:.3g}")
      reached += f" {epsilon} ({spent['delta']:g}) |" if spent else " - |"
    few = f" (of {len(tail)})" if len(tail) < last else ""
    first = next((f"{r['round_seconds']:.1f}" for r in rows if r["round"] == 1), "-")
    later_seconds = [r["round_seconds"] for r in rows if r["round"] > 1]
    later = shown(sum(later_seconds) if later_seconds else None, ".1f")
    lines.append(f"| {label} | {method_of(summary)} | {rows[-1]['round']} | "
                 f"{100 * accs[-1]:.2f} | {100 * max(accs):.2f} | {100 * sum(tail) / len(tail):.2f}{few} |{reached} "
                 f"{first} | {later} |")
  return "\n".join(lines)


def evaluation_note(runs: Runs, target: float | None) -> str:
  """Under the first table: where ``target`` is given and the runs evaluated different rounds (another
  ``--eval-every``, a skipped evaluation), a run's rounds to it are its own first evaluation at or above it, at a
  round another run may not have evaluated."""
  if target is None or not runs:
    return ""
  last = min(rows[-1]["round"] for _, _, rows in runs if rows)
  if len({tuple(r for r, _ in evaluated(rows) if r <= last) for _, _, rows in runs}) < 2:
    return ""
  return (f"\nnote: the runs evaluated different rounds: each run's rounds to {100 * target:g}% count its own "
          "evaluations (the per-seed table counts the rounds both evaluated)")


def length_note(runs: Runs) -> str:
  """A note under the table when the runs end at different rounds: their final, best and last columns then
  compare different rounds."""
  ends = {label: rows[-1]["round"] for label, _, rows in runs if rows}
  if len(set(ends.values())) < 2:
    return ""
  listed = ", ".join(f"{label} {end}" for label, end in ends.items())
  shared = last_shared_round(runs)
  cut = ("no round was evaluated by all of them, so no --up-to-round compares them at equal rounds" if shared is None
         else f"--up-to-round {shared} compares them at equal rounds" + (
             " (the last round all of them evaluated)" if shared < min(ends.values()) else ""))
  return (f"\nnote: the runs end at different rounds ({listed}): their final, best and last columns are not at the "
          f"same rounds; {cut}")


def dataset_note(runs: Runs) -> str:
  """A note under the table when the runs trained on different datasets: their accuracies do not compare."""
  datasets = {label: ((summary["config"].get("data") or {}).get("dataset") or summary["config"].get("dataset"))
              for label, summary, _ in runs}
  if len(set(datasets.values())) < 2:
    return ""
  listed = ", ".join(f"{label} {dataset}" for label, dataset in datasets.items())
  return f"\nnote: the runs trained on different datasets ({listed}): their accuracies and differences do not compare"


def seeds_table(runs: Runs) -> str:
  """Per method (or variant, e.g. a swept value) with several runs: the mean ± std over them of the final and
  the best mean accuracy (empty if no method has two runs)."""
  # Every run counts: two of one seed too (e.g. of two --sample-seed values).
  by_method: dict[str, list[list[dict[str, Any]]]] = {}
  for _, summary, rows in runs:
    by_method.setdefault(method_of(summary), []).append(rows)
  lines = ["| method | runs | final mean acc (%), mean ± std | best (%), mean ± std |", "|---|---|---|---|"]
  for method, method_runs in by_method.items():
    if len(method_runs) < 2:
      continue
    finals, bests = (np.array([100 * pick([a for _, a in evaluated(rows)]) for rows in method_runs])
                     for pick in (lambda a: a[-1], max))
    lines.append(f"| {method} | {len(method_runs)} | {finals.mean():.2f} ± {finals.std(ddof=1):.2f} | "
                 f"{bests.mean():.2f} ± {bests.std(ddof=1):.2f} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def shown(value: float | None, spec: str) -> str:
  """``value`` formatted, or "-" where the runs give none (e.g. the later rounds of a one-round run)."""
  return "-" if value is None else format(value, spec)


def si(value: float | None, unit: str) -> str:
  """``value`` with an SI prefix, three significant digits (``1.23 GB``), or "-" where the run gives none."""
  if value is None:
    return "-"
  for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(value) >= scale:
      return f"{value / scale:.3g} {prefix}{unit}"
  return f"{value:.3g} {unit}"


def signed(value: float | None) -> str:
  return shown(value, "+.2f")


def stats_cells(pairing: Pairing) -> str:
  """The cells shared by the paired tables: mean difference [95% interval] | rounds ahead | best - best."""
  pooled = pairing.pooled
  tied = np.mean(pooled == 0)  # (equal accuracies: common on small test sets, and neither ahead nor behind)
  ahead = f"{np.mean(pooled > 0):.0%} of {len(pooled)}" + (f", {tied:.0%} tied" if tied else "")
  return (f"{with_bounds(*interval(pooled), 'shared round')} | {ahead} | "
          f"{np.mean(pairing.best):+.2f} | {with_bounds(*seed_interval(pairing.seed_means), 'seed')}")


def with_bounds(mean: float, low: float | None, high: float | None, unit: str) -> str:
  """``+1.23 [+0.45, +2.01]``; ``+1.23 [n/a: 1 UNIT]`` where one value gives no interval."""
  return f"{mean:+.2f} [" + (f"n/a: 1 {unit}" if low is None or high is None else f"{low:+.2f}, {high:+.2f}") + "]"


def paired_table(runs: Runs, baseline: str) -> str:
  """Every method against ``baseline``, paired by seed and round (see the module docstring)."""
  lines = [f"| method - {baseline} | seeds | {STATS_HEADER} | per seed |", "|---|---|---|---|---|---|---|"]
  for p in pairings(runs, baseline):
    per_seed = ", ".join(f"s{s}: {mean:+.2f}" for s, mean in zip(p.seeds, p.seed_means))
    lines.append(f"| {p.method} | {len(p.seeds)} | {stats_cells(p)} | {per_seed} |")
  return "\n".join(lines)


def experiment_note(runs: Runs, baseline: str) -> str:
  """A note under the paired table for every method whose runs trained another experiment than the baseline's of
  the same seed (`runs.SAME_EXPERIMENT`): its paired differences mix the method with those settings."""
  return "".join(f"\nnote: {method}'s runs differ from {baseline}'s of the same seed in {', '.join(keys)}: the "
                 "same seed does not give them the same data and training clients, so the differences are not the "
                 "method's alone" for method, keys in experiment_differences(runs, baseline).items())


def window_table(runs: Runs, baseline: str, window: int | None = None) -> str:
  """The mean per-round difference from ``baseline`` per window of rounds (default ``default_window``)."""
  paired = pairings(runs, baseline)
  if not paired:
    return ""
  last_round = max(int(r.max()) for p in paired for r in p.rounds)
  window = window or default_window(last_round)
  starts = range(1, last_round + 1, window)
  heads = [f"{s}-{min(s + window - 1, last_round)}" if min(s + window - 1, last_round) > s else f"{s}"
           for s in starts]
  lines = [f"| method - {baseline}, rounds | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
  for p in paired:
    means = windowed_means(p.rounds, p.diffs, window, last_round)
    lines.append(f"| {p.method} | " + " | ".join(signed(m) for m in means) + " |")
  return "\n".join(lines)


def group_table(runs: Runs, baseline: str) -> str:
  """The paired statistics of every architecture group's accuracy (empty if the runs logged no group)."""
  by_group = {g: {p.method: p for p in pairings(runs, baseline, g)} for g in groups_of(runs)}
  lines = [f"| method - {baseline} | group | seeds | {STATS_HEADER} |", "|---|---|---|---|---|---|---|"]
  for method in runs_by_method(runs):
    for group, paired in by_group.items():
      if method in paired:
        lines.append(f"| {method} | {group} | {len(paired[method].seeds)} | {stats_cells(paired[method])} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def seed_table(runs: Runs, baseline: str, target: float) -> str:
  """Per seed pair: each side's best accuracy and its first round reaching ``target``, both at the rounds both
  evaluated (a longer run's later rounds would reach a target the other never had the rounds to, and a run
  evaluated every second round would count a round the other's evaluation could not)."""
  by_method = runs_by_method(runs)
  to = f"{100 * target:g}%"
  lines = [f"| method | seed | best (%) | {baseline} best (%) | best - best (points) | rounds to {to} | "
           f"{baseline} rounds to {to} |", "|---|---|---|---|---|---|---|"]
  for p in pairings(runs, baseline):
    for seed in p.seeds:
      rows, base = by_method[p.method][seed], by_method[baseline][seed]
      rounds, accuracy, base_accuracy = paired_points(rows, base)
      reached = [next((int(r) for r, a in zip(rounds, side) if a >= target), "not reached")
                 for side in (accuracy, base_accuracy)]
      lines.append(f"| {p.method} | {seed} | {100 * accuracy.max():.2f} | {100 * base_accuracy.max():.2f} | "
                   f"{100 * (accuracy.max() - base_accuracy.max()):+.2f} | {reached[0]} | {reached[1]} |")
  return "\n".join(lines)


def drop_table(runs: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]], baseline: str | None = None) -> str:
  """Every attacked run against the clean run of its method and seed (see the module docstring); empty
  if there is no such pair."""
  clean: dict[tuple[str, int], list[dict[str, Any]]] = {}
  attacked: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
  for _, summary, rows in runs:
    method, attack, seed = base_method_of(summary), attack_of(summary), seed_of(summary)
    if attack is None:
      clean[(method, seed)] = rows
    else:
      attacked.setdefault((method, attack), {})[seed] = rows
  drops: dict[tuple[str, str], tuple[float, float, float, str, int]] = {}
  for (method, attack), seeds in attacked.items():
    pairs = {s: final_pair(rows, clean[(method, s)]) for s, rows in seeds.items() if (method, s) in clean}
    pairs = {s: p for s, p in pairs.items() if p is not None}
    if pairs:
      under, free = (100 * np.mean([p[i] for p in pairs.values()]) for i in (0, 1))
      per_seed = ", ".join(f"s{s}: {100 * (p[1] - p[0]):+.2f}" for s, p in sorted(pairs.items()))
      drops[(method, attack)] = (free, under, free - under, per_seed, len(pairs))
  if not drops:
    return ""
  ratio = baseline is not None and any(m == baseline for m, _ in drops)
  lines = ["| method | attack | seeds | clean final (%) | attacked final (%) | drop (points) |"
           + (f" drop / {baseline}'s |" if ratio else "") + " per seed |",
           "|---|---|---|---|---|---|" + ("---|" if ratio else "") + "---|"]
  for (method, attack), (free, under, drop, per_seed, count) in drops.items():
    times = ""
    if ratio:
      own = drops.get((baseline, attack))
      times = f" {drop / own[2]:.2f} |" if own and own[2] else " - |"
    lines.append(f"| {method} | {attack} | {count} | {free:.2f} | {under:.2f} | {drop:+.2f} |{times} {per_seed} |")
  return "\n".join(lines)
