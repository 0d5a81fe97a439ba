"""CIFAR-10 through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

The defaults train the InCo paper's ResNet10..26 depth groups (ImageNet stem) with HeteroAvg: 100 clients,
10 per round, Dirichlet 0.5, Adam 1e-3 rebuilt every round, batch 64. On a CPU pass fewer rounds or narrower
groups, e.g. ``--groups resnet10@0.25,resnet14@0.25,resnet18@0.25,resnet22@0.25,resnet26@0.25``.
"""

from fedjax_hetero.cli.run import main
from fedjax_hetero.run.interruption import the_process_is_a_command

if __name__ == "__main__":
  the_process_is_a_command()
  main("cifar10")
