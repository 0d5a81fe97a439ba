"""Output shared by the benchmarks: one JSON object per line."""

from __future__ import annotations

import json
from typing import Any, Sequence


def emit_json_lines(rows: Sequence[dict[str, Any]], output: str | None = None, echo: bool = True) -> None:
  """Prints each row as one JSON line (unless not ``echo``) and, if ``output`` is given, writes the same lines
  there."""
  lines = [json.dumps(row) for row in rows]
  for line in lines if echo else ():
    print(line, flush=True)
  if output:
    with open(output, "w") as f:
      f.writelines(line + "\n" for line in lines)
