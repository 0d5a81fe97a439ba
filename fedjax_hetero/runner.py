"""An experiment from config to results folder: data, partition, rounds, checkpoints, plots.

``run_experiment(RunConfig(...))`` is what ``python -m experiments.<dataset>``
and the notebooks call. The results folder holds ``metrics.jsonl`` (one JSON
object per round), ``config.json``, ``summary.json``, ``accuracy.png``, the
partition report and plot, and orbax checkpoints under ``checkpoints/``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedjax_hetero import checkpoints
from fedjax_hetero import data as fdata
from fedjax_hetero import models
from fedjax_hetero.backends import make_backend
from fedjax_hetero.config import FLAGS, RunConfig, as_dict, flatten, from_dict
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.engine import ArchGroup, Simulation, assign_groups
from fedjax_hetero.methods import build_method


def partitioned_dataset(config: RunConfig, dataset: fdata.ArrayDataset | None = None
                        ) -> tuple[fdata.ArrayDataset, list[np.ndarray]]:
  """The run's dataset (loaded unless given; its subset if configured) and its client partition."""
  d, seed = config.data, config.federation.seed
  if dataset is None:
    dataset = fdata.load_dataset(d.dataset, d.data_dir)
  if d.max_train_samples or d.max_test_samples:
    dataset = dataset.subset(d.max_train_samples, d.max_test_samples, seed=seed)
  parts = fdata.partition(dataset.train_labels, d.partition, d.num_clients, seed, alpha=d.alpha,
                          classes_per_client=d.classes_per_client)
  return dataset, parts


def build_simulation(config: RunConfig, dataset: fdata.ArrayDataset | None = None,
                     log: Callable[[str], None] = print) -> tuple[Simulation, list[np.ndarray]]:
  """Loads and partitions the data and builds the simulation (no training yet)."""
  dataset, parts = partitioned_dataset(config, dataset)
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
                   track_dissimilarity=config.dissimilarity, dissimilarity_cut=config.method.fedimpro.cut)
  terms = ", ".join(t.name for t in method.terms)
  log(f"{dataset.name}: {len(dataset.train_labels)} train / {len(dataset.test_labels)} test samples, "
      f"{config.data.num_clients} clients ({config.data.partition}), groups {', '.join(config.groups)}, "
      f"method {method.name}" + (f" (client terms: {terms})" if terms else "") +
      f", backend {backend.name} on {jax.default_backend()}")
  return sim, parts


def _prepare_output(config: RunConfig) -> None:
  out = config.output.dir
  if os.path.exists(out) and os.listdir(out) and not (config.output.resume or config.output.overwrite):
    raise ValueError(f"output directory {out!r} is not empty; pass --resume to continue it or --overwrite "
                     "to start over")
  if config.output.overwrite and os.path.exists(out):
    shutil.rmtree(out)
  os.makedirs(out, exist_ok=True)


# Settings a resumed run may change. The first set leaves the trajectory as it was up to float tolerance (the
# backends agree to it; steps_per_call only groups the same steps into jitted calls; the dissimilarity metric only
# adds an upload). The second is the clients' local optimizer, rebuilt every round: lowering the learning rate
# after a divergence is the usual reason to resume. Anything else (data, partition, models, method and its settings) is a
# different run.
UNCHANGED_TRAJECTORY = frozenset({"data.data_dir", "rounds", "eval_every", "backend", "client.steps_per_call",
                                  "dissimilarity"})
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


def _check_resumable(config: RunConfig, log: Callable[[str], None]) -> None:
  """Raises ValueError, before any compute, if ``config`` would continue a run it did not start;
  logs the local-optimizer settings it changes."""
  saved = saved_config(config.output.dir, log)
  if saved is None:
    return
  before, now = flatten(saved), flatten(config)
  changed = {path: f"{path}: {before[path]!r} -> {now[path]!r}" for path in now
             if not path.startswith("output.") and path not in UNCHANGED_TRAJECTORY and before.get(path) != now[path]}
  refused = [text for path, text in changed.items() if path not in LOCAL_OPTIMIZER]
  if refused:
    raise ValueError(f"cannot resume {config.output.dir!r} with different settings ({'; '.join(refused)}); "
                     "repeat the run's own flags (see its config.json), or pass --overwrite instead of --resume to "
                     "start over")
  if changed:
    log(f"resuming with changed local training: {'; '.join(changed.values())}")


def _read_metrics(path: str, upto: int) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r["round"] <= upto]


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
  """Runs (or resumes) an experiment and writes its results folder; returns the summary."""
  config.data.check_paths()
  if config.output.resume:
    _check_resumable(config, log)
  else:
    _prepare_output(config)
  out = config.output.dir
  os.makedirs(out, exist_ok=True)
  sim, parts = build_simulation(config, dataset, log)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(as_dict(config), f, indent=2)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    initial = pool.submit(sim.init_state)  # XLA compiles the initialization while the partition is drawn
    labels = np.asarray(sim.store.labels)
    with open(os.path.join(out, "partition.txt"), "w") as f:
      f.write(fdata.partition_report(labels, parts, sim.store.num_classes))
    fdata.plot_partition(fdata.class_counts(labels, parts, sim.store.num_classes),
                         os.path.join(out, "partition.png"))
    state = initial.result()
  manager = checkpoints.manager(out, config.output.checkpoint_every)
  metrics_path = os.path.join(out, "metrics.jsonl")
  rows: list[dict[str, Any]] = []
  if config.output.resume and manager.latest_step() is not None:
    state = sim.place(checkpoints.restore_latest(manager, state))
    rows = _read_metrics(metrics_path, state.round)
    log(f"resumed from round {state.round}")
  with open(metrics_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)

  wall_start = time.perf_counter()
  bar = tqdm(total=config.rounds, initial=state.round, desc=sim.method.name, unit="round",
             disable=not config.output.progress, dynamic_ncols=True)
  try:
    while state.round < config.rounds:
      state, m = sim.run_round(state)
      final = state.round == config.rounds
      m["test_accuracy"] = sim.evaluate(state) if state.round % config.eval_every == 0 or final else None
      rows.append(m)
      with open(metrics_path, "a") as f:
        f.write(json.dumps(m) + "\n")
      checkpoints.save(manager, state, force=final)
      postfix = {"loss": f"{m['train_loss']:.3f}", "samples/s": f"{m['samples_per_s']:.0f}"}
      last_eval = next((r["test_accuracy"] for r in reversed(rows) if r.get("test_accuracy")), None)
      if last_eval:
        postfix["acc"] = f"{100 * last_eval['mean']:.2f}%"
      bar.set_postfix(postfix)
      bar.update(1)
  finally:
    bar.close()
    manager.wait_until_finished()
  summary = _summarize(config, sim, rows, time.perf_counter() - wall_start)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  plot_accuracy(rows, os.path.join(out, "accuracy.png"),
                f"{sim.method.name} on {config.data.dataset} ({config.data.partition})")
  return summary


def _summarize(config: RunConfig, sim: Simulation, rows: Sequence[dict[str, Any]],
               wall_seconds: float) -> dict[str, Any]:
  evaluated = [r for r in rows if r.get("test_accuracy")]
  best = max(evaluated, key=lambda r: r["test_accuracy"]["mean"]) if evaluated else None
  group_params = {g.name: m.num_owned() for g, m in zip(sim.groups, sim.maps)}
  train_seconds = sum(r["round_seconds"] for r in rows)
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
      "parameters_per_group": group_params,
      "config": as_dict(config),
  }
