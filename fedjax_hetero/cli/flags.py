"""The command line generated from the settings' declarations (`fedjax_hetero.config.declare`).

Every declared setting of `RunConfig` (and of `distributed.DistributedConfig`) becomes one flag, in a group per
config dataclass: its spelling, type or choices, default and help all come from the declaration, and the
parsed values go back through `RunConfig.from_flags`, whose checks name the same flags. docs/cli.md is
rendered from the same parser (`fedjax_hetero.cli.reference`), so it cannot drift from ``--help``.

Why a generator on argparse rather than a library that builds a CLI from dataclasses (tyro, simple-parsing):
those derive flag names from the field's path (``--client.learning-rate``), and keeping today's flat names
(``--lr``, ``--num-clients``, ``--fedcross-alpha``) would take an override on nearly every field, plus parsers
of their own for comma-separated lists; and the checks of a config built in code must name the flags too,
which needs the declaration to know its flag anyway. Given that, the generator is these ~100 lines over the
standard library's parser, whose error format and exit status 2 scripts already rely on.
"""

from __future__ import annotations

import argparse
from typing import Any

from fedjax_hetero.config import RunConfig, declare
from fedjax_hetero.methods import METHODS, methods_by_paper
from fedjax_hetero.methods.catalog import readers


def methods_help() -> str:
  """The methods grouped by paper, one line each."""
  lines = ["methods (--method, case-insensitive), by paper:"]
  for paper, entries in methods_by_paper().items():
    lines.append(f"  {paper}:")
    lines += [f"    {e.name:<15} {e.summary}" for e in entries]
  return "\n".join(lines)


def show_default(value: Any) -> str:
  """A default as the command line would take it back: ``cnn@1,cnn@0.5``, ``0.001``, ``true``."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, (tuple, list)):
    return ",".join(map(str, value))
  return str(value)


def _parser_of(check: declare.Check):
  """The text -> value conversion argparse calls: the builtin type (argparse says ``invalid int value``), or a
  custom parser whose ValueError argparse reports as it is (``argument --x: ...``)."""
  if not isinstance(check, declare.Custom):
    return check.parse

  def parse(text: str) -> Any:
    try:
      return check.parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None

  return parse


_METAVARS = {declare.Integer: "N", declare.Number: "X", declare.Text: "TEXT"}


def add_flag(group: Any, leaf: declare.Leaf) -> None:
  """The flag of one declared setting, with ``leaf.default`` (the tree's value) as its default."""
  decl, default = leaf.setting, leaf.default
  help_text = decl.help + ("" if default is None or default == () else f" (default: {show_default(default)})")
  kwargs: dict[str, Any] = dict(dest=leaf.flag, default=default, help=help_text.replace("%", "%%"))
  if isinstance(decl.check, declare.Flag):
    kwargs["action"] = argparse.BooleanOptionalAction
  else:
    kwargs["type"] = _parser_of(decl.check)
    if isinstance(decl.check, declare.OneOf):
      kwargs["choices"] = decl.check.choices
    metavar = decl.metavar or _METAVARS.get(type(decl.check))
    if metavar:
      kwargs["metavar"] = metavar
  group.add_argument(leaf.cli, **kwargs)


def family_title(kind: type) -> str:
  """A group's heading in --help: the class's title, or for a method's option family the methods that read it."""
  if kind.TITLE:
    return kind.TITLE
  names = readers(kind)
  if len(names) > len(METHODS) / 2:
    others = [e.name for e in METHODS.values() if e.name not in names]
    return f"options of every method but {', '.join(others)}"
  return f"options of {', '.join(names)}"


def add_settings(parser: argparse.ArgumentParser, defaults: Any, root_title: str | None = None) -> None:
  """A flag group per config dataclass of the tree ``defaults``, each flag defaulting to the tree's value."""
  for path, family in declare.families(defaults):
    own = [leaf for leaf in declare.leaves(family) if "." not in leaf.path]
    if not own:
      continue
    title = family_title(type(family)) if path or not root_title else root_title
    group = parser.add_argument_group(title, type(family).DESCRIPTION or None)
    for leaf in own:
      add_flag(group, leaf._replace(path=f"{path}.{leaf.path}" if path else leaf.path))


def config_from_args(args: argparse.Namespace) -> RunConfig:
  """The `RunConfig` of parsed flags (the run's, not the CLI's own: those are not settings)."""
  return RunConfig.from_flags(**{k: v for k, v in vars(args).items() if k in _run_flags()})


def _run_flags() -> frozenset[str]:
  return frozenset(leaf.flag for leaf in declare.leaves(RunConfig()))
