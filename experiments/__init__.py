"""The repository's commands, ``python -m experiments.<name>``.

A Ctrl-C while a command still imports (a second or two, before `fedjax_hetero.run.interruption` takes over in
its main) ends it with one line and status 130, not a traceback through the import machinery."""

import sys


def _one_line_on_ctrl_c(kind, value, traceback):
  if issubclass(kind, KeyboardInterrupt):
    print("SIGINT: stopped while the command started; nothing was done", file=sys.stderr)
  else:
    sys.__excepthook__(kind, value, traceback)


if sys.argv[:1] == ["-m"]:  # (run as a command, not imported by a program or a test)
  sys.excepthook = _one_line_on_ctrl_c
