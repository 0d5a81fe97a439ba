"""Shared test setup: one XLA compilation cache per test session, and compiled programs released between modules.

The suite builds a few hundred simulations, many of them compiling the same programs (the same tiny models and
methods under different tests). A persistent compilation cache in a fresh temporary directory, shared by the
pytest-xdist workers and the CLI subprocesses the tests start, lets every program after the first load from it:
it halves the suite's time on 2 cores. The directory is new for every session and removed after it, so no test
depends on what another session left; a cache hit is the same executable, so no result changes.

Kept alive, the XLA:CPU executables of one process filled its memory mappings up to the kernel's limit
(vm.max_map_count), where XLA's compiler segfaulted (see `fedjax_hetero.compilation.mapping_headroom`); so after a
module, a worker holding over `RELEASE_ABOVE` of that limit releases what it compiled. Below it the programs stay,
and a later module that builds the same static structure (the library's `program_cache`) finds them compiled:
releasing after every module cost 6% of the CPU time of three runner modules (165.6 s against 155.3 s) and 10% of
their wall time. The fraction sits well under the library's own release (60%), which warns.

The tests compile hundreds of programs on tiny models, and LLVM's optimizations of the code XLA:CPU generates were
half of each compile: the suite runs with them off (``--xla_backend_optimization_level=0``, XLA's graph passes
unchanged), which took a quarter off its time (41:18 to 31:38 on 2 cores). The last bits of float results differ
from the default level, so the golden record keeps one record per level (`tests.golden.signature`); set
``FEDJAX_HETERO_TEST_FULL_OPTIMIZATION=1`` to run the suite at XLA's default settings.

It also compiles with XLA:CPU's older emitters (``--xla_cpu_use_fusion_emitters=false``), which generate less code
for the same fusions: the fast loop took 3:26 against 4:25. Their float results differ in the last bits too (a
record of their own in the golden file), and two properties hold only under the default emitters: a job's runs,
mapped one after another, equal their runs alone bit for bit, and so do local steps in unrolled chunks and one
step per call (the older emitters round the runs axis' loop and a chunk's steps differently). The tests of them
are marked ``default_emitters`` and run in a child pytest without that flag (`pytest_pyfunc_call` below), as a
user's runs compile.

XLA:CPU splits a module's generated code into parts that LLVM compiles on a pool of threads; in a suite whose two
workers keep both cores busy the parts only add their overhead. Compiled as one part
(``--xla_cpu_parallel_codegen_split_count=1``), tests/test_round_program.py took 2:06 and 2:13 on 2 workers against
2:32 with 32 parts (3:54-4:01 user against 4:26). With the older emitters one part gives other last bits (a golden
record of its own, `tests.golden.signature`); with the default ones the chunked golden entries keep their bits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

# XLA reads XLA_FLAGS once, when jax first computes: set here, before anything imports jax, it reaches this
# process, the xdist workers and the subprocesses the tests start (they inherit the environment).
FULL_OPTIMIZATION_ENV = "FEDJAX_HETERO_TEST_FULL_OPTIMIZATION"
DEFAULT_EMITTERS_ENV = "FEDJAX_HETERO_TEST_DEFAULT_EMITTERS"  # set in the child pytest of a `default_emitters` test
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", OLDER_EMITTERS, ONE_CODEGEN_PART)
PROBED = (OLDER_EMITTERS, ONE_CODEGEN_PART)  # newer flags, which a later jaxlib may drop


def _xla_knows(flags: list[str]) -> bool:
  """Whether the installed XLA accepts every one of ``flags`` (it aborts on a flag it does not know). Asked once,
  by the first process: the xdist workers inherit the flags it set."""
  env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
  probe = [sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"]
  return subprocess.run(probe, env=env, capture_output=True).returncode == 0


if os.environ.get(FULL_OPTIMIZATION_ENV) != "1":
  _set = os.environ.get("XLA_FLAGS", "")
  _wanted = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in _set
             and not (f == OLDER_EMITTERS and os.environ.get(DEFAULT_EMITTERS_ENV) == "1")]
  _probed = [f for f in _wanted if f in PROBED]
  if _probed and not _xla_knows(_probed):  # (one probe, ~2 s, for all; each alone only when one is refused)
    _wanted = [f for f in _wanted if f not in PROBED or _xla_knows([f])]
  os.environ["XLA_FLAGS"] = " ".join([_set, *_wanted]).strip()

import jax  # noqa: E402 - after XLA_FLAGS
import pytest  # noqa: E402

try:
  from _pytest.nodeid import NodeId  # the pytest installed here (9.2), whose node ids are not _nodeid
except ImportError:  # a pytest without it reads the tag xdist appends to _nodeid itself
  NodeId = None

from fedjax_hetero.compilation import CACHE_ENV, memory_mappings, release_programs  # noqa: E402
from fedjax_hetero.methods import METHODS  # noqa: E402
from fedjax_hetero.rounds import RoundSpec, Simulation  # noqa: E402

_SESSION_CACHE_ENV = "FEDJAX_HETERO_TEST_SESSION_CACHE"  # set by the controller, read by the xdist workers
RELEASE_ABOVE = 0.3  # of vm.max_map_count: a module's programs take a few percent of it


def pytest_configure(config):
  directory = os.environ.get(_SESSION_CACHE_ENV)
  if directory is None:  # the controller (or a run without xdist): workers start after this and inherit it
    directory = tempfile.mkdtemp(prefix="fedjax_hetero_test_xla_")
    os.environ[_SESSION_CACHE_ENV] = directory
    config._session_cache_owner = True
  os.environ[CACHE_ENV] = directory  # the CLI subprocesses and in-process runners use it too
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # A suite started in the background (`... &` from a script) inherits SIGINT ignored, as a shell sets it for such
  # jobs; its in-process signal tests need Python's handler, as a terminal's process has it (the notebooks' kernels
  # used to put it back for whichever tests ran after them in their worker).
  if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Keeps a module marked `xdist_group` on one worker under ``--dist loadgroup`` (scripts/test.sh).

  pytest-xdist 3.8 tags such a test by appending ``@group`` to ``item._nodeid``, which pytest 9.2 no longer reads
  (a node's id is ``item._id``): every group was spread over both workers, and each worker set up the module's
  fixtures again (test_distributed.py's launches ran twice). This applies the tag xdist meant, once."""
  if NodeId is None or not getattr(config.option, "loadgroup", False):  # (set in the workers under loadgroup)
    return
  for item in items:
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    suffix = "@" + "_".join(names)
    if names and not item.nodeid.endswith(suffix):
      item._id = NodeId.parse(item.nodeid + suffix)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """Runs a test marked ``default_emitters`` in a child pytest compiling with XLA:CPU's default emitters, when this
  process compiles with the older ones (see the module's docstring)."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  if pyfuncitem.get_closest_marker("default_emitters") is None or OLDER_EMITTERS not in flags:
    return None
  env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
  env.update(XLA_FLAGS=" ".join(f for f in flags if f != OLDER_EMITTERS), **{DEFAULT_EMITTERS_ENV: "1"})
  with tempfile.TemporaryDirectory(prefix="fedjax_hetero_child_") as basetemp:
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", basetemp,
                            f"{pyfuncitem.path}::{pyfuncitem.name}"], cwd=pyfuncitem.config.rootpath, env=env,
                           capture_output=True, text=True)
  if child.returncode != 0:  # (5, no test collected, fails too)
    pytest.fail(f"at XLA's default emitters, in a child pytest (exit {child.returncode}):\n{child.stdout[-8000:]}"
                f"{child.stderr[-2000:]}", pytrace=False)
  return True


def pytest_unconfigure(config):
  if getattr(config, "_session_cache_owner", False):
    shutil.rmtree(os.environ.pop(_SESSION_CACHE_ENV), ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  counted = memory_mappings()
  if counted is None or counted[0] > RELEASE_ABOVE * counted[1]:
    release_programs()


@pytest.fixture(autouse=True, scope="module")
def _methods_registered_by_a_module_stay_in_it():
  """A registered method (the README's FedAvgM, run by tests/test_docs.py) would otherwise show in the --help
  of every later module of the same worker (docs/cli.md's test)."""
  before = dict(METHODS)
  yield
  METHODS.clear()
  METHODS.update(before)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
  """A test that leaves SIGINT or SIGTERM ignored (a command's `command_finished` outside `one_line_on_signals`)
  fails itself, naming them, instead of a later in-process signal test of its worker failing for it. The handlers
  are put back either way."""
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  yield
  after = {s: signal.getsignal(s) for s in before}
  for signum, handler in before.items():
    signal.signal(signum, handler)
  changed = [f"{signal.Signals(s).name}: {before[s]!r} -> {after[s]!r}" for s in before if after[s] != before[s]]
  assert not changed, f"the test left signal handlers changed ({'; '.join(changed)})"


@pytest.fixture
def no_compute(monkeypatch):
  """Fails the test if a simulation initializes or trains (bad input must be rejected before)."""

  def forbidden(*args, **kwargs):
    raise AssertionError("compute started before the input was rejected")

  monkeypatch.setattr(RoundSpec, "init_state", forbidden)
  monkeypatch.setattr(Simulation, "run_call", forbidden)


def pytest_terminal_summary(terminalreporter):
  """Says under the summary line why the golden record was skipped, if it was (another jax version)."""
  skipped = terminalreporter.stats.get("skipped", [])
  reasons = {report.longrepr[2] for report in skipped
             if "test_golden" in report.nodeid and isinstance(report.longrepr, tuple)}
  for reason in sorted(r.removeprefix("Skipped: ") for r in reasons if "golden record skipped" in r):
    terminalreporter.write_line(reason, yellow=True, bold=True)
