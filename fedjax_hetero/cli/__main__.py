"""``fedjax-hetero COMMAND ...`` (installed with the package; also ``python -m fedjax_hetero.cli``).

    fedjax-hetero run --dataset fashion_mnist --method FedAvg   # python -m experiments.<dataset>
    fedjax-hetero compare RUN_DIR... --baseline FedAvg           # python -m experiments.compare
    fedjax-hetero analyze tracking RUN_DIR                       # python -m experiments.analyze
    fedjax-hetero launch --num-processes 2 -- run --backend sharded
"""

from __future__ import annotations

import sys
from typing import Sequence

COMMANDS = {"run": "train one run (or one per seed) and write its results folder",
            "compare": "tables and a plot of finished runs, paired by seed",
            "analyze": "analyses of a finished run (CKA, landscapes, tracking, ...)",
            "launch": "start a multi-process run on this machine's CPUs"}


def main(argv: Sequence[str] | None = None):
  """Dispatches to the command's own main, with the arguments after the command's name."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in COMMANDS:
    usage = "\n".join(f"  {name:<8} {what}" for name, what in COMMANDS.items())
    print(f"usage: fedjax-hetero COMMAND [--help] ...\n\ncommands:\n{usage}", file=sys.stderr)
    raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
  command, rest = argv[0], argv[1:]
  if command == "run":
    from fedjax_hetero.cli.run import main as run
    return run("fashion_mnist", rest)
  if command == "compare":
    from fedjax_hetero.cli.compare import main as compare
    return compare(rest)
  if command == "analyze":
    from fedjax_hetero.cli.analyze import main as analyze
    return analyze(rest)
  from fedjax_hetero.cli.launch import main as launch
  raise SystemExit(launch(rest))


def console() -> None:
  """The ``fedjax-hetero`` console script: exits 0 after a command that returns, and on a signal after its runs
  finished (`interruption.the_process_is_a_command`)."""
  from fedjax_hetero.run.interruption import the_process_is_a_command
  the_process_is_a_command()
  main()


if __name__ == "__main__":
  console()
