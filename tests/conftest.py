"""Shared test setup: a session-wide persistent XLA compilation cache.

Compilation dominates these tests on a small CPU, and several tests build the
same programs again (each `Simulation` jits fresh closures, so the in-memory
caches miss). A persistent cache in a throwaway directory turns those repeats
into cache hits without changing any result.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

_CACHE_DIR = None


def pytest_configure(config):
  global _CACHE_DIR
  if jax.config.jax_compilation_cache_dir:  # the user chose one already
    return
  _CACHE_DIR = tempfile.mkdtemp(prefix="fedjax_hetero_xla_cache_")
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)  # inherited by subprocesses


def pytest_unconfigure(config):
  if _CACHE_DIR is not None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
