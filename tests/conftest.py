"""Shared test setup: no persistent XLA compilation cache, in this process or its subprocesses.

A session-wide throwaway cache used to turn the tests' repeated compilations into cache hits, but
XLA:CPU (jax 0.10.2) crashed three times in fresh-clone runs while reading entries of it
(``compilation_cache.get_executable_and_time``: a segmentation fault, once with threads reading
together, once an abort with one thread reading alone). The tests now compile everything themselves;
the experiment driver's own cache (``--compile-cache``) is off in the CLI subprocesses the tests start.
"""

from __future__ import annotations

import os

from fedjax_hetero.compilation import CACHE_ENV


def pytest_configure(config):
  os.environ[CACHE_ENV] = "off"  # inherited by the CLI subprocesses
