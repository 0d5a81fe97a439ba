"""SVHN (cropped digits) through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

Defaults follow the InCo paper's ResNet setting (``--preset inco``); on a CPU
use ``--preset inco-cpu``.
"""

from experiments.cli import main, preset
from experiments.presets import get_preset

PRESET = preset(dataset="svhn_cropped", **{**get_preset("inco").values, "output_dir": "runs/svhn"})

if __name__ == "__main__":
  main("svhn_cropped", PRESET, __doc__.splitlines()[0])
