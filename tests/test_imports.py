"""The modules a user imports first each import on their own in a fresh interpreter (no import cycle that only
the usual import order hides; one process per module is too slow for all of them), and the moved names still
import from their old paths."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def test_every_module_imports_first_in_a_fresh_interpreter():
  modules = [f"fedjax_hetero.{name}" for name in (
      "server", "server.steps", "client.terms", "client.local", "data", "data.store", "sampling.samplers", "config",
      "methods", "aggregators", "engine", "runner", "many_runs", "distributed", "cli.run")]
  script = ("import importlib, subprocess, sys\n"
            "failed = [m for m in sys.argv[1:] if subprocess.run([sys.executable, '-c', 'import ' + m],"
            " capture_output=True).returncode]\n"
            "print(' '.join(failed))")
  out = subprocess.run([sys.executable, "-c", script, *modules], cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0 and out.stdout.split() == [], out.stdout + out.stderr[-2000:]


def test_moved_names_import_from_their_old_paths():
  from fedjax_hetero.client.terms import proximal
  from fedjax_hetero.methods.fedprox import proximal as moved
  from fedjax_hetero.server import FedCrossConfig, nova_mean
  from fedjax_hetero.server.steps import inco
  assert proximal is moved and FedCrossConfig and nova_mean and inco
