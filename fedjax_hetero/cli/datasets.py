"""Each dataset's default run: what ``python -m experiments.<dataset>`` (and ``--dataset``) starts from.

Flags given on the command line, and a ``--preset``, change these defaults.
"""

from __future__ import annotations

from typing import NamedTuple

from fedjax_hetero.cli.presets import get_preset
from fedjax_hetero.config import RunConfig


class DatasetDefaults(NamedTuple):
  dataset: str
  description: str
  values: dict  # flag name -> value, over the library's defaults

  def config(self) -> RunConfig:
    return RunConfig.from_flags(dataset=self.dataset, **self.values)


_INCO_RESNETS = ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")

DATASETS: dict[str, DatasetDefaults] = {d.dataset: d for d in (
    # Evaluating the three models on the 10,000 test images costs about as much as two rounds on a 2-core CPU, so
    # the demo evaluates every 10 rounds (and after the last).
    DatasetDefaults("fashion_mnist", "Fashion-MNIST: the demo (heterogeneous-width CNNs, HeteroAvg, Dirichlet 0.5)",
                    dict(output_dir="runs/fmnist", eval_every=10)),
    DatasetDefaults("cifar10", "CIFAR-10 through tensorflow-datasets: the InCo paper's ResNet10..26 depth groups",
                    dict(output_dir="runs/cifar10", groups=_INCO_RESNETS, epochs=5, batch_size=64, rounds=500,
                         eval_every=10)),
    DatasetDefaults("cifar100", "CIFAR-100 through tensorflow-datasets: FedCross's VGG-16 setting",
                    dict(output_dir="runs/cifar100", method="FedCross", groups=("vgg16",), epochs=5, batch_size=50,
                         optimizer="sgd", learning_rate=0.01, momentum=0.5, rounds=1000, eval_every=20)),
    DatasetDefaults("svhn_cropped", "SVHN (cropped digits) through tensorflow-datasets: the InCo paper's setting",
                    {**get_preset("inco").values, "output_dir": "runs/svhn"}),
    DatasetDefaults("synthetic", "synthetic data (tests and quick checks)", dict(output_dir="runs/synthetic")),
)}
DATASETS["cifar100_coarse"] = DATASETS["cifar100"]._replace(dataset="cifar100_coarse")


def defaults_for(dataset: str) -> DatasetDefaults:
  try:
    return DATASETS[dataset]
  except KeyError:
    raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}") from None
