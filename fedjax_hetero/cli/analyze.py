"""Analyses of results folders: CKA, loss landscapes, update histograms, tracking, client bubbles, BatchNorm.

    python -m experiments.analyze cka RUN_DIR                      # InCo paper Sec. 5.4 / App. E
    python -m experiments.analyze landscape FEDAVG_DIR FEDCROSS_DIR  # FedCross paper, loss landscape figure
    python -m experiments.analyze histograms RUN_DIR --rounds 5    # InCo paper Figs. 2c-d, 3
    python -m experiments.analyze tracking RUN_DIR                 # InCo theta / FedCross similarity per round
    python -m experiments.analyze bubbles RUN_DIR --clients 20     # FedCross paper, data distribution figure
    python -m experiments.analyze recalibrate-bn RUN_DIR           # group accuracy with re-estimated BN statistics

A results folder is what ``python -m experiments.<dataset> --output-dir RUN_DIR`` writes. The run's
config is read from its config.json, the simulation is rebuilt from it and the last checkpoint is
restored (a run still in progress works too); nothing of the run itself (checkpoints, metrics) is
changed. Each subcommand writes its figure (and data) and prints the written paths, one per line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import traverse_util

from fedjax_hetero import analysis
from fedjax_hetero import data as fdata
from fedjax_hetero.config import FLAGS, RunConfig, declare
from fedjax_hetero.data.store import normalize
from fedjax_hetero.models import evaluation
from fedjax_hetero.rounds import RoundSpec, Simulation
from fedjax_hetero.rounds.state import ServerState
from fedjax_hetero.run import build, checkpoints, continuation, metrics_log, results_folder


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def read_config(run_dir: str, data_dir: str | None = None) -> RunConfig:
  """The run's config (config.json, or summary.json of older runs), pointed at RUN_DIR; `data_dir` overrides the
  run's."""
  config = continuation.saved_config(run_dir, _log)
  if config is None:
    raise ValueError(f"{run_dir!r} has no config.json or summary.json with the run's config; is it a results folder?")
  return config.replace(output_dir=run_dir, resume=False, resume_or_start=False, overwrite=False, progress=False,
                        data_dir=data_dir if data_dir is not None else config.data.data_dir)


def restore_last(sim: Simulation, config: RunConfig) -> ServerState:
  """The run's last checkpoint, placed as the backend trains from it."""
  directory = os.path.join(config.output.dir, "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"{directory} not found; the run wrote no checkpoint")
  manager = checkpoints.manager(config.output.dir)
  try:
    state = checkpoints.restore_latest(manager, sim.spec.state_shapes)
  finally:
    manager.close()
  return sim.place(state)


@dataclasses.dataclass(frozen=True)
class LoadedRun:
  """A results folder with its rebuilt simulation and restored last state."""

  run_dir: str
  config: RunConfig
  sim: Simulation
  state: ServerState


def load_run(run_dir: str, data_dir: str | None = None) -> LoadedRun:
  """Rebuilds RUN_DIR's simulation from its config and restores its last checkpoint."""
  config = read_config(run_dir, data_dir)
  if (partition_file := config.data.partition_file) is not None and not os.path.isfile(partition_file):
    raise ValueError(f"{run_dir}: its run read its clients from {partition_file!r} (data.partition_file in its "
                     "config.json), which is gone: put the file back there to analyze the run")
  with declare.named_from({flag.cli: f"{flag.path} of {run_dir}'s config.json" for flag in FLAGS.values()}):
    sim, _ = build.build_simulation(config, log=_log)
  if (warning := results_folder.data_warning(run_dir, sim.spec)) is not None:
    _log(warning)
  state = restore_last(sim, config)
  _log(f"{run_dir}: {sim.spec.method.name}, restored round {state.round}")
  return LoadedRun(run_dir, config, sim, state)


def _test_subset(spec: RoundSpec, num_examples: int) -> tuple[jax.Array, jax.Array]:
  n = min(num_examples, int(spec.test_labels.shape[0]))
  return spec.test_images[:n], spec.test_labels[:n]


# --------------------------------------------------------------------------- cka


def run_cka(args: argparse.Namespace) -> list[str]:
  """Linear CKA between the group models at every shared cut point (InCo Sec. 5.4 / App. E)."""
  run = load_run(args.run_dir, args.data_dir)
  spec, state = run.sim.spec, run.state
  names = [g.name for g in spec.groups]
  if len(names) < 2:
    raise ValueError(f"{args.run_dir}: CKA compares architecture groups, but this {spec.method.name} run has "
                     f"one ({names[0]})")
  images, _ = _test_subset(spec, args.num_examples)
  n = int(images.shape[0])
  if n < 2:
    raise ValueError(f"{args.run_dir}: CKA needs at least 2 test images, the run has {n}")
  models = [(g.model, spec.evaluated_group_variables(state, i)) for i, g in enumerate(spec.groups)]
  matrices = analysis.cka_matrix(models, images, spec.store.mean, spec.store.std, batch_size=args.batch_size)
  if not matrices:
    raise ValueError(f"{args.run_dir}: the groups {', '.join(names)} share no cut point besides input/logits")
  png = os.path.join(args.run_dir, "cka.png")
  analysis.plot_cka(matrices, png, names, title=f"{spec.method.name}, round {state.round}: linear CKA on {n} "
                    "test images")
  record = {"method": spec.method.name, "round": state.round, "num_examples": n, "groups": names,
            "cuts": {cut: {"matrix": np.asarray(m, np.float64).tolist(),
                           "layer_similarity": analysis.layer_similarity(m)} for cut, m in matrices.items()}}
  path = os.path.join(args.run_dir, "cka.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return [png, path]


# --------------------------------------------------------------------------- landscape


def _unique_names(names: Sequence[str], run_dirs: Sequence[str]) -> list[str]:
  """Method names, with the folder name added where two runs share a method."""
  return [f"{name} ({os.path.basename(os.path.normpath(d))})" if names.count(name) > 1 else name
          for name, d in zip(names, run_dirs)]


@jax.jit
def _directions(params: Any, key1: jax.Array, key2: jax.Array) -> tuple[Any, Any]:
  # One program: eagerly, every leaf's normalisation compiles its own small kernels (~3x slower).
  return (analysis.filter_normalized_direction(params, key1), analysis.filter_normalized_direction(params, key2))


def run_landscape(args: argparse.Namespace) -> list[str]:
  """Loss surfaces along two filter-normalized random directions, one panel per run (Li et al. 2018)."""
  key1, key2 = jax.random.split(jax.random.key(args.seed))
  alphas = betas = np.linspace(-args.span, args.span, args.grid)
  names, groups, sizes, losses, accuracies = [], [], [], [], []
  for run_dir in args.run_dirs:
    run = load_run(run_dir, args.data_dir)
    spec = run.sim.spec
    if not 0 <= args.group < len(spec.groups):
      raise ValueError(f"{run_dir}: --group {args.group} is out of range; the run has {len(spec.groups)} "
                       f"architecture group(s): {', '.join(g.name for g in spec.groups)}")
    model = spec.groups[args.group].model
    variables = spec.evaluated_group_variables(run.state, args.group)
    directions = _directions(variables["params"], key1, key2)
    images, labels = _test_subset(spec, args.num_examples)
    surface = analysis.loss_surface(model, variables, images, labels, spec.store.mean, spec.store.std, directions,
                                    alphas, betas, batch_size=args.batch_size)
    centre = f" (trained model {surface.loss[args.grid // 2, args.grid // 2]:.4f})" if args.grid % 2 else ""
    _log(f"{run_dir}: loss {surface.loss.min():.4f}..{surface.loss.max():.4f}{centre}")
    names.append(spec.method.name)
    groups.append(spec.groups[args.group].name)
    sizes.append(int(labels.shape[0]))
    losses.append(surface.loss)
    accuracies.append(surface.accuracy)
  names = _unique_names(names, args.run_dirs)
  png = args.output or os.path.join(args.run_dirs[0], "loss_landscape.png")
  if os.path.dirname(png):
    os.makedirs(os.path.dirname(png), exist_ok=True)
  examples = f"{sizes[0]}" if len(set(sizes)) == 1 else "/".join(map(str, sizes))
  analysis.plot_loss_landscapes({name: (alphas, betas, loss) for name, loss in zip(names, losses)}, png,
                                log_scale=args.log_scale,
                                title=f"test loss on {examples} images around each run's group-{args.group} model")
  npz = os.path.splitext(png)[0] + ".npz"
  np.savez(npz, names=np.asarray(names), run_dirs=np.asarray(args.run_dirs), groups=np.asarray(groups),
           alphas=alphas, betas=betas, loss=np.stack(losses), accuracy=np.stack(accuracies),
           num_examples=np.asarray(sizes), seed=np.asarray(args.seed))
  return [png, npz]


# --------------------------------------------------------------------------- histograms


def tracked_layers(spec: RoundSpec, state: ServerState) -> list[tuple[tuple[str, ...], str]]:
  """(path, label) of the layers whose updates are recorded, in model order.

  Methods with InCo's step: the cross-layer pairs' sources and targets. Others: every leaf with at
  least two axes (conv and dense kernels; biases and BatchNorm leaves are 1-D).
  """
  pairs_of = getattr(spec.federations[0].largest, "cross_layer_pairs", None)
  if pairs_of is not None and any(step.name == "inco" for step in spec.method.server):
    roles: dict[tuple[str, ...], str] = {}
    for target, source in pairs_of():
      roles.setdefault(tuple(source), "source")
      roles.setdefault(tuple(target), "target")
    return [(path, f"{'/'.join(path)} ({role})") for path, role in roles.items()]
  flat = traverse_util.flatten_dict(spec.server_variables(state))
  return [(path, "/".join(path)) for path, leaf in flat.items() if leaf.ndim >= 2]


def _host_leaves(tree: Any, paths: Sequence[tuple[str, ...]]) -> list[np.ndarray]:
  flat = traverse_util.flatten_dict(tree)
  return [np.asarray(leaf, np.float32) for leaf in jax.device_get([flat[p] for p in paths])]


def run_histograms(args: argparse.Namespace) -> list[str]:
  """Continues the run in memory and plots the server's per-layer updates of each round (InCo Figs. 2c-d, 3)."""
  run = load_run(args.run_dir, args.data_dir)
  spec, state = run.sim.spec, run.state
  layers = tracked_layers(spec, state)
  if args.layers is not None:
    layers = layers[:args.layers]
  if not layers:
    raise ValueError(f"{args.run_dir}: the {spec.method.name} model has no layer to track")
  paths = [p for p, _ in layers]
  deltas_by_round: dict[int, dict[str, np.ndarray]] = {}
  first = state.round + 1
  for _ in range(args.rounds):
    before = _host_leaves(spec.server_variables(state), paths)  # on the host: training may donate device buffers
    state, (metrics,) = run.sim.run_rounds(state, 1)
    after = _host_leaves(spec.server_variables(state), paths)
    deltas_by_round[state.round] = {label: a - b for (_, label), a, b in zip(layers, after, before)}
    loss = metrics["train_loss"]
    _log(f"round {state.round}: " + ("no local step taken" if loss is None else f"train loss {loss:.4f}"))
  png = os.path.join(args.run_dir, "update_histograms.png")
  analysis.plot_update_histograms(deltas_by_round, png, title=f"{spec.method.name}: server updates of rounds "
                                  f"{first}-{state.round} (continued from the round-{first - 1} checkpoint)")
  return [png]


# --------------------------------------------------------------------------- tracking


def _read_rows(run_dir: str) -> list[dict[str, Any]]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise ValueError(f"{path} not found; is {run_dir!r} a results folder?")
  return metrics_log.read_rows(path, keys=("round",))  # checked: one row per round


def run_tracking(args: argparse.Namespace) -> list[str]:
  """Per-round InCo theta / b > 0 fraction, or FedCross's middleware similarity, from metrics.jsonl."""
  rows = _read_rows(args.run_dir)
  written = []
  if any(row.get("inco") for row in rows):
    written.append(analysis.plot_inco_tracking(rows, os.path.join(args.run_dir, "inco_tracking.png")))
  if any(row.get("middleware_similarity") for row in rows):
    written.append(analysis.plot_similarity_tracking(rows, os.path.join(args.run_dir, "similarity_tracking.png")))
  if not written:
    raise ValueError(f"{os.path.join(args.run_dir, 'metrics.jsonl')} has no 'inco' (InCo methods) or "
                     "'middleware_similarity' (FedCross) records to plot")
  return written


# --------------------------------------------------------------------------- bubbles


def run_bubbles(args: argparse.Namespace) -> list[str]:
  """Client x class bubble plot of the run's partition (FedCross paper's data distribution figure)."""
  config = read_config(args.run_dir, args.data_dir)
  dataset, parts = build.partitioned_dataset(config)
  report = os.path.join(args.run_dir, "partition.txt")
  if os.path.isfile(report):
    with open(report) as f:
      if f.read() != fdata.partition_report(dataset.train_labels, parts, dataset.num_classes):
        _log(f"warning: the rebuilt partition differs from {report} (has the dataset changed?)")
  counts = fdata.class_counts(dataset.train_labels, parts, dataset.num_classes)
  clients = None
  if args.clients < len(parts):
    clients = np.sort(np.random.default_rng(args.seed).choice(len(parts), args.clients, replace=False))
  d = config.data
  scheme = {"dirichlet": f", alpha {d.alpha:g}", "shards": f", {d.classes_per_client} classes per client"}
  title = (f"{dataset.name}: {d.partition}{scheme.get(d.partition, '')}, "
           f"{len(parts) if clients is None else len(clients)} of {len(parts)} clients")
  png = os.path.join(args.run_dir, "client_bubbles.png")
  analysis.plot_client_bubbles(counts, png, clients=clients, title=title)
  return [png]


# --------------------------------------------------------------------------- recalibrate-bn


def run_recalibrate_bn(args: argparse.Namespace) -> list[str]:
  """Each group model's test accuracy with its stored and with re-estimated BatchNorm statistics."""
  run = load_run(args.run_dir, args.data_dir)
  spec, state = run.sim.spec, run.state
  train = spec.store.images
  n = min(args.num_examples, int(train.shape[0]))
  chosen = np.sort(np.random.default_rng(args.seed).choice(int(train.shape[0]), n, replace=False))
  batches = [normalize(train[chosen[i:i + args.batch_size]], spec.store.mean, spec.store.std)
             for i in range(0, n, args.batch_size)]
  groups = {}
  for i, group in enumerate(spec.groups):
    stored = spec.evaluated_group_variables(state, i)
    recalibrated = analysis.recalibrate_batch_stats(group.model, stored, batches)
    accuracy = {name: evaluation.accuracy(group.model, variables, spec.test_images, spec.test_labels, spec.store.mean,
                                          spec.store.std)
                for name, variables in (("stored", stored), ("recalibrated", recalibrated))}
    groups[group.name] = accuracy
    _log(f"{group.name}: test accuracy {accuracy['stored']:.4f} with the BatchNorm statistics the run evaluates "
         f"with{' (the method re-estimates them)' if spec.method.evaluation_variables else ''}, "
         f"{accuracy['recalibrated']:.4f} re-estimated on {n} training images")
  means = {k: float(np.mean([g[k] for g in groups.values()])) for k in ("stored", "recalibrated")}
  _log(f"mean over groups: {means['stored']:.4f} stored, {means['recalibrated']:.4f} re-estimated")
  record = {"method": spec.method.name, "round": state.round, "num_examples": n, "batch_size": args.batch_size,
            "seed": args.seed, "test_examples": int(spec.test_labels.shape[0]), "groups": groups, "mean": means}
  path = os.path.join(args.run_dir, "recalibrated_bn.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return [path]


# --------------------------------------------------------------------------- CLI


def _at_least(low: int) -> Callable[[str], int]:
  def parse(text: str) -> int:
    value = int(text)
    if value < low:
      raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value
  return parse


def _positive_float(text: str) -> float:
  value = float(text)
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
  return value


def build_parser() -> argparse.ArgumentParser:
  formatter = argparse.ArgumentDefaultsHelpFormatter
  parser = argparse.ArgumentParser(prog="python -m experiments.analyze", formatter_class=formatter,
                                   description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

  def command(name: str, func: Callable[[argparse.Namespace], list[str]], data: bool = True, one_run: bool = True):
    p = sub.add_parser(name, help=func.__doc__.splitlines()[0], description=func.__doc__.splitlines()[0],
                       formatter_class=formatter)
    p.set_defaults(func=func)
    if one_run:
      p.add_argument("run_dir", metavar="RUN_DIR", help="results folder")
    if data:
      p.add_argument("--data-dir", default=None, help="dataset directory (None: the run's)")
    return p

  p = command("cka", run_cka)
  p.add_argument("--num-examples", type=_at_least(2), default=500, help="first N test images")
  p.add_argument("--batch-size", type=_at_least(1), default=500, help="images per forward pass")

  p = command("landscape", run_landscape, one_run=False)
  p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="results folders, one panel each")
  p.add_argument("--grid", type=_at_least(2), default=11, help="grid points per direction")
  p.add_argument("--span", type=_positive_float, default=1.0, help="alphas = betas = linspace(-span, span, grid)")
  p.add_argument("--num-examples", type=_at_least(1), default=1000, help="first N test images")
  p.add_argument("--group", type=_at_least(0), default=0,
                 help="architecture group whose evaluated model is used (FedCross: the global model)")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed of the two directions (the same for every run)")
  p.add_argument("--batch-size", type=_at_least(1), default=1000, help="images per evaluation call")
  p.add_argument("--log-scale", action="store_true", help="contour log(loss)")
  p.add_argument("--output", default=None, help="PNG path, the arrays go next to it as .npz "
                 "(None: FIRST_RUN_DIR/loss_landscape.png)")

  p = command("histograms", run_histograms)
  p.add_argument("--rounds", type=_at_least(1), default=5, help="rounds to continue from the last checkpoint")
  p.add_argument("--layers", type=_at_least(1), default=None,
                 help="plot the first N tracked layers: the InCo pairs' sources and targets, else "
                 "every conv/dense kernel (None: all)")

  p = command("tracking", run_tracking, data=False)

  p = command("bubbles", run_bubbles)
  p.add_argument("--clients", type=_at_least(1), default=20, help="clients shown (a random sorted subset)")
  p.add_argument("--seed", type=int, default=0, help="seed of the shown subset")

  p = command("recalibrate-bn", run_recalibrate_bn)
  p.add_argument("--num-examples", type=_at_least(1), default=10000,
                 help="random training images (of all clients) the statistics are estimated on")
  p.add_argument("--batch-size", type=_at_least(2), default=500, help="images per batch statistic")
  p.add_argument("--seed", type=int, default=0, help="seed of the training-image subset")
  return parser


def main(argv: Sequence[str] | None = None) -> list[str]:
  """Runs one subcommand; prints and returns the written paths."""
  args = build_parser().parse_args(argv)
  try:
    written = args.func(args)
  except (ValueError, FileNotFoundError, fdata.DataNotFoundError, FloatingPointError) as e:
    raise SystemExit(f"error: {e}") from None
  for path in written:
    print(path, flush=True)
  return written


if __name__ == "__main__":
  main()
