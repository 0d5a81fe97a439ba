"""CIFAR-100 through tensorflow-datasets (``pip install 'fedjax_hetero[tfds]'``).

``--coarse`` trains on the 20 superclass labels, which the FedCross authors'
code uses for its "CIFAR-100" results; the default is the 100 fine classes.
The default preset is FedCross's VGG-16 setting at its paper scale; pass
``--preset fedcross-cpu`` (CNNCifar, 100 rounds) on a CPU.
"""

from experiments.cli import main, preset

PRESET = preset(dataset="cifar100", output_dir="runs/cifar100", method="FedCross", groups=("vgg16",), epochs=5,
                batch_size=50, optimizer="sgd", learning_rate=0.01, momentum=0.5, rounds=1000, eval_every=20)

if __name__ == "__main__":
  main("cifar100", PRESET, __doc__.splitlines()[0], coarse_labels=True)
