"""CIFAR-10 through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

The default preset trains the InCo paper's ResNet10..26 depth groups (ImageNet
stem) with HeteroAvg: 100 clients, 10 per round, Dirichlet 0.5, Adam 1e-3
rebuilt every round, batch 64. On a CPU pass fewer rounds or narrower groups,
e.g. ``--groups resnet10@0.25,resnet14@0.25,resnet18@0.25,resnet22@0.25,resnet26@0.25``.
"""

from experiments.cli import main, preset

PRESET = preset(dataset="cifar10", output_dir="runs/cifar10",
                groups=("resnet10", "resnet14", "resnet18", "resnet22", "resnet26"),
                epochs=5, batch_size=64, rounds=500, eval_every=10)

if __name__ == "__main__":
  main("cifar10", PRESET, __doc__.splitlines()[0])
