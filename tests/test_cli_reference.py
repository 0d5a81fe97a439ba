"""docs/cli.md is what `fedjax_hetero.cli.reference` renders, and it matches ``--help`` flag by flag."""

from __future__ import annotations

import os
import re

from fedjax_hetero.cli import reference
from tests.helpers import REPO

CLI_MD = os.path.join(REPO, "docs", "cli.md")


def test_docs_cli_md_is_rendered_from_the_parser():
  with open(CLI_MD) as f:
    written = f.read()
  assert written == reference.render(reference.fmnist_parser()), (
      "docs/cli.md is stale: run `python -m fedjax_hetero.cli.reference > docs/cli.md`")


def test_every_flag_of_help_is_in_docs_cli_md_with_its_help():
  parser = reference.fmnist_parser()
  with open(CLI_MD) as f:
    written = f.read()
  help_text = " ".join(parser.format_help().split())
  for action in parser._actions:
    if action.dest == "help":
      continue
    for option in action.option_strings:
      assert option in help_text and re.search(rf"(`|/ ){re.escape(option)}[ `]", written), option
    assert " ".join(action.help.replace("%%", "%").split()) in " ".join(written.split()), action.dest
  for group in parser._action_groups[2:]:
    assert f"## {group.title}\n" in written and group.title in help_text
