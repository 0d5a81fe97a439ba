"""A run's history, as its results folder's ``config.json`` records it: read once, checked, extended.

``config.json`` holds the latest settings (the `RunConfig` tree) and their history: one *segment* per stretch
of rounds trained with the same local optimizer (and server learning rate), ``{"from_round", "settings", "reason"}``,
oldest first; every *rollback* after a divergence, ``{"diverged_round", "to_round", "reason", "learning_rate":
[before, after]}``, under a server optimizer with ``"server_lr": [before, after]``, and for a loss that rose with
``"diverged_group"`` and ``"diverged_loss"`` (`guard.rollback_record`); and the number of processes that wrote
it. `read` reads a folder's record once (older layouts included: `upgrade`); `check_resume` says whether a config
may continue it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, NamedTuple

from fedjax_hetero import models
from fedjax_hetero.config import FLAGS, DivergenceConfig, FedGenConfig, RunConfig, as_dict, flatten, from_dict
from fedjax_hetero.config.run import FLAGS_BY_PATH
from fedjax_hetero.methods import get_entry
from fedjax_hetero.run import metrics_log, results_folder

SEGMENTS, ROLLBACKS, PROCESSES = "segments", "rollbacks", "processes"
# Settings a resumed run may change. The first set leaves the trajectory as it was up to float tolerance (the
# backends and the two round programs agree to it; steps_per_call and rounds_per_call only group the same steps and
# rounds into calls; the dissimilarity metric only adds an upload). The second is the clients' local optimizer,
# rebuilt every round: lowering the learning rate after a divergence is the usual reason to resume. Anything else
# (data, partition, models, method and its settings) is a different run.
# (Not ``dissimilarity``: it changes no trajectory, but it adds a term and a server step, so a checkpoint's state.)
UNCHANGED_TRAJECTORY = frozenset({"data.data_dir", "rounds", "eval_every", "backend", "round_program",
                                  "rounds_per_call", "client.steps_per_call", "stop_after",
                                  *(f"divergence.{f.name}" for f in dataclasses.fields(DivergenceConfig))})
LOCAL_OPTIMIZER = frozenset(f"client.{name}" for name in ("epochs", "batch_size", "optimizer", "learning_rate",
                                                          "momentum", "weight_decay", "drop_last"))
# The server optimizer's learning rate, which a rollback lowers with the clients' (`guard.rolled_back`) and a resume may
# change as the advice says: its step reads it as a number, and its moments do not depend on it.
SERVER_LR = "server.lr"
RESUMABLE = LOCAL_OPTIMIZER | {SERVER_LR}
# Older layouts' method settings (a flat `MethodOptions`), by their new place in `MethodConfig`.
_OLD_METHOD_KEYS = {"aggregate": "averaging.aggregate", "moon_mu": "moon.mu", "moon_temperature": "moon.temperature",
                    "inco_variant": "inco.variant", "inco_granularity": "inco.granularity",
                    "clusamp_similarity": "clusamp.similarity", "inclusivefl_beta": "inclusivefl.beta",
                    "inclusivefl_momentum": "inclusivefl.momentum", "nefl_skip": "nefl.skip",
                    "nefl_step_sizes": "nefl.step_sizes",
                    **{f"fedfa_{k}": f"fedfa.{k}" for k in ("graft", "scale", "norm", "percentile")},
                    **{f"heterofl_{k}": f"heterofl.{k}" for k in ("scaler", "static_bn", "bn_samples", "mask_logits")}}


@dataclasses.dataclass
class History:
  segments: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  rollbacks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  processes: int = 1

  def next_segment(self, config: RunConfig, from_round: int, reason: str) -> None:
    """The rounds from ``from_round`` on are (re)trained with ``config``: later segments are dropped (their
    rounds are trained again), and a new one starts if the local settings differ from the last's (a setting an
    older record lacks, the server learning rate, counts as the same)."""
    kept = [seg for seg in self.segments if seg["from_round"] < from_round]
    settings = local_settings(config)
    if not (kept and all(kept[-1]["settings"].get(path, value) == value for path, value in settings.items())):
      kept.append({"from_round": from_round, "settings": settings, "reason": reason})
    self.segments = kept

  def spans(self, final_round: int) -> list[dict[str, Any]]:
    """The segments with the rounds each covers, ``rounds: [first, last]``, for the summary."""
    return [{**seg, "rounds": [seg["from_round"], (later["from_round"] - 1) if later else final_round]}
            for seg, later in zip(self.segments, [*self.segments[1:], None])]


class SavedRun(NamedTuple):
  config: RunConfig
  history: History


def local_settings(config: RunConfig) -> dict[str, Any]:
  """What a segment records: the local optimizer's settings, and the server optimizer's learning rate under one."""
  flat = flatten(config)
  paths = RESUMABLE if config.server.optimizer != "none" else LOCAL_OPTIMIZER
  return {path: flat[path] for path in sorted(paths)}


def read(output_dir: str, log: Callable[[str], None] = print) -> SavedRun | None:
  """The run a results folder holds: its config and history (``config.json``, or an older run's
  ``summary.json``); None if it has neither. Settings this version does not know are skipped with a note;
  raises ValueError if the rest is not a valid config."""
  for name, key in (("config.json", None), ("summary.json", "config")):
    path = os.path.join(output_dir, name)
    if not os.path.exists(path):
      continue
    with open(path) as f:
      saved = json.load(f)
    tree = saved if key is None else saved.get(key)
    if not isinstance(tree, dict):
      continue
    history = History(list(tree.pop(SEGMENTS, [])), list(tree.pop(ROLLBACKS, [])), tree.pop(PROCESSES, 1))
    ignored: list[str] = []
    config = upgrade(tree, ignored)
    if ignored:
      log(f"note: {path}: ignoring settings this version does not know: {', '.join(sorted(ignored))}")
    return SavedRun(config, history if key is None else summary_history(saved, path, _rounds_done(output_dir), log))
  return None


def summary_history(summary: dict[str, Any], path: str, done: int, log: Callable[[str], None]) -> History:
  """The history a summary.json records beside its config (each segment with the rounds it spans), read where
  config.json is gone, if it covers the ``done`` rounds of metrics.jsonl: a summary written before a later
  session that did not end (killed) would credit that session's rounds to the settings before it. Otherwise the
  record starts again at the resume, with a note."""
  try:
    results_folder.check_history(path, summary)  # (the records config.json holds, as it holds them)
    covers = isinstance(summary.get("final_round"), int) and summary["final_round"] >= done
  except ValueError:
    covers = False
  if covers:
    return History([{k: v for k, v in s.items() if k != "rounds"} for s in summary.get(SEGMENTS, [])],
                   list(summary.get(ROLLBACKS, [])), summary.get(PROCESSES, 1))
  log(f"note: {path} holds no record of the run's segments up to round {done} (config.json is gone); the record "
      "starts again at this resume")
  return History()


def _rounds_done(output_dir: str) -> int:
  try:
    return metrics_log.last_round(os.path.join(output_dir, "metrics.jsonl"))
  except metrics_log.MetricsError:  # (the resume's own check of the file names what is wrong)
    return 0


def upgrade(tree: dict[str, Any], ignored: list[str], own_options_only: bool = True,
            base: RunConfig | None = None) -> RunConfig:
  """A `RunConfig` from a saved tree of this or an older layout: a flat one (one value per flag), or the nested
  one with a flat method (``method.fedfa_graft``, ``method.prox_mu``/``fedprox_mu``). Unknown names go to
  ``ignored``; unless ``own_options_only`` is False (a user's config file, checked later), options of families
  the run's method does not read are dropped (older configs kept them all). Settings the tree leaves out are
  ``base``'s (the library's defaults)."""
  base = RunConfig() if base is None else base
  preset = None
  sections = [f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.default)]
  sections_only = [name for name in sections if name not in FLAGS]  # a flat layout has "method", a flag
  flat = not any(isinstance(value, dict) or name in sections_only for name, value in tree.items())
  if flat:  # one value per flag
    # (an older saved layout wrote null for a setting left at its default; a user's file means what it says)
    flags = {k: v for k, v in tree.items()
             if not (own_options_only and v is None and k in FLAGS and FLAGS[k].default is not None)}
    preset = flags.pop("fedgen_preset", None)
    method = {k: flags.pop(k) for k in ("prox_mu", "fedprox_mu") if k in flags}
    ignored += sorted(set(flags) - set(FLAGS))
    tree = as_dict(base.replace(**{k: v for k, v in flags.items() if k in FLAGS}))
    tree["method"].update(method)
  malformed = [name for name in sections if name in tree and not isinstance(tree[name], dict)]
  if malformed:
    raise ValueError(f"{', '.join(repr(name) for name in malformed)} must be an object of settings")
  tree = dict(tree)
  tree["method"] = _upgraded_method(dict(tree.get("method", {})), preset)
  config = from_dict(tree, ignored, base)
  return _own_options_only(config) if own_options_only else config


def _upgraded_method(method: dict[str, Any], fedgen_preset: str | None) -> dict[str, Any]:
  prox, fedprox = method.pop("prox_mu", None), method.pop("fedprox_mu", None)
  for old, new in _OLD_METHOD_KEYS.items():
    value = method.pop(old, None)
    if value is not None:
      family, name = new.split(".")
      method.setdefault(family, {})[name] = value
  mu = prox if prox is not None else fedprox
  if mu is not None:
    method.setdefault("prox", {})["mu"] = mu
  if fedgen_preset is not None:
    method["fedgen"] = as_dict(FedGenConfig.preset(fedgen_preset))
  return method


def _own_options_only(config: RunConfig) -> RunConfig:
  entry = get_entry(config.method.name, missing_ok=True)
  if entry is None:
    return config
  defaults = {f.name: f.default for f in dataclasses.fields(config.method)}
  unread = {name: defaults[name] for name, value in vars(config.method).items()
            if dataclasses.is_dataclass(value) and type(value) not in entry.options}
  return dataclasses.replace(config, method=dataclasses.replace(config.method, **unread))


def check_resume(saved: SavedRun, config: RunConfig, processes: int, log: Callable[[str], None]) -> str | None:
  """Raises ValueError, before any compute, if ``config`` (run by ``processes`` processes) would continue a
  run it did not start; returns the local-optimizer settings it changes, as text (None if none)."""
  out = config.output.dir
  if saved.history.processes != processes:
    raise ValueError(f"cannot resume {out!r} with {processes} process(es): it was run with "
                     f"{saved.history.processes} (as its folder records); resume with --num-processes "
                     f"{saved.history.processes}, or pass --overwrite instead of --resume to start over")
  before, now = flatten(saved.config), flatten(config)
  same_method = str(before.get("method.name")).lower() == str(now["method.name"]).lower()  # (names ignore case)
  changed = {path: f"{path}: {before[path]!r} -> {now[path]!r}" for path in now
             if not path.startswith("output.") and path not in UNCHANGED_TRAJECTORY and before.get(path) != now[path]
             and not (path == "method.name" and same_method)}
  refused = [text for path, text in changed.items() if path not in RESUMABLE]
  if refused:
    raise ValueError(f"cannot resume {out!r} with different settings ({'; '.join(refused)}); repeat the run's own "
                     "flags (see its config.json), or pass --overwrite instead of --resume to start over")
  if not changed:
    return None
  log(f"resuming with changed {'local training' if set(changed) <= LOCAL_OPTIMIZER else 'training settings'}: "
      f"{'; '.join(changed.values())}")
  return "; ".join(changed.values())


def _parsed_groups(groups: Any) -> tuple | None:
  try:
    return tuple(models.parse_group_spec(spec) for spec in groups)
  except (TypeError, ValueError):
    return None


def keep_saved_group_spelling(saved: SavedRun, config: RunConfig) -> RunConfig:
  """``config`` with the saved run's spelling of its groups where the two name the same groups (``cnn@0.125`` and
  ``CNN@0.1250``: widths compared as numbers); its per-group metrics and checkpoints keep their names."""
  if config.groups == saved.config.groups or _parsed_groups(config.groups) != _parsed_groups(saved.config.groups):
    return config
  return dataclasses.replace(config, groups=saved.config.groups)


def keep_rolled_back_learning_rates(config: RunConfig, history: History, log: Callable[[str], None]) -> RunConfig:
  """A run that rolled back lowered its learning rates (the clients', and a server optimizer's); resumed with the
  command that started it, it keeps each lowered rate instead of going back to one that diverged (another --lr or
  --server-lr still overrides)."""
  for key, path in _ROLLED_BACK_RATES.items():
    records = [r[key] for r in history.rollbacks if key in r]
    (section, field), flag = path.split("."), FLAGS_BY_PATH[path].cli
    now = getattr(getattr(config, section), field)
    if not records or now not in {before for before, _ in records} or now == records[-1][1]:
      continue
    lowered = records[-1][1]
    log(f"keeping {flag} {lowered:g}, the last rollback's ({flag} {now:g} diverged in this run; pass another {flag} "
        "to change it)")
    config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{field: lowered})})
  return config


# A rollback record's rates (`guard.rolled_back`, named as `guard.RATE_NAMES` names them) by their settings' paths.
_ROLLED_BACK_RATES = {"learning_rate": "client.learning_rate", "server_lr": SERVER_LR}


def write(config: RunConfig, history: History) -> None:
  """Writes the folder's ``config.json``: the latest settings and the history (call on process 0 only)."""
  with open(os.path.join(config.output.dir, "config.json"), "w") as f:
    json.dump({**as_dict(config), SEGMENTS: history.segments, ROLLBACKS: history.rollbacks,
               PROCESSES: history.processes}, f, indent=2)
