"""Checks of single values, with errors that name what was checked, its value and what is allowed.

The config dataclasses declare each setting once (`fedjax_hetero.config.declare`) and check it with these
functions, given the setting's command-line flag, so a library user building one gets the message a CLI user
gets (``--lr must be a finite number > 0, got -1.0``); the library's pure functions check their arguments
with them under the argument's name. This module imports nothing of the package.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

# jax turns a seed into a key through 32-bit integers: larger seeds would alias smaller ones.
SEED_MAX = 2 ** 32 - 1


def first_line(error: BaseException, limit: int) -> str:
  """An exception as one line of a message: its type and the first line of its text, cut at ``limit`` characters."""
  return f"{type(error).__name__}: " + (str(error).strip().splitlines() or [""])[0][:limit]


def show(value: Any) -> str:
  """A value as a message shows it: numbers plainly (``-5.0``, ``nan``), anything else by repr."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return repr(value)
  if isinstance(value, numbers.Integral):
    return str(int(value))
  return repr(float(value))


def _is_integer(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounds(minimum: float | None, maximum: float | None, above: float | None, below: float | None) -> str:
  """`` >= 1``, `` > 0``, `` in [0, 1)``, ... (empty without bounds)."""
  low = f"[{show(minimum)}" if minimum is not None else f"({show(above)}" if above is not None else None
  high = f"{show(maximum)}]" if maximum is not None else f"{show(below)})" if below is not None else None
  if low and high:
    return f" in {low}, {high}"
  if low:
    return f" >= {show(minimum)}" if minimum is not None else f" > {show(above)}"
  if high:
    return f" <= {show(maximum)}" if maximum is not None else f" < {show(below)}"
  return ""


def _within(value: float, minimum: float | None, maximum: float | None, above: float | None,
            below: float | None) -> bool:
  return ((minimum is None or value >= minimum) and (maximum is None or value <= maximum)
          and (above is None or value > above) and (below is None or value < below))


def check_integer(name: str, value: Any, minimum: int | None = None, maximum: int | None = None,
                  optional: bool = False) -> None:
  """An integer (not a bool or a float) in ``[minimum, maximum]``; None too if ``optional``."""
  if optional and value is None:
    return
  if not (_is_integer(value) and _within(value, minimum, maximum, None, None)):
    raise ValueError(f"{name} must be an integer{_bounds(minimum, maximum, None, None)}, got {show(value)}")


def check_number(name: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
                 above: float | None = None, below: float | None = None, optional: bool = False) -> None:
  """A finite real number (not a bool), ``>= minimum``, ``<= maximum``, ``> above``, ``< below``; None too if
  ``optional``."""
  if optional and value is None:
    return
  if not (_is_number(value) and math.isfinite(value) and _within(value, minimum, maximum, above, below)):
    raise ValueError(f"{name} must be a finite number{_bounds(minimum, maximum, above, below)}, "
                     f"got {show(value)}")


def check_choice(name: str, value: Any, accepted: Iterable[Any], optional: bool = False) -> None:
  """One of ``accepted``; None too if ``optional``."""
  accepted = tuple(accepted)
  if optional and value is None:
    return
  if value not in accepted:
    raise ValueError(f"{name} must be one of {', '.join(map(str, accepted))}, got {show(value)}")


def check_bool(name: str, value: Any, optional: bool = False) -> None:
  """True or False (a string such as "false" would count as true); None too if ``optional``."""
  if optional and value is None:
    return
  if not isinstance(value, bool):
    raise ValueError(f"{name} must be true or false, got {show(value)}")


def check_text(name: str, value: Any, optional: bool = False) -> None:
  """A non-empty string; None too if ``optional``."""
  if optional and value is None:
    return
  if not (isinstance(value, str) and value.strip()):
    raise ValueError(f"{name} must be a non-empty string, got {show(value)}")
