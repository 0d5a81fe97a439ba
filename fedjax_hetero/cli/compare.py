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
the rounds compared), pooled over the seeds, to show whether a method's lead grows, holds or fades.
``--paired-output PATH`` plots the differences per round, a line per seed and their mean, a panel per method. With
``--target`` a per-seed table gives each side's best accuracy and the first round each reached the target, up to
the last round both evaluated. A method whose runs trained another experiment than the baseline's of the same
seed (data, partition, groups or cohorts) gets a note naming the settings.
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
from typing import Sequence

from fedjax_hetero import os_errors
from fedjax_hetero.analysis.plots import (plot_accuracy_against_costs, plot_accuracy_per_round, plot_client_accuracy,
                                          plot_paired_differences, run_styles)
from fedjax_hetero.analysis.runs import (attack_of, check_unique, ending_notes, groups_of, load_run, pairings,
                                         runs_by_method, up_to_round, with_variants)
from fedjax_hetero.analysis.tables import (dataset_note, drop_table, evaluation_note, experiment_note, group_table,
                                           length_note, paired_table, seed_table, seeds_table, table, window_table)


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
  p.add_argument("--paired-output", default=None, help="with --baseline: write a plot of every method's accuracy "
                 "minus the baseline's per round, a line per seed and their mean, a panel per method")
  p.add_argument("--client-output", default=None, help="write a plot of the clients' held-out accuracy (runs with "
                 "--client-eval-fraction): per group and of all clients, the mean and the worst 10%% per round")
  p.add_argument("--last", type=int, default=3, help="evaluations averaged in the 'last' column")
  p.add_argument("--up-to-round", type=int, default=None, help="cut every run at this round (default: no cut)")
  p.add_argument("--target", type=float, default=None, help="add the first round reaching this mean accuracy "
                 "(a fraction, e.g. 0.87)")
  p.add_argument("--baseline", default=None, help="add every method's paired per-round difference from this "
                 "method's runs of the same seeds, and its mean per window of rounds (the name in any letter case)")
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
  if args.paired_output and not args.baseline:
    raise SystemExit("error: --paired-output plots the differences from --baseline's runs: give --baseline")
  if args.window is not None and not args.baseline:
    raise SystemExit("error: --window cuts the differences from --baseline's runs into windows: give --baseline")
  # A glob of a folder of runs (runs/*) also names the logs and plots beside them: files are passed over, said below.
  files = [d for d in args.run_dirs if os.path.isfile(d)]
  if files and (args.labels is not None or len(files) == len(args.run_dirs)):
    raise SystemExit(f"error: {files[0]!r} is a file, not a results folder")
  args.run_dirs = [d for d in args.run_dirs if d not in files]
  for name in ("output", "cost_output", "client_output", "paired_output"):
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
  twice = next((label for label in labels if labels.count(label) > 1), None)
  if twice is not None and args.labels is not None:
    raise SystemExit(f"error: --labels {args.labels!r}: {twice!r} names {labels.count(twice)} runs (give each its own)")
  if twice is not None:  # (folders of one name in different places: named as given)
    labels = [os.path.normpath(d) if labels.count(label) > 1 else label for label, d in zip(labels, args.run_dirs)]
  given: dict[str, str] = {}
  for run_dir in args.run_dirs:
    real = os.path.realpath(run_dir)
    if real in given:
      raise SystemExit(f"error: {run_dir!r} is given twice (also as {given[real]!r}): each run counts once")
    given[real] = run_dir
  runs = []
  for label, run_dir in zip(labels, args.run_dirs):
    summary, rows = load_run(run_dir)
    runs.append((label, summary, up_to_round(rows, args.up_to_round)))
  runs = with_variants(runs)  # (a sweep's values as variants of the method)
  methods = list(runs_by_method(runs))
  if args.baseline:
    args.baseline = baseline_among(args.baseline, methods)
  if args.baseline or any(attack_of(summary) for _, summary, _ in runs):  # the tables that pair runs
    try:
      check_unique(runs)
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
  text = (table(runs, args.last, args.target) + length_note(runs) + dataset_note(runs)
          + evaluation_note(runs, args.target))
  if args.up_to_round and all(rows and rows[-1]["round"] < args.up_to_round for _, _, rows in runs):
    text += f"\nnote: --up-to-round {args.up_to_round}: every run ends before it, so it cuts nothing"
  text += "".join("\n" + note for note in ending_notes(runs))
  if files:
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    text += f"\nnote: passed over {len(files)} file(s) given with the runs, not results folders: {named}"
  spread = seeds_table(runs)
  if spread:
    text += "\n\nover the runs of each method (every run, its seeds):\n" + spread
  if args.baseline and not pairings(runs, args.baseline):
    why = ("every run given is one of its runs; add runs of another method"
           if methods == [args.baseline]
           else "none has the seed of one of its runs and a round both evaluated (compare runs of the same seeds and "
           "--eval-every)")
    text += f"\n\nno run pairs with {args.baseline}'s: {why}" + ("; --paired-output not written" if args.paired_output
                                                                else "")
  elif args.baseline:
    text += "\n\n" + paired_table(runs, args.baseline) + experiment_note(runs, args.baseline)
    windows = window_table(runs, args.baseline, args.window)
    if windows:
      text += f"\n\nmean per-round difference from {args.baseline} (points) per window of rounds:\n" + windows
    if args.target is not None:
      text += ("\n\nper seed (best accuracy and rounds to the target, at the rounds both evaluated):\n"
               + seed_table(runs, args.baseline, args.target))
    groups = group_table(runs, args.baseline) if args.per_group else ""
    if groups:
      text += "\n\nper architecture group (accuracy of each group's model, paired as above):\n" + groups
    elif args.per_group:
      text += f"\n\nper architecture group: no group is shared by a run and its {args.baseline} pair"
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
  if args.paired_output and (paired := pairings(runs, args.baseline)):  # (none: the text above says so)
    try:
      say(f"wrote {plot_paired_differences(paired, args.baseline, args.paired_output)}")
    except OSError as e:
      raise SystemExit(f"error: --paired-output {args.paired_output!r}: {os_errors.describe(e)}") from None
  return text


def baseline_among(baseline: str, methods: list[str]) -> str:
  """``--baseline``'s method among the runs' ``methods`` (in any letter case, as ``--method`` takes it)."""
  named = [m for m in methods if m == baseline] or [m for m in methods if m.lower() == baseline.lower()]
  if not named:
    raise SystemExit(f"error: no run of the baseline {baseline!r}; methods: {', '.join(methods)}")
  if len(named) > 1:
    raise SystemExit(f"error: --baseline {baseline!r} names {', '.join(named)}: give one as it is written")
  return named[0]


if __name__ == "__main__":
  main()
