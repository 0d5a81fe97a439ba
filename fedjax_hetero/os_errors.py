"""One line for an operating-system error: the path it concerns and the cause, as the CLI prints it.

Libraries wrap the `OSError` that stopped them (orbax in its own exceptions, matplotlib in a `ValueError`
at times), so `describe` looks down an error's chain of causes for the first one that says which file and
which errno. `StdoutLog` prints the CLI's lines on a stdout whose reader may go away (``| head``).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import Iterator


# What a user can do about the commonest causes.
_ADVICE = {errno.ENOSPC: "free some space or choose another --output-dir",
           errno.EDQUOT: "free some space or choose another --output-dir",
           errno.EROFS: "the file system is mounted read-only; choose another --output-dir",
           errno.EACCES: "check the permissions (and for chattr +i: lsattr)",
           errno.EPERM: "check the permissions (and for chattr +i: lsattr)",
           errno.ENAMETOOLONG: "a path component may hold at most 255 bytes",
           errno.EPIPE: "the reader of a pipe went away, as stdout's does with `| head`"}


def _chain(error: BaseException) -> Iterator[BaseException]:
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def root_os_error(error: BaseException) -> OSError | None:
  """The first error in ``error``'s chain of causes that carries an errno, if any."""
  return next((e for e in _chain(error) if isinstance(e, OSError) and e.errno is not None), None)


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return lines[0] if lines else type(error).__name__


# tensorstore (orbax's array writer) puts the errno in the text of a ValueError: "... [os_error_code='28']".
_TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")


def _errno_in_text(error: BaseException) -> int | None:
  return next((int(m.group(1)) for e in _chain(error) if (m := _TENSORSTORE_ERRNO.search(str(e)))), None)


def reason(error: BaseException) -> str:
  """The cause of an OS error without its path: ``Operation not permitted (EPERM; check the permissions ...)``;
  the first line of any other error."""
  cause = root_os_error(error)
  number = cause.errno if cause is not None else _errno_in_text(error)
  if number is None:
    return _first_line(error)
  strerror = (cause.strerror or _first_line(cause)) if cause is not None else os.strerror(number)
  code = errno.errorcode.get(number, str(number))
  advice = _ADVICE.get(number)
  return f"{strerror} ({code}" + (f"; {advice})" if advice else ")")


def failed_path(error: BaseException) -> str | None:
  """The path (or ``'a' -> 'b'`` for a rename) an OS error in ``error``'s chain concerns, if it says."""
  cause = root_os_error(error)
  if cause is None or cause.filename is None:
    return None
  return " -> ".join(repr(str(p)) for p in (cause.filename, cause.filename2) if p is not None)


def describe(error: BaseException, context: str = "") -> str:
  """``'/runs/x/metrics.jsonl': Operation not permitted (EPERM; check the permissions ...)``. An `OSError`
  without an errno (ours, such as `checkpoints.CheckpointWriteError`, whose message names the path and the
  cause) gives its message; a `MemoryError` says what to lower. ``context`` (e.g. the results folder) follows
  an error that names no path (a write to an open stream: matplotlib's savefig)."""
  if isinstance(error, MemoryError):
    return (f"out of memory while allocating arrays ({_first_line(error)}); lower --max-train-samples, "
            "--batch-size or the number of clients, or use a machine with more memory")
  if isinstance(error, OSError) and error.errno is None:
    return _first_line(error)
  path = failed_path(error)
  if path:
    return f"{path}: {reason(error)}"
  broken_pipe = (root_os_error(error) or OSError()).errno == errno.EPIPE  # (the reader's doing, not the context's)
  return reason(error) + (f" {context}" if context and not broken_pipe else "")


class StdoutLog:
  """The CLI's lines on stdout (a `print` flushed at once), surviving a reader that goes away (``| head -1``).

  At the first broken pipe, ``stdout_closed`` turns true: a training run then stops as on SIGPIPE, its state
  saved (`interruption.StopRequests.agree`); stdout's descriptor is pointed at /dev/null (so that no later
  flush, Python's at exit included, fails again) and the lines that follow, the run's resume hint among them,
  go to stderr. The line that met the closed pipe is dropped: its reader wanted no more."""

  def __init__(self):
    self.stdout_closed = False

  def __call__(self, line: str) -> None:
    if self.stdout_closed:
      print(line, file=sys.stderr, flush=True)
      return
    try:
      print(line, flush=True)
    except BrokenPipeError:
      self.stdout_closed = True
      point_at_devnull(sys.stdout)


def point_at_devnull(stream) -> None:
  """Points ``stream``'s descriptor at /dev/null: what it still buffers, and writes to come, go nowhere."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
  except (OSError, ValueError):  # (a stream without a descriptor: nothing flushes to the closed pipe later)
    pass
