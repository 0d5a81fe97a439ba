"""``--config FILE``: a whole `RunConfig` from JSON or YAML, e.g. a finished run's ``config.json``.

The file holds the config tree (``{"client": {"learning_rate": 0.01}, ...}``, the layout of ``config.json``, whose
history is ignored) or flag names (``{"learning_rate": 0.01, ...}``); settings not in it keep the library's
defaults, and older layouts are upgraded as ``--resume`` upgrades them (`fedjax_hetero.run.history.upgrade`). What a
file says about resuming or overwriting is dropped: those say what one command does, not what the run is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from fedjax_hetero.config import RunConfig
from fedjax_hetero.run import history


def _parse(path: str, text: str) -> Any:
  if path.endswith((".yaml", ".yml")):
    import yaml

    return yaml.safe_load(text)
  return json.loads(text)


def read_config(path: str, log: Callable[[str], None] = print) -> RunConfig:
  """The `RunConfig` of a JSON (``.json``) or YAML (``.yaml``/``.yml``) file; ValueError naming the file."""
  flag = f"--config {path!r}"
  if not os.path.isfile(path):
    raise ValueError(f"{flag} is not a file")
  try:
    with open(path) as f:
      tree = _parse(path, f.read())
  except (OSError, ValueError) as e:  # JSON and YAML parse errors are ValueErrors
    raise ValueError(f"{flag} cannot be read: {type(e).__name__}: {e}") from None
  if not isinstance(tree, dict):
    raise ValueError(f"{flag} must hold a mapping of settings, got {type(tree).__name__}")
  for key in (history.SEGMENTS, history.ROLLBACKS, history.PROCESSES):
    tree.pop(key, None)
  ignored: list[str] = []
  try:
    config = history.upgrade(tree, ignored)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{flag}: {e}") from None
  if ignored:
    log(f"note: {flag}: ignoring settings this version does not know: {', '.join(sorted(ignored))}")
  action = dict(resume=False, resume_or_start=False, overwrite=False)
  return dataclasses.replace(config, output=dataclasses.replace(config.output, **action))
