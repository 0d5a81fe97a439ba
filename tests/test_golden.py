"""Golden regression: every method reproduces, bit for bit, the per-round record in golden_methods.json.

The record (``python -m tests.golden``) was made with the engine as it was before the method API
was rebuilt; a change that alters any method's numbers on either backend fails here, naming the
method, backend, round and quantity. The file holds one record per CPU signature (see `tests.golden`): on a
CPU without its own record the numbers are compared within `golden.TOLERANCE` instead of bit for bit. Every
entry also checks that rounds 2 on compile nothing (evaluation included): each group's programs compile once,
in the first round.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests import golden

with open(golden.GOLDEN_PATH) as f:
  RECORD = json.load(f)
SIGNATURE = golden.signature()
OWN = next((r for r in RECORD["records"] if r["cpu"] == SIGNATURE), None)
# Why the whole module skips on another jax version; tests/conftest.py repeats it under the summary line.
SKIP_REASON = (None if jax.__version__ == RECORD["jax"] else
               f"golden record skipped: it was made with jax {RECORD['jax']}, this is jax {jax.__version__}; rerun "
               "`python -m tests.golden` on the commit before your change to compare like with like")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]
# What each entry's run produced in this process (`golden.record` is deterministic): the foreign-record check
# below reads its entry from here when the parametrized test already ran it, instead of training it again.
RUNS: dict[str, list] = {}


def assert_close(want, have, method: str, where: str) -> None:
  """A foreign CPU's numbers against a record: same clients, numbers within `golden.TOLERANCE`."""
  tol = golden.TOLERANCE
  assert (have["clients"], have["examples"]) == (want["clients"], want["examples"]), f"{where}: clients differ"
  if method in golden.CPU_SENSITIVE:
    return
  np.testing.assert_allclose(have["train_loss"], want["train_loss"], rtol=tol["loss"], err_msg=where)
  for group, loss in want["train_loss_per_group"].items():
    np.testing.assert_allclose(have["train_loss_per_group"][group], loss, rtol=tol["loss"], err_msg=where)
  for group, acc in want["test_accuracy"].items():
    np.testing.assert_allclose(have["test_accuracy"][group], acc, atol=tol["accuracy"], err_msg=where)
  for group, model in want["models"].items():
    np.testing.assert_allclose(have["models"][group]["sum"], model["sum"], rtol=tol["parameter_sum"], err_msg=where)


def expected_runs(entry) -> list:
  """The record of ``entry`` this machine is compared with (`golden.expected`; skips if no record has it)."""
  runs = golden.expected(RECORD["records"], golden.key(*entry), SIGNATURE)
  if runs is None:
    pytest.skip(f"no CPU's record has {golden.key(*entry)}: run `python -m tests.golden --missing`")
  return runs


# The vmap backend's entries the host loop runs: one per kind of federation (shared, per group with client memory,
# stacked) and CluSamp (host-side sampler). The others' vmap records hold the device program's mapping to the
# record (tests/test_round_program.py), which maps every cohort as the vmap backend does.
VMAP_ENTRIES = ("HeteroAvg", "InCoScaffold", "FedCross", "CluSamp")
ENTRIES = [e for e in golden.entries() if e[1] != "vmap" or e[0] in VMAP_ENTRIES]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: golden.key(*e))
def test_method_reproduces_its_golden_record(entry):
  expected = expected_runs(entry)
  compiled = []
  got = golden.record(*entry, compiled=compiled)
  RUNS[golden.key(*entry)] = got
  for round_index, (want, have) in enumerate(zip(expected, got), start=1):
    if OWN is None or golden.key(*entry) not in OWN["runs"]:
      assert_close(want, have, entry[0], f"{golden.key(*entry)} round {round_index} (CPU {SIGNATURE} has no record "
                   "of its own: compared within tolerance)")
      continue
    for name in want:
      assert have[name] == want[name], f"{golden.key(*entry)} round {round_index}: {name} differs"
  assert compiled[0], "the first round compiles (at least its own server program: equal trainers share theirs)"
  for round_index, names in enumerate(compiled[1:], start=2):
    assert not names, f"{golden.key(*entry)} round {round_index} compiled {names}"


# The record runs one local step per jitted call (one step program per group, the library's default). Steps grouped
# into unrolled chunks of 3 with single-step tails (`LocalConfig.steps_per_call`; the clients take even step counts
# here, 2 epochs, so a chunk of 2 would leave no tail) must give the same bits: a client memory's round on the
# sequential backend, a stacked cohort on the vmap backend.
CHUNKED_ENTRIES = [("HeteroScaffold", "sequential", "mlp"), ("HeteroAvg", "vmap", "mlp")]


@pytest.mark.default_emitters  # (XLA:CPU's older emitters fuse a chunk's three steps into other bits)
@pytest.mark.parametrize("entry", CHUNKED_ENTRIES, ids=lambda e: golden.key(*e))
def test_local_steps_in_chunks_of_three_reproduce_the_golden_record(entry):
  expected = expected_runs(entry)
  got = golden.record(*entry, steps_per_call=3)
  for round_index, (want, have) in enumerate(zip(expected, got), start=1):
    if OWN is None or golden.key(*entry) not in OWN["runs"]:
      assert_close(want, have, entry[0], f"{golden.key(*entry)} round {round_index}, steps in chunks of 3")
      continue
    assert have == want, f"{golden.key(*entry)} round {round_index}: steps in chunks of 3 differ"


def test_another_cpus_record_holds_within_tolerance():
  """The comparison a CPU without a record of its own gets, against another CPU's record (one cheap entry)."""
  foreign = next((r for r in RECORD["records"] if r["cpu"] != SIGNATURE), None)
  if foreign is None:
    pytest.skip("no record of another CPU")
  entry = ("FedAvg", "sequential", "mlp")
  got = RUNS.get(golden.key(*entry)) or golden.record(*entry)
  assert len(got) == len(foreign["runs"][golden.key(*entry)]) == golden.ROUNDS
  for round_index, (want, have) in enumerate(zip(foreign["runs"][golden.key(*entry)], got), 1):
    assert_close(want, have, entry[0], f"{golden.key(*entry)} round {round_index} against CPU {foreign['cpu']}")
