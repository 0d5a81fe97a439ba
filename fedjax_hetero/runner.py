"""An experiment from config to results folder: data, partition, rounds, checkpoints, plots.

``run_experiment(ExperimentConfig(...))`` is what ``python -m experiments.<dataset>``
and the notebooks call. The results folder holds ``metrics.jsonl`` (one JSON
object per round), ``config.json``, ``summary.json``, ``accuracy.png``, the
partition report and plot, and orbax checkpoints under ``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from fedjax_hetero import data as fdata
from fedjax_hetero import models
from fedjax_hetero.algorithms.fedgen import FedGenConfig
from fedjax_hetero.backends import BACKENDS, make_backend
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.engine import (ArchGroup, FedCrossConfig, FLConfig, ServerState, Simulation, assign_groups,
                                  get_method)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything one run needs; every field is a CLI flag of ``experiments``."""

  dataset: str = "fashion_mnist"
  data_dir: str | None = None
  method: str = "HeteroAvg"
  groups: tuple[str, ...] = ("cnn@1", "cnn@0.5", "cnn@0.25")
  num_clients: int = 100
  clients_per_round: int = 10
  partition: str = "dirichlet"
  alpha: float = 0.5
  classes_per_client: int = 2
  epochs: int = 1
  batch_size: int = 32
  optimizer: str = "adam"
  learning_rate: float = 1e-3
  momentum: float = 0.0
  weight_decay: float = 0.0
  drop_last: bool = False
  rounds: int = 100
  eval_every: int = 5
  seed: int = 0
  output_dir: str = "runs/fmnist"
  resume: bool = False
  overwrite: bool = False
  backend: str = "auto"
  weighting: str = "uniform"
  aggregate: str = "deltas"
  prox_mu: float | None = None  # FedProx's mu; None: the method's default (fedprox_mu for *Prox, else 0)
  fedprox_mu: float = 0.1  # the *Prox methods' mu when prox_mu is None (InCo paper: mu/2 = 0.05)
  moon_mu: float | None = None  # MOON's mu; None: the method's default (5 for *MOON, else 0)
  moon_temperature: float = 0.5
  fedcross_alpha: float = 0.99
  fedcross_strategy: str = "lowest_similarity"
  fedcross_similarity: str = "layerwise"
  fedcross_global: str = "middleware"
  fedcross_warmup_rounds: int = 0
  fedcross_propellers: int = 0
  fedcross_propeller_rounds: int = 0
  fedcross_dynamic_alpha_rounds: int = 0
  fedgen_preset: str = "cifar10"  # FedGen's hyperparameters (`FedGenConfig.preset`)
  clusamp_similarity: str = "L1"
  inco_variant: str | None = None  # None: the InCo* method's own ("code", the authors' code)
  inco_granularity: str | None = None  # None: "kernel"
  checkpoint_every: int = 10
  steps_per_call: int = 8
  max_train_samples: int | None = None
  max_test_samples: int | None = None
  progress: bool = True

  def validate(self) -> None:
    """Raises ValueError naming the bad value and the accepted ones, before any compute."""
    if self.dataset not in fdata.DATASETS:
      raise ValueError(f"unknown dataset {self.dataset!r}; accepted: {', '.join(fdata.DATASETS)}")
    if not self.groups:
      raise ValueError("at least one architecture group is needed (--groups)")
    for spec in self.groups:
      models.parse_group_spec(spec)
    if self.partition not in fdata.SCHEMES:
      raise ValueError(f"unknown partition {self.partition!r}; accepted: {', '.join(fdata.SCHEMES)}")
    if self.partition == "dirichlet" and not self.alpha > 0:
      raise ValueError(f"alpha must be > 0, got {self.alpha}")
    method = get_method(self.method)
    if method.one_group and len(self.groups) != 1:
      raise ValueError(f"{method.name} trains one architecture group, got {len(self.groups)} "
                       f"({', '.join(self.groups)}); pass one (e.g. --groups cnn)")
    if self.num_clients < len(self.groups):
      raise ValueError(f"num_clients={self.num_clients} is fewer than the {len(self.groups)} architecture groups")
    if not 1 <= self.clients_per_round <= self.num_clients:
      raise ValueError(f"clients_per_round={self.clients_per_round} must be between 1 and "
                       f"num_clients={self.num_clients}")
    if self.backend not in BACKENDS:
      raise ValueError(f"unknown backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
    for name in ("eval_every", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.data_dir is not None and not os.path.isdir(self.data_dir):
      raise ValueError(f"data directory {self.data_dir!r} does not exist")
    self.local_config()  # each validates its own fields (method, optimizer, epochs, ...)
    self.fl_config()

  def local_config(self) -> LocalConfig:
    return LocalConfig(epochs=self.epochs, batch_size=self.batch_size, optimizer=self.optimizer,
                       learning_rate=self.learning_rate, momentum=self.momentum, weight_decay=self.weight_decay,
                       drop_last=self.drop_last, steps_per_call=self.steps_per_call,
                       moon_temperature=self.moon_temperature)

  def fl_config(self) -> FLConfig:
    return FLConfig(method=self.method, rounds=self.rounds, clients_per_round=self.clients_per_round,
                    weighting=self.weighting, aggregate=self.aggregate, seed=self.seed, prox_mu=self.prox_mu,
                    fedprox_mu=self.fedprox_mu, moon_mu=self.moon_mu, fedcross=self.fedcross_config(),
                    fedgen=FedGenConfig.preset(self.fedgen_preset), clusamp_similarity=self.clusamp_similarity,
                    inco_variant=self.inco_variant, inco_granularity=self.inco_granularity)

  def fedcross_config(self) -> FedCrossConfig:
    return FedCrossConfig(alpha=self.fedcross_alpha, strategy=self.fedcross_strategy,
                          similarity=self.fedcross_similarity, global_from=self.fedcross_global,
                          warmup_rounds=self.fedcross_warmup_rounds, propellers=self.fedcross_propellers,
                          propeller_rounds=self.fedcross_propeller_rounds,
                          dynamic_alpha_rounds=self.fedcross_dynamic_alpha_rounds)


def partitioned_dataset(config: ExperimentConfig, dataset: fdata.ArrayDataset | None = None
                        ) -> tuple[fdata.ArrayDataset, list[np.ndarray]]:
  """The run's dataset (loaded unless given; its subset if configured) and its client partition."""
  config.validate()
  if dataset is None:
    dataset = fdata.load_dataset(config.dataset, config.data_dir)
  if config.max_train_samples or config.max_test_samples:
    dataset = dataset.subset(config.max_train_samples, config.max_test_samples, seed=config.seed)
  parts = fdata.partition(dataset.train_labels, config.partition, config.num_clients, config.seed,
                          alpha=config.alpha, classes_per_client=config.classes_per_client)
  return dataset, parts


def build_simulation(config: ExperimentConfig, dataset: fdata.ArrayDataset | None = None,
                     log: Callable[[str], None] = print) -> tuple[Simulation, list[np.ndarray]]:
  """Loads and partitions the data and builds the simulation (no training yet)."""
  dataset, parts = partitioned_dataset(config, dataset)
  store = FederatedStore.build(dataset.train_images, dataset.train_labels, parts, dataset.num_classes,
                               dataset.mean, dataset.std)
  groups = []
  for spec, clients in zip(config.groups, assign_groups(config.num_clients, len(config.groups))):
    name, width = models.parse_group_spec(spec)
    groups.append(ArchGroup(spec, models.build_model(name, dataset.num_classes, width), clients))
  backend = make_backend(config.backend)
  sim = Simulation(groups, store, config.local_config(), config.fl_config(), backend,
                   jnp.asarray(dataset.test_images), jnp.asarray(dataset.test_labels))
  terms = [f"{k} {v:g}" for k, v in (("prox mu", sim.local.prox_mu), ("moon mu", sim.local.moon_mu)) if v]
  prox = f" ({', '.join(terms)})" if terms else ""
  log(f"{dataset.name}: {len(dataset.train_labels)} train / {len(dataset.test_labels)} test samples, "
      f"{config.num_clients} clients ({config.partition}), groups {', '.join(config.groups)}, "
      f"method {sim.method.name}{prox}, backend {backend.name} on {jax.default_backend()}")
  return sim, parts


def _checkpoint_manager(output_dir: str, config: ExperimentConfig) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=config.checkpoint_every)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(output_dir, "checkpoints")), options=options)


def _checkpoint_tree(state: ServerState) -> dict[str, Any]:
  """Everything a resumed run needs: server models, server state (SCAFFOLD's c, FedCross's global
  model) and the clients' memory (SCAFFOLD's c_i, MOON's previous models)."""
  return {"models": list(state.models), "server": list(state.server), "memory": list(state.memory)}


def _restore(manager: ocp.CheckpointManager, template: ServerState) -> ServerState:
  step = manager.latest_step()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _checkpoint_tree(template))
  restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  return ServerState(int(step), tuple(restored["models"]), tuple(restored["server"]), tuple(restored["memory"]))


def _prepare_output(config: ExperimentConfig) -> None:
  out = config.output_dir
  if os.path.exists(out) and os.listdir(out) and not (config.resume or config.overwrite):
    raise ValueError(f"output directory {out!r} is not empty; pass --resume to continue it or --overwrite "
                     "to start over")
  if config.overwrite and os.path.exists(out):
    shutil.rmtree(out)
  os.makedirs(out, exist_ok=True)


# Settings a resumed run may change. The first set leaves the trajectory as it was (the backends agree
# up to float tolerance; steps_per_call only groups the same steps into jitted calls). The second is the
# clients' local optimizer, rebuilt every round: lowering the learning rate after a divergence is the
# usual reason to resume. Anything else (data, partition, models, method and its settings) is a
# different run.
UNCHANGED_TRAJECTORY = frozenset({"data_dir", "rounds", "eval_every", "output_dir", "resume", "overwrite",
                                  "backend", "checkpoint_every", "steps_per_call", "progress"})
LOCAL_OPTIMIZER = frozenset({"epochs", "batch_size", "optimizer", "learning_rate", "momentum", "weight_decay",
                             "drop_last"})


def saved_config(output_dir: str) -> dict[str, Any] | None:
  """The config a results folder was written with, as JSON values (``config.json``, or older runs'
  ``summary.json``); None if it has neither."""
  for name, key in (("config.json", None), ("summary.json", "config")):
    path = os.path.join(output_dir, name)
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
      return saved if key is None else saved.get(key)
  return None


def _check_resumable(config: ExperimentConfig, log: Callable[[str], None]) -> None:
  """Raises ValueError, before any compute, if ``config`` would continue a run it did not start;
  logs the local-optimizer settings it changes."""
  saved = saved_config(config.output_dir)
  if saved is None:
    return
  current = json.loads(json.dumps(dataclasses.asdict(config)))
  changed = {name: f"{name}: {saved[name]!r} -> {current[name]!r}" for name in current
             if name not in UNCHANGED_TRAJECTORY and name in saved and saved[name] != current[name]}
  refused = [text for name, text in changed.items() if name not in LOCAL_OPTIMIZER]
  if refused:
    raise ValueError(f"cannot resume {config.output_dir!r} with different settings ({'; '.join(refused)}); "
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
  """Test accuracy vs round, one line per architecture group plus the mean."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  evaluated = [r for r in rows if r.get("test_accuracy")]
  fig = Figure(figsize=(7, 4.5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
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


def run_experiment(config: ExperimentConfig, dataset: fdata.ArrayDataset | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs (or resumes) an experiment and writes its results folder; returns the summary."""
  config.validate()
  if config.resume:
    _check_resumable(config, log)
  else:
    _prepare_output(config)
  os.makedirs(config.output_dir, exist_ok=True)
  sim, parts = build_simulation(config, dataset, log)
  out = config.output_dir
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2)
  counts = fdata.class_counts(np.asarray(sim.store.labels), parts, sim.store.num_classes)
  with open(os.path.join(out, "partition.txt"), "w") as f:
    f.write(fdata.partition_report(np.asarray(sim.store.labels), parts, sim.store.num_classes))
  fdata.plot_partition(counts, os.path.join(out, "partition.png"))

  state = sim.init_state()
  manager = _checkpoint_manager(out, config)
  metrics_path = os.path.join(out, "metrics.jsonl")
  rows: list[dict[str, Any]] = []
  if config.resume and manager.latest_step() is not None:
    state = _restore(manager, state)
    state = state._replace(**sim.backend.place({"models": state.models, "server": state.server,
                                                "memory": state.memory}))
    rows = _read_metrics(metrics_path, state.round)
    log(f"resumed from round {state.round}")
  with open(metrics_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)

  wall_start = time.perf_counter()
  bar = tqdm(total=config.rounds, initial=state.round, desc=get_method(config.method).name, unit="round",
             disable=not config.progress, dynamic_ncols=True)
  try:
    while state.round < config.rounds:
      state, m = sim.run_round(state)
      final = state.round == config.rounds
      m["test_accuracy"] = sim.evaluate(state) if state.round % config.eval_every == 0 or final else None
      rows.append(m)
      with open(metrics_path, "a") as f:
        f.write(json.dumps(m) + "\n")
      manager.save(state.round, args=ocp.args.StandardSave(_checkpoint_tree(state)), force=final)
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
                f"{get_method(config.method).name} on {config.dataset} ({config.partition})")
  return summary


def _summarize(config: ExperimentConfig, sim: Simulation, rows: Sequence[dict[str, Any]],
               wall_seconds: float) -> dict[str, Any]:
  evaluated = [r for r in rows if r.get("test_accuracy")]
  best = max(evaluated, key=lambda r: r["test_accuracy"]["mean"]) if evaluated else None
  group_params = {g.name: m.num_owned() for g, m in zip(sim.groups, sim.maps)}
  train_seconds = sum(r["round_seconds"] for r in rows)
  return {
      "final_round": rows[-1]["round"] if rows else 0,
      "final_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
      "best_mean_accuracy": best["test_accuracy"]["mean"] if best else None,
      "best_round": best["round"] if best else None,
      "wall_seconds_this_run": wall_seconds,
      "train_seconds_all_rounds": train_seconds,
      "mean_samples_per_s": sum(r["examples"] for r in rows) / max(train_seconds, 1e-9),
      "backend": sim.backend.name,
      "prox_mu": sim.local.prox_mu,
      "moon_mu": sim.local.moon_mu,
      "platform": jax.default_backend(),
      "parameters_per_group": group_params,
      "config": dataclasses.asdict(config),
  }
