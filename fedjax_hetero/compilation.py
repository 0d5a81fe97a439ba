"""Compilation: XLA:CPU's kernel choice, jax's persistent cache, and a count of what gets compiled.

A simulation compiles each architecture group's programs in its first round and none after
(see docs/performance.md); `CompileLog` is how the tests and the runner check and report that.
`program_cache` keeps the jitted programs a process builds, up to a bound, and `release_programs`
drops them: each XLA:CPU executable holds its machine code in memory mappings of its own, and a
process that keeps every program it ever compiled runs out of them (see `mapping_headroom`).
The persistent cache makes a second run of the same command skip XLA's compilation altogether.
`use_cpu_fusions`, applied when the package is imported, hands XLA:CPU's dots and reductions
to its YNNPACK library kernels, which train the CNNs 1.2-1.8x faster than XLA's own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import os
import threading
import warnings
from typing import Any, Callable, Iterator, TypeVar

import jax
import numpy as np
from jax._src import xla_bridge  # private, but jax has no public way to ask whether it has computed yet
from jax.extend.core import find_top_trace

CACHE_ENV = "FEDJAX_HETERO_CACHE_DIR"  # a directory, or "off"
CPU_FUSIONS_ENV = "FEDJAX_HETERO_XLA_CPU_FUSIONS"  # comma-separated fusion types, or "off"
DEFAULT_CPU_FUSIONS = "dot,reduce"
_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PROGRAM_CACHE_SIZE = 32  # programs per builder: a few simulations' worth of groups and chunk lengths
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"

Builder = TypeVar("Builder", bound=Callable)
_program_caches: list = []


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


# XLA:CPU's LLVM backend spends most of a small program's compile time in its level-3 passes; at level 1 the
# same program compiles 4-5x faster (a ResNet's initialization: 12.5 s -> 2.5 s). Training arithmetic changes in
# its last bits at level 1, so only programs that copy, gather, draw random numbers or initialize take it: their
# bits are the same at either level (tests/test_compilation.py checks every model's initialization).
_LIGHT_CPU_OPTIONS = {"xla_backend_optimization_level": 1}


class light_jit:  # noqa: N801 (used like jax.jit)
  """`jax.jit` for a program whose values are the same bits at any optimization level (copies, gathers, random
  draws, initializations): called on XLA:CPU from outside a trace, it compiles at LLVM level 1; elsewhere (another
  backend, or inside a traced function, where jax allows no compiler options) it is `jax.jit` unchanged. The
  backend is read at the first call, so defining one does not start jax."""

  def __init__(self, fun: Callable, **jit_kwargs):
    self._fun, self._kwargs, self._light = fun, jit_kwargs, None
    self._plain = jax.jit(fun, **jit_kwargs)
    self._compiling: concurrent.futures.Future | None = None  # `compile_beside`'s
    self._called: set[str] = set()  # the argument types it was called with from outside a trace (compiled)
    functools.update_wrapper(self, fun)

  def compile_beside(self, *args) -> None:
    """Starts compiling the program for ``args`` (concrete arrays) on a thread of its own, beside what the caller
    does next, unless it has been called with such arguments; the next call from outside a trace waits for it
    (jit's cache then holds the program)."""
    if self._compiling is None and _signature(args) not in self._called:
      self._compiling = compile_beside(self._program(args), *args)

  def _program(self, args):
    if _traced(args):
      return self._plain
    if self._light is None:
      cpu = jax.default_backend() == "cpu"
      self._light = jax.jit(self._fun, compiler_options=_LIGHT_CPU_OPTIONS, **self._kwargs) if cpu else self._plain
    return self._light

  def __call__(self, *args, **kwargs):
    if _traced((args, kwargs)):
      return self._plain(*args, **kwargs)
    if self._compiling is not None:
      self._compiling, compiling = None, self._compiling
      compiling.result()
    self._called.add(_signature((args, kwargs)))
    return self._program((args, kwargs))(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._program((args, kwargs)).lower(*args, **kwargs)


def _traced(args: Any) -> bool:
  """Whether a call with ``args`` is traced: an argument is a tracer, or the call is inside a trace (host arrays
  passed to a function that `jax.eval_shape` traces)."""
  return not isinstance(find_top_trace(jax.tree.leaves(args)), _EVAL_TRACE)


_EVAL_TRACE = type(find_top_trace(()))  # (this module is imported outside any trace)


def _signature(args: Any) -> str:
  return str(jax.tree.map(lambda x: (np.shape(x), getattr(x, "dtype", type(x))), args))


def shared_by_value(maxsize: int) -> Callable[[Builder], Builder]:
  """`functools.lru_cache` of ``maxsize`` entries for a function whose calls with equal arguments may share one
  result; arguments that cannot be hashed (settings traced inside a job's program) call it anew, uncached."""

  def decorate(build: Builder) -> Builder:
    cached = functools.lru_cache(maxsize=maxsize)(build)

    @functools.wraps(build)
    def shared(*args, **kwargs):
      try:
        hash((args, tuple(kwargs.items())))
      except TypeError:
        return build(*args, **kwargs)
      return cached(*args, **kwargs)

    shared.cache_clear, shared.cache_info = cached.cache_clear, cached.cache_info  # type: ignore[attr-defined]
    return shared  # type: ignore[return-value]

  return decorate


def program_cache(build: Builder) -> Builder:
  """`shared_by_value` for a function that builds jitted programs from static structure (a model, a trainer, a
  map): equal arguments share their compiled programs, so a second simulation of the same structure traces
  nothing again, and the least recently used are dropped beyond `PROGRAM_CACHE_SIZE`, with their machine code.
  `release_programs` drops all of them."""
  shared = shared_by_value(PROGRAM_CACHE_SIZE)(build)
  _program_caches.append(shared)
  return shared


def release_programs() -> None:
  """Drops every compiled program this package's builders and jax's own caches hold, and frees their
  memory. Programs still referenced elsewhere (a live `Simulation`'s) stay; the rest recompile on use."""
  for cached in _program_caches:
    cached.cache_clear()
  jax.clear_caches()
  gc.collect()


def memory_mappings() -> tuple[int, int] | None:
  """(mappings this process holds, the kernel's per-process limit ``vm.max_map_count``); None where
  Linux's /proc does not say."""
  try:
    with open(_MAX_MAP_COUNT) as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
  except (OSError, ValueError):
    return None
  return used, limit


def mapping_headroom(release_above: float = 0.6, fail_above: float = 0.9) -> None:
  """Makes room before XLA compiles: XLA:CPU places each executable's code and data in memory mappings
  of their own (three per kernel), and when a process reaches the kernel's limit on mappings
  (``vm.max_map_count``, 65,530 by default) XLA's compiler dies with a segmentation fault instead of an
  error. Above ``release_above`` of the limit this calls `release_programs` (with a warning); if the
  process is still above ``fail_above`` it raises RuntimeError, which names the way out.

  Seen in one process that built ~300 simulations in a row (the test suite, before its modules released
  their programs): the crash came at 65,485 of 65,530 mappings, 5.5 GB resident.
  """
  counted = memory_mappings()
  if counted is None:
    return
  used, limit = counted
  if used > release_above * limit:
    release_programs()
    before, (used, limit) = used, memory_mappings() or (used, limit)
    warnings.warn(f"this process held {before:,} of its {limit:,} memory mappings (vm.max_map_count), mostly "
                  f"compiled programs; released the cached ones: {used:,} now", RuntimeWarning, stacklevel=2)
  if used > fail_above * limit:
    raise RuntimeError(f"this process holds {used:,} of its {limit:,} memory mappings (vm.max_map_count) and "
                       "XLA:CPU crashes when it compiles at the limit: drop the simulations you no longer need "
                       "and call fedjax_hetero.compilation.release_programs(), or raise the limit "
                       "(sysctl -w vm.max_map_count=262144)")


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
    self._lock = threading.Lock()  # programs compile in threads (`ChunkPrograms`)

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


# The event jax's profiler records on the host for every launch of a compiled program on a device (XLA:CPU
# and the PjRt GPU client both run executables through this helper).
_LAUNCH_EVENT = "ExecuteHelperOnSingleDevice"


class LaunchCount:
  """Counts device program launches (compiled programs run, eager operations included) from jax's profiler.

  Use as a context manager; ``count`` is set on exit. It records a profiler trace into a temporary directory,
  so it costs far more than the launches themselves: a test's instrument, not a benchmark's::

    with LaunchCount() as launches:
      state, rows = sim.run_rounds(state, 4)
    assert launches.count <= 2
  """

  count: int = 0

  def __enter__(self) -> "LaunchCount":
    import tempfile

    self._directory = tempfile.TemporaryDirectory()
    jax.profiler.start_trace(self._directory.name)
    return self

  def __exit__(self, *exc) -> None:
    import glob

    try:
      jax.effects_barrier()
      jax.profiler.stop_trace()
      traces = glob.glob(os.path.join(self._directory.name, "**", "*.xplane.pb"), recursive=True)
      data = jax.profiler.ProfileData.from_file(traces[0])
      self.count = sum(event.name.endswith(_LAUNCH_EVENT) for plane in data.planes for line in plane.lines
                       for event in line.events)
    finally:
      self._directory.cleanup()


_running: set[concurrent.futures.Future] = set()  # the jobs of `compile_threads` not ended yet


def compiling() -> bool:
  """Whether a `compile_threads` job runs in this process (XLA cannot stop a compile: `run.interruption`)."""
  return any(not job.done() for job in list(_running))


@contextlib.contextmanager
def compile_threads(workers: int, wait: bool = True) -> Iterator[Callable[..., concurrent.futures.Future]]:
  """``submit(fn, *args)`` running jobs on ``workers`` threads, tracked by `compiling`. The block's end waits for
  them if ``wait``, unless an exception (a Ctrl-C) leaves it: then the jobs not started are dropped and the running
  ones are not waited for."""
  pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fedjax_hetero-compile")

  def submit(fn: Callable, *args) -> concurrent.futures.Future:
    job = pool.submit(fn, *args)
    _running.add(job)
    job.add_done_callback(_running.discard)
    return job

  try:
    yield submit
  except BaseException:
    pool.shutdown(wait=False, cancel_futures=True)
    raise
  pool.shutdown(wait=wait)


def compile_side_by_side(jobs: list[Callable[[], Any]]) -> list[Any]:
  """Runs compile jobs in threads and returns their results: XLA compiles one program per core, and jit's cache
  keeps the programs, so the calls that follow find them compiled."""
  with compile_threads(len(jobs)) as submit:
    return [running.result() for running in [submit(job) for job in jobs]]  # (re-raises a job's error)


def compile_beside(jitted: Any, *args) -> concurrent.futures.Future:
  """``jitted``'s program for ``args`` compiled in a thread of its own, beside what the caller compiles next (XLA
  compiles one program per core); jit's cache keeps it, so a call after the future's result finds it compiled."""
  return in_background(lambda: jitted.lower(*args).compile())


def in_background(job: Callable[[], Any]) -> concurrent.futures.Future:
  """``job`` run on a thread of its own (a `compile_threads` job) while the caller goes on."""
  with compile_threads(1, wait=False) as submit:
    return submit(job)


# Shapes of the data and the cohort whose chunk programs a `ChunkPrograms` keeps compiled.
CHUNK_SHAPES_KEPT = 4


class ChunkPrograms:
  """A group's jitted chunk of ``count`` unrolled steps, compiled for every chunk length the schedule can
  use (`LocalConfig.chunk_lengths`) when the first chunk runs (or earlier, from `compile_jobs`), side by
  side in threads.

  Compiling them all at once means no later round compiles (a round whose clients first need a one-step
  tail would), and XLA compiles the programs on several cores at the same time. The executables are kept per
  shape of the data and the cohort (images, labels, ids, mask): two simulations of one structure share this
  object through `program_cache`, and a second one with more clients per round, or a larger store, compiles
  its own rather than calling programs compiled for the first one's shapes. The programs of the
  `CHUNK_SHAPES_KEPT` shapes compiled last are kept (a sweep over cohort sizes would hold them all).
  """

  def __init__(self, run_steps, lengths: tuple[int, ...]):
    self._jitted, self._lengths, self._compiled = run_steps, lengths, {}

  def compiled_for(self, images, labels, ids=None, mask=None) -> bool:
    """Whether every chunk length is compiled for these shapes (arrays or `jax.ShapeDtypeStruct`); without ``ids``
    and ``mask``, for some cohort's (a caller whose cohort shapes are fixed, the sequential backend's one client,
    asks so without tracing them)."""
    data, cohort = _shapes(images, labels), None if ids is None else _shapes(ids, mask)
    return any(key[:2] == data and cohort in (None, key[2:]) and len(programs) == len(self._lengths)
               for key, programs in self._compiled.items())

  def compile_jobs(self, state, images, labels, ids, mask) -> list[Callable[[], None]]:
    """One job per chunk length (arguments may be shapes, e.g. from `jax.eval_shape`)."""
    key = _shapes(images, labels, ids, mask)
    programs = self._compiled[key] = self._compiled.pop(key, {})  # (now the newest)
    for older in list(self._compiled)[:-CHUNK_SHAPES_KEPT]:
      del self._compiled[older]

    def job(n: int):
      def run():
        programs[n] = self._jitted.lower(state, images, labels, ids, mask, np.int32(0), n).compile()
      return run
    return [job(n) for n in self._lengths]

  def __call__(self, state, images, labels, ids, mask, offset: int, count: int):
    programs = self._compiled.get(_shapes(images, labels, ids, mask))
    if programs is None or len(programs) < len(self._lengths):
      compile_side_by_side(self.compile_jobs(state, images, labels, ids, mask))
      programs = self._compiled[_shapes(images, labels, ids, mask)]
    return programs[count](state, images, labels, ids, mask, np.int32(offset))


def _shapes(*arrays) -> tuple:
  return tuple((x.shape, x.dtype) for x in arrays)
