"""Compilation: XLA:CPU's kernel choice, jax's persistent cache, and a count of what gets compiled.

A simulation compiles each architecture group's programs in its first round and none after
(see docs/performance.md); `CompileLog` is how the tests and the runner check and report that.
The persistent cache makes a second run of the same command skip XLA's compilation altogether.
`use_cpu_fusions`, applied when the package is imported, hands XLA:CPU's dots and reductions
to its YNNPACK library kernels, which train the CNNs 1.2-1.8x faster than XLA's own.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
from jax._src import xla_bridge  # private, but jax has no public way to ask whether it has computed yet

CACHE_ENV = "FEDJAX_HETERO_CACHE_DIR"  # a directory, or "off"
CPU_FUSIONS_ENV = "FEDJAX_HETERO_XLA_CPU_FUSIONS"  # comma-separated fusion types, or "off"
DEFAULT_CPU_FUSIONS = "dot,reduce"
_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def use_cpu_fusions(types: str | None = None) -> str | None:
  """Asks XLA:CPU to run these fusion types with YNNPACK kernels; returns the types in effect.

  ``types`` defaults to ``$FEDJAX_HETERO_XLA_CPU_FUSIONS``, else ``"dot,reduce"`` (measured best, see
  docs/performance.md: convolutions count as dots). "off" leaves XLA's own kernels. It works through
  ``XLA_FLAGS``, which XLA reads once, when jax first computes: afterwards, and when ``XLA_FLAGS``
  already names the option, nothing changes. Accelerator backends ignore the option.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if _YNN_FLAG in flags:
    return flags.split(_YNN_FLAG + "=", 1)[-1].split()[0]
  types = types or os.environ.get(CPU_FUSIONS_ENV) or DEFAULT_CPU_FUSIONS
  if types.lower() == "off" or xla_bridge.backends_are_initialized():
    return None
  os.environ["XLA_FLAGS"] = f"{flags} {_YNN_FLAG}={types}".strip()
  return types


def default_cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fedjax_hetero", "xla")


def enable_persistent_cache(directory: str | None = None) -> str | None:
  """Turns on jax's persistent compilation cache and returns its directory (None: left off).

  The directory is ``directory`` if given, else ``$FEDJAX_HETERO_CACHE_DIR``, else
  ``~/.cache/fedjax_hetero/xla``; "off" (either way) leaves the cache off. A cache the user already
  configured for jax (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept as it is.
  """
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  directory = directory or os.environ.get(CACHE_ENV) or default_cache_dir()
  if directory.lower() == "off":
    return None
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # Cache every program, however quick to compile: a round starts dozens of small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return directory


PARALLEL_ENV = "FEDJAX_HETERO_PARALLEL_COMPILE"


def parallel_compilation() -> bool:
  """Whether programs may compile in several threads at once: only with ``FEDJAX_HETERO_PARALLEL_COMPILE=1``.

  XLA:CPU (jax 0.10.2) crashed with a segmentation fault while threads compiled side by side, with and
  without the persistent cache (fresh-clone test runs on an AVX-512 EPYC, 2026-11-25), so programs compile
  one at a time unless asked. Side by side saves part of a cold first round on two cores.
  """
  return os.environ.get(PARALLEL_ENV, "") == "1"


@dataclasses.dataclass
class CompileLog:
  """Counts programs lowered (jit cache misses, persistent cache hits included) and XLA compile time.

  Use as a context manager::

    with CompileLog() as log:
      state, _ = sim.run_round(state)
    assert log.count == 0, log.names
  """

  names: list[str] = dataclasses.field(default_factory=list)
  backend_seconds: float = 0.0

  def __post_init__(self):
    self._lock = threading.Lock()  # programs compile in threads (`backends.ChunkPrograms`)

  @property
  def count(self) -> int:
    return len(self.names)

  def _listen(self, event: str, seconds: float, **kwargs) -> None:
    with self._lock:
      if event == _LOWERING_EVENT:
        self.names.append(str(kwargs.get("fun_name", "?")))
      elif event == _BACKEND_COMPILE_EVENT:
        self.backend_seconds += seconds

  def __enter__(self) -> "CompileLog":
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)
