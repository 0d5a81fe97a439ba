"""Old import paths of names that moved: a module's ``__getattr__`` (PEP 562) that finds them in their new home
on first use, so that importing the old module does not import the new one."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def forward_moved(module: str, homes: dict[str, str]) -> Callable[[str], Any]:
  """``module``'s ``__getattr__``: a name of ``homes`` from the module it names, any other an AttributeError."""

  def __getattr__(name: str) -> Any:
    if name in homes:
      return getattr(importlib.import_module(homes[name]), name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__
