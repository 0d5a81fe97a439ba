"""The modules a user imports first each import on their own in an interpreter that has imported no module of
fedjax_hetero (no import cycle that only the usual import order hides; a fresh interpreter per module is too slow
for all of them, so each is a fork of one that has imported jax, flax and optax)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter():
  modules = [f"fedjax_hetero.{name}" for name in (
      "server", "server.steps", "client.terms", "client.local", "data", "data.store", "sampling.samplers", "config",
      "methods", "aggregators", "rounds", "rounds.spec", "rounds.many", "run", "run.runner", "run.jobs", "distributed",
      "cli.run")]
  # One interpreter imports the third-party libraries every module imports (jax and numpy alone take most of a
  # fresh interpreter's second) and forks a child per module, which imports it first of fedjax_hetero's.
  script = ("import importlib, os, sys\n"
            "import numpy, jax, jax.numpy, flax.linen, optax\n"
            "assert not any(m == 'fedjax_hetero' or m.startswith('fedjax_hetero.') for m in sys.modules)\n"
            "failed = []\n"
            "for m in sys.argv[1:]:\n"
            "  pid = os.fork()\n"
            "  if pid == 0:\n"
            "    try:\n"
            "      importlib.import_module(m)\n"
            "    except BaseException:\n"
            "      import traceback; traceback.print_exc()\n"
            "      os._exit(1)\n"
            "    os._exit(0)\n"
            "  if os.waitpid(pid, 0)[1]:\n"
            "    failed.append(m)\n"
            "print(' '.join(failed))")
  out = subprocess.run([sys.executable, "-c", script, *modules], cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0 and out.stdout.split() == [], out.stdout + out.stderr[-2000:]



# The library's layers, lowest first: a unit (a subpackage or a root module of fedjax_hetero) imports only from the
# layers below its own (docs/architecture.md draws them).
LAYERS = (
    ("validation", "compilation", "garbage", "random_batching", "os_errors"),  # checks of single values, XLA's
    # settings, Python's collector while programs trace, a function's random draws made together, OS errors in one line
    ("data", "hetero"),  # datasets, partitions, the device store; sub-model maps
    ("models", "aggregators"),  # Flax models and their evaluation; pure aggregation rules
    ("config",),  # a run's settings, as plain data
    ("distributed", "client", "server"),  # processes; a method's client pieces and server pieces
    ("sampling",),  # who takes part in a round
    ("methods",),  # the papers' methods as declarations
    ("rounds",),  # the round: spec, rows, body, mappings, simulation, many runs
    ("run",),  # a config to a results folder: build, runner, checkpoints, history, guard, jobs
    ("analysis",),  # finished runs: CKA, landscapes, figures, comparisons
    ("cli",),  # the commands
)


def imports_by_unit() -> dict[str, set[str]]:
  """Per unit, the other units its modules import (lazy imports included; `typing.TYPE_CHECKING` blocks not)."""
  import ast
  import os

  root = os.path.join(REPO, "fedjax_hetero")
  found: dict[str, set[str]] = {}
  for folder, _, files in os.walk(root):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
      if parts == ["fedjax_hetero", "__init__"]:
        continue
      unit = parts[1]
      with open(path) as f:
        tree = ast.parse(f.read())
      hidden = {id(n) for block in ast.walk(tree)
                if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
      for node in ast.walk(tree):
        if id(node) in hidden:
          continue
        modules = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fedjax_hetero"):
          modules = [f"{node.module}.{a.name}" for a in node.names] if node.module == "fedjax_hetero" else [node.module]
        elif isinstance(node, ast.Import):
          modules = [a.name for a in node.names if a.name.startswith("fedjax_hetero.")]
        for module in modules:
          other = module.split(".")[1]
          if other != unit:
            found.setdefault(unit, set()).add(other)
  return found


def test_no_module_imports_from_a_layer_above_its_own():
  layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
  found = imports_by_unit()
  unplaced = sorted((set(found) | {u for targets in found.values() for u in targets}) - set(layer))
  assert not unplaced, f"units in no layer of LAYERS: {unplaced}"
  upward = sorted(f"{unit} (layer {layer[unit]}) imports {other} (layer {layer[other]})"
                  for unit, others in found.items() for other in others if layer[other] >= layer[unit])
  assert not upward, "\n".join(upward)
