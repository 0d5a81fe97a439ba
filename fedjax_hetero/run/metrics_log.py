"""A results folder's ``metrics.jsonl`` read back, and checked: one row per round, rounds 1..n in order.

Every line is a JSON object with the keys a row has (`ROW_KEYS`), and line k holds round k. A line that is not
a row (``42``, ``{}``), a round written twice (two runs on one folder, an old copy appended) and a round
missing (a line deleted) are errors naming the file and the line: a resumed run would otherwise carry a
history that is lost or doubled, and `experiments.compare` would count it. Only a half-written last line
(a run killed while writing it) is cut off, with a warning.

`repair` (``--repair-metrics``) keeps what it can: the rows of rounds 1..k up to the first one missing,
first copy of each; it drops the rest with a note, and moves the checkpoints of rounds after k aside, so the
resumed run restores one the metrics cover and trains the later rounds again. Training is deterministic, so
the rows it writes again are the ones that were lost.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Sequence

# Keys every row has had since the first version (newer rows have more), and those the tools reading finished
# runs need (`experiments.compare`).
ROW_KEYS = ("round", "train_loss", "clients", "examples", "round_seconds", "test_accuracy")
READ_KEYS = ("round", "round_seconds")
DROPPED_CHECKPOINTS = "dropped_checkpoints"
REPAIR_HINT = ("; --resume --repair-metrics keeps the rows of the rounds before it and trains the later rounds "
               "again")

Row = dict[str, Any]


class MetricsError(ValueError):
  """metrics.jsonl is not one row per round; names the file and the line."""


def _shown(value: Any) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


def row_problem(value: Any, keys: Sequence[str] = ROW_KEYS) -> str | None:
  """Why a parsed line is not a metrics row with ``keys`` (None if it is one)."""
  if not isinstance(value, dict):
    return f"is not a metrics row but {_shown(value)}"
  missing = [key for key in keys if key not in value]
  if missing:
    return f"is not a metrics row: it has no {', '.join(missing)} ({_shown(value)})"
  number = value["round"]
  if isinstance(number, bool) or not isinstance(number, int) or number < 1:
    return f"holds round {_shown(number)}, which is not a round number (an integer >= 1)"
  if value.get("test_accuracy") is not None and not isinstance(value["test_accuracy"], dict):
    return f"holds test_accuracy {_shown(value['test_accuracy'])}, which is neither null nor an object"
  return None


def _lines(path: str) -> list[tuple[int, str]]:
  with open(path) as f:
    return [(number, line) for number, line in enumerate(f.read().splitlines(), 1) if line.strip()]


def parse(path: str, warn: Callable[[str], None] | None = None, keys: Sequence[str] = ROW_KEYS,
          hint: str = REPAIR_HINT) -> list[tuple[int, Row]]:
  """The rows of ``path`` with their line numbers; MetricsError for a line that is not JSON or not a row with
  ``keys``. A half-written last line is dropped with a warning (``warn``; without it, it is an error too)."""
  lines = _lines(path)
  rows = []
  for index, (number, line) in enumerate(lines):
    try:
      value = json.loads(line)
    except json.JSONDecodeError as e:
      if index < len(lines) - 1 or warn is None:
        raise MetricsError(f"{path}, line {number}, is not valid JSON ({e}); only a half-written last line is "
                           "repaired on --resume" + hint) from None
      warn(f"warning: {path}: its last line is half-written ({len(line)} characters: {line[:60]!r}...); removed it")
      continue
    problem = row_problem(value, keys)
    if problem:
      raise MetricsError(f"{path}, line {number}, {problem}" + hint)
    rows.append((number, value))
  return rows


def check_sequence(path: str, rows: Sequence[tuple[int, Row]], hint: str = REPAIR_HINT) -> None:
  """Line k of the rows holds round k; MetricsError naming the first line that does not."""
  for due, (number, row) in enumerate(rows, 1):
    got = row["round"]
    if got < due:
      raise MetricsError(f"{path}, line {number}, holds round {got} again (a row per round is expected: "
                         f"round {due} was due)" + hint)
    if got > due:
      missing = f"round {due} is" if got == due + 1 else f"rounds {due}-{got - 1} are"
      raise MetricsError(f"{path}, line {number}, holds round {got}, but {missing} missing" + hint)


def read_rows(path: str, keys: Sequence[str] = READ_KEYS) -> list[Row]:
  """Every row of a finished or live run's metrics.jsonl (a half-written last line, one being written, is left
  out); MetricsError if it is not one row per round, each with ``keys``."""
  rows = parse(path, warn=lambda _: None, keys=keys, hint="")
  check_sequence(path, rows, hint="")
  return [row for _, row in rows]


def last_round(path: str) -> int:
  """The last round ``path`` holds a row of (0 if it holds none or does not exist); MetricsError as `read_rows`."""
  return max((row["round"] for row in read_rows(path)), default=0) if os.path.exists(path) else 0


def check(path: str) -> None:
  """Raises MetricsError if ``path`` exists and is not one row per round (a half-written last line passes)."""
  if os.path.exists(path):
    check_sequence(path, parse(path, warn=lambda _: None))


def read_for_resume(path: str, upto: int, log: Callable[[str], None]) -> list[Row]:
  """The rows of rounds 1..``upto`` (the restored checkpoint's round). Rows of later rounds and a half-written
  last line are removed, each with a warning; rows missing before ``upto`` are an error."""
  rows = parse(path, log) if os.path.exists(path) else []
  check_sequence(path, rows)
  if len(rows) < upto:
    held = f"holds the rows of rounds 1-{len(rows)}" if rows else ("holds no row" if os.path.exists(path)
                                                                    else "does not exist")
    raise MetricsError(f"{path} {held}, but the checkpoint resumed from is of round {upto}: the history of "
                       f"rounds {len(rows) + 1}-{upto} is missing" + REPAIR_HINT)
  later = [row["round"] for _, row in rows[upto:]]
  if later:
    log(f"warning: {path}: removed the metrics of rounds {min(later)}-{max(later)}, which come after the checkpoint "
        f"of round {upto} (they are trained again)")
  return [row for _, row in rows[:upto]]


def _kept_rows(path: str) -> tuple[list[Row], list[str]]:
  """The rows of rounds 1..k (the first copy of each, k the last round before one is missing), and what was
  dropped, as text."""
  first: dict[int, Row] = {}
  dropped = []
  for number, line in _lines(path) if os.path.exists(path) else []:
    try:
      value = json.loads(line)
    except json.JSONDecodeError:
      dropped.append(f"line {number} (not valid JSON)")
      continue
    problem = row_problem(value)
    if problem or value["round"] in first:
      dropped.append(f"line {number} ({problem.split(':')[0] if problem else 'round %d again' % value['round']})")
      continue
    first[value["round"]] = value
  kept = 0
  while kept + 1 in first:
    kept += 1
  later = sorted(r for r in first if r > kept)
  if later:
    dropped.append(f"the rows of rounds {', '.join(map(str, later))} (after the missing round {kept + 1})")
  return [first[r] for r in range(1, kept + 1)], dropped


def _checkpoint_steps(output_dir: str) -> list[int]:
  root = os.path.join(output_dir, "checkpoints")
  return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def _move_checkpoints_after(output_dir: str, last: int) -> list[int]:
  """Moves the checkpoints of rounds after ``last`` to ``dropped_checkpoints/``; returns their rounds."""
  root = os.path.join(output_dir, "checkpoints")
  later = [step for step in _checkpoint_steps(output_dir) if step > last]
  for step in later:
    target = os.path.join(output_dir, DROPPED_CHECKPOINTS, str(step))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(os.path.join(root, str(step)), target)
  return later


def repair(output_dir: str, log: Callable[[str], None]) -> list[Row]:
  """``--repair-metrics``: rewrites metrics.jsonl to its rows of rounds 1..k (see the module docstring), moves
  the checkpoints after round k to ``dropped_checkpoints/``, and says what it dropped; returns the rows kept."""
  path = os.path.join(output_dir, "metrics.jsonl")
  rows, dropped = _kept_rows(path)
  with open(path, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  moved = _move_checkpoints_after(output_dir, len(rows))
  kept = f"kept the rows of rounds 1-{len(rows)}" if rows else "kept no row"
  log(f"note: --repair-metrics: {path}: {kept}" + (f"; dropped {'; '.join(dropped)}" if dropped else ""))
  if moved:
    left = max(_checkpoint_steps(output_dir), default=0)
    log(f"note: --repair-metrics: moved the checkpoints of rounds {', '.join(map(str, moved))} to "
        f"{os.path.join(output_dir, DROPPED_CHECKPOINTS)} (no metrics cover them): the run resumes from "
        + (f"the newest checkpoint left (round {left}; a damaged one is skipped with a warning)" if left else
           "the start (no checkpoint is left)")
        + (f"; rounds {left + 1}-{len(rows)} are trained again too, their kept rows replaced" if left < len(rows)
           else ""))
  return rows
