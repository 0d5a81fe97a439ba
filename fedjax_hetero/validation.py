"""Checks of the settings' values, with errors that name the command-line flag.

Every config dataclass checks its fields in ``__post_init__`` with these
functions, so a library user building one gets the message a CLI user gets:
the flag as typed (``--lr``), the value, and what is allowed. A setting is
named by its dotted path in `fedjax_hetero.config.RunConfig`
(``client.learning_rate``); `flag_name` derives its flat flag name, the rule
`fedjax_hetero.config.FLAGS` is built with, and `cli_flag` its spelling on the
command line. This module imports nothing of the package, so that every config
module can use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

# Settings whose flag name is not their leaf's name.
RENAMED_FLAGS: dict[str, str] = {"method.name": "method", "output.dir": "output_dir",
                                 "method.fedcross.global_from": "fedcross_global", "divergence.action": "on_divergence",
                                 # `fedjax_hetero.distributed.DistributedConfig`, not part of a run's config
                                 "distributed.mode": "distributed", "distributed.timeout": "distributed_timeout"}
# Families whose flag names put the family's name before the leaf's (method.fedcross.alpha: fedcross_alpha).
PREFIXED_FAMILIES: tuple[str, ...] = ("method.fedcross", "method.fedimpro", "method.fedin", "divergence")
# Families without flags of their own (FedGen's settings: only --fedgen-preset sets them).
UNFLAGGED_FAMILIES: tuple[str, ...] = ("method.fedgen",)
# Flags the CLI spells other than "--" and the flag name with dashes.
CLI_SPELLINGS: dict[str, str] = {"learning_rate": "--lr"}
# jax turns a seed into a key through 32-bit integers: larger seeds would alias smaller ones.
SEED_MAX = 2 ** 32 - 1


def _in_family(path: str, family: str) -> bool:
  return path.startswith(family + ".")


def has_flag(path: str) -> bool:
  """Whether the setting at ``path`` has a flag name (see `flag_name`)."""
  return not any(_in_family(path, family) for family in UNFLAGGED_FAMILIES)


def flag_name(path: str) -> str:
  """The flat flag name of the setting at dotted ``path`` (``client.learning_rate`` -> ``learning_rate``)."""
  if path in RENAMED_FLAGS:
    return RENAMED_FLAGS[path]
  leaf = path.rsplit(".", 1)[-1]
  for family in PREFIXED_FAMILIES:
    if _in_family(path, family):
      return f"{family.rsplit('.', 1)[-1]}_{leaf}"
  return leaf


def cli_flag(path: str) -> str:
  """How the setting at ``path`` is named to a user: its command-line flag (``--lr``), or its path if it has
  no flag."""
  if not has_flag(path):
    return path
  name = flag_name(path)
  return CLI_SPELLINGS.get(name, "--" + name.replace("_", "-"))


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


def check_integer(path: str, value: Any, minimum: int | None = None, maximum: int | None = None,
                  optional: bool = False) -> None:
  """An integer (not a bool or a float) in ``[minimum, maximum]``; None too if ``optional``."""
  if optional and value is None:
    return
  if not (_is_integer(value) and _within(value, minimum, maximum, None, None)):
    raise ValueError(f"{cli_flag(path)} must be an integer{_bounds(minimum, maximum, None, None)}, got {show(value)}")


def check_number(path: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
                 above: float | None = None, below: float | None = None, optional: bool = False) -> None:
  """A finite real number (not a bool), ``>= minimum``, ``<= maximum``, ``> above``, ``< below``; None too if
  ``optional``."""
  if optional and value is None:
    return
  if not (_is_number(value) and math.isfinite(value) and _within(value, minimum, maximum, above, below)):
    raise ValueError(f"{cli_flag(path)} must be a finite number{_bounds(minimum, maximum, above, below)}, "
                     f"got {show(value)}")


def check_choice(path: str, value: Any, accepted: Iterable[Any], optional: bool = False) -> None:
  """One of ``accepted``; None too if ``optional``."""
  accepted = tuple(accepted)
  if optional and value is None:
    return
  if value not in accepted:
    raise ValueError(f"{cli_flag(path)} must be one of {', '.join(map(str, accepted))}, got {show(value)}")


def check_bool(path: str, value: Any, optional: bool = False) -> None:
  """True or False (a string such as "false" would count as true); None too if ``optional``."""
  if optional and value is None:
    return
  if not isinstance(value, bool):
    raise ValueError(f"{cli_flag(path)} must be true or false, got {show(value)}")


def check_text(path: str, value: Any, optional: bool = False) -> None:
  """A non-empty string; None too if ``optional``."""
  if optional and value is None:
    return
  if not (isinstance(value, str) and value.strip()):
    raise ValueError(f"{cli_flag(path)} must be a non-empty string, got {show(value)}")
