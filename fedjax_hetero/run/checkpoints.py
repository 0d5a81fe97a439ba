"""Orbax checkpoints of a run's whole `ServerState`: models, server steps' state, sampler, client memory.

The state's typed parts (NamedTuples such as an optax state or FedCross's `CrossState`) are stored as flax state
dicts and rebuilt against a template state, so any method's state round-trips without knowing its types.

In a multi-process run every process calls `save` and the restores, with the same arguments: orbax writes
the replicated arrays once (process 0 is its primary host) and restores them into the template's shardings,
replicated global arrays (a restore needs a template holding real arrays, such as the initial state).

A write that fails never hangs the process: before each save the folder is tried (a probe directory, the free
space against the state's size), and a failure orbax meets in its background threads comes back from the
manager as one `CheckpointWriteError` naming the folder and the cause, with orbax's own tracebacks kept out
of the log and its waiting threads let go. Each checkpoint records its round (orbax's custom metadata), and a
restore refuses a checkpoint whose recorded round is not its folder's name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import serialization

from fedjax_hetero import distributed
from fedjax_hetero.os_errors import failed_path, reason, root_os_error
from fedjax_hetero.rounds.state import ServerState
from fedjax_hetero.validation import first_line


BEST_METRIC = "mean_accuracy"


class _QuietUnrankedSaves(logging.Filter):
  """Orbax logs a warning for each save without metrics when checkpoints are ranked; rounds without an
  evaluation are saved that way on purpose."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


class _QuietWriteFailures(logging.Filter):
  """A write orbax fails on (disk full, no permission) is logged by each of its threads with a traceback;
  it also comes back from the manager, which reports it in one line (`CheckpointWriteError`).

  ``in_message``: the record names orbax in its message rather than its source, as asyncio's does: after the
  manager has raised, orbax's other write tasks can fail the same way, and asyncio logs each such task when it is
  collected, as an exception never retrieved (at any later moment)."""

  def __init__(self, in_message: bool = False):
    super().__init__()
    self.in_message = in_message

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    origin = record.getMessage() if self.in_message else record.pathname
    return not ("orbax" in origin and error is not None and _is_write_failure(error))


class _QuietLostProcess(logging.Filter):
  """A save whose cross-process barrier failed because another process is gone is logged by orbax's threads
  with a traceback; the process then ends with one line naming the lost process (`distributed.lost_process`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not ("orbax" in record.pathname and error is not None and distributed.lost_process(error, 0, 2))


logging.getLogger("absl").addFilter(_QuietUnrankedSaves())
logging.getLogger("absl").addFilter(_QuietWriteFailures())
logging.getLogger("asyncio").addFilter(_QuietWriteFailures(in_message=True))
logging.getLogger("absl").addFilter(_QuietLostProcess())


class _ClosedLoopNoiseDropped:
  """``sys.stderr`` without the tracebacks of reads (writes) that end after their restore (save) failed.

  When one array of a damaged checkpoint fails to read (or to be written, on a full disk), orbax raises and closes
  the asyncio loop while tensorstore still completes the other arrays; each then fails to reach the closed loop,
  and tensorstore prints a ``RuntimeError: Event loop is closed`` traceback (from its threads, line by line, at
  any moment). The failure is reported in one line (`restore_latest_intact`, `CheckpointWriteError`). Every other
  line passes unchanged; a partial line waits only while it could begin one of those tracebacks."""

  _TRACEBACK = "Traceback (most recent call last):"
  _FRAME = re.compile(r'  File ".*asyncio[/\\]base_events\.py", line \d+, in (call_soon_threadsafe|_check_closed)$')
  _BODY = ("    self._check_closed()", "    raise RuntimeError('Event loop is closed')")
  _END = "RuntimeError: Event loop is closed"

  def __init__(self, stream):
    self.stream, self._lock = stream, threading.Lock()
    self._partial, self._held, self._open = "", 0, 0

  def write(self, text: str) -> int:
    with self._lock:
      self._partial += text
      *lines, self._partial = self._partial.split("\n")
      out = "".join(self._line(line) for line in lines)
      if self._partial and not self._could_begin_noise(self._partial):
        out, self._partial = out + self._partial, ""
      if out:
        self.stream.write(out)
    return len(text)

  def _could_begin_noise(self, partial: str) -> bool:
    fixed = (self._TRACEBACK, self._END, *self._BODY, '  File "')
    return partial.startswith('  File "') or any(k.startswith(partial) for k in fixed)

  def _line(self, line: str) -> str:
    if line == self._TRACEBACK:
      self._held += 1
      return ""
    if self._held and self._FRAME.match(line) and line.endswith("call_soon_threadsafe"):
      self._held, self._open = self._held - 1, self._open + 1
      return ""
    if self._open and (self._FRAME.match(line) or line in self._BODY):
      return ""
    if self._open and line == self._END:
      self._open -= 1
      return ""
    held, self._held = self._held, 0
    return (self._TRACEBACK + "\n") * held + line + "\n"

  def __getattr__(self, name: str) -> Any:
    return getattr(self.stream, name)


def _drop_closed_loop_noise() -> None:
  """Filters ``sys.stderr`` from now on (once per process): a failed restore's or save's I/O can end at any time."""
  if not isinstance(sys.stderr, _ClosedLoopNoiseDropped):
    sys.stderr = _ClosedLoopNoiseDropped(sys.stderr)


class CheckpointWriteError(OSError):
  """A checkpoint could not be written; the message names the folder, the round and the cause."""


def _write_error(directory: Any, step: int | None, error: BaseException) -> CheckpointWriteError:
  which = f"the checkpoint of round {step}" if step is not None else "a checkpoint"
  path = failed_path(error)
  where = f" ({path})" if path and path.strip("'") != str(directory) else ""
  return CheckpointWriteError(f"cannot write {which} in {str(directory)!r}{where}: {reason(error)}")


# tensorstore reports a failed write as a status in the text of a ValueError, not as an OSError.
_STORAGE_STATUSES = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "No space left on device", "Read-only file system")


def _is_write_failure(error: BaseException) -> bool:
  """Whether ``error`` (or a cause) is the file system refusing a write, as opposed to a misuse of orbax."""
  chain, seen = error, set()
  while chain is not None and id(chain) not in seen:
    seen.add(id(chain))
    if any(status in str(chain) for status in _STORAGE_STATUSES):
      return True
    chain = chain.__cause__ or chain.__context__
  return root_os_error(error) is not None


def _let_waiting_threads_go() -> None:
  """Ends orbax's save threads that wait for a signal from a save that failed (they would wait 300 s each,
  and the interpreter waits for them at exit). Best effort: orbax's thread class is private."""
  from orbax.checkpoint._src.futures import future as orbax_future
  for thread in threading.enumerate():
    if isinstance(thread, getattr(orbax_future, "_SignalingThread", ())) and thread.is_alive():
      try:
        thread.cancel()
        orbax_future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
      except Exception:  # noqa: BLE001 - another orbax version: the error is still reported
        pass


class _Manager(ocp.CheckpointManager):
  """orbax's manager, whose failed writes raise one `CheckpointWriteError` and leave no thread waiting."""

  def wait_until_finished(self) -> None:
    try:
      super().wait_until_finished()
    except Exception as e:
      if not _is_write_failure(e):
        raise
      _let_waiting_threads_go()
      raise _write_error(self.directory, None, e) from e

  def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
    try:
      return super().save(step, *args, **kwargs)
    except CheckpointWriteError:
      raise
    except Exception as e:
      if not _is_write_failure(e):
        raise
      _let_waiting_threads_go()
      raise _write_error(self.directory, step, e) from e


def manager(output_dir: str, every: int = 1, keep: int = 2) -> ocp.CheckpointManager:
  """The results folder's checkpoint manager (``checkpoints/``), saving every ``every`` rounds.

  It keeps the ``keep`` latest checkpoints and, besides them, the one with the best mean test accuracy
  (`save` with ``accuracy``), so that a run which diverges still has its best state. Opening it reads every
  checkpoint's metadata, and fails on a damaged one: a resumed run calls `restore_latest_intact` first.
  """
  best = ocp.checkpoint_managers.BestN(get_metric_fn=lambda metrics: metrics[BEST_METRIC], n=1,
                                       keep_checkpoints_without_metrics=False)
  policy = ocp.checkpoint_managers.AnyPreservationPolicy([ocp.checkpoint_managers.LatestN(keep), best])
  # best_fn too: without it orbax's best_step() is the latest step and the metrics are not written to disk, so a
  # manager that reopens the folder (a resumed run) would see no best at all.
  options = ocp.CheckpointManagerOptions(save_interval_steps=every, preservation_policy=policy,
                                         best_fn=lambda metrics: metrics[BEST_METRIC], best_mode="max")
  _drop_closed_loop_noise()  # (before any save: a failed save's other writes can end after orbax closed its loop)
  return _Manager(_root(output_dir), options=options)


def _root(output_dir: str) -> str:
  return os.path.abspath(os.path.join(output_dir, "checkpoints"))


def state_tree(state: ServerState) -> dict[str, Any]:
  """Everything a resumed run needs, as nested dicts of arrays (the round is the checkpoint's step)."""
  return serialization.to_state_dict({"models": state.models, "steps": state.steps, "sampler": state.sampler,
                                      "memory": state.memory})


def save(checkpoints: ocp.CheckpointManager, state: ServerState, force: bool = False,
         accuracy: float | None = None) -> bool:
  """Saves at ``state.round`` if the manager's interval (or ``force``) says so; ``accuracy`` (the round's mean
  test accuracy) ranks it for keeping the best. Returns whether it saved; the save finishes in the background
  (``checkpoints.wait_until_finished()``)."""
  metrics = None if accuracy is None else {BEST_METRIC: float(accuracy)}
  tree = state_tree(state)
  if force or checkpoints.should_save(state.round):
    check_room(str(checkpoints.directory), state.round, sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))
  return checkpoints.save(state.round, args=ocp.args.StandardSave(tree), force=force, metrics=metrics,
                          custom_metadata={ROUND_KEY: int(state.round), LAYOUT_KEY: STATE_LAYOUT})


# Room a checkpoint needs beyond its arrays' bytes (orbax's metadata files and file blocks), and the key of its
# recorded round.
_MARGIN_BYTES, _MARGIN_FACTOR = 64 << 10, 1.1
ROUND_KEY = "round"
# The layout of the server state a checkpoint holds: 2 since client memory is one entry per client term (before:
# a dict by term name, as in the checkpoints of Scaffold and MOON runs written before then).
LAYOUT_KEY, STATE_LAYOUT = "state_layout", 2


def check_room(directory: str, step: int, nbytes: int) -> None:
  """Raises `CheckpointWriteError` unless ``directory`` takes a new folder and has room for ``nbytes``: checked
  before orbax's threads start, so the common failures (no permission, an immutable or read-only folder, a
  full disk) stop the run at once."""
  try:
    os.makedirs(directory, exist_ok=True)
    os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=directory))
    stats = os.statvfs(directory)
  except OSError as e:  # (the probe's own name would only confuse: the folder is named)
    raise _write_error(directory, step, OSError(e.errno, e.strerror)) from None
  free, needed = stats.f_bavail * stats.f_frsize, int(nbytes * _MARGIN_FACTOR) + _MARGIN_BYTES
  if free < needed:
    raise CheckpointWriteError(f"cannot write the checkpoint of round {step} in {directory!r}: No space left on "
                               f"device (ENOSPC; it needs about {needed / 1e6:.1f} MB, {free / 1e6:.1f} MB are free; "
                               "free some space or choose another --output-dir)")


def best_step(checkpoints: ocp.CheckpointManager) -> int | None:
  """The kept checkpoint with the best mean test accuracy, if any was saved with one."""
  return checkpoints.best_step()


def restore(checkpoints: ocp.CheckpointManager, step: int, template: ServerState) -> ServerState:
  """The checkpoint of round ``step``, shaped and typed like ``template`` (e.g. the simulation's initial state)."""
  _check_step_files(str(checkpoints.directory), step)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  try:
    restored = checkpoints.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:
    raise _older_layout(str(checkpoints.directory), step, e) or e
  return _from_tree(step, restored, template)


def _older_layout(root: str, step: int, error: BaseException) -> ValueError | None:
  """The error to raise for a checkpoint that did not restore, if an earlier version wrote it (else None)."""
  path = os.path.join(root, str(step), _METADATA)
  try:
    with open(path) as f:
      layout = (json.load(f).get("custom_metadata") or {}).get(LAYOUT_KEY)
  except (OSError, ValueError, AttributeError):
    return None
  if layout == STATE_LAYOUT:
    return None
  return ValueError(f"the checkpoint of round {step} was written by an earlier version of fedjax_hetero, whose "
                    "server state had another layout (client memory by term name); it cannot be restored: start "
                    f"the run again ({first_line(error, 200)})")


def _from_tree(step: int, restored: Any, template: ServerState) -> ServerState:
  parts = {"models": template.models, "steps": template.steps, "sampler": template.sampler,
           "memory": template.memory}
  parts = serialization.from_state_dict(parts, restored)
  return ServerState(int(step), parts["models"], parts["steps"], parts["sampler"], parts["memory"])


def restore_latest(checkpoints: ocp.CheckpointManager, template: ServerState) -> ServerState:
  """The latest checkpoint, shaped and typed like ``template``; raises ValueError if there is none."""
  step = checkpoints.latest_step()
  if step is None:
    raise ValueError(f"no checkpoint in {checkpoints.directory}")
  return restore(checkpoints, step, template)


# The JSON files a manager reads when it opens a folder (the step's metadata and its metrics).
_METADATA = "_CHECKPOINT_METADATA"
_OPENED_FILES = (_METADATA, os.path.join("metrics", "metrics"))


def _check_step_files(root: str, step: int) -> None:
  """Raises ValueError if a JSON file of checkpoint ``step`` does not parse, or the round it records is not
  ``step`` (a renamed or copied folder); checkpoints of older versions record none."""
  for name in _OPENED_FILES:
    path = os.path.join(root, str(step), name)
    if not os.path.exists(path):
      continue
    with open(path) as f:
      content = json.load(f)
    recorded = (content.get("custom_metadata") or {}).get(ROUND_KEY) if isinstance(content, dict) else None
    if name == _METADATA and recorded is not None and recorded != step:
      raise ValueError(f"it records round {recorded}, but its folder is named {step}")


# The temporary folder of a save that did not finish (a process killed during it): orbax's ``3.orbax-checkpoint-tmp``
# (some versions add ``-<timestamp>``), renamed to ``3`` only once the whole checkpoint is written.
_UNFINISHED_SAVE = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")


def _remove_unfinished_saves(root: str, log: Callable[[str], None]) -> None:
  """Removes what interrupted saves left in ``root``, one line each (orbax warned about it at the next save of
  the round, or kept it for good)."""
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    if _UNFINISHED_SAVE.match(name):
      shutil.rmtree(path, ignore_errors=True)
      if not os.path.exists(path):  # (one that cannot be removed: orbax's next save of the round names the cause)
        log(f"removed {path}: a checkpoint save that did not finish (the process ended during it)")


def restore_latest_intact(output_dir: str, template: ServerState,
                          warn: Callable[[str], None]) -> ServerState | None:
  """The newest checkpoint of a results folder that restores, read without a manager (which fails to open on a
  damaged one), once the leftovers of unfinished saves are removed. Each newer one that does not restore, and each
  older one without its metadata (deleted partway), is named in a warning and moved to ``damaged_checkpoints/``
  (kept for inspection; its rounds are trained again). None if there is no checkpoint; if none restores, raises
  ValueError and moves nothing (a failure shared by all of them is not damage)."""
  root = _root(output_dir)
  if os.path.isdir(root) and jax.process_index() == 0:
    _remove_unfinished_saves(root, warn)
  steps = sorted((int(name) for name in os.listdir(root) if name.isdigit()), reverse=True) \
      if os.path.isdir(root) else []
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  failures: list[tuple[int, Exception]] = []
  if steps:  # (before the first try: a failed read's noise can come before its error does)
    _drop_closed_loop_noise()
  for step in steps:
    try:
      _check_step_files(root, step)
      restored = ocp.StandardCheckpointer().restore(os.path.join(root, str(step), "default"), abstract)
    except Exception as e:  # orbax raises many kinds (ValueError, OSError, tensorstore's, msgpack's)
      failures.append((step, _older_layout(root, step, e) or e))
      continue
    has_metadata = lambda s: os.path.exists(os.path.join(root, str(s), _METADATA))
    if has_metadata(step):  # (an older one without it was being deleted as the run stopped: orbax would warn)
      failures += [(s, ValueError(f"no {_METADATA}: deleted partway?")) for s in steps[steps.index(step) + 1:]
                   if not has_metadata(s)]
    for damaged, error in failures:
      source = os.path.join(root, str(damaged))
      target = os.path.join(os.path.dirname(root), "damaged_checkpoints", str(damaged))
      if jax.process_index() == 0:  # every process of a multi-process run finds the same damage; one moves it
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(source, target)
      warn(f"warning: checkpoint {source} cannot be restored ({first_line(error, 300)}); moved it to {target} and "
           f"resumed from round {step}")
    return _from_tree(step, restored, template)
  if failures:
    raise ValueError(f"no checkpoint in {root} can be restored (rounds {', '.join(map(str, steps))}; the newest: "
                     f"{first_line(failures[0][1], 300)}); nothing was moved")
  return None


def drop_after(checkpoints: ocp.CheckpointManager, step: int) -> None:
  """Deletes the checkpoints of rounds after ``step`` (a rolled-back trajectory), so the rounds can be saved again."""
  checkpoints.wait_until_finished()
  for later in [s for s in checkpoints.all_steps() if s > step]:
    checkpoints.delete(later)
