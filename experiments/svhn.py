"""SVHN (cropped digits) through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

The defaults follow the InCo paper's ResNet setting (``--preset inco``); on a CPU use ``--preset inco-cpu``.
"""

from fedjax_hetero.cli.run import main

if __name__ == "__main__":
  main("svhn_cropped")
