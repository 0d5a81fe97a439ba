"""Executes notebooks/quickstart.ipynb end to end at tiny scale (real Fashion-MNIST).

The notebook's ``parameters`` cell is overridden papermill-style (assignments
appended to it) and the notebook runs in a fresh ipykernel that uses this
interpreter, with the repository on PYTHONPATH, so the install cell finds
``fedjax_hetero`` and never touches the network.
"""

from __future__ import annotations

import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install -e '.[test]')")

from fedjax_hetero.data import datasets  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")

# Tiny run: 2 rounds of 4 of 10 clients on 2000 train / 1000 test images.
OVERRIDES = {
    "ROUNDS": 2,
    "EVAL_EVERY": 1,
    "NUM_CLIENTS": 10,
    "CLIENTS_PER_ROUND": 4,
    "MAX_TRAIN_SAMPLES": 2000,
    "MAX_TEST_SAMPLES": 1000,
    "STEPS_PER_CALL": 1,  # compiles a one-step program instead of eight unrolled steps
    "PROGRESS": False,
}


def _fashion_mnist_unavailable() -> str | None:
  """Why Fashion-MNIST cannot be loaded without network, or None if it can."""
  dirs = [datasets.FASHION_MNIST_SYSTEM_DIR]
  if os.environ.get(datasets.DATA_DIR_ENV):
    dirs.insert(0, os.path.join(os.environ[datasets.DATA_DIR_ENV], "fashion-mnist"))
  for d in dirs:
    if all(os.path.isfile(os.path.join(d, f)) or os.path.isfile(os.path.join(d, f + ".gz"))
           for f in datasets.FASHION_MNIST_FILES):
      return None
  try:
    import tensorflow_datasets as tfds
    if tfds.builder("fashion_mnist").is_prepared():
      return None
  except Exception:  # not installed, or no prepared copy
    pass
  return (f"Fashion-MNIST not available offline: no IDX files in {' or '.join(dirs)} and no prepared "
          "tfds copy (apt-get install dataset-fashion-mnist, or set FEDJAX_HETERO_DATA_DIR)")


def _tagged_cell(nb, tag):
  cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
  assert len(cells) == 1, f"expected exactly one cell tagged {tag!r}, found {len(cells)}"
  return cells[0]


def _python_kernel(tmp_path, monkeypatch) -> str:
  """A 'python3' kernel spec running this interpreter, first on JUPYTER_PATH."""
  from ipykernel.kernelspec import install

  prefix = tmp_path / "jupyter-prefix"
  install(kernel_name="python3", prefix=str(prefix))
  data_dir = prefix / "share" / "jupyter"
  monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(data_dir), os.environ.get("JUPYTER_PATH")])))
  from jupyter_client.kernelspec import KernelSpecManager

  spec = KernelSpecManager().get_kernel_spec("python3")
  assert spec.argv[0] == sys.executable, spec.argv
  return "python3"


def test_notebook_is_stored_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, cell.source[:80]
  params = _tagged_cell(nb, "parameters")
  for name in OVERRIDES:
    assert f"\n{name} = " in "\n" + params.source, f"parameters cell has no {name}"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  reason = _fashion_mnist_unavailable()
  if reason:
    pytest.skip(reason)

  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = _tagged_cell(nb, "parameters")
  params.source += "\n\n# test overrides\n" + "".join(f"{k} = {v!r}\n" for k, v in OVERRIDES.items())

  kernel = _python_kernel(tmp_path, monkeypatch)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR",
                     os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path / "xla_cache"))
  client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=600,
                                   resources={"metadata": {"path": str(tmp_path)}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"notebook cell failed:\n{e}")

  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, "\n".join(f"{o.ename}: {o.evalue}" for o in errors)
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "already installed; skipping pip install" in text
  images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
  # partition plot, HeteroAvg accuracy, HeteroAvg-vs-FedAvg comparison
  assert len(images) >= 3, f"expected >= 3 PNG outputs, got {len(images)}"
  assert "changed" in text and "final test accuracy" in text
