"""Compare finished runs: a markdown table and one plot of mean test accuracy vs round.

    python -m experiments.compare runs/a runs/b --labels A,B --output compare.png

Each RUN_DIR is a results folder of ``python -m experiments.<dataset>``
(``summary.json`` + ``metrics.jsonl``). The table lists, per run, the method,
rounds, final and best mean accuracy, the accuracy averaged over the last few
evaluations (less noisy than the final one; "(of N)" where a run has fewer), and the training wall time:
round 1's apart (it compiles the programs), then the sum of the later rounds' ("-" for a run of one round:
a value the runs do not give shows as "-" in every table). Where a method has several
runs (seeds), a second table gives the mean ± std over them of the final and best accuracy; runs of one
method that differ in a setting (the values of a ``--sweep``) are variants of it, ``METHOD [setting=value]``,
in every table.
Where the runs logged their costs (`fedjax_hetero.rounds.costs`), the first table gives each run's cumulative
bytes (down + up) and client training FLOPs beside its accuracy, up to the rounds compared; ``--cost-output
PATH`` plots mean accuracy against both (docs/costs.md).
A run that has not finished (killed, interrupted by a signal, stopped by ``--stop-after``, or still training)
is compared up to its last row, with a note saying so, and so is a run the divergence guard stopped (the note
names the round). Runs that end at different rounds get a note under the table naming the last round all of
them evaluated; ``--up-to-round R`` cuts every run at round R, to compare them at equal rounds. ``--target 0.87``
(a fraction of 1) adds the first round each run reached 87% mean accuracy.

``--baseline METHOD`` adds paired statistics: every other method's runs are paired with the baseline's runs of the
same seed, round by round at the rounds both evaluated, and the table gives the mean per-round difference in
accuracy points with a 95% interval (normal, over the per-round pairs of all seeds; neighbouring rounds are
correlated, so read it as a lower bound on the uncertainty; a single pair has none: "n/a: 1 shared round"), the
fraction of rounds ahead, the best accuracy minus the baseline's best (both at the rounds both evaluated; averaged
over the seeds), the mean of the seeds' mean differences with a Student-t 95% interval over the seeds (each seed
one observation: the interval to order methods by; "n/a: 1 seed"), and each seed's mean difference. A second table
gives the mean difference per window of rounds (``--window W``: rounds 1-W, W+1-2W, ...; by default a quarter of
the rounds compared), pooled over the seeds, to show whether a method's lead grows, holds or fades. With
``--target`` a per-seed table gives each side's best accuracy and the first round each reached the target.
``--per-group`` adds the paired statistics (difference with its interval, rounds ahead, best - best, over seeds) of
every architecture group's accuracy (``test_accuracy`` in ``metrics.jsonl`` holds one per group beside the mean),
and the plot a panel per group. Where runs log the gradient dissimilarity (``fedjax_hetero.methods.dissimilarity``)
the plot shows it per round beside the accuracy. Where runs evaluate every client (``--client-eval-fraction``,
docs/client-evaluation.md), the first table gives the last evaluation's mean and worst 10% of the clients' held-out
accuracy, the plot a panel of both per round, and ``--client-output PATH`` plots them per architecture group.

    python -m experiments.compare runs/repro/inco/*_s* --baseline HeteroAvg --window 20 --per-group

Runs under the backdoor attack (``malicious_fraction`` > 0, `fedjax_hetero.client.attack`) are shown as
their own variant of the method, e.g. ``HeteroFL [backdoor 20% x20]``, in all tables (so ``--baseline
HeteroFL`` pairs them with the clean runs, and the difference is the attack's cost per round). When the runs
hold an attacked run and a clean run of the same method and seed, a last table gives the accuracy drop
under the attack: the clean run's final accuracy minus the attacked run's, at the last round both
evaluated, averaged over the seeds; with ``--baseline`` it also gives each method's drop as a multiple of the
baseline method's (the FedFA paper's robustness ratio, e.g. ``--baseline FedFA``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

import numpy as np

from fedjax_hetero import os_errors
from fedjax_hetero.analysis.plots import (plot_accuracy_against_costs, plot_accuracy_per_round, plot_client_accuracy,
                                          run_styles)
from fedjax_hetero.analysis.runs import (Pairing, Runs, attack_of, base_method_of, check_unique, cumulative_costs,
                                         default_window, ending_notes, evaluated, final_pair, groups_of, interval,
                                         last_client_accuracy, last_shared_round, load_run, mean_dissimilarity,
                                         method_of, paired_points, pairings, rounds_to, runs_by_method, seed_interval,
                                         seed_of, up_to_round, windowed_means, with_variants)

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
      raise SystemExit(f"error: run {label!r} has no evaluation in the rounds compared")
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
  by_method = runs_by_method(runs)
  lines = ["| method | runs | final mean acc (%), mean ± std | best (%), mean ± std |", "|---|---|---|---|"]
  for method, seeds in by_method.items():
    if len(seeds) < 2:
      continue
    finals, bests = (np.array([100 * pick([a for _, a in evaluated(rows)]) for rows in seeds.values()])
                     for pick in (lambda a: a[-1], max))
    lines.append(f"| {method} | {len(seeds)} | {finals.mean():.2f} ± {finals.std(ddof=1):.2f} | "
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
  return (f"{with_bounds(*interval(pooled), 'shared round')} | {np.mean(pooled > 0):.0%} of {len(pooled)} | "
          f"{np.mean(pairing.best):+.2f} | {with_bounds(*seed_interval(pairing.seed_means), 'seed')}")


def with_bounds(mean: float, low: float | None, high: float | None, unit: str) -> str:
  """``+1.23 [+0.45, +2.01]``; ``+1.23 [n/a: 1 UNIT]`` where one value gives no interval."""
  return f"{mean:+.2f} [" + (f"n/a: 1 {unit}" if low is None or high is None else f"{low:+.2f}, {high:+.2f}") + "]"


def paired_table(runs: Runs, baseline: str) -> str:
  """Every method against ``baseline``, paired by seed and round (see the module docstring)."""
  lines = [f"| method - {baseline} | seeds | {STATS_HEADER} | per seed |", "|---|---|---|---|---|---|---|"]
  for p in pairings(runs, baseline):
    per_seed = ", ".join(f"s{s}: {d.mean():+.2f}" for s, d in zip(p.seeds, p.diffs))
    lines.append(f"| {p.method} | {len(p.seeds)} | {stats_cells(p)} | {per_seed} |")
  return "\n".join(lines)


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
  """Per seed pair: each side's best accuracy at the rounds both evaluated and first round reaching ``target``."""
  by_method = runs_by_method(runs)
  to = f"{100 * target:g}%"
  lines = [f"| method | seed | best (%) | {baseline} best (%) | best - best (points) | rounds to {to} | "
           f"{baseline} rounds to {to} |", "|---|---|---|---|---|---|---|"]
  for p in pairings(runs, baseline):
    for seed in p.seeds:
      rows, base = by_method[p.method][seed], by_method[baseline][seed]
      _, accuracy, base_accuracy = paired_points(rows, base)
      reached = [rounds_to(r, target) or "not reached" for r in (rows, base)]
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module docstring as it is, and the defaults but None and False (their help says what they mean)."""

  def _get_help_string(self, action: argparse.Action) -> str | None:
    return action.help if action.default in (None, False) else super()._get_help_string(action)


def plot_path(flag: str, path: str) -> str:
  """``path`` checked before the tables (an error is one line, not a traceback after them) and its folder made;
  returned with the ".png" matplotlib adds to a name without an extension."""
  from matplotlib.backend_bases import FigureCanvasBase

  if os.path.isdir(path) or path.endswith(os.sep):
    raise SystemExit(f"error: {flag} {path!r} is a folder: give a file, e.g. {os.path.join(path, 'compare.png')!r}")
  extension, formats = os.path.splitext(path)[1][1:].lower(), sorted(FigureCanvasBase.get_supported_filetypes())
  if extension and extension not in formats:
    raise SystemExit(f"error: {flag} {path!r}: matplotlib does not write .{extension}; use one of "
                     + ", ".join("." + f for f in formats))
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  except OSError as e:
    raise SystemExit(f"error: {flag} {path!r}: {os_errors.describe(e)}") from None
  return path if extension else path + ".png"


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
  p.add_argument("run_dirs", nargs="+")
  p.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
  p.add_argument("--output", default=None, help="write the accuracy plot here")
  p.add_argument("--title", default="mean test accuracy")
  p.add_argument("--cost-output", default=None, help="write a plot of mean accuracy against the runs' cumulative "
                 "bytes (down + up) and client training FLOPs here")
  p.add_argument("--client-output", default=None, help="write a plot of the clients' held-out accuracy (runs with "
                 "--client-eval-fraction): per group and of all clients, the mean and the worst 10%% per round")
  p.add_argument("--last", type=int, default=3, help="evaluations averaged in the 'last' column")
  p.add_argument("--up-to-round", type=int, default=None, help="cut every run at this round (default: no cut)")
  p.add_argument("--target", type=float, default=None, help="add the first round reaching this mean accuracy "
                 "(a fraction, e.g. 0.87)")
  p.add_argument("--baseline", default=None, help="add every method's paired per-round difference from this "
                 "method's runs of the same seeds, and its mean per window of rounds")
  p.add_argument("--window", type=int, default=None, help="with --baseline: rounds per window of the windowed "
                 "differences (default: a quarter of the rounds compared)")
  p.add_argument("--per-group", action="store_true", help="with --baseline: also pair every architecture "
                 "group's accuracy, not only the mean; with --output: also plot it, one panel per group")
  args = p.parse_args(argv)
  for flag, value in (("--last", args.last), ("--up-to-round", args.up_to_round), ("--window", args.window)):
    if value is not None and value < 1:
      raise SystemExit(f"error: {flag} must be at least 1, got {value}")
  if args.target is not None and not 0 < args.target <= 1:
    example = args.target if 1 < args.target <= 100 else 87
    raise SystemExit(f"error: --target {args.target:g} is a fraction of 1 ({example / 100:g} for {example:g}%)")
  if args.per_group and not (args.baseline or args.output):
    raise SystemExit("error: --per-group adds every group to --baseline's tables and to --output's plot: give either")
  for name in ("output", "cost_output", "client_output"):
    if getattr(args, name):
      setattr(args, name, plot_path("--" + name.replace("_", "-"), getattr(args, name)))
  say = os_errors.StdoutLog()  # (`compare ... | head`: the plots are still written, the rest goes to stderr)
  labels = (args.labels.split(",") if args.labels is not None
            else [os.path.basename(os.path.normpath(d)) for d in args.run_dirs])
  empty = [i for i, label in enumerate(labels, start=1) if not label.strip()]
  if empty:
    raise SystemExit(f"error: --labels {args.labels!r}: label {empty[0]} is empty (give one name per run)")
  if len(labels) != len(args.run_dirs):
    raise SystemExit(f"error: {len(labels)} labels for {len(args.run_dirs)} runs")
  runs = []
  for label, run_dir in zip(labels, args.run_dirs):
    summary, rows = load_run(run_dir)
    runs.append((label, summary, up_to_round(rows, args.up_to_round)))
  runs = with_variants(runs)  # (a sweep's values as variants of the method)
  if args.baseline or any(attack_of(summary) for _, summary, _ in runs):  # the tables that pair runs
    try:
      check_unique(runs)
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
  text = table(runs, args.last, args.target) + length_note(runs) + dataset_note(runs)
  text += "".join("\n" + note for note in ending_notes(runs))
  spread = seeds_table(runs)
  if spread:
    text += "\n\nover the runs of each method (its seeds):\n" + spread
  if args.baseline and not pairings(runs, args.baseline):
    text += (f"\n\nno run pairs with {args.baseline}'s: none has the seed of one of its runs and a round both "
             "evaluated (compare runs of the same seeds and --eval-every)")
  elif args.baseline:
    text += "\n\n" + paired_table(runs, args.baseline)
    windows = window_table(runs, args.baseline, args.window)
    if windows:
      text += f"\n\nmean per-round difference from {args.baseline} (points) per window of rounds:\n" + windows
    if args.target is not None:
      text += "\n\nper seed (best at the rounds both evaluated):\n" + seed_table(runs, args.baseline, args.target)
    groups = group_table(runs, args.baseline) if args.per_group else ""
    if groups:
      text += "\n\nper architecture group (accuracy of each group's model, paired as above):\n" + groups
  drops = drop_table(runs, args.baseline)
  if drops:
    text += ("\n\naccuracy drop under the backdoor attack (clean final - attacked final, same method and seed):\n"
             + drops)
  say(text)
  if args.output:
    try:
      groups = groups_of(runs) if args.per_group else ()
      say(f"wrote {plot_accuracy_per_round(runs, args.output, args.title, run_styles(runs), groups)}")
    except OSError as e:
      raise SystemExit(f"error: --output {args.output!r}: {os_errors.describe(e)}") from None
  if args.cost_output:
    try:
      written = plot_accuracy_against_costs([(label, rows) for label, _, rows in runs], args.cost_output, args.title,
                                            run_styles(runs))
    except ValueError as e:
      raise SystemExit(f"error: --cost-output: {e}") from None
    except OSError as e:
      raise SystemExit(f"error: --cost-output {args.cost_output!r}: {os_errors.describe(e)}") from None
    say(f"wrote {written}")
  if args.client_output:
    try:
      runs_rows = [(label, rows) for label, _, rows in runs]
      say(f"wrote {plot_client_accuracy(runs_rows, args.client_output, styles=run_styles(runs))}")
    except ValueError as e:
      raise SystemExit(f"error: --client-output: {e}") from None
    except OSError as e:
      raise SystemExit(f"error: --client-output {args.client_output!r}: {os_errors.describe(e)}") from None
  return text


if __name__ == "__main__":
  main()
