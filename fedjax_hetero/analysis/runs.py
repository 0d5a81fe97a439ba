"""Finished runs read back and paired: what `fedjax_hetero.cli.compare` tabulates.

A run is a results folder's ``summary.json`` and ``metrics.jsonl`` rows. `pairings` pairs every method's runs
with a baseline method's runs of the same seed, round by round at the rounds both evaluated; `interval` and
`windowed_means` summarize the per-round differences. Runs under the backdoor attack are their own variant of
the method (`method_of`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import numpy as np

from fedjax_hetero import os_errors
from fedjax_hetero.config import RunConfig, as_dict
from fedjax_hetero.run import metrics_log, results_folder
from fedjax_hetero.run.history import PROCESSES, ROLLBACKS, SEGMENTS

Runs = Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]]  # (label, summary.json, metrics.jsonl rows)


def load_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  """A results folder's summary and rows. A run that has not finished (killed, stopped, still training: no
  summary.json yet) is read from its config.json and the rows so far, its summary marked ``"unfinished": True``."""
  if os.path.isfile(run_dir):
    raise SystemExit(f"error: {run_dir!r} is a file, not a results folder")
  summary_path, metrics_path = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "metrics.jsonl")
  config_path = os.path.join(run_dir, "config.json")
  if not os.path.exists(summary_path) and os.path.exists(metrics_path) and os.path.exists(config_path):
    try:
      config, rows = results_folder.read_json_object(config_path), metrics_log.read_rows(metrics_path)
    except (ValueError, OSError) as e:
      raise SystemExit(f"error: {os_errors.describe(e) if isinstance(e, OSError) else e}") from None
    config = {k: v for k, v in config.items() if k not in (SEGMENTS, ROLLBACKS, PROCESSES)}  # (as summary.json's)
    method = config.get("method")
    return {"method": method.get("name") if isinstance(method, dict) else method, "config": config,
            "unfinished": True}, rows
  if not os.path.exists(summary_path) and os.path.exists(metrics_path):
    raise SystemExit(f"error: {run_dir!r} has rows (metrics.jsonl) but neither summary.json nor config.json, which "
                     "say what the run was: it cannot be compared or resumed (a results folder copied in part?)")
  for path in (summary_path, metrics_path):
    if not os.path.exists(path):
      raise SystemExit(f"error: {path} not found; is {run_dir!r} a finished results folder?")
  try:  # read back checked: a damaged file is an error naming it and the line, not a traceback
    summary = results_folder.read_json_object(summary_path)
    rows = metrics_log.read_rows(metrics_path)
  except (ValueError, OSError) as e:
    raise SystemExit(f"error: {os_errors.describe(e) if isinstance(e, OSError) else e}") from None
  return summary, rows


def evaluated(rows: Sequence[dict[str, Any]], part: str = "mean") -> list[tuple[int, float]]:
  """(round, accuracy) of every round that evaluated ``part``: ``mean`` or an architecture group's name."""
  return [(r["round"], r["test_accuracy"][part]) for r in rows if part in (r.get("test_accuracy") or {})]


def up_to_round(rows: Sequence[dict[str, Any]], last_round: int | None) -> list[dict[str, Any]]:
  return [r for r in rows if last_round is None or r["round"] <= last_round]


def last_shared_round(runs: Runs) -> int | None:
  """The last round that every run evaluated (its mean accuracy), or None if they share none."""
  shared = None
  for _, _, rows in runs:
    rounds = {r for r, _ in evaluated(rows)}
    shared = rounds if shared is None else shared & rounds
  return max(shared) if shared else None


def ending_notes(runs: Runs) -> list[str]:
  """A note for every run that did not end as a finished run: one with no summary.json yet (killed, still
  training), one interrupted by a signal or stopped by ``--stop-after`` before its last round, and one stopped by
  the divergence guard."""
  notes = []
  for label, summary, rows in runs:
    last = rows[-1]["round"] if rows else 0
    interrupted, stopped = summary.get("interrupted") or {}, summary.get("stopped_after") or {}
    early = (interrupted or stopped).get("completed_round", 0) < (summary.get("config") or {}).get("rounds", math.inf)
    why = ("no summary.json" if summary.get("unfinished") else
           f"{interrupted.get('signal', 'a signal')} after round {interrupted.get('completed_round')}"
           if interrupted and early else
           f"--stop-after {stopped.get('seconds')} s after round {stopped.get('completed_round')}" if stopped and early
           else None)
    if why:
      notes.append(f"note: {label} has not finished ({why}): its rows up to round {last} are compared")
    diverged = summary.get("stopped_by_divergence")
    if diverged:
      reason = str(diverged.get("reason") or "")
      reason = reason.split(": ", 1)[1] if reason.startswith("round ") and ": " in reason else reason
      notes.append(f"note: {label} was stopped at round {diverged.get('round')}, when it diverged"
                   f"{f' ({reason})' if reason else ''}: its rows up to round {last} are compared")
  return notes


def base_method_of(summary: dict[str, Any]) -> str:
  return summary.get("method") or summary["config"]["method"]  # older summaries: only the flat config's


def attack_of(summary: dict[str, Any]) -> str | None:
  """The backdoor attack a run was under, as text (None: a clean run, or an older one without the option)."""
  federation = summary["config"].get("federation") or {}
  fraction = federation.get("malicious_fraction") or 0
  if not fraction:
    return None
  delta = "" if federation.get("backdoor_delta", "update") == "update" else f" {federation['backdoor_delta']}"
  group = "" if federation.get("malicious_group", "any") == "any" else f" {federation['malicious_group']}"
  leaves = "" if federation.get("backdoor_leaves", "all") == "all" else f" {federation['backdoor_leaves']} only"
  return f"backdoor {100 * fraction:g}% x{federation.get('backdoor_scale'):g}{leaves}{delta}{group}"


def method_of(summary: dict[str, Any]) -> str:
  """The method, and the attack if the run was under one (an attacked run is a variant of its own)."""
  attack = attack_of(summary)
  return base_method_of(summary) + (f" [{attack}]" if attack else "")


def seed_of(summary: dict[str, Any]) -> int:
  config = summary["config"]
  return config["federation"]["seed"] if "federation" in config else config["seed"]


def rounds_to(rows: Sequence[dict[str, Any]], target: float) -> int | None:
  """The first evaluated round whose mean accuracy is at least ``target`` (a fraction), or None."""
  return next((r for r, a in evaluated(rows) if a >= target), None)


def dissimilarity_per_round(rows: Sequence[dict[str, Any]], part: str) -> list[tuple[int, float]]:
  """(round, the part's gradient dissimilarity averaged over the groups) for every round that logged it."""
  out = []
  for r in rows:
    values = [g[part] for g in (r.get("dissimilarity") or {}).values() if g.get(part) is not None]
    if values:
      out.append((r["round"], float(np.mean(values))))
  return out


def client_accuracy_per_round(rows: Sequence[dict[str, Any]], group: str, key: str) -> list[tuple[int, float]]:
  """(round, ``key`` of group ``group``'s clients' held-out accuracy: mean, worst_10pct or std; group "all": every
  client) for every evaluation round with per-client evaluation (``client_accuracy``)."""
  return [(r["round"], r["client_accuracy"][group][key]) for r in rows
          if r.get("client_accuracy") and group in r["client_accuracy"]]


def last_client_accuracy(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """The last evaluation's ``client_accuracy`` (None for a run without per-client evaluation)."""
  return next((r["client_accuracy"] for r in reversed(rows) if r.get("client_accuracy")), None)


def cumulative_costs(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """The running cost totals after the last row (`fedjax_hetero.rounds.costs`): bytes down, up and both, client
  FLOPs; None for a run that logged none (older runs)."""
  return (rows[-1].get("costs") or {}).get("cumulative") if rows else None


def accuracy_by_cost(rows: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
  """(the running total ``key`` after the round, e.g. ``bytes`` or ``client_flops``, mean accuracy) at every
  evaluated round that logged it."""
  out = []
  for r in rows:
    total = ((r.get("costs") or {}).get("cumulative") or {}).get(key)
    if r.get("test_accuracy") and total is not None:
      out.append((float(total), r["test_accuracy"]["mean"]))
  return out


def mean_dissimilarity(rows: Sequence[dict[str, Any]], part: str) -> float | None:
  """The part's gradient dissimilarity averaged over the rounds that logged it (None if none did)."""
  values = [v for _, v in dissimilarity_per_round(rows, part)]
  return float(np.mean(values)) if values else None


@dataclasses.dataclass(frozen=True)
class Pairing:
  """One method's runs against the baseline's runs of the same seeds, for one accuracy (the mean or a group's).

  Per seed (in ``seeds`` order): ``rounds``, the rounds both runs evaluated; ``diffs``, the run's accuracy minus
  the baseline's at those rounds (points); ``best``, the run's best accuracy minus the baseline's best at those
  rounds (points)."""
  method: str
  seeds: list[int]
  rounds: list[np.ndarray]
  diffs: list[np.ndarray]
  best: list[float]

  @property
  def pooled(self) -> np.ndarray:
    return np.concatenate(self.diffs)

  @property
  def seed_means(self) -> np.ndarray:
    """Each seed's mean per-round difference: one observation per seed, for ``seed_interval``."""
    return np.array([d.mean() for d in self.diffs])


def runs_by_method(runs: Runs) -> dict[str, dict[int, list[dict[str, Any]]]]:
  """method (with its attack, see ``method_of``) -> seed -> rows, in the order the runs were given."""
  by_method: dict[str, dict[int, list[dict[str, Any]]]] = {}
  for _, summary, rows in runs:
    by_method.setdefault(method_of(summary), {})[seed_of(summary)] = rows
  return by_method


def groups_of(runs: Runs) -> list[str]:
  """The architecture groups whose accuracy the runs logged (``test_accuracy`` keys but ``mean``), first seen first."""
  return list(dict.fromkeys(g for _, _, rows in runs for r in rows for g in (r.get("test_accuracy") or {})
                            if g != "mean"))


def paired_points(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]],
                  part: str = "mean") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(rounds, the run's accuracy, the baseline's accuracy) at the rounds both evaluated ``part``."""
  base_acc = dict(evaluated(base, part))
  common = [(r, a, base_acc[r]) for r, a in evaluated(rows, part) if r in base_acc]
  return (np.array([r for r, _, _ in common], dtype=int), np.array([a for _, a, _ in common], dtype=float),
          np.array([b for _, _, b in common], dtype=float))


def pairings(runs: Runs, baseline: str, part: str = "mean") -> list[Pairing]:
  """Every method but ``baseline`` paired with it by seed and round (seeds without a common round left out)."""
  by_method = runs_by_method(runs)
  if baseline not in by_method:
    raise SystemExit(f"error: no run of the baseline {baseline!r}; methods: {', '.join(by_method)}")
  out = []
  for method, seeds in by_method.items():
    if method == baseline:
      continue
    common = sorted(set(seeds) & set(by_method[baseline]))
    points = {s: paired_points(seeds[s], by_method[baseline][s], part) for s in common}
    points = {s: p for s, p in points.items() if len(p[0])}
    if points:
      out.append(Pairing(method, list(points), [p[0] for p in points.values()],
                         [100 * (p[1] - p[2]) for p in points.values()],
                         [100 * (p[1].max() - p[2].max()) for p in points.values()]))
  return out


def interval(diffs: np.ndarray, z: float = 1.96) -> tuple[float, float | None, float | None]:
  """(mean, low, high): the mean with a normal 95% interval over the pairs (None bounds for a single pair,
  which has no spread)."""
  mean = float(diffs.mean())
  if len(diffs) < 2:
    return mean, None, None
  half = z * float(diffs.std(ddof=1)) / math.sqrt(len(diffs))
  return mean, mean - half, mean + half


def seed_interval(means: np.ndarray, level: float = 0.95) -> tuple[float, float | None, float | None]:
  """(mean, low, high): the mean of the seeds' mean differences with a Student-t interval over the seeds (n - 1
  degrees of freedom; None bounds for a single seed). Each seed counts once, so unlike ``interval`` over the pooled
  rounds it does not treat a seed's correlated rounds as independent: the interval to order methods by."""
  from scipy import stats  # (only here: scipy's import is slow and the other statistics need numpy alone)
  mean = float(means.mean())
  if len(means) < 2:
    return mean, None, None
  half = float(stats.t.ppf(0.5 + level / 2, len(means) - 1)) * float(means.std(ddof=1)) / math.sqrt(len(means))
  return mean, mean - half, mean + half


def windowed_means(rounds: Sequence[np.ndarray], diffs: Sequence[np.ndarray], window: int,
                   last_round: int) -> list[float | None]:
  """The mean difference over every seed's pairs in each window of ``window`` rounds (1..window,
  window+1..2*window, ...) up to ``last_round``; None for a window without a pair."""
  rounds_all, diffs_all = np.concatenate(rounds), np.concatenate(diffs)
  out: list[float | None] = []
  for start in range(1, last_round + 1, window):
    inside = (rounds_all >= start) & (rounds_all < start + window)
    out.append(float(diffs_all[inside].mean()) if inside.any() else None)
  return out


def default_window(last_round: int) -> int:
  """A quarter of the rounds compared, rounded up: four windows."""
  return max(1, math.ceil(last_round / 4))


def final_pair(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
  """(the run's, the other's) accuracy at the last round both evaluated; None if they share none."""
  base_acc = dict(evaluated(base))
  common = [(r, a) for r, a in evaluated(rows) if r in base_acc]
  if not common:
    return None
  last, accuracy = common[-1]
  return accuracy, base_acc[last]


# Config keys that differ between the runs of one experiment without making another variant of its method.
# (method.name: runs are grouped by the method their summary names; its spelling in the config is not a variant)
NOT_A_VARIANT = ("federation.seed", "federation.sample_seed", "output.", "data.data_dir", "rounds", "eval_every",
                 "backend", "round_program", "rounds_per_call", "client.steps_per_call", "stop_after", "divergence.",
                 "method.name")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = tuple(value) if isinstance(value, list) else value
  return out


def flat_settings(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each run's config as ``{"path.to.setting": value}``, a setting newer than the run's folder at its default (the
  run had it)."""
  defaults = _flat(as_dict(RunConfig()))
  return [_file_named(PATH_SETTINGS, {**defaults, **_flat(summary["config"])}) for summary in summaries]


# Settings holding a file's path: runs given the same file by another path (relative, from another folder) are one
# experiment, so they are compared by the file's name.
PATH_SETTINGS = ("data.partition_file", "federation.availability_trace")


def _file_named(keys: Sequence[str], config: dict[str, Any]) -> dict[str, Any]:
  return {k: os.path.basename(v) if k in keys and isinstance(v, str) else v for k, v in config.items()}


def with_variants(runs: Runs) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
  """The runs with each method's variants told apart: where runs of one method (and attack) differ in a setting
  besides the seed (the values of a ``--sweep``), each run's method reads ``METHOD [setting=value, ...]``."""
  configs = flat_settings([summary for _, summary, _ in runs])
  out = []
  for (label, summary, rows), config in zip(runs, configs):
    siblings = [c for (_, s, _), c in zip(runs, configs) if method_of(s) == method_of(summary)]
    differ = sorted(k for k in config if not k.startswith(NOT_A_VARIANT)
                    and len({repr(c.get(k)) for c in siblings}) > 1)
    if differ:
      named = ", ".join(f"{k}={config[k]}" for k in differ)
      summary = {**summary, "method": f"{base_method_of(summary)} [{named}]"}
    out.append((label, summary, rows))
  return out


# Settings that decide which clients hold which examples and train in which rounds (and the cohorts' seed,
# --sample-seed): a run and the baseline's run of its seed pair round by round only where these agree (the method's
# own settings may differ, as may the optimizer's).
SAME_EXPERIMENT = ("data.", "groups", "federation.clients_per_round", "federation.group_draw",
                   "federation.client_dropout", "federation.availability_trace")


def experiment_differences(runs: Runs, baseline: str) -> dict[str, list[str]]:
  """Per method paired with ``baseline``: the `SAME_EXPERIMENT` settings in which any of its runs differs from
  the baseline's run of the same seed (methods that differ in none left out)."""
  settings = []
  for (_, summary, _), config in zip(runs, flat_settings([summary for _, summary, _ in runs])):
    cohorts = config.get("federation.sample_seed")
    settings.append({**{k: repr(v) for k, v in config.items()
                        if k.startswith(SAME_EXPERIMENT) and k != "data.data_dir"},
                     "federation.sample_seed": repr(seed_of(summary) if cohorts is None else cohorts)})
  base = {seed_of(s): mine for (_, s, _), mine in zip(runs, settings) if method_of(s) == baseline}
  out: dict[str, list[str]] = {}
  for (_, summary, _), mine in zip(runs, settings):
    method, seed = method_of(summary), seed_of(summary)
    if method != baseline and seed in base:
      differ = [k for k in sorted(set(mine) | set(base[seed])) if mine.get(k) != base[seed].get(k)]
      if differ:
        out[method] = sorted(set(out.get(method, [])) | set(differ))
  return out


def check_unique(runs: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]]) -> None:
  """The paired and drop tables pair runs by method, attack and seed, so two runs sharing all three (e.g. a
  method's ablations, which keep its name) would be merged: an error naming both."""
  seen: dict[tuple[str, str | None, int], str] = {}
  for name, summary, _ in runs:
    key = (base_method_of(summary), attack_of(summary), seed_of(summary))
    if key in seen:
      method, attack, seed = key
      raise ValueError(f"{seen[key]} and {name} are both {method}{f' [{attack}]' if attack else ''} with seed "
                       f"{seed}, so their rows would be merged; compare them in separate calls")
    seen[key] = name
