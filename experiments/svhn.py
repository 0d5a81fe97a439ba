"""SVHN (cropped digits) through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

The defaults follow the InCo paper's ResNet setting (``--preset inco``); on a CPU use ``--preset inco-cpu``.
"""

from fedjax_hetero.cli.run import main
from fedjax_hetero.run.interruption import the_process_is_a_command

if __name__ == "__main__":
  the_process_is_a_command()
  main("svhn_cropped")
