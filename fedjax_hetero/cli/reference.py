"""docs/cli.md, rendered from the parser ``python -m experiments.fmnist --help`` prints.

``python -m fedjax_hetero.cli.reference > docs/cli.md`` writes it; tests/test_cli_reference.py checks that the
file is what this renders and that every flag of ``--help`` is in it with its help text.
"""

from __future__ import annotations

import argparse
import sys

from fedjax_hetero.cli.datasets import DATASETS
from fedjax_hetero.cli.flags import methods_help
from fedjax_hetero.cli.presets import PRESETS
from fedjax_hetero.cli.run import build_parser, run_defaults
from fedjax_hetero.config import FLAGS, typed_flag

HEADER = """# Command-line reference

Every flag of `python -m experiments.<dataset>` (and `fedjax-hetero run`), grouped as `--help` groups them.
Each comes from one declaration in `fedjax_hetero/config/`: the flag, its default, its check and this line
(rendered by `python -m fedjax_hetero.cli.reference > docs/cli.md`; a test keeps the two equal). The defaults
are `experiments.fmnist`'s; the other datasets' and the presets' are listed at the end. Every value is checked
before anything is loaded: a bad one stops the command with `error: ...` naming the flag, exit status 2.
"""


def _usage(action: argparse.Action) -> str:
  if not action.option_strings:
    return action.dest
  flag = " / ".join(action.option_strings)
  if action.nargs == 0:
    return flag
  metavar = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices else
                               action.dest.upper())
  return f"{flag} {metavar}"


def render(parser: argparse.ArgumentParser) -> str:
  """The markdown of every flag group of ``parser``: one bullet per flag, with its help as ``--help`` has it."""
  lines = [HEADER]
  for group in parser._action_groups:
    actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    if not actions:
      continue
    lines += [f"## {group.title}", ""]
    if group.description:
      lines += [" ".join(group.description.split()), ""]
    lines += [f"- `{_usage(a)}`: {a.help.replace('%%', '%')}" for a in actions] + [""]
  lines += ["## Methods", "", "```", methods_help(), "```", ""]
  return "\n".join(lines + _other_defaults())


def _other_defaults() -> list[str]:
  base = DATASETS["fashion_mnist"].config().flags()
  lines = ["## Other datasets' defaults", "",
           "`python -m experiments.<dataset>` (or `--dataset`) starts from these, where they differ from the above:",
           ""]
  for name, defaults in DATASETS.items():
    changed = {k: v for k, v in defaults.config().flags().items() if v != base[k] and k != "dataset"}
    if name != "fashion_mnist" and changed:
      lines.append(f"- `{name}`: " + ", ".join(f"`{typed_flag(FLAGS[k].cli, v)}`" for k, v in changed.items()))
  lines += ["", "## Presets", "", "`--preset NAME` starts from a paper's protocol; flags given as well win.", ""]
  lines += [f"- `{p.name}`: {p.description}" + (f" (reduced: {p.reduced})" if p.reduced else "")
            for p in PRESETS.values()]
  return lines + [""]


def fmnist_parser() -> argparse.ArgumentParser:
  defaults = run_defaults([], "fashion_mnist")[0]
  return build_parser(defaults, DATASETS["fashion_mnist"].description)


if __name__ == "__main__":
  sys.stdout.write(render(fmnist_parser()))
