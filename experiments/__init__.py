"""The repository's commands, ``python -m experiments.<name>``.

A Ctrl-C while a command still imports (a second or two, before `fedjax_hetero.run.interruption` takes over in
its main) ends it with one line and status 130, not a traceback through the import machinery. It must not raise
`KeyboardInterrupt` there: an exception raised inside a native extension's initialisation (jaxlib's) aborts the
process from C++ ("terminate called ...", SIGABRT). So while the command imports, the signal ends the process at
once, by the signal; elsewhere it raises `KeyboardInterrupt` as Python's own handler does."""

import os
import signal
import sys

_STOPPED_WHILE_STARTING = "SIGINT: stopped while the command started; nothing was done"


def _importing_the_command(frame) -> bool:
  """Whether ``frame`` runs inside an import that the command's own module (``__main__``) started."""
  inner = None
  while frame is not None:
    if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
      return inner is not None and inner.f_code.co_filename.startswith("<frozen importlib")
    inner, frame = frame, frame.f_back
  return False


def _on_ctrl_c(signum, frame):
  if not _importing_the_command(frame):
    signal.default_int_handler(signum, frame)
  print(_STOPPED_WHILE_STARTING, file=sys.stderr, flush=True)
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)
  os._exit(128 + signum)  # (not reached: the default action of SIGINT ends the process)


def _one_line_on_ctrl_c(kind, value, traceback):
  if issubclass(kind, KeyboardInterrupt):
    print(_STOPPED_WHILE_STARTING, file=sys.stderr)
  else:
    sys.__excepthook__(kind, value, traceback)


if sys.argv[:1] == ["-m"]:  # (run as a command, not imported by a program or a test)
  sys.excepthook = _one_line_on_ctrl_c
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where it is inherited ignored: nohup)
    signal.signal(signal.SIGINT, _on_ctrl_c)
