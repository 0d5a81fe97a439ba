"""The option families of the methods with many settings: FedCross, FedGen, FedImpro, FedIN.

Each is the plain data its method's factory takes (`fedjax_hetero.methods.catalog`); the algorithms
(`fedjax_hetero.methods`) read them. Where a default follows the paper or
the authors' code is said in each method's module docstring and in docs/methods.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from fedjax_hetero.aggregators.fedcross import SIMILARITY_KINDS, STRATEGIES, dynamic_alpha
from fedjax_hetero.config.declare import Flag, Integer, Number, OneOf, Settings, Text, cli_name, setting, validate

GLOBAL_FROM = ("middleware", "uploaded")
LOSS_MODES = ("sum", "concat")
SAMPLE_SOURCES = ("global", "local")
RULES = ("eq14", "sum", "project")
PROJECTIONS = ("tensor", "global")
BANK_MODES = ("latest", "history")
NUM_PAIRS = 16
BANK_CAPACITY = 4096
# FedGen's per-dataset values (the FedCross framework's config; --fedgen-preset).
FEDGEN_PRESETS: Mapping[str, Mapping[str, float]] = {
    "cifar10": dict(ensemble_lr=3e-4, generative_alpha=0.2, generative_beta=0.2),
    "cifar100": dict(ensemble_lr=1e-4, generative_alpha=10.0, generative_beta=1.0),
    "femnist": dict(ensemble_lr=3e-4, generative_alpha=10.0, generative_beta=10.0),
}


@dataclasses.dataclass(frozen=True)
class FedCrossConfig(Settings):
  """FedCross's server options (Alg. 1 and Sec. III-D); see `aggregators.fedcross`."""

  FLAG_PREFIX = "fedcross"

  alpha: float = setting(0.99, "w_i = alpha v_i + (1 - alpha) v_partner(i)", Number(minimum=0, maximum=1))
  strategy: str = setting(
      "lowest_similarity", "collaborative-model selection: in_order ((i + r mod (K-1) + 1) mod K), or the "
      "lowest/highest similarity among the other uploads", OneOf(STRATEGIES))
  similarity: str = setting(
      "layerwise", "cosine: true cosine over all parameters (the paper's intent); paper: the paper's printed "
      "formula; layerwise: sum of per-layer cosines (the authors' code)", OneOf(SIMILARITY_KINDS))
  global_from: str = setting(
      "middleware", "global model = mean of the new middleware models (paper) or of the uploads (authors' code)",
      OneOf(GLOBAL_FROM), flag="fedcross_global")
  warmup_rounds: int = setting(
      0, "FedAvg warm-up of the authors' code: every middleware model := the mean before this round", Integer(0))
  propellers: int = setting(
      0, "propeller models per slot (Sec. III-D PM) during the first --fedcross-propeller-rounds", Integer(0))
  propeller_rounds: int = setting(0, "length of the propeller stage", Integer(0))
  dynamic_alpha_rounds: int = setting(
      0, "dynamic alpha (Sec. III-D DA): linear 0.5 -> --fedcross-alpha over the first N rounds", Integer(0))

  def __post_init__(self):
    validate(self)
    if self.strategy == "in_order" and self.similarity != type(self).similarity:
      raise ValueError(f"{cli_name(self, 'similarity')} {self.similarity} sets how partners are chosen by "
                       f"similarity, which {cli_name(self, 'strategy')} in_order does not use")
    propellers, rounds = cli_name(self, "propellers"), cli_name(self, "propeller_rounds")
    if self.propeller_rounds and not self.propellers:
      raise ValueError(f"{rounds} {self.propeller_rounds} needs {propellers} >= 1 (the propeller models per slot)")
    if self.propellers and not self.propeller_rounds:
      raise ValueError(f"{propellers} {self.propellers} needs {rounds} >= 1 (the length of the propeller stage)")

  def alpha_at(self, round_index: int) -> float:
    if round_index < self.dynamic_alpha_rounds:
      return float(dynamic_alpha(round_index, 0, self.dynamic_alpha_rounds, 0.5, self.alpha))
    return self.alpha

  def stage_at(self, round_index: int) -> str:
    if round_index < self.warmup_rounds:
      return "warmup"
    if round_index < self.propeller_rounds and self.propellers:
      return "propellers"
    return "cross"


@dataclasses.dataclass(frozen=True)
class FedGenConfig(Settings):
  """FedGen's hyperparameters (defaults: the spec's CIFAR-10 values; `fedjax_hetero.methods.fedgen_generator`)."""

  FLAG_PREFIX = "fedgen"

  noise_dim: int = setting(100, "generator noise size", Integer(1))
  hidden_dim: int = setting(512, "generator hidden width", Integer(1))
  embedding: bool = setting(False, "label input: an embedding of width noise_dim instead of one-hot", Flag())
  ensemble_lr: float = setting(3e-4, "server: the generator's Adam learning rate", Number(above=0))
  ensemble_lr_decay: float = setting(0.98, "server: its decay per round (FedGen code)", Number(above=0, maximum=1))
  weight_decay: float = setting(1e-2, "server: the generator's coupled L2 weight decay", Number(minimum=0))
  ensemble_epochs: int = setting(50, "server: generator steps per round (with --fedgen-n-teacher-iters)", Integer(1))
  n_teacher_iters: int = setting(5, "server: steps per generator epoch", Integer(1))
  batch_size: int = setting(128, "server: generated samples per generator step", Integer(1))
  ensemble_alpha: float = setting(1.0, "server: teacher-loss weight", Number(minimum=0))
  ensemble_eta: float = setting(1.0, "server: diversity-loss weight", Number(minimum=0))
  label_pseudo_count: float = setting(1.0, "server: every client's label counts start at this (FedGen code)",
                                      Number(minimum=0))
  # (the floor is the smaller of it and each weight, taken when the clients' coefficients are built)
  generative_alpha: float = setting(0.2, "clients: weight of the teacher term", Number(minimum=0))
  generative_beta: float = setting(0.2, "clients: weight of the latent-matching term", Number(minimum=0))
  coefficient_decay: float = setting(0.98, "clients: both weights' decay per round", Number(above=0, maximum=1))
  coefficient_floor: float = setting(1e-4, "clients: both weights' floor", Number(minimum=0))
  gen_batch_size: int = setting(32, "clients: generated labels per local step (FedGen code)", Integer(1))

  def __post_init__(self):
    validate(self)
    if self.ensemble_epochs < self.n_teacher_iters:
      raise ValueError(f"{cli_name(self, 'ensemble_epochs')} must be >= {cli_name(self, 'n_teacher_iters')} "
                       "(steps = epochs // iters * iters)")

  @classmethod
  def preset(cls, dataset: str, **overrides: Any) -> "FedGenConfig":
    """The spec's values for "cifar10", "cifar100" or "femnist", then ``overrides``."""
    if dataset not in FEDGEN_PRESETS:
      raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(FEDGEN_PRESETS)}")
    return cls(**{**FEDGEN_PRESETS[dataset], **overrides})

  @property
  def generator_steps(self) -> int:
    """Server Adam steps per round: (ensemble_epochs // n_teacher_iters) epochs of n_teacher_iters."""
    return (self.ensemble_epochs // self.n_teacher_iters) * self.n_teacher_iters

  def generator_learning_rate(self, round_index: int) -> float:
    return self.ensemble_lr * self.ensemble_lr_decay ** round_index


@dataclasses.dataclass(frozen=True)
class FedImproConfig(Settings):
  """FedImpro's settings (`fedjax_hetero.methods.fedimpro` says where each default comes from)."""

  FLAG_PREFIX = "fedimpro"

  cut: str | None = setting(
      None, "cut point splitting the model into low and high parts (FedImpro's shared features, and the "
      "low/high split of the dissimilarity metric of every method); default: the model's (cnn: conv2, ResNets: "
      "stage2)", Text(), shared=True)
  beta: float = setting(
      0.0, "momentum of the clients' per-class feature estimate (Eq. 7); 0 replaces it by every batch's "
      "statistics, which is what the authors' code does in effect", Number(minimum=0, below=1))
  std_max: float = setting(0.1, "upper clamp of the estimated feature standard deviation (the authors' code)",
                           Number(above=0))
  weight: float = setting(1.0, "weight of the cross-entropy on synthetic features", Number(minimum=0))
  loss: str = setting(
      "concat", "concat: the mean cross-entropy over real and synthetic rows (the authors' code and the proof of "
      "Theorem 4.2); sum: CE(real) + weight CE(synthetic) (Eq. 6 as printed)", OneOf(LOSS_MODES))
  sample_from: str = setting(
      "global", "draw synthetic features from the round's global estimate (Alg. 1) or from the client's running "
      "estimate (the authors' code)", OneOf(SAMPLE_SOURCES))
  noise: float = setting(0.0, "std of Gaussian noise on the uploaded means and deviations (the paper's privacy "
                         "experiment)", Number(minimum=0))
  num_synthetic: int | None = setting(
      None, "synthetic features per local step; default: as many as the batch has real rows (the paper's "
      "N-hat = N)", Integer(1))

  def __post_init__(self):
    validate(self)


@dataclasses.dataclass(frozen=True)
class FedINConfig(Settings):
  """FedIN's settings (`fedjax_hetero.methods.fedin` says where each default comes from)."""

  FLAG_PREFIX = "fedin"

  rule: str = setting(
      "eq14", "how the IN gradient and the local one combine: eq14 (Z = G_IN + lambda/2 G_local, the paper's "
      "runs), sum (G_IN + G_local: the ablation without the rule), project (Eq. 13: G_IN projected onto "
      "<Z, G_local> >= 0 on the intermediate layers, G_local elsewhere)", OneOf(RULES))
  lam: float = setting(1.0, "lambda of Eq. 14", Number(minimum=0))
  projection: str = setting(
      "tensor", "Eq. 13's inner products per intermediate-layer tensor or over all of them (--fedin-rule project)",
      OneOf(PROJECTIONS))
  bank: str = setting(
      "latest", "the server's feature bank: the latest round's pairs, or every round's (a ring buffer of "
      "--fedin-bank-capacity pairs)", OneOf(BANK_MODES))
  bank_capacity: int = setting(BANK_CAPACITY, "pairs the history bank holds, the oldest overwritten first",
                               Integer(1))
  num_pairs: int = setting(
      NUM_PAIRS, "|S|: feature pairs each client uploads and regresses on per step (the paper: one batch, 16); "
      "drawn with replacement from a smaller bank", Integer(1))

  def __post_init__(self):
    validate(self)
