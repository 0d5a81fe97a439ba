"""Multi-process runs on jax.distributed (`fedjax_hetero.distributed`, `experiments.launch`).

Three runs of processes, shared by the tests (module fixture `runs`), on a tiny Fashion-MNIST subset:

* one process of 4 CPU devices: HeteroAvg, InCoAvg and FedCross on the sharded backend (that one process's
  sharded backend equals the sequential one is tests/test_backends.py's);
* `experiments.launch`, 2 processes x 2 devices: the same three sharded runs, HeteroAvg last: in it process 1
  kills itself (SIGKILL) before round 2;
* `experiments.launch` 2 x 2 again, HeteroAvg, where process 1 gets a SIGTERM of its own before round 1: both
  processes stop after round 1, together, with a checkpoint;
* `experiments.launch` again, resuming the killed and the signalled runs; the resumed runs are the HeteroAvg
  run compared with the others (round 1 from the stopped processes, round 2 from the new ones).

Every run goes through ``experiments.fmnist``'s command line (`tests.distributed_run` runs several in one
process, so that they share its start-up). The bad-input tests run in this process and start nothing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fedjax_hetero import distributed
from fedjax_hetero.cli import launch
from fedjax_hetero.cli import run as cli
from fedjax_hetero.config.distributed import from_flags
from tests.helpers import FMNIST_FILE, REPO

# One xdist worker runs the whole module, so its module-scoped launches run once (scripts/test.sh: --dist loadgroup).

ROUNDS = 2
HEARTBEAT_S = 10
COMMON = ["--num-clients", "8", "--clients-per-round", "4", "--rounds", str(ROUNDS), "--eval-every", "1",
          "--checkpoint-every", "1", "--max-train-samples", "320", "--max-test-samples", "64", "--image-size", "8",
          "--batch-size", "16", "--no-progress", "--no-dissimilarity", "--heartbeat-timeout", str(HEARTBEAT_S)]
# Tiny groups each method accepts (InCo needs same-shaped layers: a ViT block's two LayerNorms).
GROUPS = {"HeteroAvg": "mlp@0.25,mlp@0.125", "InCoAvg": "vit_d1@0.125", "FedCross": "mlp@0.25"}
# 2 processes x 2 devices against 1 x 4: the same programs on the same mesh, but the cross-process sums run over
# gloo, in another order (seen: round 1 equal, round 2 within 1e-7).
SAME_MESH_RTOL = 1e-5
# A killed process must end the other within this time. A collective the survivor starts after the death fails at
# once; one it was already waiting in (here: round 2's sum) ends when jax's coordination service declares the
# silent process dead, after --heartbeat-timeout (10 s here), and aborts the survivor naming it.
DEATH_NOTICE_S = HEARTBEAT_S + 20
TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("distributed"),
              pytest.mark.skipif(not os.path.exists(FMNIST_FILE),
                                 reason="Fashion-MNIST Debian package not installed (apt-get install dataset-fashion-mnist)")]


def flags(method: str, backend: str, out) -> list[str]:
  return ["--method", method, "--groups", GROUPS[method], "--backend", backend, "--output-dir", str(out), *COMMON]


def env(devices: int | None = None) -> dict[str, str]:
  """This process's environment for a child (this checkout first on its path), with ``devices`` CPU devices the
  way `experiments.launch` gives them to its processes."""
  environment = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  return launch.process_env(devices, environment) if devices else environment


def start_driver(spec: dict, path, launched: bool, log) -> subprocess.Popen:
  """`tests.distributed_run` with ``spec``: under `experiments.launch` (2 x 2) or as one process of 4 devices."""
  with open(path, "w") as f:
    json.dump(spec, f)
  if launched:
    cmd = [sys.executable, "-m", "experiments.launch", "--num-processes", "2", "--devices-per-process", "2",
           "--grace", "60", "--", "tests.distributed_run", str(path)]
    environment = env()
  else:
    cmd = [sys.executable, "-m", "tests.distributed_run", str(path)]
    environment = env(devices=4)
  return subprocess.Popen(cmd, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT)


def read_rows(out) -> list[dict]:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("distributed")
  out = {(m, kind): base / f"{m}-{kind}" for m in GROUPS for kind in ("1x4", "2x2")}
  killed, stamp, signalled = out["HeteroAvg", "2x2"], base / "died_at", base / "HeteroAvg-2x2-signalled"
  last = ("InCoAvg", "FedCross", "HeteroAvg")
  specs = {
      "single": {"runs": [flags(m, "sharded", out[m, "1x4"]) for m in GROUPS]},
      "pair": {"runs": [flags(m, "sharded", out[m, "2x2"]) for m in last],
               "die": {"run": last.index("HeteroAvg"), "process": 1, "round": 2,
                       "after": str(killed / "checkpoints" / "1"), "stamp": str(stamp)}},
      "signalled": {"runs": [flags("HeteroAvg", "sharded", signalled)],
                    "signal": {"run": 0, "process": 1, "round": 1, "name": "SIGTERM"}},
      "resume": {"runs": [flags("HeteroAvg", "sharded", killed) + ["--resume"],
                          flags("HeteroAvg", "sharded", signalled) + ["--resume"]]}}
  logs = {name: open(base / f"{name}.log", "w") for name in specs}
  start = lambda name, launched: start_driver(specs[name], base / f"{name}.json", launched, logs[name])
  # The single process and the pair side by side (the pair's processes wait for each other at every collective),
  # then one launch after another: each pair alone, so a process's death is noticed in `DEATH_NOTICE_S`.
  procs, ended, stopped_rows = {"single": start("single", False), "pair": start("pair", True)}, {}, {}
  after = {"pair": "signalled", "signalled": "resume"}
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while len(ended) < len(specs):
      if time.monotonic() > deadline:
        raise TimeoutError(f"the test's processes ran for more than {TIMEOUT_S} s")
      for name, proc in list(procs.items()):
        if name not in ended and proc.poll() is not None:
          ended[name] = time.time()
          if name in after:
            folder = killed if name == "pair" else signalled
            written = folder / "summary.json"
            summary = json.loads(written.read_text()) if written.exists() else None
            stopped_rows[name] = ([r["round"] for r in read_rows(folder)], summary,
                                  sorted(os.listdir(folder / "checkpoints")))
            procs[after[name]] = start(after[name], True)
      time.sleep(0.05)
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
    for log in logs.values():
      log.close()
  results = {}
  for name, proc in procs.items():
    with open(base / f"{name}.log") as f:
      results[name] = (proc.returncode, f.read(), ended[name])
  return dict(out=out, killed=killed, killed_rows=stopped_rows["pair"][0], stamp=stamp, single=results["single"],
              pair=results["pair"], resumed=results["resume"], signalled=signalled,
              signalled_stop=stopped_rows["signalled"], signalled_launch=results["signalled"])


def test_one_process_of_four_devices_runs_every_method(runs):
  status, output, _ = runs["single"]
  assert status == 0, output[-3000:]
  for method in GROUPS:
    assert [r["round"] for r in read_rows(runs["out"][method, "1x4"])] == [1, 2], method


def test_two_processes_of_two_devices_equal_one_of_four(runs):
  assert runs["single"][0] == 0, runs["single"][1][-3000:]
  for method in GROUPS:
    with open(os.path.join(runs["out"][method, "2x2"], "summary.json")) as f:
      summary = json.load(f)
    assert (summary["processes"], summary["devices"], summary["backend"]) == (2, 4, "sharded")
    pair, single = read_rows(runs["out"][method, "2x2"]), read_rows(runs["out"][method, "1x4"])
    assert len(pair) == len(single) == ROUNDS, method
    for a, b in zip(pair, single):
      where = f"{method} round {a['round']}"
      assert (a["clients"], a["examples"]) == (b["clients"], b["examples"]), where
      np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=SAME_MESH_RTOL, err_msg=where)
      for group, loss in b["train_loss_per_group"].items():
        np.testing.assert_allclose(a["train_loss_per_group"][group], loss, rtol=SAME_MESH_RTOL, err_msg=where)
      assert a["test_accuracy"] == b["test_accuracy"], where


def test_only_process_zero_writes_and_every_process_checkpoints(runs):
  folder = runs["out"]["FedCross", "2x2"]
  assert sorted(os.listdir(folder)) == ["accuracy.png", "checkpoints", "config.json", "data_fingerprint.json",
                                        "metrics.jsonl", "partition.png", "partition.txt", "summary.json"]
  assert sorted(os.listdir(os.path.join(folder, "checkpoints"))) == ["1", "2"]
  with open(os.path.join(folder, "config.json")) as f:
    assert json.load(f)["processes"] == 2
  output = runs["pair"][1]
  assert output.count("fashion_mnist: 320 train") == len(GROUPS), output[-3000:]  # process 0's log, per run
  assert "[process 1] fashion_mnist" not in output


def test_a_killed_process_ends_the_other_with_a_clear_error(runs):
  status, output, ended = runs["pair"]
  assert status != 0, output[-3000:]
  with open(runs["stamp"]) as f:
    died = float(f.read())
  assert ended - died < DEATH_NOTICE_S, (ended - died, output[-3000:])
  assert "launch: process 1 was killed by SIGKILL" in output, output[-3000:]
  assert "launch again with --resume added to the run's flags" in output, output[-3000:]
  # Process 0 stopped by itself (the launcher's grace is 60 s), saying why: a failed collective (our line, with no
  # traceback), or jax's coordination service naming the process that stopped sending heartbeats (jax's abort).
  ours = ("process 0 exited with status 1" in output and "error: process 0 of 2: process 1 stopped (" in output
          and "Traceback" not in output)
  jaxs = ("process 0 was killed by SIGABRT" in output and "The following tasks are unhealthy (stopped sending "
          "heartbeats):\n1\n" in output and "another task died" in output)
  assert ours or jaxs, output[-3000:]
  assert runs["killed_rows"] == [1]


def test_resume_with_the_same_processes_completes_the_killed_run(runs):
  """The resumed run equals the uninterrupted one of 1 process x 4 devices within `SAME_MESH_RTOL`, the tolerance
  2 x 2 and 1 x 4 agree to (test_two_processes_of_two_devices_equal_one_of_four checks every number)."""
  status, output, _ = runs["resumed"]
  assert status == 0, output[-3000:]
  assert output.count("resumed from round 1") == 2, output[-3000:]
  straight = read_rows(runs["out"]["HeteroAvg", "1x4"])
  for folder in (runs["killed"], runs["signalled"]):
    resumed = read_rows(folder)
    assert [r["round"] for r in resumed] == [1, 2]
    for a, b in zip(resumed, straight):
      assert (a["clients"], a["examples"], a["test_accuracy"]) == (b["clients"], b["examples"], b["test_accuracy"])
      np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=SAME_MESH_RTOL)


def test_a_sigterm_to_one_process_stops_every_process_after_the_same_call_with_a_checkpoint(runs):
  """(The other process waited in a collective until the heartbeat timeout, and no summary was written.) The
  processes agree on the stop at the end of the call; resume completes the run (next test)."""
  status, output, _ = runs["signalled_launch"]
  assert status == 128 + signal.SIGTERM, output[-3000:]
  assert "launch: process" in output and "exited with status 143" in output, output[-3000:]
  assert "SIGTERM reached another process: stopping after this call" in output, output[-3000:]  # process 0
  assert "interrupted after round 1 of 2 (SIGTERM)" in output, output[-3000:]
  rows, summary, saved = runs["signalled_stop"]  # (as the processes left the folder, before its resume)
  assert rows == [1] and saved == ["1"]
  assert summary["interrupted"] == {"signal": "SIGTERM", "completed_round": 1}


def test_resume_with_another_process_count_is_refused(runs, tmp_path, capsys, no_compute):
  assert runs["resumed"][0] == 0
  argv = flags("HeteroAvg", "sharded", runs["killed"]) + ["--resume", "--rounds", "3"]
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  assert info.value.code == 2
  assert "with 1 process(es): it was run with 2" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- bad input

@pytest.fixture
def no_join(monkeypatch):
  """Fails the test if this process would join a multi-process run."""

  def forbidden(config):
    raise AssertionError(f"joined a run with a bad input: {config}")

  monkeypatch.setattr(distributed, "initialize", forbidden)


BAD = [
    ("--coordinator 127.0.0.1:1234 --num-processes 2 --process-id 2",
     "--process-id must be in [0, 1] for --num-processes 2, got 2"),
    ("--coordinator 127.0.0.1:1234 --num-processes 0 --process-id 0", "--num-processes must be an integer >= 1, got 0"),
    ("--coordinator 127.0.0.1 --num-processes 2 --process-id 0", "--coordinator must be HOST:PORT"),
    ("--num-processes 2 --process-id 0", "given without --coordinator"),
    ("--coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0 --backend sequential",
     "--backend sequential trains on this process's devices only"),
    ("--distributed auto --distributed-timeout 0", "--distributed-timeout must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("args, fragment", BAD, ids=[a for a, _ in BAD])
def test_bad_multi_process_flags_are_rejected_before_anything_starts(args, fragment, tmp_path, capsys, no_compute,
                                                                      no_join):
  argv = ["--output-dir", str(tmp_path / "out"), *args.split()]
  with pytest.raises(SystemExit) as info:
    cli.main("fashion_mnist", argv)
  assert info.value.code == 2
  assert fragment in capsys.readouterr().err


def test_the_coordinator_settings_come_from_the_environment(monkeypatch):
  environ = {"FEDJAX_HETERO_COORDINATOR": "10.0.0.1:1234", "FEDJAX_HETERO_NUM_PROCESSES": "4",
             "FEDJAX_HETERO_PROCESS_ID": "3"}
  config = from_flags(environ=environ)
  assert (config.coordinator, config.num_processes, config.process_id, config.multi_process) == (
      "10.0.0.1:1234", 4, 3, True)
  assert from_flags(process_id=1, environ=environ).process_id == 1  # a flag wins
  with pytest.raises(ValueError, match=r"\$FEDJAX_HETERO_NUM_PROCESSES must be an integer \(--num-processes\), "
                                       r"got 'two'"):
    from_flags(environ={**environ, "FEDJAX_HETERO_NUM_PROCESSES": "two"})
  assert not from_flags(environ={}).enabled
  assert from_flags("auto", environ={}).multi_process is None  # jax's detection will tell


@pytest.mark.parametrize("argv, fragment", [
    (["--num-processes", "0", "--", "experiments.fmnist"], "--num-processes must be an integer >= 1, got 0"),
    (["--devices-per-process", "2"], "give the experiment module and its flags after --"),
    (["--", "experiments.fmnist", "--process-id", "1"], "the launcher sets"),
])
def test_the_launcher_rejects_bad_input(argv, fragment, capsys):
  with pytest.raises(SystemExit) as info:
    launch.parse(argv)
  assert info.value.code == 2
  assert fragment in capsys.readouterr().err


def test_the_launcher_documents_itself():
  text = launch.build_parser().format_help()
  for fragment in ("--num-processes", "--devices-per-process", "--grace", "--log-dir", "experiments.fmnist",
                   "--xla_force_host_platform_device_count", "127.0.0.1"):
    assert fragment in text, fragment
  assert launch.process_env(3, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"})["XLA_FLAGS"] == (
      "--foo --xla_force_host_platform_device_count=3")


def test_the_launcher_drains_a_process_whose_lines_it_can_no_longer_show():
  """(``launch ... | head``: the thread showing process I's lines died on the broken pipe, and the process would
  block on its full pipe.)"""
  class Closed(io.StringIO):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")
  lines = iter(["a\n", "b\n", "c\n"])
  launch._pump(lines, Closed(), "[process 1] ")
  assert next(lines, None) is None


SLEEPER = '''
import os, signal, sys, time
folder = os.environ["SLEEPER_DIR"]
def stop(signum, frame):
  open(os.path.join(folder, f"stopped-{os.getpid()}"), "w").close()
  sys.exit(int(os.environ.get("SLEEPER_STATUS", 143)))  # (a run's status when a signal stopped it)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(folder, f"started-{os.getpid()}"), "w").close()
time.sleep(120)
'''


@pytest.mark.parametrize("status", [143, 0], ids=["stopped", "finished"])
def test_a_sigterm_to_the_launcher_reaches_every_process_and_it_waits_for_them(tmp_path, status):
  """(It orphaned them.) The processes stand for runs: each records the SIGTERM it gets, then ends, stopped by it
  (143), or having finished its run as the signal came (0): the launcher's status is then 0 too."""
  (tmp_path / "sleeper.py").write_text(SLEEPER)
  env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "SLEEPER_DIR": str(tmp_path),
         "SLEEPER_STATUS": str(status)}
  launcher = subprocess.Popen([sys.executable, "-m", "experiments.launch", "--num-processes", "2", "--grace", "20",
                               "--", "sleeper"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  pids = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("started-*"))
  assert len(pids) == 2, launcher.stderr
  launcher.send_signal(signal.SIGTERM)
  _, err = launcher.communicate(timeout=30)
  assert launcher.returncode == status, err
  assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("stopped-*")) == pids, err
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
  assert "launch: SIGTERM: waiting up to 20 s for the processes to stop" in err


def test_a_launcher_killed_outright_takes_its_processes_with_it(tmp_path):
  """(Its processes ran on as orphans.) SIGKILL leaves the launcher no handler: the kernel signals them."""
  (tmp_path / "sleeper.py").write_text(SLEEPER)
  env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "SLEEPER_DIR": str(tmp_path)}
  launcher = subprocess.Popen([sys.executable, "-m", "experiments.launch", "--num-processes", "2", "--", "sleeper"],
                              cwd=REPO, env=env, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 60
  while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  pids = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("started-*"))
  assert len(pids) == 2
  launcher.kill()
  launcher.wait()
  deadline = time.monotonic() + 20
  while len(list(tmp_path.glob("stopped-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("stopped-*")) == pids
