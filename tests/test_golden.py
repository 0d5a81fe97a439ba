"""Golden regression: every method reproduces, bit for bit, the per-round record in golden_methods.json.

The record (``python -m tests.golden``) was made with the engine as it was before the method API
was rebuilt; a change that alters any method's numbers on either backend fails here, naming the
method, backend, round and quantity. Every entry also checks that rounds 2 on compile nothing
(evaluation included): each group's programs compile once, in the first round.
"""

from __future__ import annotations

import json

import jax
import pytest

from tests import golden

with open(golden.GOLDEN_PATH) as f:
  RECORD = json.load(f)


@pytest.mark.parametrize("entry", list(golden.entries()), ids=lambda e: golden.key(*e))
def test_method_reproduces_its_golden_record(entry):
  expected = RECORD["runs"][golden.key(*entry)]
  if jax.__version__ != RECORD["jax"]:
    pytest.skip(f"the record was made with jax {RECORD['jax']}; this is {jax.__version__}: rerun "
                "`python -m tests.golden` on the commit before your change to compare like with like")
  compiled = []
  got = golden.record(*entry, compiled=compiled)
  for round_index, (want, have) in enumerate(zip(expected, got), start=1):
    for name in want:
      assert have[name] == want[name], f"{golden.key(*entry)} round {round_index}: {name} differs"
  assert compiled[0], "the first round compiles the programs"
  for round_index, names in enumerate(compiled[1:], start=2):
    assert not names, f"{golden.key(*entry)} round {round_index} compiled {names}"
