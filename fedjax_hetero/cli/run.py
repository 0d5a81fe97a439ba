"""``python -m experiments.<dataset>``: flags -> `RunConfig` -> `runner.run_experiment`.

Every setting's flag comes from its declaration (`fedjax_hetero.cli.flags`); a dataset's defaults
(`fedjax_hetero.cli.datasets`) and a ``--preset`` change the defaults, flags given win. Every value is
checked before anything is loaded or computed: a bad one ends the command with ``error: ...`` naming the
flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Callable, NoReturn, Sequence

from fedjax_hetero import distributed, os_errors
from fedjax_hetero import data as fdata
from fedjax_hetero.cli import flags
from fedjax_hetero.cli.config_file import file_notes, known_lines, named_dataset, read_config
from fedjax_hetero.cli.datasets import DATASETS, defaults_for
from fedjax_hetero.cli.flags import methods_help
from fedjax_hetero.cli.presets import PRESETS, Preset, get_preset, paper_deviations, values_for
from fedjax_hetero.compilation import CACHE_ENV, enable_persistent_cache
from fedjax_hetero.config import DistributedConfig, FedGenConfig, RunConfig, as_dict, declare, flatten
from fedjax_hetero.config.distributed import from_flags as distributed_settings
from fedjax_hetero.config.options import FEDGEN_PRESETS
from fedjax_hetero.config.run import FLAGS, FLAGS_BY_PATH, combinations_unchecked
from fedjax_hetero.methods import get_entry
from fedjax_hetero.methods.catalog import readers
from fedjax_hetero.run.build import run_method
from fedjax_hetero.run.continuation import keep_latest_local_training
from fedjax_hetero.run.interruption import Interrupted, command_finished, ending_on_signal, one_line_on_signals
from fedjax_hetero.run.jobs import parse_sweep, run_jobs, runs_of, sweep_names
from fedjax_hetero.run.preflight import check_settings
from fedjax_hetero.run.runner import run_checked

# Flags of earlier versions that were renamed, and what to pass instead (README, "Upgrading").
RENAMED = {"--fedprox-mu": "--prox-mu (one proximal mu, read by FedProx, HeteroProx, InCoProx and FedIN)"}
STOPPED_AFTER_STATUS = 75  # a run --stop-after ended (EX_TEMPFAIL: not done, the same command with --resume goes on)
DISTRIBUTED_FLAGS = tuple(leaf.flag for leaf in flags.declare.leaves(DistributedConfig()))


def fail(message: str, status: int = 2) -> NoReturn:
  """The CLI's answer to a bad input: ``error: message`` on stderr and exit status 2 (argparse's), no traceback."""
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(status) from None


def _pre_parse(argv: Sequence[str] | None, dataset: str) -> argparse.Namespace:
  """The flags that choose the defaults of the others: --dataset, --preset, --method, --fedgen-preset."""
  pre = argparse.ArgumentParser(add_help=False)
  for name, default in (("--dataset", dataset), ("--method", None), ("--fedgen-preset", None)):
    pre.add_argument(name, default=default)
  for name in ("--preset", "--config"):  # (a second one would replace the first whole: refused, not dropped)
    pre.add_argument(name, action="append")
  known, _ = pre.parse_known_args(argv)
  for name in ("preset", "config"):
    given = getattr(known, name) or [None]
    if len(given) > 1:
      raise ValueError(f"--{name} is given {len(given)} times ({', '.join(given)}): each holds a whole run; give one")
    setattr(known, name, given[0])
  return known


def run_defaults(argv: Sequence[str] | None, dataset: str
                 ) -> tuple[RunConfig, Preset | None, dict[str, str], RunConfig]:
  """The defaults the parser starts from: the dataset's or a ``--config`` file's, a preset's values for the
  method the run will have, and a FedGen preset; the settings the file or preset set (dotted path -> which,
  e.g. ``"--preset inco-cpu"``); and the run's dataset's own defaults. ValueError naming the flag if one of those
  is bad."""
  known = _pre_parse(argv, dataset)
  if known.config is not None and known.preset is not None:
    raise ValueError("--config and --preset exclude each other: a config file holds a whole run")
  if known.config is None:
    dataset_defaults = defaults_for(known.dataset).config()
    defaults, sources = dataset_defaults, {}
  else:  # the file's settings over its dataset's defaults (--dataset's, if given)
    dataset = known.dataset if _given(argv, "--dataset") else named_dataset(known.config) or known.dataset
    dataset_defaults = defaults_for(dataset).config()
    defaults = read_config(known.config, dataset_defaults)
    sources = {path: f"--config {known.config}" for path in known_lines(known.config) if path in FLAGS_BY_PATH}
  if (known.config is not None and _names_its_own_folder(known.config, defaults)
      and not any(_given(argv, f) for f in ("--output-dir", "--resume", "--resume-or-start", "--overwrite"))):
    raise ValueError(f"--config {known.config!r} holds the settings of the run in {defaults.output.dir!r} (they name "
                     "it as their folder); pass --output-dir for a new run from them, or --resume to continue "
                     "that run")
  if (known.config is not None and _copied_run_folder(known.config, defaults)
      and not _given(argv, "--output-dir")):  # (--overwrite would have cleared the folder it names)
    folder = os.path.dirname(known.config) or "."
    raise ValueError(f"--config {known.config!r} lies in the run folder {folder!r} but names {defaults.output.dir!r} "
                     f"as its run's (a copied folder?); pass --output-dir {folder} for the run there, or "
                     f"--output-dir {defaults.output.dir} for the one it names (with --resume to continue it, or "
                     "another --output-dir for a new run)")
  chosen = None if known.preset is None else get_preset(known.preset)
  if chosen is not None:
    method = known.method or chosen.values.get("method", defaults.method.name)
    values = values_for(chosen, method)
    defaults = defaults.replace(**values, output_dir=f"runs/{known.dataset}-{chosen.name}")
    sources.update({FLAGS[name].path: f"--preset {chosen.name}" for name in values})
  if known.fedgen_preset is not None:
    in_file = sorted(path for path, source in sources.items()
                     if path.startswith("method.fedgen.") and source.startswith("--config"))
    if in_file:  # (the preset replaces every FedGen setting: the file's were dropped in silence)
      raise ValueError(f"--fedgen-preset {known.fedgen_preset} would replace {', '.join(in_file)} of --config "
                       f"{known.config}: set FedGen's settings in the file or by the preset, not both")
    fedgen = FedGenConfig.preset(known.fedgen_preset)
    defaults = defaults.replace(**{f"fedgen_{k}": v for k, v in as_dict(fedgen).items()})
    sources.update({f"method.fedgen.{k}": f"--fedgen-preset {known.fedgen_preset}" for k in as_dict(fedgen)})
  return defaults, chosen, sources, dataset_defaults


def _flags_given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
  """The settings' flag names (argparse dests) on the command line, however spelled or abbreviated."""
  unset = object()
  dests = [a.dest for a in parser._actions if a.dest in FLAGS]
  probe = argparse.Namespace(**{dest: unset for dest in dests})
  parser.parse_known_args(argv, probe)
  return {dest for dest in dests if getattr(probe, dest) is not unset}


def _without_unread_options(config: RunConfig, sources: dict[str, str], given: set[str],
                            notes: list[str]) -> RunConfig:
  """The method options a preset set for a method the run does not have back at their defaults, and a config
  file's too when ``--method`` chose another method than the file's (each one dropped says so in ``notes``). A
  file's option its own method does not read stays (`methods.check_options` refuses it if changed); one given as a
  flag is refused even at its default (``--prox-mu 0.1`` beside HeteroAvg would pass as if it acted)."""
  entry = get_entry(config.method.name, missing_ok=True)
  if entry is None:
    return config
  preset = next((s for p, s in sources.items() if p.startswith("method.fedgen.") and s.startswith("--fedgen")), None)
  if preset is not None and FedGenConfig not in entry.options:  # (asked for by name: not a preset's passing value)
    raise ValueError(f"{preset} applies to {', '.join(readers(FedGenConfig))}, not {entry.name}")
  reset, values = {}, flatten(config)
  for kind in config.method.families():
    if kind in entry.options:
      continue
    for leaf in (leaf for leaf in FLAGS.values() if leaf.owner is kind):
      if leaf.flag in given and not leaf.setting.shared:
        raise ValueError(f"{leaf.cli} applies to {', '.join(readers(kind)) or 'no method'}, not {entry.name}")
      source = sources.get(leaf.path, "")
      if not source or values[leaf.path] == leaf.default or (source.startswith("--config") and "method" not in given):
        continue
      reset[leaf.flag] = leaf.default
      if source.startswith("--config"):
        notes.append(f"note: {leaf.path} {values[leaf.path]!r} of {source} is left at its default "
                     f"{leaf.default!r}: --method {config.method.name} does not read it")
  return config.replace(**reset) if reset else config


def _given(argv: Sequence[str] | None, flag: str) -> bool:
  """Whether ``flag`` is on the command line, spelled whole or abbreviated as argparse accepts (``--output``)."""
  names = (arg.split("=", 1)[0] for arg in (sys.argv[1:] if argv is None else argv) if arg.startswith("--"))
  return any(len(name) > 3 and flag.startswith(name) for name in names)


def _copied_run_folder(path: str, config: RunConfig) -> bool:
  """Whether a config file is the config.json of a run folder other than the one it names (e.g. a copy)."""
  metrics = os.path.join(os.path.dirname(os.path.abspath(path)), "metrics.jsonl")
  return os.path.basename(path) == "config.json" and os.path.exists(metrics) and not _names_its_own_folder(path, config)


def _names_its_own_folder(path: str, config: RunConfig) -> bool:
  """Whether a config file is a results folder's own config.json (its output.dir is the file's folder)."""
  folder = os.path.dirname(os.path.abspath(path))
  return os.path.isdir(config.output.dir) and os.path.samefile(folder, config.output.dir)


def build_parser(defaults: RunConfig, description: str, coarse_labels: bool = False) -> argparse.ArgumentParser:
  """Every setting's flag, defaulting to ``defaults``, and this command's own flags."""
  parser = argparse.ArgumentParser(description=description, epilog=flags.methods_help(),
                                   usage="%(prog)s [--preset NAME] [--method NAME] [--FLAG VALUE ...]",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  flags.add_settings(parser, defaults, root_title="run")
  flags.add_settings(parser, DistributedConfig())
  own = parser.add_argument_group("this command")
  own.add_argument("--config", default=None, metavar="FILE",
                   help="start from the run in a JSON or YAML file (e.g. a results folder's config.json); the "
                   "flags given as well win")
  own.add_argument("--seeds", default=None, type=_seed_list, metavar="S,S,...",
                   help="one run per seed into sibling folders --output-dir_sS (which `compare --baseline` pairs by "
                   "seed); replaces --seed. On the fused round program the runs advance together in one device "
                   "program, else one after another (docs/many-runs.md)")
  own.add_argument("--sweep", default=[], action="append", metavar="SETTING=V,V,...",
                   help="one run per value of a config-tree setting (e.g. client.learning_rate=1e-3,3e-3 or "
                   "method.prox.mu=0.01,0.1; repeat for the product, times --seeds), into folders "
                   "--output-dir_SETTING=V[_sS]; only settings that change no shape or program structure")
  own.add_argument("--runs-per-program", default=None, type=int, metavar="N",
                   help="at most N runs of --seeds/--sweep in one device program (default: as many as XLA's "
                   "memory estimate fits on the device; more go in chunks)")
  own.add_argument("--preset", default=None, choices=tuple(PRESETS), help="start from a named setting: " + "; ".join(
      f"{p.name}: {p.description}" + (f" (reduced: {p.reduced})" if p.reduced else "") for p in PRESETS.values()))
  own.add_argument("--fedgen-preset", default=None, choices=tuple(FEDGEN_PRESETS),
                   help="FedGen's generator and regularizer values of the FedCross framework's config for this "
                   "dataset (--fedgen-* flags given as well win)")
  own.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="jax's persistent compilation cache (a second run skips XLA's compilation); default "
                   f"${CACHE_ENV}, else $XDG_CACHE_HOME/fedjax_hetero/xla (~/.cache/fedjax_hetero/xla); 'off' "
                   "turns it off")
  if coarse_labels:
    own.add_argument("--coarse", action="store_true",
                     help="train on the 20 superclass labels (the FedCross authors' code) instead of the fine ones")
  return parser


def _seed_list(text: str) -> tuple[int, ...]:
  try:
    seeds = tuple(int(s) for s in text.split(",") if s.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integer seeds, got {text!r}") from None
  if not seeds or len(set(seeds)) != len(seeds):
    raise argparse.ArgumentTypeError(f"expected distinct seeds, got {text!r}")
  out_of_range = [s for s in seeds if not 0 <= s < 2**32]
  if out_of_range:  # (checked here: the runs' own check would name --seed, which the command does not give)
    raise argparse.ArgumentTypeError(f"a seed must be an integer in [0, 4294967295], got {out_of_range[0]}")
  return seeds


def seed_runs(config: RunConfig, seeds: Sequence[int] | None) -> list[RunConfig]:
  """The runs of ``--seeds``: the config with each seed, into sibling folders ``<output-dir>_s<seed>``."""
  if not seeds:
    return [config]
  return [config.replace(seed=seed, output_dir=f"{config.output.dir.rstrip('/')}_s{seed}") for seed in seeds]


def _check_compile_cache(directory: str | None) -> None:
  if directory and directory.lower() != "off" and os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"--compile-cache {directory!r} is a file, not a directory")


def parse(argv: Sequence[str] | None, dataset: str, description: str | None = None,
          coarse_labels: bool = False) -> tuple[RunConfig, DistributedConfig, argparse.Namespace, Preset | None]:
  """The run's config, this process's multi-process settings, the command's own flags and the preset chosen;
  every value checked (exits with status 2 naming the flag otherwise)."""
  for old, new in RENAMED.items():
    if _given(argv, old):
      fail(f"{old} was renamed: pass {new}")
  try:
    with combinations_unchecked():  # (the flags may still change them: the run's config is checked whole below)
      defaults, chosen, sources, dataset_defaults = run_defaults(argv, dataset)
  except ValueError as e:
    fail(str(e))
  parser = build_parser(defaults, description or defaults_for(dataset).description, coarse_labels)
  args = parser.parse_args(argv)
  given = _flags_given(parser, argv)
  if args.seeds and "seed" in given:
    fail("--seed and --seeds exclude each other: --seeds gives every run its seed")
  # Where each setting not given as a flag came from, for the messages about it (`preflight.check_settings`), and
  # how messages name it (`declare.named_from`).
  args.flags_given = given
  args.dataset_defaults = dataset_defaults
  args.setting_sources = {path: source for path, source in sources.items()
                          if path not in FLAGS_BY_PATH or FLAGS_BY_PATH[path].flag not in given}
  args.setting_names = setting_names(args.setting_sources, known_lines(args.config))
  if getattr(args, "coarse", False):
    args.dataset = f"{args.dataset}_coarse"
  args.notes = []
  if args.seeds and "federation.seed" in args.setting_sources:  # (as --seed beside --seeds is refused)
    args.notes.append(f"note: --seeds replaces federation.seed {getattr(args, 'seed')} of "
                      f"{args.setting_sources['federation.seed']}")
  for first, second in (("partition_file", "max_train_samples"), ("test_first", "max_test_samples")):
    source = args.setting_sources.get(FLAGS[second].path, "")
    if first in given and second not in given and source.startswith("--preset"):  # (no flag could unset it)
      args.notes.append(f"note: {FLAGS[first].cli} replaces {second} {getattr(args, second)} of {source}")
      setattr(args, second, None)
  # A setting at its default is named so in the checks of the whole config, not as a flag the user gave.
  args.setting_names = {**{leaf.cli: f"{leaf.cli} (default)" for leaf in FLAGS.values() if leaf.flag not in given
                           and leaf.path not in sources and not leaf.path.startswith("output.")},
                        **args.setting_names}
  try:
    with declare.named_from(args.setting_names):
      config = _without_unread_options(flags.config_from_args(args), args.setting_sources, given, args.notes)
      args.notes += file_notes(args.config, config)
      processes = distributed_settings(*(getattr(args, name) for name in DISTRIBUTED_FLAGS))
      processes.check_backend(config.backend)
      config.data.check_paths()
      config.output.check_paths()
      _check_compile_cache(args.compile_cache)
  except ValueError as e:
    fail(str(e))
  return config, processes, args, chosen


def setting_names(sources: dict[str, str], lines: dict[str, int]) -> dict[str, str]:
  """Command-line flag -> how messages name that setting, for the settings a preset or a config file gave:
  ``clients_per_round (from --preset inco-cpu)``, ``federation.clients_per_round (from --config run.yaml, line
  3)``."""
  names = {}
  for path, source in sources.items():
    leaf = FLAGS_BY_PATH.get(path)
    if leaf is None:
      continue
    if source.startswith("--config"):
      line = lines.get(path)
      names[leaf.cli] = f"{path} (from {source}" + (f", line {line})" if line else ")")
    else:
      names[leaf.cli] = f"{leaf.flag} (from {source})"
  return names


def _describe_preset(chosen: Preset, config: RunConfig) -> str:
  changed = paper_deviations(chosen, config.flags())
  note = "; this run differs from the paper's protocol in: " + ", ".join(
      f"{k}={v!r} (paper {'unset' if p is None else repr(p)})" for k, (v, p) in changed.items()) if changed else ""
  return f"preset {chosen.name}: {'REDUCED SCALE. ' if chosen.reduced else ''}{chosen.description}{note}"


def _run(runs: Sequence[RunConfig], train: Callable[[], list[dict[str, Any]]], main_process: bool,
         log: Callable[[str], None] = print) -> list[dict[str, Any]]:
  """The summaries of ``train()`` (the runs ``runs``), printed; errors and signals end the command."""
  try:
    with distributed.lost_process_named():  # (a collective failing as another process died: one line naming it)
      summaries = train()
  except Interrupted as e:  # the run wrote its folder and said how to resume
    raise ending_on_signal(e.exit_status) from None
  except (ValueError, fdata.DataNotFoundError, FloatingPointError) as e:
    fail(str(e))
  except (OSError, MemoryError) as e:  # one line for every OS error
    where = "" if len(runs) == 1 else " and its siblings"
    fail(os_errors.describe(e, f"(writing in --output-dir {runs[0].output.dir!r}{where})"), 1)
  if not (stopped := any(summary.get("stopped_after") for summary in summaries)):
    command_finished()
  if main_process:
    for run, summary in zip(runs, summaries):
      log(json.dumps({"final_accuracy": summary["final_accuracy"] or {},
                      "best_mean_accuracy": summary["best_mean_accuracy"],
                      "train_seconds": round(summary["train_seconds_all_rounds"], 1),
                      "output_dir": run.output.dir}, indent=1))
  if stopped:
    raise SystemExit(STOPPED_AFTER_STATUS)
  return summaries


def main(dataset: str = "fashion_mnist", argv: Sequence[str] | None = None, description: str | None = None,
         coarse_labels: bool = False) -> dict[str, Any] | list[dict[str, Any]]:
  """Parses flags and runs (one run per seed with ``--seeds``: a list of summaries); ``coarse_labels`` adds
  ``--coarse`` (CIFAR-100's 20 superclasses)."""
  with one_line_on_signals():
    config, processes, args, chosen = parse(argv, dataset, description, coarse_labels)
    try:
      sweeps = [parse_sweep(text, config) for text in args.sweep]
    except ValueError as e:
      fail(str(e))
    with declare.named_from({**args.setting_names, **sweep_names(sweeps)}):
      return _main(config, processes, args, chosen, sweeps)


def _main(config: RunConfig, processes: DistributedConfig, args: argparse.Namespace, chosen: Preset | None,
          sweeps: list[tuple[str, tuple[float, ...]]]) -> dict[str, Any] | list[dict[str, Any]]:
  try:
    for name, _ in sweeps:
      if FLAGS_BY_PATH[name].flag in args.flags_given:
        raise ValueError(f"--sweep {name} gives every run its value: drop {FLAGS_BY_PATH[name].cli}, or add its "
                         "value to the sweep's")
      if name in args.setting_sources:
        args.notes.append(f"note: --sweep {name} replaces its value {flatten(config)[name]!r} of "
                          f"{args.setting_sources[name]}")
    if args.runs_per_program is not None and args.runs_per_program < 1:
      raise ValueError(f"--runs-per-program must be at least 1, got {args.runs_per_program}")
    runs = runs_of(config, args.seeds, sweeps) if sweeps else seed_runs(config, args.seeds)
    paths_of_flags = frozenset(FLAGS[name].path for name in args.flags_given if name in FLAGS)
    from_file = {path for path, source in args.setting_sources.items() if source.startswith("--config")}
    given_paths = paths_of_flags | from_file | {name for name, _ in sweeps}
    runs = [keep_latest_local_training(run, given_paths, args.notes.append) for run in runs]
    for run in runs:
      check_settings(run, args.setting_sources, args.dataset_defaults, paths_of_flags)
      run.output.check_paths()
    # The build step: every run's method made and checked against its groups and cohort, before any data.
    methods = [run_method(run) for run in runs]
  except ValueError as e:
    fail(str(e))
  # In a multi-process run a process that fails exits at once (`distributed.exit_on_failure`).
  with distributed.exit_on_failure(processes.enabled):
    try:
      distributed.initialize(processes)
    except RuntimeError as e:
      fail(str(e), distributed.FAILED)
    try:
      enable_persistent_cache(args.compile_cache)
    except OSError as e:
      fail(f"--compile-cache {args.compile_cache!r} cannot be used: {e}")
    main_process = distributed.is_main_process() if processes.enabled else True
    log = os_errors.StdoutLog()  # (a closed stdout, as with `| head`, stops the run as SIGPIPE would)
    if chosen is not None and main_process:
      log(_describe_preset(chosen, config))
    for note in args.notes if main_process else ():
      log(note)
    if len(runs) == 1:
      summaries = _run(runs, lambda: [run_checked(runs[0], methods[0], log=log)], main_process, log)
    else:
      jobs_log = log if main_process else (lambda _: None)
      summaries = _run(runs, lambda: run_jobs(runs, methods, jobs_log, args.runs_per_program), main_process, log)
  if args.seeds and main_process:
    log(f"paired by seed: python -m experiments.compare {' '.join(shlex.quote(r.output.dir) for r in runs)} "
        "RUNS_OF_ANOTHER_METHOD --baseline " + methods[0].name)  # (the name the runs record)
  return summaries if len(runs) > 1 or args.seeds else summaries[0]


__all__ = ["DATASETS", "build_parser", "main", "methods_help", "parse", "run_defaults"]
