"""Starts a multi-process run on this machine's CPUs: N processes of D host devices each, on 127.0.0.1.

    python -m experiments.launch --num-processes 2 --devices-per-process 2 -- \\
        experiments.fmnist --backend sharded --rounds 5 --output-dir runs/fmnist-2x2

Every process runs ``python -m MODULE ARGS --coordinator 127.0.0.1:PORT --num-processes N --process-id I``
(a free port; MODULE ``run`` is ``fedjax-hetero run``) with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=D``; together
they are one run of N x D devices on jax.distributed (see `fedjax_hetero.distributed`), the way processes on
several hosts or accelerators would be. Process 0's output is shown as it comes; the others' lines are shown
prefixed with ``[process I]`` (or written to ``--log-dir``). If a process exits with an error, the others get
``--grace`` seconds to stop by themselves (they normally fail at their next collective) and are then
terminated; the launcher exits with that process's status, naming it. A SIGTERM or SIGHUP to the launcher is
passed on to every process; the launcher waits up to ``--grace`` seconds for them to end and then terminates
the rest, so no process outlives it; on Linux a launcher killed outright (SIGKILL) has the kernel send every
process SIGTERM. A SIGINT to the launcher is passed on as SIGTERM, which stops a process after its round in
progress as SIGINT does: a terminal's Ctrl-C reaches every process itself, and a second SIGINT from the launcher
would make it abandon that round ("Ctrl-C again"). So ``kill -INT`` of the launcher alone and a Ctrl-C both stop
every process after the same call, and a second Ctrl-C still abandons it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, Sequence

from fedjax_hetero.os_errors import describe, point_at_devnull

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
COORDINATOR_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--distributed")
POLL_SECONDS = 0.1
KILL_AFTER_TERM_SECONDS = 5.0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m experiments.launch", description=__doc__.split("\n\n")[0],
                              epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--num-processes", type=int, default=2, help="processes to start (default 2)")
  p.add_argument("--devices-per-process", type=int, default=1,
                 help="CPU devices each process has (XLA's forced host device count; default 1)")
  p.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                 help="after a process fails, how long the others may take to stop by themselves before they are "
                 "terminated (default 30)")
  p.add_argument("--log-dir", default=None, metavar="DIR",
                 help="write process I's output (I >= 1) to DIR/process_I.log instead of showing it prefixed")
  p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- MODULE ARGS",
                 help="the experiment module (e.g. experiments.fmnist) and its flags, after --")
  return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The launcher's flags; exits with status 2 and a message naming the bad one."""
  parser = build_parser()
  args = parser.parse_args(argv)
  command = list(args.command)
  if command and command[0] == "--":
    command = command[1:]
  if args.num_processes < 1:
    parser.error(f"--num-processes must be an integer >= 1, got {args.num_processes}")
  if args.devices_per_process < 1:
    parser.error(f"--devices-per-process must be an integer >= 1, got {args.devices_per_process}")
  if not args.grace >= 0:
    parser.error(f"--grace must be a number >= 0, got {args.grace}")
  if not command or command[0].startswith("-"):
    parser.error("give the experiment module and its flags after --, e.g. -- experiments.fmnist --backend sharded")
  taken = [a for a in command[1:] if a.split("=", 1)[0] in COORDINATOR_FLAGS]
  if taken:
    parser.error(f"the launcher sets {', '.join(COORDINATOR_FLAGS)} itself; remove {', '.join(taken)}")
  # A console command (`run`) is started as `python -m fedjax_hetero.cli run ...`.
  args.command = ["fedjax_hetero.cli", *command] if command[0] == "run" else command
  return args


def free_port() -> int:
  """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of one process: CPU only, ``devices`` host devices (any other XLA flags kept)."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _pump(stream: IO[str], out: IO[str], prefix: str) -> None:
  """``stream``'s lines to ``out``, prefixed; once ``out`` is closed (``| head``) the lines are read and dropped,
  so that the process never blocks on a full pipe."""
  for line in stream:
    if out is None:
      continue
    try:
      out.write(prefix + line)
      out.flush()
    except BrokenPipeError:
      point_at_devnull(out)  # (what it still buffers would fail again at exit)
      out = None


def _describe(status: int) -> str:
  if status < 0:
    try:
      return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
      return f"was killed by signal {-status}"
  return f"exited with status {status}"


def _end_with(launcher: int) -> None:
  """Run in each process before it starts (Linux): the kernel sends it SIGTERM when the launcher dies, even by
  SIGKILL, so it stops after its call (with a checkpoint) instead of running on as an orphan."""
  try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: a launcher killed by SIGKILL leaves its processes running
    return
  if os.getppid() != launcher:  # it died before the request took effect
    os.kill(os.getpid(), signal.SIGTERM)


def open_logs(log_dir: str, num_processes: int) -> list[IO[str]]:
  """``log_dir``/process_I.log for I >= 1, open for writing, before any process starts: a folder that cannot be
  made or written is one line, not a traceback."""
  if os.path.exists(log_dir) and not os.path.isdir(log_dir):
    raise SystemExit(f"error: --log-dir {log_dir!r} is a file, not a folder")
  logs = []
  try:
    os.makedirs(log_dir, exist_ok=True)
    for i in range(1, num_processes):
      logs.append(open(os.path.join(log_dir, f"process_{i}.log"), "w"))
  except OSError as e:
    for log in logs:
      log.close()
    raise SystemExit(f"error: --log-dir {log_dir!r}: {describe(e)}") from None
  return logs


def launch(args: argparse.Namespace) -> int:
  """Runs the processes to the end; returns the launcher's exit status (0 when every process succeeded)."""
  logs = open_logs(args.log_dir, args.num_processes) if args.log_dir else []
  port = free_port()
  env = process_env(args.devices_per_process)
  procs, pumps = [], []
  end_with_launcher = functools.partial(_end_with, os.getpid())
  for i in range(args.num_processes):
    cmd = [sys.executable, "-m", *args.command, "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", str(args.num_processes), "--process-id", str(i)]
    if i == 0:
      proc = subprocess.Popen(cmd, env=env, preexec_fn=end_with_launcher)
    elif args.log_dir:
      proc = subprocess.Popen(cmd, env=env, stdout=logs[i - 1], stderr=subprocess.STDOUT,
                              preexec_fn=end_with_launcher)
    else:
      proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", preexec_fn=end_with_launcher)
      pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, f"[process {i}] "), daemon=True)
      pump.start()
      pumps.append(pump)
    procs.append(proc)
  print(f"launch: {args.num_processes} processes x {args.devices_per_process} CPU devices, coordinator "
        f"127.0.0.1:{port}, pids {' '.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)
  try:
    with _signals_raised((signal.SIGTERM, signal.SIGHUP)):
      status = _supervise(procs, args.grace)
  except (KeyboardInterrupt, _Signalled) as e:
    # A second Ctrl-C reaches the processes from the terminal (they abandon their round); the launcher waits on.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signum = e.signum if isinstance(e, _Signalled) else signal.SIGINT
    passed = " (passed on as SIGTERM)" if signum == signal.SIGINT else ""
    print(f"launch: {signal.Signals(signum).name}{passed}: waiting up to {args.grace:g} s for the processes to "
          "stop", file=sys.stderr, flush=True)
    try:
      _stop(procs, signum, args.grace)
    finally:
      signal.signal(signal.SIGINT, previous)
    # (processes that had finished their run as the signal came end with 0: the run is done)
    status = 0 if all(p.returncode == 0 for p in procs) else 128 + signum
  # (the processes have ended: a signal while their last lines are copied has nothing left to stop)
  quiet = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  try:
    for pump in pumps:
      pump.join(timeout=5)
  finally:
    for signum, handler in quiet.items():
      signal.signal(signum, handler)
  for log in logs:
    log.close()
  return status


def _supervise(procs: list[subprocess.Popen], grace: float) -> int:
  """Waits for every process; after the first failure, terminates those still running after ``grace`` s."""
  failed, deadline = None, None
  while True:
    codes = [p.poll() for p in procs]
    if failed is None:
      failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
      if failed is not None:
        deadline = time.monotonic() + grace
        print(f"launch: process {failed} {_describe(codes[failed])}; the others get {grace:g} s to stop",
              file=sys.stderr, flush=True)
    if all(c is not None for c in codes):
      break
    if deadline is not None and time.monotonic() > deadline:
      running = [i for i, c in enumerate(codes) if c is None]
      print(f"launch: terminating process(es) {', '.join(map(str, running))}", file=sys.stderr, flush=True)
      _terminate(procs)
      break
    time.sleep(POLL_SECONDS)
  if failed is None:
    return 0
  others = [f"process {i} {_describe(p.returncode)}" for i, p in enumerate(procs) if i != failed]
  code = procs[failed].returncode
  # (The others may have had no chance to say it: jax ends a process waiting on a dead one with its own abort.)
  resume = ("; to continue, launch again with --resume added to the run's flags: it goes on from the last "
            "checkpoint every process saved") if code < 0 else ""
  print(f"launch: failed: process {failed} {_describe(code)}" + (f" ({'; '.join(others)})" if others else "")
        + resume, file=sys.stderr, flush=True)
  return code if code > 0 else 1


class _Signalled(Exception):
  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


@contextlib.contextmanager
def _signals_raised(signums: Sequence[int]) -> Iterator[None]:
  """``signums`` raise `_Signalled` in the block (not the default: the launcher dying and orphaning its processes)."""
  def handler(signum, _):
    raise _Signalled(signum)
  previous = {s: signal.signal(s, handler) for s in signums}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def _stop(procs: list[subprocess.Popen], signum: int, grace: float) -> None:
  """``signum`` passed on to the running processes, SIGINT as SIGTERM (a terminal's Ctrl-C may have reached them
  already, and a second SIGINT would cost them their round in progress); up to ``grace`` s for them to end, then
  `_terminate`."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
  end = time.monotonic() + grace
  while any(p.poll() is None for p in procs) and time.monotonic() < end:
    time.sleep(POLL_SECONDS)
  _terminate(procs)


def _terminate(procs: list[subprocess.Popen]) -> None:
  """SIGTERM to every running process, SIGKILL to those still running a few seconds later."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  end = time.monotonic() + KILL_AFTER_TERM_SECONDS
  for p in procs:
    try:
      p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def main(argv: Sequence[str] | None = None) -> int:
  return launch(parse(argv))


if __name__ == "__main__":
  sys.exit(main())
