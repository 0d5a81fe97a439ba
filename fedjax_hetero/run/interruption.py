"""Stopping a run cleanly on Ctrl-C (SIGINT) or a scheduler's SIGTERM.

While a run trains, the first of those signals asks the training loop to stop after the round in progress
(`StopRequests.requested`); the runner then waits for a pending checkpoint, saves the state, writes the
summary and plot of the rounds done, says how to resume and raises `Interrupted`, which the command line turns
into exit status 130 (SIGINT) or 143 (SIGTERM) without a traceback. A second Ctrl-C abandons the round in
progress at once (the runner keeps what the last completed round left). Handlers are installed in the main
thread. The processes of a multi-process run must stop at the same round: at the end of every call they agree
(`StopRequests.agree`, one small collective), so a signal to any one of them (a scheduler's SIGTERM to one
host, the launcher's to all) stops every process after the same call, each saving its part of the checkpoint.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (its exit handler waits for its threads: registered before `_exit_now`)
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from fedjax_hetero import compilation, distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
  """The run stopped on a signal after writing its results folder; ``exit_status`` is the shell's 128 + signal."""

  def __init__(self, signum: int, completed_round: int):
    super().__init__(f"{signal.Signals(signum).name} after round {completed_round}")
    self.signum, self.completed_round = signum, completed_round

  @property
  def exit_status(self) -> int:
    return 128 + self.signum


class _Terminated(KeyboardInterrupt):
  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


_ending_status: int | None = None  # the exit status a signal ends this command with (`ending_on_signal`)
_finished = False  # the command's runs are done and written (`command_finished`)
_whole_process = False  # the command is the process's (`the_process_is_a_command`)


def ending_on_signal(status: int) -> SystemExit:
  """The `SystemExit` that ends the command on a signal, with ``status``. If a program is still compiling on a
  thread when the interpreter exits (`compilation.compiling`), the process ends then without waiting for it: XLA's
  compile cannot be stopped, and a round program's takes minutes on a busy CPU."""
  global _ending_status
  _ending_status = status
  return SystemExit(status)


def _exit_now() -> None:
  if _ending_status is not None and compilation.compiling():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_ending_status)


if hasattr(threading, "_register_atexit"):  # (private: the hook Python runs before it waits for threads at exit)
  threading._register_atexit(_exit_now)


def the_process_is_a_command() -> None:
  """Called by a command's entry point (``python -m experiments.<dataset>``, ``fedjax-hetero``) before its main: once
  its runs have finished, signals stay ignored for the rest of the process's life (`command_finished`)."""
  global _whole_process
  _whole_process = True


def command_finished() -> None:
  """The command's runs are done and their folders written: SIGINT and SIGTERM are ignored from now on, until
  `one_line_on_signals` ends, and in a command's process (`the_process_is_a_command`) while the interpreter exits too
  (joining threads, closing jax's backends and a multi-process run's connection to the others: under a second). The
  command so ends with status 0, as it would have, not 130 or 143, which a scheduler reads as a run to start again;
  an in-process caller gets its summaries. (Ended at once instead, process 0 of a multi-process run left the others
  aborting in their shutdown.)"""
  global _finished
  _finished = True
  if threading.current_thread() is threading.main_thread():
    for signum in SIGNALS:
      signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def one_line_on_signals() -> Iterator[None]:
  """Around a whole command: a Ctrl-C or SIGTERM that comes where no run's training loop holds them (while flags
  parse, data loads or a first program compiles) ends it with one line and the shell's status, not a traceback.
  A folder it leaves holds no run, or the run as far as its checkpoints go: --resume-or-start goes on from it."""
  global _ending_status, _finished
  _ending_status, _finished = None, False

  def terminated(signum: int, frame) -> None:
    raise _Terminated(signum)

  main = threading.current_thread() is threading.main_thread()
  previous = {s: signal.getsignal(s) for s in SIGNALS} if main else {}
  if main:
    signal.signal(signal.SIGTERM, terminated)
  try:
    with interrupts_not_swallowed() if main else contextlib.nullcontext():
      yield
  except Interrupted:  # (a run said how it stopped)
    raise
  except KeyboardInterrupt as e:
    if _finished:
      raise ending_on_signal(0) from None
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"{signal.Signals(signum).name}: stopped with no round in progress; to go on, run the same command with "
          "--resume-or-start", file=sys.stderr)
    raise ending_on_signal(128 + signum) from None
  finally:
    if not (_finished and _whole_process):  # (a finished command's process keeps ignoring them as it exits)
      for signum, handler in previous.items():  # (SIGINT too: `command_finished` set it)
        signal.signal(signum, handler)


@contextlib.contextmanager
def interrupts_not_swallowed() -> Iterator[None]:
  """While open (in the main thread), a signal handler's `KeyboardInterrupt` that lands inside a callback Python runs
  for itself (a garbage collection's, a finalizer, a weakref's) is delivered again once that callback has returned.
  Python reports an exception raised there and goes on ("Exception ignored in ..."), and jax runs a callback at every
  collection: a Ctrl-C during a setup that allocates a lot was then lost, and the command trained on."""
  previous = sys.unraisablehook

  def deliver_again(unraisable) -> None:
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
      return previous(unraisable)
    signum = getattr(unraisable.exc_value, "signum", signal.SIGINT)
    later = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, signum))  # (not in this hook)
    later.daemon = True
    later.start()

  sys.unraisablehook = deliver_again
  try:
    yield
  finally:
    sys.unraisablehook = previous


class StopRequests:
  """A context in which SIGINT and SIGTERM set ``requested`` (the signal number) instead of ending the process.

  Contexts nest: an inner one (a run's training) starts with what the outer one (its job) was asked, and hands
  what it was asked back when it exits, so a signal between a job's runs stops the job before its next run."""

  def __init__(self, log: Callable[[str], None]):
    self.enabled = threading.current_thread() is threading.main_thread()
    self.log, self.requested, self._previous = log, None, {}
    self.in_progress = "the round in progress"  # (what a signal waits for: a runner names its call's rounds)
    self._outer: StopRequests | None = None
    self._kept = contextlib.ExitStack()  # (`interrupts_not_swallowed`: a second Ctrl-C raises)

  def _handle(self, signum: int, frame) -> None:
    if self.requested is not None:
      if signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: abandon the round in progress
      return  # (stopping already: a SIGTERM after a Ctrl-C, as the launcher passes one on, keeps the first reason)
    self.requested = signum
    again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
    self.log(f"{signal.Signals(signum).name}: stopping after {self.in_progress}{again}")

  def __enter__(self) -> "StopRequests":
    if self.enabled:
      outer = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
      if isinstance(outer, StopRequests):
        self._outer, self.requested = outer, outer.requested
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
      self._kept.enter_context(interrupts_not_swallowed())
    return self

  def __exit__(self, *exc) -> None:
    self._kept.close()
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    if self._outer is not None and self.requested is not None:
      self._outer.requested = self.requested

  def calling(self, rounds: range) -> Callable[[], bool] | None:
    """Names the call of ``rounds`` a signal waits for; returns whether one came, for the call to end early while its
    program compiles, in a single-process run (processes stop at the same call: `agree`)."""
    first, last = rounds[0], rounds[-1]
    self.in_progress = f"round {first}" if first == last else f"rounds {first}-{last}, one program call"
    return (lambda: self.requested is not None) if jax.process_count() == 1 else None

  def agree(self, time_up: Sequence[bool]) -> tuple[int | None, tuple[bool, ...]]:
    """What every process does at the end of a call: stop on the signal any of them got (the highest number
    when they differ), and which runs' --stop-after time is up on any of them (clocks differ by process).
    Local values in a single-process run; one small collective otherwise. A closed stdout (``| head``: the log
    is an `os_errors.StdoutLog`) stops the run as SIGPIPE would."""
    if self.requested is None and getattr(self.log, "stdout_closed", False):
      self.requested = signal.SIGPIPE
      self.log("stdout was closed (broken pipe): stopping after this call, as on SIGPIPE")
    flags = distributed.max_over_processes(np.asarray([self.requested or 0, *time_up], np.int32))
    if flags[0] and self.requested is None:  # (a signal another process got)
      self.requested = int(flags[0])
      self.log(f"{signal.Signals(self.requested).name} reached another process: stopping after this call")
    return (int(flags[0]) or None), tuple(bool(f) for f in flags[1:])
