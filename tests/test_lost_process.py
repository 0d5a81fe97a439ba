"""A multi-process run whose collective fails because another process is gone ends with one line naming it
(`fedjax_hetero.distributed.lost_process`, `lost_process_named`, `exit_on_failure`); the launches that kill a
process for real are tests/test_distributed.py's."""

from __future__ import annotations

import jax
import pytest

from fedjax_hetero import distributed

# What process 0 of 2 caught when process 1 got kill -9 (jax 0.10.2): in a tiny fmnist run under `experiments.launch`,
# gloo's read in orbax's barrier (a JaxRuntimeError) and jax's coordination service once process 1's heartbeats
# stopped (orbax's TimeoutError on top of it); in a bare 2-process script, gloo in `process_allgather` (a ValueError);
# under `experiments.launch` 2 x 1 (probe P78), gloo in a round's all-reduce, at `block_until_ready`.
GLOO_RESET = jax.errors.JaxRuntimeError(
    "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:43905: "
    "Connection reset by peer")
GLOO_CLOSED = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection "
                         "closed by peer [127.0.0.1]:4253")
GLOO_ALL_REDUCE = jax.errors.JaxRuntimeError(
    "INTERNAL: Error dispatching computation: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
    "Read error [127.0.0.1]:52221: Connection reset by peer")
HEARTBEAT = jax.errors.JaxRuntimeError(
    "INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout. This indicates "
    "that the remote task has failed, got preempted, or crashed unexpectedly. Check the task logs for an earlier "
    "error or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow."
    "CoordinationServiceError='']. Barrier Id: ThreadSaveMultiHostValueHolder:set_v\n\nRPC: /xla.coordination."
    "CoordinationService/Barrier")
ORBAX_TIMEOUT = TimeoutError("Timed out while waiting for async_write_complete barrier.")
ORBAX_TIMEOUT.__cause__ = HEARTBEAT
RESUME = ("; it was killed or crashed (see its output). To continue, start the run again with --resume, every "
          "process: it goes on from the last checkpoint they all saved")
RESET_LINE = "process 0 of 2: process 1 stopped (gloo: Connection reset by peer, in a collective)" + RESUME


@pytest.mark.parametrize("error, processes, line", [
    (GLOO_RESET, 2, RESET_LINE),
    (GLOO_CLOSED, 2, "process 0 of 2: process 1 stopped (gloo: Connection closed by peer, in a collective)" + RESUME),
    (GLOO_ALL_REDUCE, 2, RESET_LINE),
    (GLOO_RESET, 4, "process 0 of 4: another process stopped (gloo: Connection reset by peer, in a collective)"
     + RESUME),
    (ORBAX_TIMEOUT, 4, "process 0 of 4: process 1 stopped (jax's coordination service: its heartbeats stopped)"
     + RESUME),
    (ValueError("shapes (3,) and (4,) differ"), 2, None),
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"), 2, None)])
def test_a_collective_that_lost_a_process_is_one_line_naming_it(error, processes, line):
  """(Process 0 ended with gloo's text after a traceback, or, for a ValueError, as if its input were bad.)"""
  assert distributed.lost_process(error, 0, processes) == line


@pytest.mark.parametrize("collective", ["all-reduce", "AllReduce", "AllGather", "all-gather", "ReduceScatter",
                                        "all-to-all", "collective permute", "broadcast", "barrier"])
def test_every_gloo_collective_that_lost_a_process_is_named(collective):
  """(Only one-word names were: "Gloo all-reduce failed" was not, the collective a round's sum runs.)"""
  error = jax.errors.JaxRuntimeError(f"INTERNAL: Gloo {collective} failed: [pair.cc:538] Read error [127.0.0.1]:1: "
                                     "Connection reset by peer")
  assert distributed.lost_process(error, 0, 2) == RESET_LINE


@pytest.fixture
def two_processes(monkeypatch):
  """This process as process 0 of 2, whose exit raises SystemExit with its status instead of ending pytest."""
  monkeypatch.setattr(jax, "process_index", lambda *_, **__: 0)
  monkeypatch.setattr(jax, "process_count", lambda *_, **__: 2)

  def exit_now(status):
    raise SystemExit(status)

  monkeypatch.setattr(distributed, "_exit_now", exit_now)


@pytest.mark.parametrize("named", [True, False], ids=["in_lost_process_named", "outside_it"])
def test_a_process_whose_round_lost_the_other_ends_with_one_line_and_no_traceback(named, two_processes, capsys):
  """Probe P78: `lost_process_named` let gloo's all-reduce error through, and `exit_on_failure` printed its
  traceback before its line; an error outside `lost_process_named` (after training) gets the same line."""
  with pytest.raises(SystemExit) as info:
    with distributed.exit_on_failure(True):
      if named:
        with distributed.lost_process_named():
          raise GLOO_ALL_REDUCE
      raise GLOO_ALL_REDUCE
  assert info.value.code == distributed.FAILED
  assert capsys.readouterr().err == f"error: {RESET_LINE}\n"


def test_any_other_failure_of_a_process_keeps_its_traceback(two_processes, capsys):
  with pytest.raises(SystemExit) as info:
    with distributed.exit_on_failure(True):
      raise RuntimeError("a bug")
  assert info.value.code == distributed.FAILED
  err = capsys.readouterr().err
  assert "Traceback" in err and err.endswith("error: process 0 of 2: RuntimeError: a bug\n")
