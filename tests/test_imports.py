"""The modules a user imports first each import on their own in an interpreter that has imported no module of
fedjax_hetero (no import cycle that only the usual import order hides; a fresh interpreter per module is too slow
for all of them, so each is a fork of one that has imported jax, flax and optax), and the moved names still import
from their old paths."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_every_module_imports_first_in_a_fresh_interpreter():
  modules = [f"fedjax_hetero.{name}" for name in (
      "server", "server.steps", "client.terms", "client.local", "data", "data.store", "sampling.samplers", "config",
      "methods", "aggregators", "engine", "runner", "many_runs", "distributed", "cli.run")]
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


def test_moved_names_import_from_their_old_paths():
  from fedjax_hetero.client.terms import proximal
  from fedjax_hetero.methods.fedprox import proximal as moved
  from fedjax_hetero.server import FedCrossConfig, nova_mean
  from fedjax_hetero.server.steps import inco
  assert proximal is moved and FedCrossConfig and nova_mean and inco
