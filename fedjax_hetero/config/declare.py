"""One declaration per setting: a dataclass field made by `setting`, holding its default, help and check.

Everything else about a setting is derived from that field:

* its *flag name*, the flat name presets, `RunConfig.from_flags` and older results folders use: the field's
  name, after the class's `Settings.FLAG_PREFIX` if it has one (``fedcross`` + ``alpha`` -> ``fedcross_alpha``),
  unless the declaration names it (``flag="method"``);
* its command-line flag: ``--`` and the flag name with dashes, unless the declaration spells it
  (``spelling="--lr"``);
* its ``config.json`` key: its dotted path in the tree (``client.learning_rate``);
* the check run when the dataclass is built (`validate`), whose message names the command-line flag, or where the
  value came from if not from a flag (`named_from`: a preset, a config file's line, a sweep);
* its entry in ``--help`` and in docs/cli.md (`fedjax_hetero.cli.flags`).

A config dataclass derives from `Settings`, declares every field with `setting` (or as a nested `Settings`
dataclass), and calls `validate` first thing in ``__post_init__``. This module imports nothing of the
package but `fedjax_hetero.validation`, so that every config module can use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from typing import Any, Callable, ClassVar, Iterator, Mapping, NamedTuple

from fedjax_hetero.validation import check_bool, check_choice, check_integer, check_number, check_text

FLOAT32_MAX = 3.4028234663852886e38  # np.finfo(np.float32).max, without numpy here

_KEY = "fedjax_hetero.setting"
# Command-line flag -> how messages name that setting while its value comes from elsewhere (`named_from`).
_NAMES: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("fedjax_hetero_setting_names", default={})


@dataclasses.dataclass(frozen=True)
class Integer:
  minimum: int | None = None
  maximum: int | None = None

  def __call__(self, name: str, value: Any, optional: bool) -> None:
    check_integer(name, value, self.minimum, self.maximum, optional=optional)

  parse = staticmethod(int)


@dataclasses.dataclass(frozen=True)
class Number:
  minimum: float | None = None
  maximum: float | None = None
  above: float | None = None
  below: float | None = None

  def __call__(self, name: str, value: Any, optional: bool) -> None:
    check_number(name, value, self.minimum, self.maximum, above=self.above, below=self.below, optional=optional)
    if value is not None and abs(value) > FLOAT32_MAX:  # the programs compute in float32: it would be inf
      raise ValueError(f"{name} {value:g} is beyond float32's range (largest {FLOAT32_MAX:.4g}), which the runs "
                       "compute in")

  parse = staticmethod(float)


@dataclasses.dataclass(frozen=True)
class OneOf:
  choices: tuple[str, ...]

  def __call__(self, name: str, value: Any, optional: bool) -> None:
    check_choice(name, value, self.choices, optional=optional)

  parse = staticmethod(str)


@dataclasses.dataclass(frozen=True)
class Flag:
  """True or False; on the command line ``--name`` / ``--no-name``."""

  def __call__(self, name: str, value: Any, optional: bool) -> None:
    check_bool(name, value, optional=optional)

  parse = None


@dataclasses.dataclass(frozen=True)
class Text:
  def __call__(self, name: str, value: Any, optional: bool) -> None:
    check_text(name, value, optional=optional)

  parse = staticmethod(str)


@dataclasses.dataclass(frozen=True)
class Custom:
  """A check of its own (``check(name, value)``) and how the command line's text becomes a value."""

  check: Callable[[str, Any], None]
  parse: Callable[[str], Any]

  def __call__(self, name: str, value: Any, optional: bool) -> None:
    if not (optional and value is None):
      self.check(name, value)


Check = Integer | Number | OneOf | Flag | Text | Custom


@dataclasses.dataclass(frozen=True)
class Setting:
  help: str
  check: Check
  flag: str | None = None  # the flag name, if not the field's name (after the class's prefix)
  spelling: str | None = None  # the command-line flag, if not "--" + the flag name with dashes
  metavar: str | None = None
  shared: bool = False  # read by the whole run, not only by the methods of its option family


def setting(default: Any, help: str, check: Check, *, flag: str | None = None, spelling: str | None = None,
            metavar: str | None = None, shared: bool = False) -> Any:
  """A declared field: ``default``, ``help`` and ``check`` (`Integer`, `Number`, `OneOf`, `Flag`, `Text`,
  `Custom`); a default of None makes None a valid value too."""
  return dataclasses.field(default=default,
                           metadata={_KEY: Setting(help, check, flag, spelling, metavar, shared)})


class Settings:
  """Base of the config dataclasses: ``FLAG_PREFIX`` goes before its fields' flag names, ``TITLE`` (and
  ``DESCRIPTION``) head its flags in ``--help``."""

  FLAG_PREFIX: ClassVar[str] = ""
  TITLE: ClassVar[str] = ""
  DESCRIPTION: ClassVar[str] = ""


def is_off(value: Any) -> bool:
  """Whether a setting's value is a concrete zero, which turns its part of the run off (a proximal term, SGD's
  momentum). A traced value (a setting swept in a job of many runs, which is never zero there: `run.jobs`) is on."""
  return isinstance(value, (int, float)) and value == 0


def declaration(field: dataclasses.Field) -> Setting | None:
  return field.metadata.get(_KEY)


def flag_name(owner: type, field: dataclasses.Field) -> str:
  decl = declaration(field)
  if decl is not None and decl.flag:
    return decl.flag
  prefix = getattr(owner, "FLAG_PREFIX", "")
  return f"{prefix}_{field.name}" if prefix else field.name


def spelling(owner: type, field: dataclasses.Field) -> str:
  decl = declaration(field)
  if decl is not None and decl.spelling:
    return decl.spelling
  return "--" + flag_name(owner, field).replace("_", "-")


def field_named(owner: type, name: str) -> dataclasses.Field:
  return next(f for f in dataclasses.fields(owner) if f.name == name)


@contextlib.contextmanager
def named_from(names: Mapping[str, str]) -> Iterator[None]:
  """Within it, messages name the settings of ``names`` (command-line flag -> name) by that name: a setting a
  preset, a config file or a sweep gave is reported as, e.g., ``clients_per_round (from --preset inco-cpu)``,
  not as a flag the user never passed."""
  token = _NAMES.set({**_NAMES.get(), **names})
  try:
    yield
  finally:
    _NAMES.reset(token)


def in_messages(flag: str) -> str:
  """How a message names the setting whose command-line flag is ``flag`` (see `named_from`)."""
  return _NAMES.get().get(flag, flag)


def cli_name(owner: Any, name: str) -> str:
  """How a message names field ``name`` of the config class (or instance) ``owner``: its command-line flag
  (``--lr``), or where its value came from (`named_from`)."""
  owner = owner if isinstance(owner, type) else type(owner)
  return in_messages(spelling(owner, field_named(owner, name)))


def flag_of(owner: Any, name: str) -> str:
  """The command-line flag of field ``name`` of ``owner``, for advice to pass it (`cli_name` says where a value
  came from, which advice to add the flag must not)."""
  owner = owner if isinstance(owner, type) else type(owner)
  return spelling(owner, field_named(owner, name))


def validate(config: Any) -> None:
  """Runs every declared field's check on ``config``; ValueError naming the setting (`cli_name`)."""
  for field in dataclasses.fields(config):
    decl = declaration(field)
    if decl is not None:
      decl.check(in_messages(spelling(type(config), field)), getattr(config, field.name), field.default is None)
    elif is_settings(field.default) and not isinstance(getattr(config, field.name), type(field.default)):
      value = getattr(config, field.name)
      raise ValueError(f"{field.name} must be a {type(field.default).__name__}, got {type(value).__name__}")


def is_settings(value: Any) -> bool:
  return dataclasses.is_dataclass(value) and isinstance(value, Settings)


class Leaf(NamedTuple):
  """A declared setting where it sits in a config tree."""

  path: str  # its config.json key, e.g. "client.learning_rate"
  owner: type  # the dataclass declaring it
  field: dataclasses.Field
  setting: Setting
  default: Any  # the value in the tree walked

  @property
  def flag(self) -> str:
    return flag_name(self.owner, self.field)

  @property
  def cli(self) -> str:
    return spelling(self.owner, self.field)


def leaves(config: Any, prefix: str = "") -> Iterator[Leaf]:
  """Every declared setting of the config tree ``config`` (an instance), depth first in declaration order."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    decl = declaration(field)
    if decl is not None:
      yield Leaf(prefix + field.name, type(config), field, decl, value)
    elif is_settings(value):
      yield from leaves(value, f"{prefix}{field.name}.")


def flag_table(config: Any) -> dict[str, Leaf]:
  """Flag name -> its leaf, for the tree ``config``; two settings sharing a flag name is an error."""
  table: dict[str, Leaf] = {}
  for leaf in leaves(config):
    if leaf.flag in table:
      raise AssertionError(f"{leaf.path} and {table[leaf.flag].path} share the flag name {leaf.flag!r}")
    table[leaf.flag] = leaf
  return table


def families(config: Any) -> Iterator[tuple[str, Any]]:
  """Every nested `Settings` dataclass of the tree, with its path, the root first (path "")."""
  yield "", config
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if declaration(field) is None and is_settings(value):
      for path, family in families(value):
        yield (f"{field.name}.{path}" if path else field.name), family


def changed_fields(config: Any) -> list[str]:
  """The declared fields of ``config`` (one dataclass, not its nested ones) that differ from their defaults."""
  return [f.name for f in dataclasses.fields(config)
          if declaration(f) is not None and getattr(config, f.name) != f.default]


def value_at(config: Any, path: str) -> Any:
  """The value at dotted ``path`` of the config tree ``config`` (``client.learning_rate``)."""
  for part in path.split("."):
    config = getattr(config, part)
  return config


def substituted(config: Any, values: dict[str, Any]) -> Any:
  """A copy of the frozen config tree ``config`` with ``values`` (by dotted path) set, unchecked: a job's program
  holds a run's swept settings there as traced values, which cannot be checked (each run's own were)."""
  for path, value in values.items():
    config = _substitute(config, path.split("."), value)
  return config


def _substitute(node: Any, parts: list[str], value: Any) -> Any:
  new = copy.copy(node)
  object.__setattr__(new, parts[0],
                     value if len(parts) == 1 else _substitute(getattr(node, parts[0]), parts[1:], value))
  return new
