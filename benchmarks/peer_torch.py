"""Peer benchmark: HeteroAvg in fedjax_hetero against a plain PyTorch loop on the same clients.

The workload is the one the papers' PyTorch repositories run: HeteroAvg over ResNet depth groups (default ResNet10
and ResNet18 at width 0.25) on Fashion-MNIST, Dirichlet(alpha) over ``--num-clients`` clients, one local epoch of
Adam (a fresh optimizer every round) in batches of ``--batch-size`` with the last partial batch kept, server update
weighted by client sample count.

Each side runs in its own subprocess, launched back to back by the parent, so both whole-process wall times
(interpreter start, imports, compilation, data loading, rounds, evaluation) are measured the same way:

* ``jax``: the library's own `Simulation` (``build_simulation`` of the same `RunConfig` with
  ``weighting="num_samples"``) on JAX's default platform;
* ``torch``: the same ResNets written in PyTorch (same channels, strides, BatchNorm, pooling, classifier and
  initialization; layers named alike, so a shallower group's ``state_dict`` keys are a subset of the deepest one's),
  clients trained one after another from their group's slice of the global model with a DataLoader-free tensor loop,
  and deltas averaged per parameter name over the clients that hold it (BatchNorm running statistics included, as
  our ``batch_stats``), weighted by sample count. Threads are torch's default.

The torch side builds the client index lists with the library's numpy data code (`fedjax_hetero.data`, as
`run.build.partitioned_dataset` does, without importing JAX) and draws each round's clients with the rule of
`data.store.sample_clients` (sorted, uniform without replacement, seeded by (seed, round)); both sides report a
digest of the partition and the drawn clients, and the summary line says whether they agree.

Per side: samples/s over rounds 2..N, the first round's seconds, the subprocess's wall time, per-round seconds,
parameter counts per group and test accuracy of every group's model on the first ``--eval-samples`` test images. The
summary holds the jax/torch ratios (medians over ``--repeats``)::

  python -m benchmarks.peer_torch
  python -m benchmarks.peer_torch --rounds 2 --num-clients 8 --clients-per-round 2 --max-train-samples 2000

Needs PyTorch: ``pip install -e '.[peer]'``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from fedjax_hetero import data as fdata
from fedjax_hetero.config.run import ROUND_PROGRAMS
from benchmarks.common import emit_json_lines
from benchmarks.peer_summary import SIDES, summarize
from benchmarks.torch_resnet import TORCH_RESNETS, torch_resnet_class

FORWARDED = ("rounds", "num_clients", "clients_per_round", "groups", "batch_size", "epochs", "lr", "alpha", "seed",
             "backend", "round_program", "rounds_per_call", "steps_per_call", "max_train_samples", "eval_samples",
             "device", "data_dir")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--num-clients", type=int, default=20)
  p.add_argument("--clients-per-round", type=int, default=4)
  p.add_argument("--groups", default="resnet10@0.25,resnet18@0.25",
                 help=f"comma-separated NAME@WIDTH, smallest first; names: {', '.join(TORCH_RESNETS)}")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
  p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
  p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--backend", default="auto", help="our side's backend")
  p.add_argument("--round-program", default="auto", choices=ROUND_PROGRAMS,
                 help="our side: a device program per call of rounds (union: one masked union model for every "
                      "client; fused: each group on its model), or the host loop (auto: by platform)")
  p.add_argument("--rounds-per-call", type=int, default=None,
                 help="our side's rounds per device program (fused; default: ours)")
  p.add_argument("--steps-per-call", type=int, default=None, help="our side's steps per jitted call (default: ours)")
  p.add_argument("--max-train-samples", type=int, default=None, help="class-balanced training subset")
  p.add_argument("--eval-samples", type=int, default=2000, help="test images every group's model is evaluated on")
  p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch's device (ours: JAX's default)")
  p.add_argument("--data-dir", default=None, help="directory holding the Fashion-MNIST IDX files")
  p.add_argument("--repeats", type=int, default=1, help="back-to-back pairs of runs")
  p.add_argument("--sides", default="both", choices=("both",) + SIDES)
  p.add_argument("--side", default=None, choices=SIDES, help="run one side in this process (what the parent launches)")
  p.add_argument("--output", default=None, help="also write the JSON lines to this file")
  return p


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def parse_groups(text: str) -> list[tuple[str, str, float]]:
  """``"resnet10@0.25,..."`` -> ``[(spec, name, width), ...]``."""
  out = []
  for spec in (s.strip() for s in text.split(",") if s.strip()):
    name, _, width = spec.partition("@")
    name = name.lower()
    if name not in TORCH_RESNETS:
      raise SystemExit(f"error: group {spec!r}: the torch side has {', '.join(TORCH_RESNETS)} only")
    out.append((spec, name, float(width) if width else 1.0))
  if not out:
    raise SystemExit("error: --groups is empty")
  return out


def federated_data(args: argparse.Namespace) -> tuple[fdata.ArrayDataset, list[np.ndarray]]:
  """The dataset (its subset if asked) and client partition of `run.build.partitioned_dataset`, without JAX."""
  dataset = fdata.load_dataset("fashion_mnist", args.data_dir)
  if args.max_train_samples:
    dataset = dataset.subset(args.max_train_samples, None, seed=args.seed)
  parts = fdata.partition(dataset.train_labels, "dirichlet", args.num_clients, args.seed, alpha=args.alpha)
  return dataset, parts


def round_clients(num_clients: int, clients_per_round: int, seed: int, round_index: int) -> np.ndarray:
  """`data.store.sample_clients`: the round's clients, sorted."""
  rng = np.random.default_rng([seed, round_index])
  return np.sort(rng.choice(num_clients, size=clients_per_round, replace=False))


def partition_digest(parts: Sequence[np.ndarray]) -> str:
  h = hashlib.sha1()
  for p in parts:
    h.update(np.asarray(p, np.int64).tobytes() + b"|")
  return h.hexdigest()[:16]


def _timing(round_s: Sequence[float], examples: Sequence[float], trained: Sequence[Sequence[str]]) -> dict[str, Any]:
  """Throughput fields; ``trained`` are the groups with clients in each round (a group first trained after
  round 1 compiles its programs then, on our side)."""
  later = sum(round_s[1:])
  first = {}
  for r, names in enumerate(trained):
    for name in names:
      first.setdefault(name, r + 1)
  return {"samples_per_s_after_first": sum(examples[1:]) / later if later > 0 else None,
          "first_round_s": round_s[0], "round_s": list(round_s), "examples_per_round": list(examples),
          "first_round_of_group": first}


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
  t_start = time.perf_counter()
  try:
    import torch
    import torch.nn.functional as F
  except ImportError:
    raise SystemExit("error: the torch side needs PyTorch: pip install -e '.[peer]'") from None
  if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit("error: --device cuda but torch sees no CUDA device")
  device = torch.device(args.device)
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  groups = parse_groups(args.groups)
  dataset, parts = federated_data(args)
  torch.manual_seed(args.seed)
  resnet = torch_resnet_class()
  models = [resnet(TORCH_RESNETS[name], dataset.num_classes, width, dataset.train_images.shape[-1]).to(device)
            for _, name, width in groups]
  sizes = [sum(p.numel() for p in m.parameters()) for m in models]
  big = max(range(len(models)), key=sizes.__getitem__)
  global_state = {k: v.detach().clone() for k, v in models[big].state_dict().items()}
  for (spec, _, _), model in zip(groups, models):
    for k, v in model.state_dict().items():
      if k not in global_state or global_state[k].shape != v.shape:
        raise SystemExit(f"error: group {spec}: {k} {tuple(v.shape)} is not a layer of the largest model")

  images = torch.from_numpy(dataset.train_images).permute(0, 3, 1, 2).contiguous().to(device)
  labels = torch.from_numpy(dataset.train_labels).long().to(device)
  client_ids = [torch.from_numpy(np.asarray(p, np.int64)).to(device) for p in parts]
  group_of = np.empty(args.num_clients, int)
  for g, block in enumerate(np.array_split(np.arange(args.num_clients), len(groups))):
    group_of[block] = g
  mean = torch.tensor(dataset.mean, device=device).view(1, -1, 1, 1)
  std = torch.tensor(dataset.std, device=device).view(1, -1, 1, 1)
  shuffle = torch.Generator().manual_seed(args.seed)
  skipped = 0

  def train_client(model, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    nonlocal skipped
    start = {k: global_state[k] for k in model.state_dict()}
    model.load_state_dict(start)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    n, seen = len(ids), 0
    for _ in range(args.epochs):
      order = ids[torch.randperm(n, generator=shuffle).to(device)]
      for s in range(0, n, args.batch_size):
        batch = order[s:s + args.batch_size]
        if len(batch) == 1:  # torch's train-mode BatchNorm refuses one value per channel (the 1x1 last stage)
          skipped += 1
          continue
        x = (images[batch].float() / 255 - mean) / std
        loss = F.cross_entropy(model(x), labels[batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += len(batch)
    delta = {k: v.detach() - start[k] for k, v in model.state_dict().items() if v.is_floating_point()}
    return delta, seen

  round_s, examples, drawn, skipped_per_round = [], [], [], []
  for r in range(args.rounds):
    skipped_before = skipped
    t0 = time.perf_counter()
    clients = round_clients(args.num_clients, args.clients_per_round, args.seed, r)
    total = {k: torch.zeros_like(v) for k, v in global_state.items() if v.is_floating_point()}
    weight = dict.fromkeys(total, 0.0)
    seen_round = 0
    for c in clients:
      delta, seen = train_client(models[group_of[c]], client_ids[c])
      seen_round += seen
      w = float(len(parts[c]))
      for k, d in delta.items():
        total[k].add_(d, alpha=w)
        weight[k] += w
    for k, w in weight.items():
      if w > 0:
        global_state[k] += total[k] / w
    sync()
    round_s.append(time.perf_counter() - t0)
    examples.append(seen_round)
    skipped_per_round.append(skipped - skipped_before)
    drawn.append([int(c) for c in clients])
    _log(f"torch round {r + 1}: {round_s[-1]:.2f} s, {seen_round} examples")

  n_eval = min(args.eval_samples, len(dataset.test_labels))
  test_x = torch.from_numpy(dataset.test_images[:n_eval]).permute(0, 3, 1, 2).to(device)
  test_y = torch.from_numpy(dataset.test_labels[:n_eval]).long().to(device)
  accuracy = {}
  with torch.no_grad():
    for (spec, _, _), model in zip(groups, models):
      model.load_state_dict({k: global_state[k] for k in model.state_dict()})
      model.eval()
      correct = sum(int((model((test_x[s:s + 500].float() / 255 - mean) / std).argmax(1) == test_y[s:s + 500]).sum())
                    for s in range(0, n_eval, 500))
      accuracy[spec] = correct / n_eval
  trained = [sorted({groups[group_of[c]][0] for c in clients}) for clients in drawn]
  return {"side": "torch", **_timing(round_s, examples, trained), "run_s": time.perf_counter() - t_start,
          # what the clients drew, the skipped one-example batches included (our side trains on those)
          "examples_drawn_per_round": [e + s for e, s in zip(examples, skipped_per_round)],
          "test_accuracy": accuracy, "eval_samples": n_eval,
          "param_counts": {spec: n for (spec, _, _), n in zip(groups, sizes)},
          "singleton_batches_skipped": skipped, "clients": drawn, "partition_digest": partition_digest(parts),
          "framework": f"torch {torch.__version__}", "device": str(device),
          "torch_num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


def run_jax(args: argparse.Namespace) -> dict[str, Any]:
  t_start = time.perf_counter()
  import jax

  from fedjax_hetero.compilation import enable_persistent_cache
  from fedjax_hetero.config import RunConfig
  from fedjax_hetero.models.evaluation import accuracy
  from fedjax_hetero.rounds import make_backend
  from fedjax_hetero.run.build import build_simulation

  compile_s = _compile_phases()
  cache = enable_persistent_cache()  # as the CLI does (FEDJAX_HETERO_CACHE_DIR, or ~/.cache/fedjax_hetero/xla)
  groups = [spec for spec, _, _ in parse_groups(args.groups)]
  extra = {"steps_per_call": args.steps_per_call} if args.steps_per_call else {}
  try:
    config = RunConfig.from_flags(
        dataset="fashion_mnist", data_dir=args.data_dir, groups=tuple(groups), method="HeteroAvg",
        num_clients=args.num_clients, clients_per_round=args.clients_per_round, partition="dirichlet",
        alpha=args.alpha, epochs=args.epochs, batch_size=args.batch_size, optimizer="adam", learning_rate=args.lr,
        weighting="num_samples", rounds=args.rounds, seed=args.seed, backend=args.backend,
        round_program=args.round_program, rounds_per_call=args.rounds_per_call,
        max_train_samples=args.max_train_samples, progress=False, dissimilarity=False, **extra)  # the loop has none
    sim, parts = build_simulation(config, log=_log)
  except (ValueError, fdata.DataNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None
  state = sim.init_state()
  setup_compile_s = dict(compile_s)
  round_s, examples, drawn, trained = [], [], [], []
  # Round 1 alone (it compiles), then the rest in as few calls as the simulation makes (the round program's
  # rows each carry their call's mean round time).
  state, first = sim.run_rounds(state, 1, consume=True)
  first_compile_s = dict(compile_s)
  state, rest = sim.run_rounds(state, args.rounds - 1, consume=True) if args.rounds > 1 else (state, [])
  for r, m in enumerate(first + rest):
    trained.append(sorted(m["train_loss_per_group"]))
    round_s.append(m["round_seconds"])
    examples.append(m["examples"])
    drawn.append(m["clients"])
    _log(f"jax round {r + 1}: {round_s[-1]:.2f} s, {m['examples']} examples")
  n_eval = min(args.eval_samples, int(sim.spec.test_labels.shape[0]))
  images, labels = sim.spec.test_images[:n_eval], sim.spec.test_labels[:n_eval]
  acc, counts = {}, {}
  for gi, group in enumerate(sim.spec.groups):
    variables = sim.spec.group_variables(state, gi)
    acc[group.name] = accuracy(group.model, variables, images, labels, sim.spec.store.mean, sim.spec.store.std, 500)
    counts[group.name] = int(sum(x.size for x in jax.tree.leaves(variables["params"])))
  # The backend of the flags (a device program maps the clients as it would, without training through it).
  backend = make_backend(config.backend).name if sim.cohorts.in_program else sim.cohorts.backend.name
  return {"side": "jax", **_timing(round_s, examples, trained), "run_s": time.perf_counter() - t_start,
          "test_accuracy": acc, "eval_samples": n_eval, "param_counts": counts, "clients": drawn,
          "partition_digest": partition_digest(parts), "framework": f"jax {jax.__version__}",
          "device": f"{jax.default_backend()} x{jax.device_count()}", "backend": backend,
          "round_program": (f"{sim.cohorts.name if sim.cohorts.name == 'union' else 'fused'}, "
                            f"{sim.rounds_per_call} rounds per call" if sim.cohorts.in_program else "host loop"),
          "steps_per_call": config.client.steps_per_call, "cpu_count": os.cpu_count(), "compile_cache": cache,
          # Cumulative seconds of jax's trace / lowering / XLA compile: by the end of the setup, of round 1, of the run.
          "compile_s": {"setup": setup_compile_s, "round_1": first_compile_s, "end": dict(compile_s)}}


def _compile_phases() -> dict[str, float]:
  """Seconds jax spends tracing, lowering and compiling from now on (persistent cache hits count their lowering),
  summed in place in the returned dict: where a first round's time goes."""
  from jax import monitoring

  events = {"/jax/core/compile/jaxpr_trace_duration": "trace",
            "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
            "/jax/core/compile/backend_compile_duration": "backend_compile"}
  phases = dict.fromkeys(events.values(), 0.0)

  def listen(event: str, seconds: float, **kwargs) -> None:
    if event in events:
      phases[events[event]] = round(phases[events[event]] + seconds, 2)

  monitoring.register_event_duration_secs_listener(listen)
  return phases


def _child_argv(args: argparse.Namespace, side: str) -> list[str]:
  argv = [sys.executable, "-m", "benchmarks.peer_torch", "--side", side]
  for name in FORWARDED:
    value = getattr(args, name)
    if value is not None:
      argv += [f"--{name.replace('_', '-')}", str(value)]
  return argv


class SideFailed(Exception):
  """A side's subprocess exited with an error (its stderr says why)."""


def launch(args: argparse.Namespace, side: str) -> dict[str, Any]:
  """One side in a fresh subprocess; its row plus the process's whole wall time."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  t0 = time.perf_counter()
  done = subprocess.run(_child_argv(args, side), stdout=subprocess.PIPE, text=True, env=env, cwd=root)
  wall = time.perf_counter() - t0
  if done.returncode != 0:
    raise SideFailed(f"the {side} side exited with status {done.returncode}")
  row = json.loads(done.stdout.strip().splitlines()[-1])
  keys = ("side", "samples_per_s_after_first", "first_round_s")
  return {**{k: row[k] for k in keys}, "wall_s": wall, **{k: v for k, v in row.items() if k not in keys}}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Runs the benchmark; prints (and returns) one JSON-able dict per side and run, then the summary."""
  args = build_parser().parse_args(argv)
  for name in ("rounds", "repeats", "num_clients", "clients_per_round", "batch_size", "epochs", "eval_samples"):
    if getattr(args, name) < 1:
      raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
  parse_groups(args.groups)
  if args.side:
    row = (run_torch if args.side == "torch" else run_jax)(args)
    emit_json_lines([row])
    return [row]
  sides = SIDES if args.sides == "both" else (args.sides,)
  rows, failed = [], []
  for repeat in range(args.repeats):
    for side in sides:
      if side in failed:
        continue
      try:
        row = {**launch(args, side), "repeat": repeat}
      except SideFailed as e:  # the other side still runs: its row is half of what a one-shot GPU session wants
        _log(f"error: {e}")
        failed.append(side)
        continue
      speed = row["samples_per_s_after_first"]
      _log(f"{side}: wall {row['wall_s']:.1f} s, first round {row['first_round_s']:.1f} s"
           + (f", {speed:.0f} samples/s after it" if speed else "") + f", accuracy {row['test_accuracy']}")
      rows.append(row)
      emit_json_lines([row])
  if len(sides) == 2 and not failed:
    rows.append(summarize(rows))
    emit_json_lines(rows[-1:])
  emit_json_lines(rows, args.output, echo=False)
  if failed:
    raise SystemExit(f"error: the {' and '.join(failed)} side{'s' if len(failed) > 1 else ''} failed (above)")
  return rows


if __name__ == "__main__":
  main()
