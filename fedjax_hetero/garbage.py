"""Python's full garbage collections deferred while a run sets up, traces and trains.

Tracing a round builds a heap of Python objects (jaxprs, tracers, Flax scopes) that lives until the program is
lowered. CPython collects its oldest generation after every tenth collection of the middle one, each time walking
every object the process tracks: while that heap grows, it is walked again and again (in a run's setup and first
call on a warm compilation cache, nine full collections took 1.3 s of about 6.5; docs/performance.md). Deferred, the
full collections come a hundred times less often; the young generations are collected as before, and reference
counting frees the rest at once. A run (`runner.run_checked`, a job's `jobs.run_together`) and each
`Simulation.run_call` defer them throughout: what the rounds leave for a full collection is little (the demo's
peak memory over 100 rounds was the same). A Python whose collector has no such generations ignores the setting.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

FULL_COLLECTION_EVERY = 1000  # middle-generation collections between two full ones while deferred (CPython: 10)

_lock = threading.Lock()  # (a run traces on threads of its own: `compilation.compile_beside`)
_depth = 0
_thresholds: tuple[int, ...] = ()


@contextlib.contextmanager
def deferred_full_collections(every: int = FULL_COLLECTION_EVERY) -> Iterator[None]:
  """Within the block, a full collection after at least ``every`` collections of the middle generation; the
  thresholds before it are restored at its end. Blocks may nest and overlap across threads: the outermost
  one's end restores."""
  global _depth, _thresholds
  with _lock:
    if _depth == 0:
      _thresholds = gc.get_threshold()
      gc.set_threshold(*_thresholds[:2], max(_thresholds[2], every))
    _depth += 1
  try:
    yield
  finally:
    with _lock:
      _depth -= 1
      if _depth == 0:
        gc.set_threshold(*_thresholds)
