"""Multi-process runs on JAX's own distributed runtime (`jax.distributed`, multi-controller JAX).

Every process runs the same program: it loads the same data, draws the same cohorts and calls the same
jitted programs in the same order. ``--backend sharded`` puts the cohort's clients axis over the devices of
all processes (`backends.make_backend`), so each process trains the clients of its own devices, and the
aggregation is a collective inside the jitted reduction. Server state is replicated on every device, so every
process can read it; process 0 alone writes the results folder (`runner.run_experiment`).

`initialize` must run before jax computes anything: jax.distributed connects the processes through a
coordinator (process 0's ``HOST:PORT``), or detects them on Cloud TPU VMs, SLURM and Open MPI
(``--distributed auto``). Its timeouts are bounded (`DistributedConfig`), so that a process that never
joins, or dies, ends the others with an error instead of a hang; `exit_on_failure` makes a failing process
exit at once, so that the others' next collective fails instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from typing import Iterator

import jax
import numpy as np
from jax._src import xla_bridge  # private, but jax has no public way to ask whether it has computed yet

from fedjax_hetero.config.declare import cli_name
from fedjax_hetero.config.distributed import EXPLICIT, DistributedConfig
from fedjax_hetero.validation import first_line

# Exit status of a process whose run failed in a multi-process run (argparse's 2 stays for bad input).
FAILED = 1


def initialize(config: DistributedConfig) -> bool:
  """Joins the run ``config`` describes (`jax.distributed.initialize`); returns whether it did.

  Must come before jax computes anything. On CPU the processes' collectives run over gloo
  (``jax_cpu_collectives_implementation``; GPUs and TPUs have their own, and ignore it). If the processes
  do not all join within ``config.timeout``, jax ends the process with its own fatal error
  (``DEADLINE_EXCEEDED``, after the line this prints first); other failures to join, such as ``mode``
  "auto" finding no cluster, raise RuntimeError.
  """
  if not config.enabled:
    return False
  if _joined:  # a process joins once; a second call (another run in the same process) must describe the same run
    if _joined[0] != config:
      raise RuntimeError(f"this process already joined a multi-process run ({_joined[0]}); it cannot join {config}")
    return True
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("jax already computed in this process: the multi-process runtime must start first "
                       "(fedjax_hetero.distributed.initialize before anything that uses jax)")
  if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  who = ("a process" if config.process_id is None else f"process {config.process_id}") + (
      f" of {config.num_processes}" if config.num_processes else "")
  where = f"coordinator {config.coordinator}" if config.coordinator else "the cluster jax detects"
  # Said first because a join that times out ends in jax's own fatal error, which does not say what it waited for.
  timeout = cli_name(DistributedConfig, "timeout")
  print(f"{who}: joining the run ({where}); waiting up to {config.timeout} s ({timeout}) "
        "for every process", file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(config.coordinator, config.num_processes, config.process_id,
                               initialization_timeout=config.timeout,
                               heartbeat_timeout_seconds=config.heartbeat_timeout,
                               shutdown_timeout_seconds=config.timeout)
  except ValueError as e:  # jax's checks of what it was given or detected
    hint = (f"; {cli_name(DistributedConfig, 'mode')} auto found no Cloud TPU VM, SLURM or Open MPI job: pass "
            f"{', '.join(cli_name(DistributedConfig, n) for n in EXPLICIT)}" if config.coordinator is None else "")
    raise RuntimeError(f"{who}: cannot join the run ({where}): {str(e).rstrip('.')}{hint}") from e
  except Exception as e:  # jax raises its runtime's errors (e.g. DEADLINE_EXCEEDED) under several types
    raise RuntimeError(f"{who}: the processes did not all join ({where}) within "
                       f"{cli_name(DistributedConfig, 'timeout')} {config.timeout} s: {first_line(e, 400)}") from e
  _joined.append(config)
  return True


_joined: list[DistributedConfig] = []  # the run this process joined, if any


def from_host(x, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array placed by ``sharding`` from host data every process holds the same: each process copies
  its own devices' parts (``jax.device_put`` of host data would first check, by a collective, that all
  processes agree)."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def is_main_process() -> bool:
  """Whether this process writes the results (process 0; the only one of a single-process run)."""
  return jax.process_index() == 0


def describe() -> str:
  """``process 1 of 2`` (empty in a single-process run), for messages."""
  return f"process {jax.process_index()} of {jax.process_count()}" if jax.process_count() > 1 else ""


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier ``name`` (no-op in a single-process run): e.g. between
  every process reading a file and process 0 rewriting it."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def max_over_processes(values: np.ndarray) -> np.ndarray:
  """The elementwise maximum of every process's ``values`` (the same shape on each; ``values`` itself in a
  single-process run): e.g. whether any process was asked to stop."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils
  gathered = np.asarray(multihost_utils.process_allgather(values))
  return np.max(gathered.reshape((-1,) + values.shape), axis=0)


# How a collective fails when another process is gone (jax 0.10's texts, under several exception types): gloo's
# connection to it (CPU collectives), or jax's coordination service, which names the silent process by its id.
# Gloo names the collective in several spellings ("AllGather", "all-reduce", "collective permute").
_GLOO_FAILED = re.compile(r"\bGloo [\w -]{1,40}? failed\b", re.IGNORECASE)
_GLOO_CAUSES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                "Timed out")
_SILENT_TASK = re.compile(r"Task (\d+) heartbeat timeout|stopped sending heartbeats\):\s*(\d+)")


def lost_process(error: BaseException, process: int, processes: int) -> str | None:
  """The one line (without ``error:``) for a collective of process ``process`` of ``processes`` that failed
  because another process is gone (killed, crashed), naming that process where the error or the process count
  tells which, and how to resume; None for any other error."""
  texts = []
  while error is not None and len(texts) < 8:
    texts.append(str(error))
    error = error.__cause__ or error.__context__
  text = "\n".join(texts)
  silent = _SILENT_TASK.search(text)
  if silent and int(silent.group(1) or silent.group(2)) == process:  # (this process was too slow: not a loss)
    return None
  if silent:
    lost, how = f"process {silent.group(1) or silent.group(2)}", "jax's coordination service: its heartbeats stopped"
  elif _GLOO_FAILED.search(text):
    lost = f"process {1 - process}" if processes == 2 else "another process"
    how = "gloo: " + next((c for c in _GLOO_CAUSES if c in text), "its connection failed") + ", in a collective"
  else:
    return None
  return (f"process {process} of {processes}: {lost} stopped ({how}); it was killed or crashed (see its output). "
          "To continue, start the run again with --resume, every process: it goes on from the last checkpoint "
          "they all saved")


@contextlib.contextmanager
def lost_process_named() -> Iterator[None]:
  """In a multi-process run, a collective that fails because another process is gone ends this process at once
  with `lost_process`'s line and status `FAILED`, instead of gloo's or jax's text (or a traceback)."""
  try:
    yield
  except Exception as e:  # noqa: BLE001 - the types that carry these failures vary (ValueError, JaxRuntimeError, ...)
    line = lost_process(e, jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None
    if line is None:
      raise
    print(f"error: {line}", file=sys.stderr)
    _exit_now(FAILED)


@contextlib.contextmanager
def exit_on_failure(enabled: bool) -> Iterator[None]:
  """In a multi-process run (``enabled``), an error leaving the block ends the process at once, with its
  message and status (SystemExit's, else `FAILED`).

  A process that returned normally would wait in jax's shutdown for the others while they wait in a
  collective for it; exiting without that wait makes their next collective fail, so every process stops
  within a bounded time, each saying why.
  """
  if not enabled:
    yield
    return
  try:
    yield
  except SystemExit as e:
    if e.code is not None and not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
    _exit_now(0 if e.code is None else e.code if isinstance(e.code, int) else FAILED)
  except BaseException as e:  # noqa: BLE001 - every failure must end the process, not only the expected ones
    # A collective that lost a process, wherever it failed, is `lost_process`'s one line, as in `lost_process_named`.
    lost = lost_process(e, jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None
    if lost is None:
      traceback.print_exc()
    line = lost or f"{describe() or 'this process'}: {first_line(e, 400)}" + (
        "; a collective operation failed: another process has probably exited (see its output)"
        if isinstance(e, jax.errors.JaxRuntimeError) else "")
    print(f"error: {line}", file=sys.stderr)
    _exit_now(FAILED)


def _exit_now(status: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)
