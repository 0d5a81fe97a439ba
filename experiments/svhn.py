"""SVHN (cropped digits) through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

The defaults follow the InCo paper's ResNet setting (``--preset inco``); on a CPU use ``--preset inco-cpu``.
"""

from fedjax_hetero.cli.run import main
from fedjax_hetero.run.interruption import exit_zero_on_signals

if __name__ == "__main__":
  main("svhn_cropped")
  exit_zero_on_signals()  # (the run is done: a signal as the process exits is no interruption)
