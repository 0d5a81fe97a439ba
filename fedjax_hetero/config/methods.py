"""The method and its options: `MethodConfig` holds the method's name and one option family per kind of
option, each a small dataclass of its own.

A method's catalog entry (`fedjax_hetero.methods.catalog`) names the families its factory takes, by type;
a family is read only by the methods whose entries take it, which is where "this flag applies only to
method X" comes from (`fedjax_hetero.methods.catalog.check_options`). The defaults are the papers'
(docs/methods.md says where each comes from).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from fedjax_hetero.aggregators.fedfa import CENTERS as FEDFA_CENTERS
from fedjax_hetero.aggregators.fedfa import NORMS as FEDFA_NORMS
from fedjax_hetero.aggregators.fedfa import PERCENTILE as FEDFA_PERCENTILE
from fedjax_hetero.aggregators.inco import GRANULARITIES as INCO_GRANULARITIES
from fedjax_hetero.aggregators.inco import VARIANTS as INCO_VARIANTS
from fedjax_hetero.config.declare import (Flag, Integer, Number, OneOf, Settings, Text, cli_name, is_settings, setting,
                                          validate)
from fedjax_hetero.config.options import FedCrossConfig, FedGenConfig, FedINConfig, FedImproConfig
from fedjax_hetero.models.resnet import SKIPS

AGGREGATE_MODES = ("deltas", "weights")
SIMILARITIES = ("L1", "L2", "arccos")  # of CluSamp's representative gradients
# InCo paper: "The hyper-parameter mu/2 for FedProx and InCoProx is 0.05", so mu = 0.1.
FEDPROX_MU = 0.1
# MOON (Li, He, Song 2021): mu = 5 and tau = 0.5 are its CIFAR-10 settings; the InCo paper gives none.
MOON_MU, MOON_TEMPERATURE = 5.0, 0.5
BN_SAMPLES = 2000  # HeteroFL's static BN: training samples the statistics are re-estimated on
SKIP = "middle"  # NeFL's depth sub-models skip a stage's middle blocks
# InclusiveFL's distillation strength and momentum: our choices (neither the FedIN paper nor its spec gives them).
INCLUSIVE_BETA, INCLUSIVE_MOMENTUM = 0.2, 0.5


@dataclasses.dataclass(frozen=True)
class Averaging(Settings):
  aggregate: str = setting("deltas", "average the clients' deltas or their uploaded weights", OneOf(AGGREGATE_MODES))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class Proximal(Settings):
  FLAG_PREFIX = "prox"

  mu: float = setting(FEDPROX_MU, "mu of FedProx's client objective CE + mu/2 ||w - w_glob||^2 (the InCo paper: "
                      "0.1; the fedcross preset: 0.01, the FedCross paper's CIFAR-10 value); 0: no term",
                      Number(minimum=0))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class Contrastive(Settings):
  FLAG_PREFIX = "moon"

  mu: float = setting(MOON_MU, "MOON's weight of the model-contrastive loss", Number(minimum=0))
  temperature: float = setting(MOON_TEMPERATURE, "MOON's temperature tau", Number(above=0))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class CrossLayer(Settings):
  FLAG_PREFIX = "inco"

  variant: str = setting(
      "code", "cross-layer rule: code (the authors' code: theta = clip(|b|/a, 0, 5), + theta g0, update clipped to "
      "0.1; reproduces the published numbers), theorem (Theorem 3.1: project only if b < 0), paper (Alg. 1: "
      "g_k - theta g_0 always), and the Sec. 5.3 ablations no_normalization, no_optimization (theta = 1), none "
      "(raw g_k + g_0)", OneOf(INCO_VARIANTS))
  granularity: str = setting("kernel", "norms and theta per 3x3 kernel slice (the authors' code) or per tensor "
                             "(the paper's reading)", OneOf(INCO_GRANULARITIES))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class ClusteredSampling(Settings):
  FLAG_PREFIX = "clusamp"

  similarity: str = setting("L1", "dissimilarity of the clients' representative gradients in clustered sampling",
                            OneOf(SIMILARITIES))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class FedFAOptions(Settings):
  FLAG_PREFIX = "fedfa"

  graft: bool = setting(
      True, "layer grafting (Alg. 2): before aggregation a shallow client's last block of a stage also fills the "
      "stage's deeper blocks where their shapes match (not from a lone downsampling block); needs models "
      "declaring their stages (ResNets)", Flag())
  scale: bool = setting(
      True, "scalable aggregation (Alg. 1): each client's kernels times alpha = cohort mean of ||M_95|| / its own "
      "||M_95||; biases and BatchNorm get alpha = 1", Flag())
  norm: str = setting("l2", "||M_95||: l2 (the paper) or rms (l2 / sqrt(kept elements), comparable across widths)",
                      OneOf(FEDFA_NORMS))
  percentile: float = setting(FEDFA_PERCENTILE, "the norm keeps the weights with |w| at most this percentile of |w|",
                              Number(above=0, maximum=100))
  center: str = setting("mean", "the cohort's ||M_95|| alpha scales every kernel to: mean (the paper) or median (an "
                        "ablation that a minority of outsized uploads cannot pull up)", OneOf(FEDFA_CENTERS))
  static_bn: bool = setting(False, "HeteroFL's static BatchNorm, which the paper trains with (Sec. 5.1): no running "
                            "statistics averaged; re-estimated on training samples before each evaluation", Flag())

  def __post_init__(self):
    validate(self)
    if not self.scale and (self.norm != "l2" or self.percentile != FEDFA_PERCENTILE or self.center != "mean"):
      raise ValueError(f"{cli_name(self, 'norm')}/{cli_name(self, 'percentile')}/{cli_name(self, 'center')} set the "
                       f"scalable aggregation, which --no-fedfa-scale turns off")


@dataclasses.dataclass(frozen=True)
class HeteroFLOptions(Settings):
  FLAG_PREFIX = "heterofl"

  scaler: bool = setting(True, "the Scaler: hidden layers' outputs divided in training by the group's rate, its "
                         "width over the global model's (MLP, CNN, ResNet)", Flag())
  static_bn: bool = setting(True, "static BN: no running statistics kept or averaged in training; re-estimated on "
                            "training samples before each evaluation", Flag())
  bn_samples: int = setting(BN_SAMPLES, "training samples (a fixed draw) static BN re-estimates statistics on",
                            Integer(1))
  mask_logits: bool = setting(True, "in local training, zero the logits of classes absent from the client's round "
                              "schedule (its data, less what --drop-last drops)", Flag())

  def __post_init__(self):
    validate(self)
    if not self.static_bn and self.bn_samples != BN_SAMPLES:
      raise ValueError(f"{cli_name(self, 'bn_samples')} sets static BN's re-estimation, which "
                       "--no-heterofl-static-bn turns off")


@dataclasses.dataclass(frozen=True)
class NeFLOptions(Settings):
  FLAG_PREFIX = "nefl"

  skip: str = setting(
      SKIP, "which blocks a depth group's stage of d blocks holds of a deeper one: middle (the first d-1 and the "
      "last, NeFL's ResNet34/110 tables) or last (the first d, FedFA's extraction)", OneOf(SKIPS))
  step_sizes: bool = setting(True, "learnable per-block step sizes x + s F(x), s = 1 at the start, kept per group "
                             "(ResNets)", Flag())

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class MomentumDistillation(Settings):
  FLAG_PREFIX = "inclusivefl"

  beta: float = setting(INCLUSIVE_BETA, "a shallow group's last block of a stage moves by beta x the momentum of "
                        "the deeper blocks' update", Number(minimum=0))
  momentum: float = setting(INCLUSIVE_MOMENTUM, "momentum of the deeper blocks' mean update across rounds",
                            Number(minimum=0, below=1))

  def __post_init__(self):
    validate(self)


Family = TypeVar("Family")


@dataclasses.dataclass(frozen=True)
class MethodConfig(Settings):
  """The method by its paper name (case-insensitive) and every option family; each method reads its own."""

  TITLE = "method"

  name: str = setting("HeteroAvg", "federated method by its paper name (listed below)", Text(), flag="method")
  averaging: Averaging = Averaging()
  prox: Proximal = Proximal()
  moon: Contrastive = Contrastive()
  inco: CrossLayer = CrossLayer()
  fedcross: FedCrossConfig = FedCrossConfig()
  fedgen: FedGenConfig = FedGenConfig()
  clusamp: ClusteredSampling = ClusteredSampling()
  fedimpro: FedImproConfig = FedImproConfig()
  fedfa: FedFAOptions = FedFAOptions()
  heterofl: HeteroFLOptions = HeteroFLOptions()
  nefl: NeFLOptions = NeFLOptions()
  fedin: FedINConfig = FedINConfig()
  inclusivefl: MomentumDistillation = MomentumDistillation()

  def __post_init__(self):
    validate(self)

  def family(self, kind: type[Family]) -> Family:
    """The option family of type ``kind``."""
    for field in dataclasses.fields(self):
      if type(field.default) is kind:
        return getattr(self, field.name)
    raise ValueError(f"MethodConfig has no option family of type {kind.__name__}")

  def families(self) -> dict[type, Any]:
    """Every option family, by its type."""
    return {type(getattr(self, f.name)): getattr(self, f.name) for f in dataclasses.fields(self)
            if is_settings(getattr(self, f.name))}
