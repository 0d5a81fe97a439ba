"""The installed distribution: ``pip install .`` into a fresh virtual environment, then used from another
directory, as a user's project would (one with an ``experiments/`` folder of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

from tests.helpers import REPO

# End to end (`pytest -m "not slow"` leaves it out). One worker runs the module, so its module-scoped wheel builds
# once (scripts/test.sh: --dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packaging")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
  out = tmp_path_factory.mktemp("wheel")
  proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), REPO],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  [name] = os.listdir(out)
  return str(out / name)


def test_the_wheel_holds_the_library_alone(wheel):
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
  assert {name.split("/")[0] for name in names} == {"fedjax_hetero", "fedjax_hetero-0.1.0.dist-info"}
  assert "fedjax_hetero/cli/run.py" in names and "fedjax_hetero/config/declare.py" in names
  assert "fedjax-hetero = fedjax_hetero.cli.__main__:console" in entry_points


def test_a_fresh_install_runs_from_another_directory(wheel, tmp_path):
  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=False)
  python = env_dir / "bin" / "python"
  # Outside the repository, without its PYTHONPATH: there pip would find the checkout and skip the install.
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", wheel],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  # The dependencies (jax, flax, ...) come from this test's environment rather than the network: a path entry
  # to its site-packages, after the fresh one (so its editable fedjax_hetero, a .pth hook there, stays unused).
  purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
  with open(os.path.join(purelib, "_test_dependencies.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  project = tmp_path / "project"
  (project / "experiments").mkdir(parents=True)
  (project / "experiments" / "__init__.py").write_text("")  # a user's own experiments package
  env["JAX_PLATFORMS"] = "cpu"
  where = subprocess.run([str(python), "-c", "import fedjax_hetero, experiments, importlib.util as u; "
                          "print(fedjax_hetero.__file__, experiments.__file__, u.find_spec('benchmarks'))"],
                         cwd=project, env=env, capture_output=True, text=True, timeout=300)
  assert where.returncode == 0, where.stderr
  library, theirs, benchmarks = where.stdout.split()
  assert library.startswith(str(env_dir)) and theirs.startswith(str(project)) and benchmarks == "None"
  run = subprocess.run([str(env_dir / "bin" / "fedjax-hetero"), "run", "--dataset", "synthetic", "--groups", "mlp",
                        "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1", "--no-progress",
                        "--compile-cache", "off", "--output-dir", "runs/first"],
                       cwd=project, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr
  assert (project / "runs" / "first" / "summary.json").exists()
  help_text = subprocess.run([str(env_dir / "bin" / "fedjax-hetero"), "compare", "--help"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=300)
  assert help_text.returncode == 0 and "--baseline" in help_text.stdout
