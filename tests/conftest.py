"""Shared test setup: no persistent XLA compilation cache, and each module's compiled programs released.

The suite builds a few hundred simulations in one process. Kept alive, their XLA:CPU executables
filled the process's memory mappings up to the kernel's limit (vm.max_map_count), where XLA's compiler
segfaulted (see `fedjax_hetero.compilation.mapping_headroom`); so every module releases what it compiled.
The tests compile everything themselves (the CLI subprocesses they start get
``FEDJAX_HETERO_CACHE_DIR=off`` too), so no test depends on what an earlier one left in a cache.
"""

from __future__ import annotations

import os

import pytest

from fedjax_hetero import engine
from fedjax_hetero.compilation import CACHE_ENV, release_programs


def pytest_configure(config):
  os.environ[CACHE_ENV] = "off"  # inherited by the CLI subprocesses


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  release_programs()


@pytest.fixture
def no_compute(monkeypatch):
  """Fails the test if a simulation initializes or trains (bad input must be rejected before)."""

  def forbidden(*args, **kwargs):
    raise AssertionError("compute started before the input was rejected")

  monkeypatch.setattr(engine.Simulation, "init_state", forbidden)
  monkeypatch.setattr(engine.Simulation, "run_round", forbidden)
