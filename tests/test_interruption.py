"""A Ctrl-C or SIGTERM whose `KeyboardInterrupt` lands inside a callback Python runs for itself (jax runs one at every
garbage collection): it still stops the command. (Found by hand: a Ctrl-C two seconds into ``python -m
experiments.fmnist --preset inco-cpu`` printed "Exception ignored in: <function _xla_gc_callback ...>" and the run
trained to its end with status 0.)"""

from __future__ import annotations

import concurrent.futures
import gc
import signal
import subprocess
import sys
import threading
import time

import pytest

from fedjax_hetero import compilation
from fedjax_hetero.run.interruption import StopRequests, one_line_on_signals
from tests.helpers import sigint_as_from_a_terminal, tiny_simulation


def signal_inside_a_gc_callback(signum: int) -> None:
  """Sends ``signum`` from inside the next garbage collection's callback, so that its handler raises there."""
  sent = []

  def callback(phase, info):
    if phase == "start" and not sent:
      sent.append(signum)
      signal.raise_signal(signum)
      sent.append("the handler did not raise in the callback")

  gc.callbacks.append(callback)
  try:
    gc.collect()
  finally:
    gc.callbacks.remove(callback)
  assert sent == [signum], sent  # (the test's premise: Python swallowed the handler's exception)


def python_for(seconds: float) -> None:
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    time.sleep(0.001)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_swallowed_by_a_callback_still_ends_the_command_in_one_line(signum, capsys):
  hook = sys.unraisablehook
  with sigint_as_from_a_terminal(), pytest.raises(SystemExit) as info, one_line_on_signals():
    signal_inside_a_gc_callback(signum)
    python_for(5.0)
  assert info.value.code == 128 + signum
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [f"{signal.Signals(signum).name}: stopped with no round in progress; to go on, "
                                      "run the same command with --resume-or-start"], err  # (no "Exception ignored")
  assert sys.unraisablehook is hook


def test_a_second_ctrl_c_swallowed_by_a_callback_still_abandons_the_round(capsys):
  logs = []
  with sigint_as_from_a_terminal(), pytest.raises(KeyboardInterrupt), StopRequests(logs.append) as stop:
    signal.raise_signal(signal.SIGINT)
    assert stop.requested == signal.SIGINT
    signal_inside_a_gc_callback(signal.SIGINT)
    python_for(5.0)
  assert "Exception ignored" not in capsys.readouterr().err


def test_other_exceptions_in_callbacks_are_reported_as_before(monkeypatch):
  class Finalized:
    def __del__(self):
      raise ValueError("from a finalizer")

  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)
  with one_line_on_signals():
    Finalized()
  assert [r.exc_type for r in reported] == [ValueError]


# ------------------------------------------------------------------------------ a signal while a program compiles
# (Found by hand: a Ctrl-C 6 s into ``python -m experiments.fmnist --preset inco-cpu --round-program union
# --compile-cache off`` on a busy 2-core VM printed its line and the process ended 112 s later, after the first
# call's compile and 10 rounds.)


def test_compile_threads_left_by_an_exception_do_not_wait_for_their_jobs():
  release = threading.Event()
  t0 = time.monotonic()
  with pytest.raises(KeyboardInterrupt):
    with compilation.compile_threads(2) as submit:
      jobs = [submit(release.wait, 30) for _ in range(3)]  # (the third never starts: dropped)
      assert compilation.compiling()
      raise KeyboardInterrupt
  assert time.monotonic() - t0 < 5 and jobs[2].cancelled() and compilation.compiling()
  release.set()
  concurrent.futures.wait(jobs[:2])
  assert not compilation.compiling()


def test_a_stop_requested_while_the_first_call_compiles_returns_no_round():
  sim = tiny_simulation("HeteroAvg", round_program="fused")
  state = sim.init_state()
  compiling = concurrent.futures.Future()
  sim._compiling["first call"] = compiling  # (a compile that has not ended)
  t0 = time.monotonic()
  after, rows = sim.run_call(state, 1, (), stop_requested=lambda: True)
  assert time.monotonic() - t0 < 5 and after is state and rows == []
  compiling.set_result(None)  # the compile ended: the next call runs
  after, rows = sim.run_call(state, 1, (), stop_requested=lambda: False)
  assert after.round == 1 and len(rows) == 1 and "first call" not in sim._compiling
  asked = []  # a call compiling its own program: a stop asked meanwhile is seen once it is compiled
  assert sim.run_call(after, 2, (), stop_requested=lambda: asked.append(1) or True) == (after, []) and asked == [1]


STOPPED_WHILE_COMPILING = """
import os, signal, threading, time
from fedjax_hetero import compilation
from fedjax_hetero.run.interruption import one_line_on_signals
with one_line_on_signals():
  compilation.in_background(lambda: threading.Event().wait(60))  # (a compile that XLA cannot stop)
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(60)
"""


def test_a_command_stopped_by_a_signal_ends_without_waiting_for_a_compile():
  t0 = time.monotonic()
  # (A suite started in the background passes SIGINT on ignored, and the child's kill would then do nothing.)
  with sigint_as_from_a_terminal():
    done = subprocess.run([sys.executable, "-c", STOPPED_WHILE_COMPILING], capture_output=True, text=True,
                          timeout=50)
  assert done.returncode == 130 and time.monotonic() - t0 < 30, (done.returncode, done.stderr)
  assert done.stderr.strip().endswith("SIGINT: stopped with no round in progress; to go on, run the same command "
                                      "with --resume-or-start"), done.stderr


def test_a_signal_names_the_rounds_it_waits_for():
  logs = []
  for rounds in (range(3, 4), range(11, 21)):
    with sigint_as_from_a_terminal(), StopRequests(logs.append) as stop:
      assert stop.calling(rounds)() is False  # (a single process: the call can end early)
      signal.raise_signal(signal.SIGINT)
      assert stop.calling(rounds)() is True
  assert logs == ["SIGINT: stopping after round 3 (Ctrl-C again to stop at once)",
                  "SIGINT: stopping after rounds 11-20, one program call (Ctrl-C again to stop at once)"], logs
