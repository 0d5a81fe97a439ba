"""Executes the notebooks end to end at tiny scale (real Fashion-MNIST).

A notebook's ``parameters`` cell is overridden papermill-style (assignments
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

pytestmark = pytest.mark.slow  # end to end (`pytest -m "not slow"` leaves it out)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")
TPU_NOTEBOOK = os.path.join(REPO, "notebooks", "tpu_colab.ipynb")

# Tiny run: 2 rounds of 4 of 10 clients on 2000 train / 1000 test images, two CNN width groups instead of the
# notebook's three (each group compiles its own programs).
OVERRIDES = {
    "ROUNDS": 2,
    "EVAL_EVERY": 1,
    "NUM_CLIENTS": 10,
    "CLIENTS_PER_ROUND": 4,
    "MAX_TRAIN_SAMPLES": 2000,
    "MAX_TEST_SAMPLES": 1000,
    "GROUPS": ("cnn@0.5", "cnn@0.25"),
    "STEPS_PER_CALL": 1,  # compiles a one-step program instead of eight unrolled steps
    "PROGRESS": False,
}

# The TPU notebook on this CPU with 8 forced host devices: both methods, 2 rounds of 8 of 16 clients (one per
# device in each group's padded cohort), 512 train / 200 test images, one epoch at batch 16. The groups are two
# ViT depths (InCo pairs their blocks' LayerNorm scales) instead of the preset's ResNets: the run's cost is
# compilation, and two ResNet groups (resnet10, resnet14 at 1/16 width) took 64 s of CPU time against 30 s
# (jit(init) of a ResNet alone compiles for about 10 s), over the test's budget of about 40 s. The second
# method reuses the first one's client programs through the persistent compilation cache.
TPU_OVERRIDES = {
    "EXPECT_PLATFORM": "cpu",
    "DATASET": "fashion_mnist",
    "GROUPS": ("vit_d1", "vit_d2"),
    "WIDTH": 0.25,
    "ROUNDS": 2,
    "EVAL_EVERY": 1,
    "NUM_CLIENTS": 16,
    "CLIENTS_PER_ROUND": 8,
    "EPOCHS": 1,
    "BATCH_SIZE": 16,
    "MAX_TRAIN_SAMPLES": 512,
    "MAX_TEST_SAMPLES": 200,
}
HOST_DEVICES = 8


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


def _execute(path: str, overrides: dict, tmp_path, monkeypatch):
  """Runs the notebook with ``overrides`` in a fresh kernel (its environment: this process's, as monkeypatched);
  returns its code cells' outputs and their stream text."""
  nb = nbformat.read(path, as_version=4)
  params = _tagged_cell(nb, "parameters")
  params.source += "\n\n# test overrides\n" + "".join(f"{k} = {v!r}\n" for k, v in overrides.items())

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
  return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def _images(outputs) -> list:
  return [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]


@pytest.mark.parametrize("path, overrides", [(NOTEBOOK, OVERRIDES), (TPU_NOTEBOOK, TPU_OVERRIDES)],
                         ids=["quickstart", "tpu_colab"])
def test_notebook_is_stored_without_outputs(path, overrides):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, cell.source[:80]
  params = _tagged_cell(nb, "parameters")
  for name in overrides:
    assert f"\n{name} = " in "\n" + params.source, f"parameters cell has no {name}"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  reason = _fashion_mnist_unavailable()
  if reason:
    pytest.skip(reason)
  outputs, text = _execute(NOTEBOOK, OVERRIDES, tmp_path, monkeypatch)
  assert "already installed; skipping pip install" in text
  # partition plot, HeteroAvg accuracy, HeteroAvg-vs-FedAvg comparison
  assert len(_images(outputs)) >= 3, f"expected >= 3 PNG outputs, got {len(_images(outputs))}"
  assert "changed" in text and "final test accuracy" in text


@pytest.mark.slow
def test_tpu_notebook_runs_sharded_on_8_host_devices(tmp_path, monkeypatch):
  reason = _fashion_mnist_unavailable()
  if reason:
    pytest.skip(reason)
  # The kernel's environment, read when it imports jax: 8 CPU devices for the sharded backend's mesh.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
  monkeypatch.setenv("XLA_FLAGS", " ".join([*flags, f"--xla_force_host_platform_device_count={HOST_DEVICES}"]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  outputs, text = _execute(TPU_NOTEBOOK, TPU_OVERRIDES, tmp_path, monkeypatch)
  assert "already installed; skipping pip install" in text
  assert f"platform: cpu | {HOST_DEVICES} devices" in text
  assert f"over {HOST_DEVICES} devices" in text
  for method in ("HeteroAvg", "InCoAvg"):
    assert f"{method} round    2" in text, text
  assert "rounds/s" in text and "final test accuracy" in text
  assert len(_images(outputs)) == 1  # accuracy per group of both methods, beside the round times
