"""CIFAR-100 through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

``--coarse`` trains on the 20 superclass labels, which the FedCross authors' code uses for its "CIFAR-100"
results; the default is the 100 fine classes. The defaults are FedCross's VGG-16 setting at its paper scale;
pass ``--preset fedcross-cpu`` (CNNCifar, 100 rounds) on a CPU.
"""

from fedjax_hetero.cli.run import main
from fedjax_hetero.run.interruption import the_process_is_a_command

if __name__ == "__main__":
  the_process_is_a_command()
  main("cifar100", coarse_labels=True)
