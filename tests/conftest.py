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
``FEDJAX_HETERO_TEST_FULL_OPTIMIZATION=1`` to run the suite at XLA's default level.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# XLA reads XLA_FLAGS once, when jax first computes: set here, before anything imports jax, it reaches this
# process, the xdist workers and the subprocesses the tests start (they inherit the environment).
FULL_OPTIMIZATION_ENV = "FEDJAX_HETERO_TEST_FULL_OPTIMIZATION"
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if os.environ.get(FULL_OPTIMIZATION_ENV) != "1" and "--xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

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
