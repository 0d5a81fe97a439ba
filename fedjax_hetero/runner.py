"""An experiment from config to results folder: data, partition, rounds, checkpoints, plots.

In a multi-process run (`fedjax_hetero.distributed`) every process runs the experiment the same way, and
process 0 alone writes the folder's files, logs and shows progress; every process saves and restores the
checkpoints (orbax's multi-process checkpointing), so the folder must be on a file system all of them see.

``run_experiment(RunConfig(...))`` is what ``python -m experiments.<dataset>``
and the notebooks call. The results folder holds ``metrics.jsonl`` (one JSON
object per round), ``config.json``, ``summary.json``, ``accuracy.png``, the
partition report and plot, and orbax checkpoints under ``checkpoints/``. Under the backdoor attack
(``--malicious-fraction``) the malicious clients' ids are in ``summary.json`` (``malicious_clients``), at the
end of ``partition.txt`` (by architecture group) and in the log.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedjax_hetero import checkpoints
from fedjax_hetero import data as fdata
from fedjax_hetero import distributed
from fedjax_hetero import metrics_log, preflight, results_folder  # reliability hooks (issue 35)
from fedjax_hetero import models
from fedjax_hetero.backends import make_backend
from fedjax_hetero.config import FLAGS, RunConfig, as_dict, flatten, from_dict
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.engine import ArchGroup, NonFiniteLossError, Simulation, assign_groups
from fedjax_hetero.guard import DivergenceConfig, DivergenceError, DivergenceWatch
from fedjax_hetero.methods import build_method
from fedjax_hetero.validation import cli_flag


def partitioned_dataset(config: RunConfig, dataset: fdata.ArrayDataset | None = None
                        ) -> tuple[fdata.ArrayDataset, list[np.ndarray]]:
  """The run's dataset (loaded unless given; its subset, first test images, resized images and normalization if
  configured) and its client partition (drawn, or read from the partition file)."""
  d, seed = config.data, config.federation.seed
  if dataset is None:
    dataset = fdata.load_dataset(d.dataset, d.data_dir)
  d.check_sizes(len(dataset.train_labels), len(dataset.test_labels), dataset.num_classes)
  if d.partition_file is not None:  # checked before the images are resized
    parts = d.client_parts(len(dataset.train_labels))
  if d.max_train_samples or d.max_test_samples:
    dataset = dataset.subset(d.max_train_samples, d.max_test_samples, seed=seed)
  if d.test_first is not None:
    dataset = dataclasses.replace(dataset, test_images=dataset.test_images[:d.test_first],
                                  test_labels=dataset.test_labels[:d.test_first])
  if d.image_size is not None:
    dataset = dataclasses.replace(dataset, train_images=fdata.resize_images(dataset.train_images, d.image_size),
                                  test_images=fdata.resize_images(dataset.test_images, d.image_size))
  if d.normalize == "none":
    channels = dataset.image_shape[-1]
    dataset = dataclasses.replace(dataset, mean=(0.0,) * channels, std=(1.0,) * channels)
  if d.partition_file is None:
    parts = fdata.partition(dataset.train_labels, d.partition, d.num_clients, seed, alpha=d.alpha,
                            classes_per_client=d.classes_per_client)
  return dataset, parts


def build_simulation(config: RunConfig, dataset: fdata.ArrayDataset | None = None,
                     log: Callable[[str], None] = print) -> tuple[Simulation, list[np.ndarray]]:
  """Loads and partitions the data and builds the simulation (no training yet)."""
  dataset, parts = partitioned_dataset(config, dataset)
  preflight.check_fit(config, dataset, parts, log)  # reliability hook: sizes that would fail or do nothing
  store = FederatedStore.build(dataset.train_images, dataset.train_labels, parts, dataset.num_classes,
                               dataset.mean, dataset.std)
  groups = []
  for spec, clients in zip(config.groups, assign_groups(config.data.num_clients, len(config.groups))):
    name, width = models.parse_group_spec(spec)
    groups.append(ArchGroup(spec, models.build_model(name, dataset.num_classes, width), clients))
  backend = make_backend(config.backend)
  method = build_method(config.method.name, config.method, config.client)
  sim = Simulation(groups, store, config.client, method, config.federation, backend,
                   jnp.asarray(dataset.test_images), jnp.asarray(dataset.test_labels),
                   track_dissimilarity=config.dissimilarity, dissimilarity_cut=config.method.fedimpro.cut,
                   round_program=config.round_program, rounds_per_call=config.rounds_per_call)
  terms = ", ".join(t.name for t in method.terms)
  split = config.data.partition_file or config.data.partition
  log(f"{dataset.name}: {len(dataset.train_labels)} train / {len(dataset.test_labels)} test samples, "
      f"{config.data.num_clients} clients ({split}), groups {', '.join(config.groups)}, "
      f"method {method.name}" + (f" (client terms: {terms})" if terms else "") +
      f", backend {backend.name} on {jax.default_backend()}, " + (
          f"{sim.round_program.rounds_per_call} rounds per device program" if sim.round_program else
          "rounds as a host loop") + (
          f" ({jax.device_count()} devices of {jax.process_count()} processes)" if jax.process_count() > 1 else ""))
  if len(sim.malicious_clients):
    attack = config.federation
    log(f"backdoor attack: {len(sim.malicious_clients)} malicious clients (lambda {attack.backdoor_scale:g}, "
        f"delta_backdoor = {attack.backdoor_delta}): {_id_list(sim.malicious_clients)}")
  return sim, parts


def _id_list(ids: np.ndarray) -> str:
  return " ".join(str(int(c)) for c in ids)


def malicious_report(sim: Simulation) -> str:
  """The partition report's section on the backdoor attack's malicious clients (empty without attack)."""
  if not len(sim.malicious_clients):
    return ""
  lines = [f"\nmalicious clients (backdoor attack, fixed by the seed): {len(sim.malicious_clients)} of "
           f"{sim.store.num_clients}, by assigned architecture group"]
  for group, clients in ((g.name, np.intersect1d(g.clients, sim.malicious_clients)) for g in sim.groups):
    lines.append(f"  {group}: {_id_list(clients) or '-'}")
  return "\n".join(lines) + "\n"


def _check_output(config: RunConfig) -> None:
  results_folder.check_fresh(config.output.dir, config.output.overwrite)  # reliability hook


def _prepare_output(config: RunConfig) -> None:
  out = config.output.dir
  if config.output.overwrite and not config.output.resume and os.path.exists(out):
    results_folder.clear_for_overwrite(out)  # reliability hook: the folder's lock file stays
  os.makedirs(out, exist_ok=True)


def _quiet(_: str) -> None:
  pass


# Settings a resumed run may change. The first set leaves the trajectory as it was up to float tolerance (the
# backends agree to it; steps_per_call only groups the same steps into jitted calls; the dissimilarity metric only
# adds an upload). The second is the clients' local optimizer, rebuilt every round: lowering the learning rate
# after a divergence is the usual reason to resume. Anything else (data, partition, models, method and its settings) is a
# different run.
UNCHANGED_TRAJECTORY = frozenset({"data.data_dir", "rounds", "eval_every", "backend", "round_program",
                                  "rounds_per_call", "client.steps_per_call",
                                  "dissimilarity", *(f"divergence.{f.name}" for f in dataclasses.fields(DivergenceConfig))})
LOCAL_OPTIMIZER = frozenset(f"client.{name}" for name in ("epochs", "batch_size", "optimizer", "learning_rate",
                                                          "momentum", "weight_decay", "drop_last"))


def saved_config(output_dir: str, log: Callable[[str], None] = print) -> RunConfig | None:
  """The config a results folder was written with (``config.json``, or older runs' flat ``config.json``
  or ``summary.json``); None if it has neither. Settings this version does not know are skipped with a
  note; raises ValueError if the rest is not a valid config."""
  for name, key in (("config.json", None), ("summary.json", "config")):
    path = os.path.join(output_dir, name)
    if not os.path.exists(path):
      continue
    with open(path) as f:
      saved = json.load(f)
    saved = saved if key is None else saved.get(key)
    if not isinstance(saved, dict):
      continue
    saved = {k: v for k, v in saved.items() if k not in (SEGMENTS, ROLLBACKS, PROCESSES)}
    ignored: list[str] = []
    if "data" not in saved:  # the flat layout of older versions: one value per flag
      ignored = sorted(set(saved) - set(FLAGS) - {"fedgen_preset"})
      config = RunConfig.from_flags(**{k: v for k, v in saved.items() if k not in ignored})
    else:
      config = from_dict(saved, ignored)
    if ignored:
      log(f"note: {path}: ignoring settings this version does not know: {', '.join(ignored)}")
    return config
  return None


def _check_resumable(config: RunConfig, log: Callable[[str], None]) -> str | None:
  """Raises ValueError, before any compute, if ``config`` would continue a run it did not start; returns the
  local-optimizer settings it changes, as text (None if none)."""
  saved = saved_config(config.output.dir, log)
  if saved is None:
    return None
  before, now = flatten(saved), flatten(config)
  changed = {path: f"{path}: {before[path]!r} -> {now[path]!r}" for path in now
             if not path.startswith("output.") and path not in UNCHANGED_TRAJECTORY and before.get(path) != now[path]}
  refused = [text for path, text in changed.items() if path not in LOCAL_OPTIMIZER]
  if refused:
    raise ValueError(f"cannot resume {config.output.dir!r} with different settings ({'; '.join(refused)}); "
                     "repeat the run's own flags (see its config.json), or pass --overwrite instead of --resume to "
                     "start over")
  if not changed:
    return None
  log(f"resuming with changed local training: {'; '.join(changed.values())}")
  return "; ".join(changed.values())


# A results folder's config.json is the latest settings plus their history: one segment per stretch of rounds
# trained with the same local optimizer, {"from_round", "settings", "reason"}, oldest first; and every rollback
# after a divergence, {"diverged_round", "to_round", "reason", "learning_rate": [before, after]}.
SEGMENTS, ROLLBACKS = "segments", "rollbacks"
# config.json also records the run's process count: a multi-process run resumes with as many processes.
PROCESSES = "processes"


def _keep_rolled_back_learning_rate(config: RunConfig, log: Callable[[str], None]) -> RunConfig:
  """A run that rolled back lowered its learning rate; resumed with the command that started it, it keeps the
  lowered rate instead of going back to one that diverged (another --lr still overrides)."""
  _, rollbacks = _saved_history(config.output.dir)
  if not rollbacks:
    return config
  lowered = rollbacks[-1]["learning_rate"][1]
  diverged = {r["learning_rate"][0] for r in rollbacks}
  if config.client.learning_rate not in diverged or config.client.learning_rate == lowered:
    return config
  log(f"keeping the learning rate {lowered:g} of the last rollback: --lr {config.client.learning_rate:g} diverged "
      "in this run (pass another --lr to override)")
  return dataclasses.replace(config, client=dataclasses.replace(config.client, learning_rate=lowered))


def _local_settings(config: RunConfig) -> dict[str, Any]:
  flat = flatten(config)
  return {path: flat[path] for path in sorted(LOCAL_OPTIMIZER)}


def _saved_history(output_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """The segments and rollbacks of a results folder's config.json (none for a new or older folder)."""
  path = os.path.join(output_dir, "config.json")
  if not os.path.exists(path):
    return [], []
  with open(path) as f:
    saved = json.load(f)
  return list(saved.get(SEGMENTS, [])), list(saved.get(ROLLBACKS, []))


def _write_config(config: RunConfig, segments: Sequence[dict[str, Any]], rollbacks: Sequence[dict[str, Any]]) -> None:
  if not distributed.is_main_process():
    return
  with open(os.path.join(config.output.dir, "config.json"), "w") as f:
    json.dump({**as_dict(config), SEGMENTS: list(segments), ROLLBACKS: list(rollbacks),
               PROCESSES: jax.process_count()}, f, indent=2)


def _check_process_count(output_dir: str) -> None:
  """Raises ValueError if the results folder was written by a run with another process count (a folder
  without the record was written by one process)."""
  path = os.path.join(output_dir, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f).get(PROCESSES, 1)
  if saved != jax.process_count():
    raise ValueError(f"cannot resume {output_dir!r} with {jax.process_count()} process(es): it was run with "
                     f"{saved} (its config.json); resume with {cli_flag('distributed.num_processes')} "
                     f"{saved}, or pass --overwrite instead of --resume to start over")


def _next_segment(segments: list[dict[str, Any]], config: RunConfig, from_round: int, reason: str) -> list[dict[str, Any]]:
  """The segments after the rounds from ``from_round`` on are (re)trained with ``config``: later segments are
  dropped (their rounds are trained again), and a new one starts if the settings differ from the last's."""
  kept = [seg for seg in segments if seg["from_round"] < from_round]
  settings = _local_settings(config)
  if kept and kept[-1]["settings"] == settings:
    return kept
  return kept + [{"from_round": from_round, "settings": settings, "reason": reason}]


def plot_accuracy(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
  """Test accuracy vs round, one line per architecture group plus the mean; beside it, if the rows log it, the
  gradient dissimilarity of the low and high parts per group."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  evaluated = [r for r in rows if r.get("test_accuracy")]
  spread = [r for r in rows if r.get("dissimilarity")]
  fig = Figure(figsize=(12, 4.5) if spread else (7, 4.5))
  FigureCanvasAgg(fig)
  ax, *right = fig.subplots(1, 2 if spread else 1, squeeze=False)[0]
  if spread:
    for group in spread[-1]["dissimilarity"]:
      for part, style in (("low", "--"), ("high", "-")):
        points = [(r["round"], r["dissimilarity"][group][part]) for r in spread
                  if r["dissimilarity"].get(group, {}).get(part) is not None]
        if points:
          right[0].plot(*zip(*points), style, lw=1.1, label=f"{group} {part}")
    right[0].set_yscale("log")
    right[0].set_xlabel("round")
    right[0].set_title("gradient dissimilarity Σ p_c ‖d_c − d̄‖² / ‖d̄‖²")
    right[0].grid(alpha=0.3)
    right[0].legend(fontsize="small")
  if evaluated:
    for name in evaluated[-1]["test_accuracy"]:
      xs = [r["round"] for r in evaluated]
      ys = [100 * r["test_accuracy"][name] for r in evaluated]
      if name == "mean":
        ax.plot(xs, ys, "k-", lw=2.5, label="mean over groups")
      else:
        ax.plot(xs, ys, "-", lw=1.3, marker=".", label=name)
  ax.set_xlabel("round")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def run_experiment(config: RunConfig, dataset: fdata.ArrayDataset | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs (or resumes) an experiment and writes its results folder; returns the summary.

  Raises `guard.DivergenceError` when the run diverges and ``config.divergence`` says stop (after writing the
  summary; the best checkpoint is kept). In a multi-process run every process calls it, with the same config;
  only process 0 writes files and logs. The run holds its folder's lock throughout (`results_folder.lock`):
  a second run on the folder fails at once with FolderInUseError."""
  # Reliability hooks (issue 35): settings that would do nothing, then the folder's lock.
  preflight.check_settings(config)
  config.output.check_paths()
  with results_folder.lock(config.output.dir, enabled=distributed.is_main_process()):
    return _run_experiment(config, dataset, log)


def _run_experiment(config: RunConfig, dataset: fdata.ArrayDataset | None, log: Callable[[str], None]) -> dict[str, Any]:
  main = distributed.is_main_process()
  log = log if main else _quiet
  config.data.check_paths()
  config.output.check_paths()
  changed = None
  if config.output.resume:
    results_folder.check_resume(config, saved_config, log)  # reliability hook: what the resume reads is sound
    _check_process_count(config.output.dir)
    config = _keep_rolled_back_learning_rate(config, log)
    changed = _check_resumable(config, log)
  else:
    _check_output(config)
  out = config.output.dir
  segments, rollbacks = _saved_history(out) if config.output.resume else ([], [])
  distributed.barrier("fedjax_hetero.runner: settings read")  # before process 0 changes the folder
  if main:
    _prepare_output(config)
  sim, parts = build_simulation(config, dataset, log)
  results_folder.check_data(config, sim, log)  # reliability hook: a resume trains on the data it started on
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    initial = pool.submit(sim.init_state)  # XLA compiles the initialization while the partition is drawn
    if main:
      labels = np.asarray(sim.store.labels)
      with open(os.path.join(out, "partition.txt"), "w") as f:
        f.write(fdata.partition_report(labels, parts, sim.store.num_classes) + malicious_report(sim))
      fdata.plot_partition(fdata.class_counts(labels, parts, sim.store.num_classes),
                           os.path.join(out, "partition.png"))
    state = initial.result()
  metrics_path = os.path.join(out, "metrics.jsonl")
  rows: list[dict[str, Any]] = []
  if config.output.resume:
    restored = checkpoints.restore_latest_intact(out, state, log)
    if restored is not None:
      state = sim.place(restored)
      log(f"resumed from round {state.round}")
    rows = metrics_log.read_for_resume(metrics_path, state.round, log)  # reliability hook
  # Every process has read the folder (and process 0 set damaged checkpoints aside) before it is rewritten.
  distributed.barrier("fedjax_hetero.runner: folder read")
  manager = checkpoints.manager(out, config.output.checkpoint_every, config.output.keep_checkpoints)
  reason = ("start" if state.round == 0 else f"resumed with changed local training: {changed}" if changed
            else "resumed (the folder kept no earlier segments)")
  if state.round < config.rounds:
    segments = _next_segment(segments, config, state.round + 1, reason)
  _write_config(config, segments, rollbacks)
  _write_metrics(metrics_path, rows)
  watch = DivergenceWatch(config.divergence, sim.store.num_classes)
  watch.replay(rows)
  best = _best_accuracy(rows)

  wall_start = time.perf_counter()
  bar = tqdm(total=config.rounds, initial=state.round, desc=sim.method.name, unit="round",
             disable=not (config.output.progress and main), dynamic_ncols=True)
  try:
    while state.round < config.rounds:
      error = None
      count = _call_length(config, sim, state.round)
      evaluate = {r for r in range(state.round + 1, state.round + count + 1)
                  if r % config.eval_every == 0 or r == config.rounds}
      try:
        # `state` is not used again (a rollback restores a checkpoint)
        next_state, new_rows = sim.run_rounds(state, count, evaluate=evaluate, consume=True)
      except NonFiniteLossError as e:
        if config.divergence.action == "off":
          raise
        error, new_rows = DivergenceError(str(e), state.round + 1, None), []
      for m in new_rows:
        rows.append(m)
        if main:
          with open(metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        error = watch.check(m) if config.divergence.action != "off" else None
        if error is not None:
          break
      if error is not None:
        manager.wait_until_finished()
        if (config.divergence.action == "stop" or len(rollbacks) >= config.divergence.max_rollbacks
            or checkpoints.best_step(manager) is None):
          _stop(config, sim, rows, time.perf_counter() - wall_start, segments, rollbacks, error, manager)
        config, sim, state, rows, segments = _roll_back(config, dataset, manager, rows, segments, rollbacks, error,
                                                        log)
        _write_metrics(metrics_path, rows)
        watch = DivergenceWatch(config.divergence, sim.store.num_classes)
        watch.replay(rows)
        best = _best_accuracy(rows)
        bar.n = state.round
        bar.refresh()
        continue
      state, m = next_state, new_rows[-1]
      final = state.round == config.rounds
      accuracy = m["test_accuracy"]["mean"] if m["test_accuracy"] else None
      new_best = accuracy is not None and accuracy > best and accuracy >= _best_accuracy(new_rows)
      best = max(best, _best_accuracy(new_rows))
      if checkpoints.save(manager, state, force=final or new_best, accuracy=accuracy) and jax.tree.leaves(state.memory):
        manager.wait_until_finished()  # the next round writes the memory in place: the save must have read it
      postfix = {"loss": f"{m['train_loss']:.3f}", "samples/s": f"{m['samples_per_s']:.0f}"}
      last_eval = next((r["test_accuracy"] for r in reversed(rows) if r.get("test_accuracy")), None)
      if last_eval:
        postfix["acc"] = f"{100 * last_eval['mean']:.2f}%"
      bar.set_postfix(postfix)
      bar.update(count)
  finally:
    bar.close()
    manager.wait_until_finished()
  return _finish(config, sim, rows, time.perf_counter() - wall_start, segments, rollbacks)


def _call_length(config: RunConfig, sim: Simulation, done: int) -> int:
  """The rounds of the next `Simulation.run_rounds` call: one on the host loop; on the round program, up to the
  next checkpoint round or the last round (a call is the unit of checkpoints and of the divergence stop)."""
  if sim.round_program is None:
    return 1
  every = config.output.checkpoint_every
  return min(config.rounds, (done // every + 1) * every) - done


def _best_accuracy(rows: Sequence[dict[str, Any]]) -> float:
  return max((r["test_accuracy"]["mean"] for r in rows if r.get("test_accuracy")), default=-1.0)


def _write_metrics(path: str, rows: Sequence[dict[str, Any]]) -> None:
  if not distributed.is_main_process():
    return
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def _finish(config: RunConfig, sim: Simulation, rows: Sequence[dict[str, Any]], wall_seconds: float,
            segments: Sequence[dict[str, Any]], rollbacks: Sequence[dict[str, Any]],
            stopped: dict[str, Any] | None = None) -> dict[str, Any]:
  """Writes summary.json and accuracy.png (process 0); returns the summary."""
  summary = _summarize(config, sim, rows, wall_seconds, segments, rollbacks, stopped)
  if not distributed.is_main_process():
    return summary
  with open(os.path.join(config.output.dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  plot_accuracy(rows, os.path.join(config.output.dir, "accuracy.png"),
                f"{sim.method.name} on {config.data.dataset} ({config.data.partition})")
  return summary


def _stop(config: RunConfig, sim: Simulation, rows: Sequence[dict[str, Any]], wall_seconds: float,
          segments: Sequence[dict[str, Any]], rollbacks: Sequence[dict[str, Any]], error: DivergenceError,
          manager) -> None:
  """Ends a diverged run: the summary says where and why, and the error names the best checkpoint."""
  manager.wait_until_finished()
  best = checkpoints.best_step(manager)
  stopped = {"round": error.round, "group": error.group, "reason": str(error), "best_checkpoint": best}
  _finish(config, sim, rows, wall_seconds, segments, rollbacks, stopped)
  where = (f"; the best checkpoint (round {best}) is kept in {manager.directory}: --on-divergence rollback restarts "
           "from it with a lower learning rate" if best is not None else
           "; no checkpoint with an evaluation was saved, so there is nothing to keep or roll back to")
  raise DivergenceError(f"{error}{where}", error.round, error.group) from None


def _roll_back(config: RunConfig, dataset: fdata.ArrayDataset | None, manager, rows: Sequence[dict[str, Any]],
               segments: list[dict[str, Any]], rollbacks: list[dict[str, Any]], error: DivergenceError,
               log: Callable[[str], None]):
  """Restores the best checkpoint into a simulation with the learning rate lowered, and appends the rollback to
  ``rollbacks``; returns the new (config, simulation, state, rows, segments)."""
  best = checkpoints.best_step(manager)
  old_lr = config.client.learning_rate
  config = dataclasses.replace(config, client=dataclasses.replace(
      config.client, learning_rate=old_lr * config.divergence.rollback_lr_factor))
  reason = f"rollback to round {best}: {error}; learning rate {old_lr:g} -> {config.client.learning_rate:g}"
  log(f"diverged: {reason}")
  checkpoints.drop_after(manager, best)
  sim, _ = build_simulation(config, dataset, log)
  state = sim.place(checkpoints.restore(manager, best, sim.state_shapes))
  rollbacks.append({"diverged_round": error.round, "to_round": best, "reason": str(error),
                    "learning_rate": [old_lr, config.client.learning_rate]})
  segments = _next_segment(segments, config, best + 1, reason)
  _write_config(config, segments, rollbacks)
  return config, sim, state, [r for r in rows if r["round"] <= best], segments


def _summarize(config: RunConfig, sim: Simulation, rows: Sequence[dict[str, Any]], wall_seconds: float,
               segments: Sequence[dict[str, Any]], rollbacks: Sequence[dict[str, Any]],
               stopped: dict[str, Any] | None) -> dict[str, Any]:
  evaluated = [r for r in rows if r.get("test_accuracy")]
  best = max(evaluated, key=lambda r: (r["test_accuracy"]["mean"], r["round"])) if evaluated else None  # as BestN
  group_params = {g.name: m.num_owned() for g, m in zip(sim.groups, sim.maps)}
  train_seconds = sum(r["round_seconds"] for r in rows)
  final_round = rows[-1]["round"] if rows else 0
  return {
      "method": sim.method.name,
      "final_round": rows[-1]["round"] if rows else 0,
      "final_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
      "best_mean_accuracy": best["test_accuracy"]["mean"] if best else None,
      "best_round": best["round"] if best else None,
      "wall_seconds_this_run": wall_seconds,
      "train_seconds_all_rounds": train_seconds,
      "mean_samples_per_s": sum(r["examples"] for r in rows) / max(train_seconds, 1e-9),
      "backend": sim.backend.name,
      "client_terms": [t.name for t in sim.method.terms],
      "server_steps": [s.name for s in sim.method.server],
      "platform": jax.default_backend(),
      "processes": jax.process_count(),
      "devices": jax.device_count(),
      "parameters_per_group": group_params,
      "segments": [{**seg, "rounds": [seg["from_round"], (later["from_round"] - 1) if later else final_round]}
                   for seg, later in zip(segments, [*segments[1:], None])],
      "rollbacks": list(rollbacks),
      "stopped_by_divergence": stopped,
      "config": as_dict(config),
      # The backdoor attack's malicious client ids (`fedjax_hetero.client.backdoor`), only when it is on.
      **({"malicious_clients": [int(c) for c in sim.malicious_clients]} if len(sim.malicious_clients) else {}),
  }
