"""Where a run starts: a fresh folder, or the saved run it continues (`history`), checked before anything trains.

`history` reads a results folder's settings and history once (on --resume or --resume-or-start) and says whether
this command may continue it; `prepare_folder` makes the folder (or clears it for --overwrite).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax

from fedjax_hetero.config import RunConfig, flatten
from fedjax_hetero.config.run import FLAGS_BY_PATH
from fedjax_hetero.run import history as run_history
from fedjax_hetero.run import metrics_log, results_folder

Log = Callable[[str], None]


def saved_config(output_dir: str, log: Log = print) -> RunConfig | None:
  """The config a results folder was written with (older layouts too), or None (see `history.read`)."""
  saved = run_history.read(output_dir, log)
  return None if saved is None else saved.config


def keep_latest_local_training(config: RunConfig, chosen: frozenset[str], log: Log) -> RunConfig:
  """On a resume, each local-training setting (and the server learning rate: `history.RESUMABLE`) that this command
  does not choose (``chosen``: dotted paths its flags or config file give) keeps the value the folder's run trained
  with last: a ``--lr`` passed to an earlier resume stays when the run is resumed again with its first command. A
  chosen value still changes it."""
  if not (config.output.resume or config.output.resume_or_start):
    return config
  try:
    saved = saved_config(config.output.dir, log=lambda _: None)
  except (ValueError, OSError):  # (an unreadable folder: the resume's own checks say so, or repair it)
    return config
  if saved is None:
    return config
  before, now = flatten(saved), flatten(config)
  kept = {path: before[path] for path in sorted(run_history.RESUMABLE - chosen)
          if path in before and before[path] != now[path]}
  if not kept:
    return config
  for path, value in kept.items():
    flag = FLAGS_BY_PATH[path].cli
    log(f"keeping {flag} {_shown(value)}, the run's latest (this command would set {_shown(now[path])}; pass {flag} "
        "to change it)")
    section, field = path.split(".")
    config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{field: value})})
  return config


def _shown(value: Any) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def prepare_folder(config: RunConfig) -> None:
  """The run's folder, made (or cleared for --overwrite: the run's files only, its lock file stays)."""
  out = config.output.dir
  if config.output.overwrite and not config.output.resume and os.path.exists(out):
    results_folder.clear_for_overwrite(out)
  os.makedirs(out, exist_ok=True)


def history(config: RunConfig, log: Log) -> tuple[RunConfig, run_history.History, str | None]:
  """The run's history so far (read once, on --resume) and the config it continues with; raises ValueError if
  the config may not continue the folder's run."""
  output = config.output
  if output.resume:  # what the resume reads is sound (settings, metrics.jsonl), repaired as asked
    results_folder.check_resume(config, saved_config, log)
  saved = run_history.read(output.dir, log) if output.resume or output.resume_or_start else None
  if saved is None and output.resume_unchecked:  # its unreadable settings were set aside: this command's go on
    return config, run_history.History(processes=jax.process_count()), None
  if saved is None:
    if output.resume and results_folder.never_started(output.dir):
      log(f"{output.dir}: its run was stopped before it saved its settings (no config.json); starting it")
      config = dataclasses.replace(config, output=dataclasses.replace(output, resume=False))
    elif output.resume and results_folder.left_empty(output.dir):
      log(f"{output.dir}: empty (a run stopped before it wrote anything?); starting it")
      config = dataclasses.replace(config, output=dataclasses.replace(output, resume=False))
    elif output.resume and not output.resume_or_start:
      results_folder.check_no_foreign_files(output.dir)
      raise ValueError(f"--resume: {output.dir!r} holds no run to continue (no config.json); start it without "
                       "--resume, or pass --resume-or-start to continue a run where there is one and start it "
                       "where there is none")
    results_folder.check_fresh(output.dir, output.overwrite)
    return config, run_history.History(processes=jax.process_count()), None
  config = dataclasses.replace(config, output=dataclasses.replace(output, resume=True))
  config = run_history.keep_saved_group_spelling(saved, config)
  config = run_history.keep_rolled_back_learning_rates(config, saved.history, log)
  changed = run_history.check_resume(saved, config, jax.process_count(), log)
  check_rounds_left(config)
  return config, saved.history, changed


def check_rounds_left(config: RunConfig) -> None:
  """A resume to fewer rounds than the folder's run has trained is refused (it would do nothing)."""
  path = os.path.join(config.output.dir, "metrics.jsonl")
  done = metrics_log.last_round(path)
  if done > config.rounds:
    raise ValueError(f"--rounds {config.rounds}: the run in {config.output.dir!r} has trained {done} rounds already; "
                     f"pass --rounds above {done} to continue it (its results stay as they are)")


def finished_summary(output_dir: str, last_row: dict[str, Any]) -> dict[str, Any] | None:
  """The folder's summary.json if it is that of a run finished at ``last_row`` (not stopped or interrupted before
  it, its final accuracy that row's), else None: a resume with nothing to train keeps it as it is."""
  path = os.path.join(output_dir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  finished = (isinstance(saved, dict) and saved.get("final_round") == last_row["round"]
              and saved.get("final_accuracy") == last_row["test_accuracy"]
              and not any(saved.get(key) for key in ("interrupted", "stopped_after", "stopped_by_divergence")))
  return saved if finished else None
