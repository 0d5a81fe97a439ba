"""Every example in README.md, docs/ and notebooks/README.md runs as written, or is parsed.

* Python blocks (```` ```python ````) are executed, each in a fresh folder (slow: some train a few rounds).
* Shell blocks (```` ```bash ````) run in bash with the commands they start replaced by stubs that record
  their arguments; each recorded command is then checked without running it: an experiment command is parsed
  and its settings built and checked (the build step, as the CLI does before any data is loaded); `compare`,
  `analyze`, `launch`, the benchmarks and the scripts are parsed by their own parsers; a script run by bash
  must exist and pass ``bash -n``; ``pip install`` must name extras the project has.
* Inline commands (`` `python -m ...` `` in the text) are parsed too when they are complete; with placeholders
  (``RUN_DIR``) only their flags are checked to exist.

The dated logs under docs/reports/ are history and are not checked.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import tomllib
from unittest import mock

import pytest

from fedjax_hetero.cli import flags, run
from fedjax_hetero.run.build import run_method
from tests.helpers import REPO, skip_without_fashion_mnist

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))),
        "notebooks/README.md"]
DATASET_MODULES = {"experiments.fmnist": "fashion_mnist", "experiments.cifar10": "cifar10",
                   "experiments.cifar100": "cifar100", "experiments.svhn": "svhn_cropped"}
# Shell stubs: record "COMMAND ARGS..." (shell-quoted) as one line of $RECORD; srun and gcloud run what they wrap.
STUBS = r"""
record() { printf '%q ' "$@" >> "$RECORD"; printf '\n' >> "$RECORD"; }
python() { record python "$@"; }
python3() { record python "$@"; }
.venv/bin/python() { record python "$@"; }
bash() { record bash "$@"; }
pip() { record pip "$@"; }
fedjax-hetero() { record fedjax-hetero "$@"; }
jupyter() { record jupyter "$@"; }
papermill() { record papermill "$@"; }
git() { :; }
cd() { :; }
srun() { "$@"; }
gcloud() { for a; do case $a in --command=*) eval "${a#--command=}";; esac; done; }
"""


def pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def fenced_blocks(path: str) -> list[tuple[str, str, int]]:
  """(language, code, first line) of every fenced block of a markdown file."""
  with open(os.path.join(REPO, path)) as f:
    lines = f.read().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    if lines[i].startswith("```"):
      language, start = lines[i][3:].strip(), i + 1
      end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
      blocks.append((language, "\n".join(lines[start:end]) + "\n", start + 1))
      i = end
    i += 1
  return blocks


def blocks_of(language: str) -> list[tuple[str, str, int]]:
  return [(path, code, line) for path in DOCS for lang, code, line in fenced_blocks(path) if lang == language]


def recorded_commands(code: str, tmp_path) -> list[list[str]]:
  """The commands a shell block starts, with their arguments, each as bash would pass them."""
  record = tmp_path / "commands.txt"
  record.write_text("")
  script = tmp_path / "block.sh"
  script.write_text(STUBS + code)
  proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env={**os.environ, "RECORD": str(record)},
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  return [shlex.split(line) for line in record.read_text().splitlines() if line.strip()]


class Parsed(Exception):
  """Raised in place of running a command whose arguments were parsed."""


def parse_only(main, argv: list[str]) -> argparse.Namespace:
  """Calls ``main(argv)`` until its argparse parser has parsed ``argv`` (bad flags exit with status 2)."""
  parse_args = argparse.ArgumentParser.parse_args

  def stop(self, args=None, namespace=None):
    raise Parsed(parse_args(self, args, namespace))

  with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
    try:
      main(argv)
    except Parsed as parsed:
      return parsed.args[0]
  raise AssertionError(f"{main} returned without parsing")


def check_run(dataset: str, argv: list[str]) -> None:
  """An experiment command: its flags parsed, its settings built and its method checked (no paths, no data)."""
  defaults = run.run_defaults(argv, dataset)[0]
  args = run.build_parser(defaults, "docs").parse_args(argv)
  run_method(flags.config_from_args(args))


def check_command(command: list[str]) -> None:
  program, *args = command
  if program in ("jupyter", "papermill"):  # the notebook named must exist
    notebooks = [a for a in args if a.endswith(".ipynb") and not a.startswith("out")]
    assert notebooks and all(os.path.isfile(os.path.join(REPO, n)) for n in notebooks), command
    return
  if program == "pip" or command[1:3] == ["-m", "pip"]:
    args = args[2:] if program != "pip" else args
    extras = pyproject()["project"]["optional-dependencies"]
    for arg in args:
      for extra in re.findall(r"\[([\w,-]+)\]", arg):
        assert set(extra.split(",")) <= set(extras), (command, sorted(extras))
    return
  if program == "bash":
    script = os.path.join(REPO, args[0])
    assert os.path.isfile(script) and subprocess.run(["bash", "-n", script]).returncode == 0, command
    if args[0] == "scripts/demo.sh":
      check_run("fashion_mnist", args[1:])
    return
  if program == "fedjax-hetero":
    from fedjax_hetero.cli import __main__ as console
    parse_only(console.main, args)
    return
  assert program == "python", command
  if args[0] == "-c":
    compile(args[1], "<doc>", "exec")
  elif args[0] == "-m":
    check_module(args[1], args[2:])
  else:
    scripts = ("scripts/convert_inco_split.py", "scripts/plot_fedfa_attackers.py",
               "scripts/plot_fedfa_intensity.py")  # (argparse first in main)
    assert args[0] in scripts, f"no check for `python {args[0]}`"
    spec = importlib.util.spec_from_file_location("doc_script", os.path.join(REPO, args[0]))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse_only(module.main, args[1:])


# Modules whose main() parses its arguments with argparse first thing (parse_only stops it there).
ARGPARSE_MAINS = {"experiments.compare", "experiments.analyze", "experiments.launch", "benchmarks.throughput",
                  "benchmarks.method_overhead", "benchmarks.peer_torch", "benchmarks.scaling",
                  "benchmarks.layer_profile", "benchmarks.program_size", "benchmarks.depth_union",
                  "benchmarks.client_conv", "benchmarks.cost_overhead", "benchmarks.startup",
                  "benchmarks.device_profile", "benchmarks.step_modes"}


def check_module(name: str, argv: list[str]) -> None:
  if name in DATASET_MODULES:
    check_run(DATASET_MODULES[name], argv)
  elif name in ARGPARSE_MAINS:
    args = parse_only(importlib.import_module(name).main, argv)
    if name == "experiments.launch":
      inner = [a for a in args.command if a != "--"]
      if inner:
        check_module(inner[0], inner[1:])
  elif name == "tests.golden":
    assert set(argv) <= {"--missing"}, argv
  elif name == "pytest":
    markers = [m.split(":")[0] for m in pyproject()["tool"]["pytest"]["ini_options"]["markers"]]
    expression = argv[argv.index("-m") + 1] if "-m" in argv else ""
    assert set(re.findall(r"\w+", expression)) - {"not", "and", "or"} <= set(markers), expression
  elif name == "fedjax_hetero.cli.reference":
    assert not argv, argv
  else:
    raise AssertionError(f"no check for `python -m {name}`: add one to tests/test_docs.py")


def run_check(command: list[str]) -> None:
  """`check_command`, where a command that exits with status 0 (``--help``) passes."""
  try:
    check_command(command)
  except SystemExit as e:
    if e.code not in (0, None):
      raise


def test_every_shell_block_parses(tmp_path):
  checked = 0
  for path, code, line in blocks_of("bash"):
    for command in recorded_commands(code, tmp_path):
      try:
        run_check(command)
      except (Exception, SystemExit) as e:
        raise AssertionError(f"{path}:{line}: {shlex.join(command)}: {e!r}") from e
      checked += 1
  assert checked >= 30


INLINE = re.compile(r"`((?:python -m|bash scripts/)[^`]+)`")


def test_every_inline_command_parses_or_names_real_flags(tmp_path):
  for path in DOCS:
    with open(os.path.join(REPO, path)) as f:
      text = f.read()
    for match in INLINE.finditer(text):
      command = shlex.split(match.group(1))
      command = command[:command.index(">")] if ">" in command else command  # a redirection of its output
      if command[:2] == ["python", "-m"] and len(command) == 3 and "<" not in command[2]:  # a module named
        assert importlib.util.find_spec(command[2]) is not None, f"{path}: no module {command[2]}"
        continue
      if any(re.fullmatch(r"[A-Z][A-Z_,]*|\.\.\.|.*<\w+>.*", word) for word in command):
        module = command[2] if command[0] == "python" else None
        known = _flags_of(module)
        for word in command:
          if word.startswith("--") and known is not None:
            assert word.split("=")[0] in known, f"{path}: {match.group(1)}: {word} is no flag"
        continue
      try:
        run_check(command)
      except (Exception, SystemExit) as e:
        raise AssertionError(f"{path}: {match.group(1)}: {e!r}") from e


def _flags_of(module: str | None) -> set[str] | None:
  if module in DATASET_MODULES or module == "experiments.<dataset>":
    parser = run.build_parser(run.run_defaults([], "fashion_mnist")[0], "docs")
    return {option for action in parser._actions for option in action.option_strings}
  return None


@pytest.mark.slow
@pytest.mark.parametrize("path, code, line", blocks_of("python"), ids=lambda v: str(v)[:40])
def test_every_python_block_runs_as_written(path, code, line, tmp_path, monkeypatch):
  if "fashion_mnist" in code or "RunConfig" in code:
    skip_without_fashion_mnist()
  monkeypatch.chdir(tmp_path)
  exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "__doc_example__"})


def test_no_doc_names_an_issue_number_and_only_logs_are_dated():
  logs = sorted(glob.glob(os.path.join(REPO, "docs", "reports", "*.md")))
  assert logs and all(re.match(r"\d{4}-\d{2}-\d{2}-", os.path.basename(p)) for p in logs)
  for path in DOCS + [os.path.relpath(p, REPO) for p in logs]:
    with open(os.path.join(REPO, path)) as f:
      text = f.read()
    assert not re.search(r"\bissues? \d+|\(#\d+\)", text, re.IGNORECASE), path
    if path in DOCS:  # the reference pages: no commit hashes, no machine dates
      assert not re.search(r"\bcommit [0-9a-f]{7}\b|(?<!reports/)\b20\d\d-\d\d-\d\d\b", text), path
