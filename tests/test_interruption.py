"""A Ctrl-C or SIGTERM whose `KeyboardInterrupt` lands inside a callback Python runs for itself (jax runs one at every
garbage collection): it still stops the command. (Found by hand: a Ctrl-C two seconds into ``python -m
experiments.fmnist --preset inco-cpu`` printed "Exception ignored in: <function _xla_gc_callback ...>" and the run
trained to its end with status 0.)"""

from __future__ import annotations

import gc
import signal
import sys
import time

import pytest

from fedjax_hetero.run.interruption import StopRequests, one_line_on_signals
from tests.helpers import sigint_as_from_a_terminal


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
