"""Named experiment settings: the papers' protocols and their CPU-sized versions.

``python -m experiments.fmnist --preset inco-cpu`` starts from a preset's
values; any flag given as well overrides them. The ``*-cpu`` presets keep a
paper's protocol (partition, clients, local epochs, optimizer, architecture
family) and shrink only what a 2-core CPU cannot afford: widths and rounds.
A preset's values for a method's options (e.g. FedProx's mu in the FedCross
protocol) apply to the methods that read them (`values_for`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_hetero.config import FLAGS
from fedjax_hetero.methods import get_entry

INCO_RESNETS = ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  description: str
  values: dict[str, Any]
  reduced: str | None = None  # what a CPU-sized preset changes from the paper's protocol
  paper: str | None = None  # the preset holding the paper's protocol, if this one scales it down
  # Values of method options (flag names), for the methods that read them (e.g. the protocol's FedProx mu).
  method_options: dict[str, Any] = dataclasses.field(default_factory=dict)


_INCO = dict(groups=INCO_RESNETS, num_clients=100, clients_per_round=10, partition="dirichlet", alpha=0.5, epochs=5,
             batch_size=64, optimizer="adam", learning_rate=1e-3, rounds=500, eval_every=10, method="InCoAvg",
             drop_last=True)
_INCO_CPU = {**_INCO, "groups": tuple(f"{g}@0.125" for g in INCO_RESNETS), "rounds": 30, "eval_every": 5}
_INCO_CPU_REDUCED = "widths x0.125 (base channels 8, stages 8/16/32/64) and 30 rounds instead of 500"
# FedCross paper (Sec. IV-A): 100 clients, 10% per round, batch 50, 5 epochs, SGD lr 0.01 momentum 0.5, alpha 0.99,
# lowest-similarity selection; CNN rounds 2000. Baselines as the authors' framework: FedAvg-type aggregation
# weighted by sample count, FedProx mu 0.01 (the paper's CIFAR-10 value).
_FEDCROSS = dict(groups=("cnn_cifar",), num_clients=100, clients_per_round=10, partition="dirichlet", alpha=0.5,
                 epochs=5, batch_size=50, optimizer="sgd", learning_rate=0.01, momentum=0.5, rounds=2000,
                 eval_every=20, method="FedCross", fedcross_alpha=0.99, fedcross_strategy="lowest_similarity",
                 weighting="num_samples")
_FEDCROSS_OPTIONS = dict(prox_mu=0.01)

# FedImpro paper (Sec. 5, Table 5) and its authors' run scripts: ResNet-18 with the CIFAR stem, 10 clients, 5 per
# round, Dirichlet 0.1, 1 local epoch, batch 128 (drop_last), SGD lr 0.1 without momentum, weight decay 1e-4,
# FedAvg weighted by sample count, 1000 rounds; FedProx's mu 0.1 (the code's default).
_FEDIMPRO = dict(groups=("resnet18_cifar",), num_clients=10, clients_per_round=5, partition="dirichlet", alpha=0.1,
                 epochs=1, batch_size=128, drop_last=True, optimizer="sgd", learning_rate=0.1, momentum=0.0,
                 weight_decay=1e-4, weighting="num_samples", rounds=1000, eval_every=10, method="FedImpro")

# FedFA paper: no training hyper-parameters in its text (its Table 6 is not available); these are the HeteroFL
# code's defaults, which FedFA builds on: 100 clients, 10% per round, SGD lr 0.01 (MNIST-like; 0.1 for CIFAR) with
# momentum 0.9 and weight decay 5e-4, batch 10, 5 local epochs. Aggregation is weighted by sample count, as FedFA's
# Algorithm 1 weights by N_c (HeteroFL's code counts clients; with IID clients of equal size it is the same).
# Two depth groups of one family, as in its depth experiments.
_FEDFA_NOT_KEPT = ("not reproduced: HeteroFL's lr decay (x0.1 halfway), and the paper's static BatchNorm, "
                   "--fedfa-static-bn, FedFA's alone: its depth baselines keep running statistics, as FedFA does "
                   "here")
_FEDFA = dict(groups=("resnet18", "resnet26"), num_clients=100, clients_per_round=10, partition="iid", epochs=5,
              batch_size=10, optimizer="sgd", learning_rate=0.01, momentum=0.9, weight_decay=5e-4,
              weighting="num_samples", rounds=200, eval_every=10, method="FedFA")

# FedIN paper (Sec. 5.1): ResNet10/14/18/22/26, 20 clients each, 100 clients, Dirichlet 0.5, 5 local epochs,
# batch 16, Adam 1e-3, 500 rounds, mu/2 = 0.05; the participation rate (0.1) and drop_last are the authors'
# InCo code's, which shares FedIN's setting; averaging is the count-based layer-wise mean of that code.
_FEDIN = dict(groups=INCO_RESNETS, num_clients=100, clients_per_round=10, partition="dirichlet", alpha=0.5, epochs=5,
              batch_size=16, optimizer="adam", learning_rate=1e-3, rounds=500, eval_every=1, method="FedIN",
              drop_last=True)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("inco", "InCo paper (Sec. 5): ResNet10/14/18/22/26 groups, ImageNet stem, 100 clients, 10 per round, "
           "Dirichlet 0.5, 5 epochs, batch 64, Adam 1e-3, 500 rounds", _INCO),
    Preset("inco-cpu", "the InCo protocol at CPU size", _INCO_CPU, reduced=_INCO_CPU_REDUCED, paper="inco"),
    Preset("fedcross", "FedCross paper (Sec. IV-A) with its CNN: 100 clients, 10 per round, Dirichlet 0.5, "
           "batch 50, 5 epochs, SGD 0.01 momentum 0.5, alpha 0.99, lowest similarity, 2000 rounds; baselines "
           "aggregate weighted by sample count, FedProx mu 0.01", _FEDCROSS, method_options=_FEDCROSS_OPTIONS),
    Preset("fedcross-cpu", "the FedCross protocol at CPU size", {**_FEDCROSS, "rounds": 100, "eval_every": 5},
           method_options=_FEDCROSS_OPTIONS,
           reduced="100 rounds instead of 2000", paper="fedcross"),
    Preset("fedimpro", "FedImpro paper (Sec. 5): ResNet-18 (CIFAR stem), 10 clients, 5 per round, Dirichlet 0.1, "
           "1 epoch, batch 128, SGD lr 0.1, weight decay 1e-4, weighted by sample count, 1000 rounds", _FEDIMPRO),
    Preset("fedimpro-cpu", "the FedImpro protocol at CPU size",
           {**_FEDIMPRO, "groups": ("cnn",), "max_train_samples": 12000, "drop_last": False, "rounds": 50,
            "eval_every": 1},
           reduced="the two-conv CNN instead of ResNet-18, 12,000 training samples, 50 rounds, evaluation every "
                   "round (rounds to a target), and partial last batches kept (with 12,000 samples over 10 "
                   "Dirichlet-0.1 clients, drop_last would leave small clients without a step)", paper="fedimpro"),
    Preset("fedfa", "FedFA paper's depth setting on HeteroFL's training defaults: ResNet18 and ResNet26 groups, "
           "100 IID clients, 10 per round, 5 epochs, batch 10, SGD 0.01 momentum 0.9 weight decay 5e-4, weighted by "
           "sample count, 200 rounds; " + _FEDFA_NOT_KEPT, _FEDFA),
    Preset("fedfa-cifar10", "FedFA's CIFAR-10 IID table on HeteroFL's CIFAR defaults (python -m experiments.cifar10; "
           "for a GPU): ResNet18 and ResNet26 groups, SGD lr 0.1 momentum 0.9 weight decay 5e-4, batch 10, 5 epochs, "
           "400 rounds; the paper's Pre-ResNet and its lr milestones [150, 250] are not reproduced, the ResNets keep "
           "their ImageNet stem on 32x32 images (no CIFAR-stem ResNet26 here), and BatchNorm keeps running "
           "statistics (the paper's static BatchNorm is --fedfa-static-bn, FedFA's alone)",
           {**_FEDFA, "learning_rate": 0.1, "rounds": 400}),
    Preset("fedin", "FedIN paper (Sec. 5.1): ResNet10/14/18/22/26 groups, 100 clients, 10 per round, Dirichlet 0.5, "
           "5 epochs, batch 16, Adam 1e-3, mu/2 0.05, 500 rounds, evaluation every round (rounds to a target)", _FEDIN),
    Preset("fedin-cpu", "the FedIN protocol at CPU size",
           {**_FEDIN, "groups": tuple(f"{g}@0.125" for g in INCO_RESNETS), "epochs": 2, "rounds": 60},
           reduced="widths x0.125, 2 local epochs instead of 5 and 60 rounds instead of 500", paper="fedin"),
    Preset("fedfa-cpu", "the FedFA protocol at CPU size; as in fedfa, " + _FEDFA_NOT_KEPT,
           {**_FEDFA, "groups": ("resnet18@0.125", "resnet26@0.125"), "epochs": 1, "rounds": 40, "eval_every": 2},
           reduced="widths x0.125, 1 local epoch instead of 5 and 40 rounds instead of 200", paper="fedfa"),
    Preset("inco-authors-cpu", "inco-cpu with the InCo authors' data pipeline: images resized to 32x32, pixels in "
           "[0, 1] without normalization, evaluation on the first 9,728 test images, every round; add their client "
           "split with --partition-file (scripts/convert_inco_split.py converts their hetero-fix-100-0.5.npy; "
           "docs/reproduction.md)",
           {**_INCO_CPU, "image_size": 32, "normalize": "none", "test_first": 9728, "eval_every": 1},
           reduced=_INCO_CPU_REDUCED, paper="inco"),
)}


# A paper's protocol trains and tests on the whole dataset as the library reads it: a preset that does not set these
# holds them at their defaults, and a run that changes them differs from the paper.
DATA_PIPELINE = ("max_train_samples", "max_test_samples", "image_size", "normalize", "test_first")


def paper_deviations(preset: Preset, values: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """``{field: (this run's value, the paper's)}`` for every field of the paper's protocol the run changes."""
  paper = {**{k: FLAGS[k].default for k in DATA_PIPELINE},
           **values_for(PRESETS[preset.paper or preset.name], values["method"])}
  # The method is what a run compares, not part of the protocol.
  return {k: (values[k], v) for k, v in paper.items() if k in values and values[k] != v and k != "method"}


def values_for(preset: Preset, method: str) -> dict[str, Any]:
  """The preset's values for a run of ``method``: its settings, and those of its method options that
  ``method`` reads (a protocol sets its baselines' options too, which its own method must not get)."""
  entry = get_entry(method)
  return {**preset.values, **{k: v for k, v in preset.method_options.items() if FLAGS[k].owner in entry.options}}


def get_preset(name: str) -> Preset:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown preset {name!r}; accepted: {', '.join(PRESETS)}") from None
