"""`experiments.launch` at its edges: a --log-dir it cannot use, and a SIGINT to the launcher (alone, or to its
whole process group as a terminal's Ctrl-C), with stand-in processes that only record the signals they get."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fedjax_hetero.cli import launch
from tests.helpers import REPO, sigint_as_from_a_terminal

# A stand-in for an experiment module: records each SIGINT/SIGTERM it gets, and exits a second after the first
# (a run stops after its round in progress), as 128 + that signal.
RECORDER = """
import os, signal, sys, time
out, me = sys.argv[1], sys.argv[sys.argv.index("--process-id") + 1]
got = []
def record(signum, frame):
  got.append((signum, time.monotonic()))
  with open(os.path.join(out, f"signals_{me}"), "a") as f:
    f.write(signal.Signals(signum).name + "\\n")
for s in (signal.SIGINT, signal.SIGTERM):
  signal.signal(s, record)
open(os.path.join(out, f"ready_{me}"), "w").close()
end = time.monotonic() + 60
while time.monotonic() < end and not (got and time.monotonic() > got[0][1] + 1):
  time.sleep(0.05)
sys.exit(128 + got[0][0] if got else 0)
"""


@pytest.fixture
def no_process(monkeypatch):
  def popen(*args, **kwargs):
    raise AssertionError("a process was started")
  monkeypatch.setattr(launch.subprocess, "Popen", popen)


@pytest.mark.parametrize("where, message", [("/proc/nope", r"'/proc/nope': .*\(ENOENT"),
                                            ("FILE", r"'.*FILE' is a file, not a folder$"),
                                            ("/proc", r"'/proc': '/proc/process_1.log': ")])
def test_a_log_dir_that_cannot_be_used_is_one_line_before_any_process_starts(tmp_path, no_process, where, message):
  """Held-out probes 2 T4: an os.makedirs traceback."""
  if where == "FILE":
    where = str(tmp_path / "FILE")
    (tmp_path / "FILE").write_text("")
  with pytest.raises(SystemExit, match=r"^error: --log-dir " + message):
    launch.main(["--log-dir", where, "--", "experiments.fmnist", "--backend", "sharded"])


def start_launcher(tmp_path, **popen):
  (tmp_path / "recorder.py").write_text(RECORDER)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
  with sigint_as_from_a_terminal():
    launcher = subprocess.Popen([sys.executable, "-m", "experiments.launch", "--num-processes", "2", "--grace",
                                 "30", "--", "recorder", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **popen)
  deadline = time.monotonic() + 30
  while not all((tmp_path / f"ready_{i}").exists() for i in (0, 1)):
    assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
    time.sleep(0.05)
  return launcher


def signals_of(tmp_path, process):
  path = tmp_path / f"signals_{process}"
  return path.read_text().split() if path.exists() else []


@pytest.mark.slow
def test_a_sigint_to_the_launcher_alone_reaches_every_process_once(tmp_path):
  """Held-out probes 2 U12: `kill -INT <launcher>` was not passed on; the processes trained to their end."""
  launcher = start_launcher(tmp_path)
  start = time.monotonic()
  launcher.send_signal(signal.SIGINT)
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 130, err
  assert time.monotonic() - start < 15, "the processes stopped on the signal, not at the end of --grace 30"
  assert "launch: SIGINT (passed on as SIGTERM): waiting up to 30 s" in err, err
  assert [signals_of(tmp_path, i) for i in (0, 1)] == [["SIGTERM"], ["SIGTERM"]]


@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_a_terminal_ctrl_c_gives_each_process_one_sigint_not_two(tmp_path, presses):
  """A Ctrl-C reaches the launcher's whole process group: a second SIGINT from the launcher would make each
  process abandon its round in progress ("Ctrl-C again"). A second Ctrl-C does that, and the launcher waits on."""
  launcher = start_launcher(tmp_path, start_new_session=True)
  for _ in range(presses):
    os.killpg(launcher.pid, signal.SIGINT)
    time.sleep(0.3)
  _, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 130 and "Traceback" not in err, err
  for i in (0, 1):
    assert signals_of(tmp_path, i).count("SIGINT") == presses, (i, signals_of(tmp_path, i), err)
