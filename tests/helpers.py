"""Helpers shared by several test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from fedjax_hetero.config import FederationConfig, LocalConfig, MethodConfig, RunConfig
from fedjax_hetero.data import ArrayDataset, partition, synthetic_dataset
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.methods import build_method, dissimilarity
from fedjax_hetero.models import ResNet, build_model
from fedjax_hetero.rounds import ArchGroup, RoundSpec, Simulation, assign_groups, make_backend, make_simulation
from fedjax_hetero.rounds.body import server_round
from fedjax_hetero.rounds.inputs import RoundRows, cohort_rows, plans
from fedjax_hetero.rounds.rows import host_metrics

TINY_NUM_CLIENTS = 6
FMNIST_FILE = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def sigint_as_from_a_terminal() -> Iterator[None]:
  """Around starting a child that a test sends SIGINT: the child gets SIGINT at the default, as from a terminal. A
  suite started in the background (``cmd &``) ignores SIGINT and passes that on (Python then installs no
  KeyboardInterrupt, and the child never sees the test's Ctrl-C); a caught signal is reset by exec. (Not a
  ``preexec_fn``: that forks a multithreaded process, which jax warns of.)"""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def skip_without_fashion_mnist() -> None:
  """Skips the calling test where the Fashion-MNIST Debian package is not installed."""
  import pytest

  if not os.path.exists(FMNIST_FILE):
    pytest.skip("Fashion-MNIST Debian package not installed (apt-get install dataset-fashion-mnist)")


def run_fmnist_cli(*args: str, timeout: int = 600, trains_long: bool = False) -> subprocess.CompletedProcess:
  """``python -m experiments.fmnist ARGS`` from the repository root; skips the test without the Debian package.

  ``trains_long``: a run whose time goes to training more than to compiling, which LLVM's level 0 (the suite's,
  tests/conftest.py) slows down; it runs at level 1, the level of the library's own light programs (a CNN run of
  4,000 samples: 35 s at level 0, 24 s at level 1, 27 s at XLA's default)."""
  skip_without_fashion_mnist()
  env = dict(os.environ)
  if trains_long:
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0",
                                                        "--xla_backend_optimization_level=1")
  return subprocess.run([sys.executable, "-m", "experiments.fmnist", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=env)


def numpy_variables(shapes, seed: int):
  """Variables shaped like ``shapes`` (e.g. ``jax.eval_shape(model.init, ...)``), filled with numpy.

  ``model.init`` compiles one PRNG kernel per leaf shape; this avoids those compiles and gives
  BatchNorm statistics and scales non-trivial values.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for path, leaf in traverse_util.flatten_dict(dict(shapes)).items():
    if path[-1] == "var":
      value = rng.uniform(0.5, 1.5, leaf.shape)
    elif path[-1] == "scale":
      value = 1.0 + 0.1 * rng.normal(size=leaf.shape)
    elif path[-1] in ("bias", "mean"):
      value = 0.1 * rng.normal(size=leaf.shape)
    else:
      value = rng.normal(size=leaf.shape) / np.sqrt(max(1, np.prod(leaf.shape[:-1])))
    out[path] = jnp.asarray(value, jnp.float32)
  return traverse_util.unflatten_dict(out)


def model_variables(model, sample_input, seed: int):
  """``numpy_variables`` for ``model`` on inputs shaped like ``sample_input``."""
  return numpy_variables(jax.eval_shape(model.init, jax.random.key(0), sample_input), seed)


def random_batch(seed: int, size: int, num_classes: int = 4, image_shape: tuple[int, ...] = (8, 8, 1)):
  """``(uint8 images [size, *image_shape], int32 labels [size])`` drawn from ``seed``."""
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.integers(0, 256, (size, *image_shape)), jnp.uint8)
  labels = jnp.asarray(rng.integers(0, num_classes, size), jnp.int32)
  return images, labels


def random_tree(shapes: dict, rng: np.random.Generator):
  """A nested dict of float32 normal draws, one leaf per ``path: shape`` entry (path ``("a", "b")`` or
  ``"a/b"``)."""
  return traverse_util.unflatten_dict({tuple(path.split("/")) if isinstance(path, str) else path:
                                       rng.normal(size=shape).astype(np.float32) for path, shape in shapes.items()})


def tiny_resnet(stage_sizes=(1, 1), width: float = 1.0, num_classes: int = 4, **fields) -> ResNet:
  """The smallest ResNet with stages, blocks and BatchNorm: base width 4, the CIFAR stem."""
  return ResNet(stage_sizes=stage_sizes, num_classes=num_classes, width=width, base_channels=4, stem="cifar",
                **fields)


def tiny_federation(num_clients: int = TINY_NUM_CLIENTS, num_train: int = 160, num_test: int = 32,
                    scheme: str = "iid_imbalanced") -> tuple[ArrayDataset, FederatedStore]:
  """Synthetic images split over ``num_clients`` clients (by default 160 training images over 6 clients of
  unequal sizes)."""
  ds = synthetic_dataset(num_train=num_train, num_test=num_test, seed=0)
  parts = partition(ds.train_labels, scheme, num_clients, 0)
  return ds, FederatedStore.build(ds.train_images, ds.train_labels, parts, ds.num_classes, ds.mean, ds.std)


def mlp_groups(widths=(1.0,), hidden=(16,), num_classes: int = 4) -> list[tuple[str, nn.Module]]:
  """MLP width groups, named ``mlp@WIDTH``."""
  return [(f"mlp@{w}", build_model("mlp", num_classes, w, hidden=hidden)) for w in widths]


def method_options(**flags) -> MethodConfig:
  """The method options set by flag name (``fedfa_graft=False``) or by family (``fedgen=FedGenConfig(...)``)."""
  families = {name: flags.pop(name) for name in list(flags) if isinstance(flags[name], tuple(
      type(family) for family in MethodConfig().families().values()))}
  return dataclasses.replace(RunConfig.from_flags(**flags).method, **families)


# One step per jitted call (the library's default): a group compiles one step program, where steps_per_call=2
# compiled a 2-step chunk and a 1-step tail (3x the compile time). Chunks and tails stay tested against the golden
# record (tests/test_golden.py, both backends), by test_fedgen_clusamp_engine's resume through the runner and
# test_benchmark's step modes.
TINY_LOCAL = LocalConfig(epochs=2, batch_size=8, optimizer="adam", learning_rate=1e-2, steps_per_call=1)


def simulation(method, models, data=None, local: LocalConfig = TINY_LOCAL, backend: str = "sequential",
               options: dict | None = None, track_dissimilarity: bool = False, round_program: str = "auto",
               rounds_per_call: int | None = None, **federation) -> Simulation:
  """The tests' simulation builder: the groups ``models`` ((name, module) pairs) over the clients of ``data``
  (`tiny_federation` by default) in contiguous blocks; ``method`` a name (with ``options``, `method_options`'s
  flags) or a `Method`; ``federation``: `FederationConfig` fields (seed 0, 3 clients per round unless given)."""
  ds, store = data or tiny_federation()
  groups = [ArchGroup(name, model, clients)
            for (name, model), clients in zip(models, assign_groups(store.num_clients, len(models)))]
  if isinstance(method, str):
    method = build_method(method, method_options(**(options or {})), local)
  if track_dissimilarity:
    method = dissimilarity.tracked(method)
  config = FederationConfig(**{"clients_per_round": 3, "seed": 0, **federation})
  spec = RoundSpec.build(groups, store, local, method, config, jnp.asarray(ds.test_images), jnp.asarray(ds.test_labels))
  return make_simulation(spec, make_backend(backend), round_program, rounds_per_call)


def tiny_simulation(method, backend: str = "sequential", widths=(1.0,), clients_per_round: int = 3,
                    optimizer: str = "adam", hidden=(16,), data=None, weighting: str = "uniform",
                    group_draw=(), track_dissimilarity: bool = False, round_program: str = "auto",
                    **options) -> Simulation:
  """A two-epoch simulation of MLP width groups on `tiny_federation` (or ``data``). ``method`` is a name
  (then ``options`` are `method_options`) or a `Method`."""
  local = dataclasses.replace(TINY_LOCAL, optimizer=optimizer, learning_rate=1e-2 if optimizer == "adam" else 0.05)
  data = data or tiny_federation()
  return simulation(method, mlp_groups(widths, hidden, data[0].num_classes), data, local, backend, options,
                    track_dissimilarity, round_program, clients_per_round=clients_per_round, weighting=weighting,
                    group_draw=group_draw)


def run_rounds(sim: Simulation, rounds: int = 2):
  """``rounds`` rounds from the simulation's initial state: (final state, the rounds' metrics)."""
  return sim.run_rounds(sim.init_state(), rounds)


def aggregate(sim: Simulation, state, starts, results, cohorts):
  """Federation 0's server steps in round ``state.round`` on the groups' ``results`` of ``cohorts`` (client ids
  per group, each client of weight 1): the new model, the steps' states and their metrics (host values)."""
  spec = sim.spec
  rows = tuple(jax.tree.map(lambda a: a[0], cohort_rows(spec, g, [np.asarray(c)], [np.ones(len(c))],
                                                        spec.stack_size(g))) for g, c in enumerate(cohorts))
  step_plans = plans(spec, state.round)
  x = RoundRows(state.round, 0, False, rows, tuple(p.inputs for p in step_plans), tuple(p.static for p in step_plans))
  model, steps, metrics = server_round(spec, 0, state, starts, results, x)
  return model, steps, host_metrics(metrics)


def measured(output_dir) -> list[dict]:
  """A results folder's metrics rows without their timings (what two runs of the same rounds share bit for bit)."""
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [{k: v for k, v in row.items() if k not in ("round_seconds", "samples_per_s")} for row in rows]


def run_alone(run: RunConfig, dataset) -> str:
  """``run`` (one run of a job) trained again on its own, in a folder beside its own; that folder."""
  from fedjax_hetero.run.runner import run_experiment
  alone = run.replace(output_dir=run.output.dir + "_alone")
  run_experiment(alone, dataset, log=lambda _: None)
  return alone.output.dir


class TrainedAlone:
  """`run_alone` once per setting, for a module-scoped fixture: a run whose setting (its folder aside) a test of the
  module trained already reads that folder. ``dataset`` makes the module's dataset."""

  def __init__(self, tmp_path_factory, dataset: Callable[[], Any]):
    self._tmp, self._dataset, self._folders = tmp_path_factory, dataset, {}

  def __call__(self, run: RunConfig) -> str:
    setting = run.replace(output_dir="alone")
    if setting not in self._folders:
      self._folders[setting] = run_alone(run.replace(output_dir=str(self._tmp.mktemp("alone") / "run")),
                                         self._dataset())
    return self._folders[setting]
