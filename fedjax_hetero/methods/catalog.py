"""Every method of the papers as a short declaration, and the registry the CLI looks names up in.

The InCo paper's 15 methods are five base methods (the client side and the
averaging rule) under three ways of sharing server models: each architecture group its own
federation (FedAvg, FedProx, Scaffold, FedNova, MOON), one global model
averaged layer-wise (Hetero*), and the latter plus InCo's cross-layer step
(InCo*). FedCross and its two further baselines, FedGen and CluSamp, follow,
then FedImpro, FedFA with its depth baseline FlexiFed, its width baseline HeteroFL and its width+depth baseline
NeFL, FedRolex, and FedIN with its baseline InclusiveFL.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from fedjax_hetero import aggregators
from fedjax_hetero.algorithms.fedgen import FedGenConfig
from fedjax_hetero.algorithms.fedimpro import FedImproConfig
from fedjax_hetero.algorithms.fedin import FedINConfig
from fedjax_hetero.client import terms
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, build_group_map
from fedjax_hetero.methods.api import PER_GROUP, SHARED, STACKED, Method, Sharing
from fedjax_hetero.methods.fedfa import fedfa_aggregation, scaled_upload
from fedjax_hetero.methods.fedgen import generative_regularizer, generator_training
from fedjax_hetero.methods.fedimpro import feature_sharing, feature_statistics
from fedjax_hetero.methods.fedin import (INCLUSIVE_BETA, INCLUSIVE_MOMENTUM, feature_bank, gradient_rule,
                                         intermediate_training, momentum_distillation)
from fedjax_hetero.methods.heterofl import (BN_SAMPLES, absent_class_logits, scaler, static_batch_norm,
                                            static_batch_norm_evaluation)
from fedjax_hetero.methods.nefl import SKIP, inconsistent_leaves, nested_model
from fedjax_hetero.models.resnet import SKIPS
from fedjax_hetero.sampling.clustered import SIMILARITIES
from fedjax_hetero.sampling.samplers import clustered, shuffled
from fedjax_hetero.server import steps
from fedjax_hetero.server.cross import FedCrossConfig, cross_aggregation
from fedjax_hetero.validation import check_bool, check_choice, check_integer, check_number

# InCo paper: "The hyper-parameter mu/2 for FedProx and InCoProx is 0.05", so mu = 0.1.
FEDPROX_MU = 0.1
# MOON (Li, He, Song 2021): mu = 5 and tau = 0.5 are its CIFAR-10 settings; the InCo paper gives none.
MOON_MU, MOON_TEMPERATURE = 5.0, 0.5
AGGREGATE_MODES = ("deltas", "weights")
INCO_PAPER = "InCo Aggregation (Chan et al., ICLR 2024) and its baselines"
FEDCROSS_PAPER = "FedCross (Hu et al., ICDE 2024) and its baselines"
FEDIMPRO_PAPER = "FedImpro (decoupled gradient dissimilarity; its baselines are FedAvg, FedProx, Scaffold, FedNova)"
FEDFA_PAPER = "FedFA (Park & Joe-Wong, ECML-PKDD 2024) and its depth, width and width+depth baselines"
FEDROLEX_PAPER = "FedRolex (Alam et al., NeurIPS 2022)"
FEDIN_PAPER = "FedIN (Chan et al., 2023) and its baseline InclusiveFL"


@dataclasses.dataclass(frozen=True)
class MethodOptions:
  """Methods' hyper-parameters; each method reads the ones it has."""

  aggregate: str = "deltas"  # average client deltas, or their uploaded weights
  prox_mu: float | None = None  # FedProx's mu on any method; None: the method's default
  fedprox_mu: float = FEDPROX_MU  # the *Prox methods' default mu
  moon_mu: float | None = None  # MOON's mu on any method; None: the method's default
  moon_temperature: float = MOON_TEMPERATURE
  inco_variant: str | None = None  # None: "code", the authors' code
  inco_granularity: str | None = None  # None: "kernel"
  fedcross: FedCrossConfig = FedCrossConfig()
  fedgen: FedGenConfig = FedGenConfig()  # FedGen's generator and regularizer (CIFAR-10 values)
  clusamp_similarity: str = "L1"
  fedimpro: FedImproConfig = FedImproConfig()
  fedfa_graft: bool | None = None  # FedFA's layer grafting (Alg. 2); None: on
  fedfa_scale: bool | None = None  # FedFA's scalable aggregation (Alg. 1 lines 12-22); None: on
  fedfa_norm: str | None = None  # the trimmed norm: "l2" (the paper) or "rms" (per element); None: "l2"
  fedfa_percentile: float | None = None  # the trim's percentile of |w|; None: 95
  heterofl_scaler: bool | None = None  # HeteroFL's Scaler; None: on
  heterofl_static_bn: bool | None = None  # HeteroFL's static BatchNorm (sBN); None: on
  heterofl_bn_samples: int | None = None  # training samples sBN re-estimates statistics on; None: BN_SAMPLES
  heterofl_mask_logits: bool | None = None  # HeteroFL's zeroing of absent classes' logits; None: on
  nefl_skip: str | None = None  # which blocks NeFL's depth sub-models skip: "middle" or "last"; None: "middle"
  nefl_step_sizes: bool | None = None  # NeFL's learnable per-block step sizes; None: on
  fedin: FedINConfig = FedINConfig()
  inclusivefl_beta: float = INCLUSIVE_BETA  # InclusiveFL's distillation strength
  inclusivefl_momentum: float = INCLUSIVE_MOMENTUM  # InclusiveFL's momentum of the deeper blocks' update

  def __post_init__(self):
    check_choice("method.aggregate", self.aggregate, AGGREGATE_MODES)
    check_number("method.prox_mu", self.prox_mu, minimum=0, optional=True)
    check_number("method.fedprox_mu", self.fedprox_mu, minimum=0)
    check_number("method.moon_mu", self.moon_mu, minimum=0, optional=True)
    check_number("method.moon_temperature", self.moon_temperature, above=0)
    check_choice("method.inco_variant", self.inco_variant, aggregators.INCO_VARIANTS, optional=True)
    check_choice("method.inco_granularity", self.inco_granularity, aggregators.INCO_GRANULARITIES, optional=True)
    check_choice("method.clusamp_similarity", self.clusamp_similarity, SIMILARITIES)
    for path, value in (("method.fedfa_graft", self.fedfa_graft), ("method.fedfa_scale", self.fedfa_scale),
                        ("method.heterofl_scaler", self.heterofl_scaler),
                        ("method.heterofl_static_bn", self.heterofl_static_bn),
                        ("method.heterofl_mask_logits", self.heterofl_mask_logits),
                        ("method.nefl_step_sizes", self.nefl_step_sizes)):
      check_bool(path, value, optional=True)
    check_integer("method.heterofl_bn_samples", self.heterofl_bn_samples, minimum=1, optional=True)
    check_choice("method.fedfa_norm", self.fedfa_norm, aggregators.FEDFA_NORMS, optional=True)
    check_choice("method.nefl_skip", self.nefl_skip, SKIPS, optional=True)
    check_number("method.fedfa_percentile", self.fedfa_percentile, above=0, maximum=100, optional=True)
    check_number("method.inclusivefl_beta", self.inclusivefl_beta, minimum=0)
    check_number("method.inclusivefl_momentum", self.inclusivefl_momentum, minimum=0, below=1)
    for path, value, kind in (("method.fedcross", self.fedcross, FedCrossConfig),
                              ("method.fedgen", self.fedgen, FedGenConfig),
                              ("method.fedimpro", self.fedimpro, FedImproConfig),
                              ("method.fedin", self.fedin, FedINConfig)):
      if not isinstance(value, kind):
        raise ValueError(f"{path} must be a {kind.__name__}, got {type(value).__name__}")


class Base(NamedTuple):
  """A base method's client side and averaging rule."""

  name: str  # the per-group method's name
  suffix: str  # of the Hetero*/InCo* names
  client: str  # what the clients do, for --help
  build: Callable[[MethodOptions, LocalConfig], tuple[tuple[terms.ClientTerm, ...], tuple[steps.ServerStep, ...]]]


def _averaging(o: MethodOptions) -> steps.ServerStep:
  return steps.mean_of_weights() if o.aggregate == "weights" else steps.mean_delta()


def _deltas_only(name: str, o: MethodOptions) -> None:
  if o.aggregate == "weights":
    raise ValueError(f"{name} aggregates deltas; --aggregate weights is not defined for it")


def _scaffold(o, local):
  _deltas_only("SCAFFOLD", o)
  return (terms.scaffold_correction(local.learning_rate),), (steps.mean_delta(), steps.apply_delta(),
                                                             steps.scaffold_control())


def _nova(o, local):
  _deltas_only("FedNova", o)
  return (terms.nova_normalization(local.optimizer, local.momentum),), (steps.nova_mean(), steps.apply_delta())


BASES = (
    Base("FedAvg", "Avg", "plain cross-entropy", lambda o, local: ((), (_averaging(o), steps.apply_delta()))),
    Base("FedProx", "Prox", f"CE + mu/2 ||w - w_glob||^2 (FedProx, default mu {FEDPROX_MU})",
         lambda o, local: ((terms.proximal(o.fedprox_mu),), (_averaging(o), steps.apply_delta()))),
    Base("Scaffold", "Scaffold", "SCAFFOLD's control-variate correction (option II)", _scaffold),
    Base("FedNova", "Nova", "FedNova's normalized averaging by each client's local step count", _nova),
    Base("MOON", "MOON", f"CE + mu * model-contrastive loss on a projection head (MOON, mu {MOON_MU:g})",
         lambda o, local: ((terms.model_contrastive(MOON_MU, o.moon_temperature),),
                           (_averaging(o), steps.apply_delta()))),
)


def _layered(name: str, base: Base, sharing: Sharing, inco: bool) -> Callable[[MethodOptions, LocalConfig], Method]:
  def build(o: MethodOptions, local: LocalConfig) -> Method:
    client, server = base.build(o, local)
    method = Method(name, INCO_PAPER, "", client, server, sharing)
    if inco:
      method = method.with_step_before("apply", steps.inco(o.inco_variant or "code", o.inco_granularity or "kernel"))
    return method

  return build


def fedcross(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("FedCross", FEDCROSS_PAPER, "", terms=(terms.upload_variables("cross"),),
                server=(cross_aggregation(o.fedcross),), sharing=STACKED, sampler=shuffled(),
                one_group="(its K middleware models share one shape)")


def fedgen(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("FedGen", FEDCROSS_PAPER, "", terms=(generative_regularizer(o.fedgen),),
                server=(_averaging(o), steps.apply_delta(), generator_training(o.fedgen)), sharing=PER_GROUP)


def clusamp(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("CluSamp", FEDCROSS_PAPER, "", terms=(terms.upload_flat_delta("clustered"),),
                server=(_averaging(o), steps.apply_delta()), sharing=PER_GROUP,
                sampler=clustered(o.clusamp_similarity),
                one_group="(clustering compares all clients' representative gradients, so they need one shape)")


def fedimpro(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("FedImpro", FEDIMPRO_PAPER, "", terms=(feature_sharing(o.fedimpro),),
                server=(_averaging(o), steps.apply_delta(), feature_statistics(o.fedimpro)), sharing=SHARED)


def fedfa(o: MethodOptions, local: LocalConfig) -> Method:
  scale = o.fedfa_scale is not False
  upload = scaled_upload(o.fedfa_percentile or aggregators.fedfa.PERCENTILE, o.fedfa_norm or "l2") if scale else ()
  return Method("FedFA", FEDFA_PAPER, "", terms=upload,
                server=(fedfa_aggregation(o.fedfa_graft is not False, scale), steps.apply_delta()), sharing=SHARED)


def flexifed(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("FlexiFed", FEDFA_PAPER, "", server=(steps.mean_of_weights(), steps.apply_delta()), sharing=SHARED)


def heterofl(o: MethodOptions, local: LocalConfig) -> Method:
  """HeteroFL (Diao et al., ICLR 2021): the layer-wise mean over leading-channel slices, with its Scaler,
  static BN and absent-class logit masking, each on unless turned off."""
  static_bn = o.heterofl_static_bn is not False
  parts = ((scaler(),) if o.heterofl_scaler is not False else ()) + ((static_batch_norm(),) if static_bn else ())
  parts += (absent_class_logits(),) if o.heterofl_mask_logits is not False else ()
  evaluation = static_batch_norm_evaluation(o.heterofl_bn_samples or BN_SAMPLES) if static_bn else None
  return Method("HeteroFL", FEDFA_PAPER, "", terms=parts, server=(_averaging(o), steps.apply_delta()),
                sharing=SHARED, evaluation_variables=evaluation)


def nefl(o: MethodOptions, local: LocalConfig) -> Method:
  """NeFL (Kang et al., arXiv 2308.07761; `methods.nefl`): ResNets with learnable step sizes whose depth
  sub-models skip blocks (``--nefl-skip``), shared weights averaged over their holders, and the step sizes and
  BatchNorm kept and averaged per architecture group."""
  return Method("NeFL", FEDFA_PAPER, "", terms=(nested_model(o.nefl_skip or SKIP, o.nefl_step_sizes is not False),),
                server=(_averaging(o), steps.apply_delta()), sharing=SHARED, own_leaves=inconsistent_leaves)


def rolling_channels(global_shapes: Variables, group_shapes: Variables, group_name: str = "group") -> SubmodelMap:
  """FedRolex's map: rolling windows on every narrower axis (`build_group_map` with ``rolling``), where
  each rolled axis must be a channel axis, i.e. the output axis of some layer at the same sizes.

  A Dense layer reading a flattened feature map (the CNNs' ``fc1``) has C*H*W rows, whose window would
  roll by single features rather than by the channels its input rolls by; such models are rejected.
  """
  group_map = build_group_map(global_shapes, group_shapes, group_name, rolling=True)
  shapes = dict(group_map.global_shapes)
  channels = {(link.window.shape[-1], shapes[link.global_][-1]) for link in group_map.pull if link.window.shape}
  for link in group_map.pull:
    for axis in link.window.rolled:
      sizes = (link.window.shape[axis], shapes[link.global_][axis])
      if sizes not in channels:
        raise ValueError(f"{group_name}: FedRolex rolls channel windows, but axis {axis} of {'/'.join(link.client)} "
                         f"({sizes[0]} of {sizes[1]}) is no layer's channel axis (a flattened feature map?); use a "
                         "model with pooled features (ResNets, VGG, ViT, MLP)")
  return group_map


def fedrolex(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("FedRolex", FEDROLEX_PAPER, "", server=(_averaging(o), steps.apply_delta()), sharing=SHARED,
                submodel=rolling_channels)


def fedin(o: MethodOptions, local: LocalConfig) -> Method:
  """FedIN: HeteroProx (layer-wise mean, the proximal term with mu = --fedprox-mu) plus the IN loss on the
  server's feature pairs, its gradient combined with the local one by --fedin-rule."""
  return Method("FedIN", FEDIN_PAPER, "", terms=(terms.proximal(o.fedprox_mu), intermediate_training(o.fedin)),
                server=(_averaging(o), steps.apply_delta(), feature_bank(o.fedin)), sharing=SHARED,
                combine=gradient_rule(o.fedin))


def inclusivefl(o: MethodOptions, local: LocalConfig) -> Method:
  return Method("InclusiveFL", FEDIN_PAPER, "", server=(_averaging(o), momentum_distillation(
      o.inclusivefl_beta, o.inclusivefl_momentum), steps.apply_delta()), sharing=SHARED)


class Entry(NamedTuple):
  name: str
  paper: str
  summary: str
  build: Callable[[MethodOptions, LocalConfig], Method]


def _entries() -> list[Entry]:
  out = []
  for base in BASES:
    hetero, inco = f"Hetero{base.suffix}", f"InCo{base.suffix}"
    out += [Entry(base.name, INCO_PAPER, f"every architecture group its own federation; clients: {base.client}",
                  _layered(base.name, base, PER_GROUP, False)),
            Entry(hetero, INCO_PAPER, f"one global model averaged layer-wise; clients: {base.client}",
                  _layered(hetero, base, SHARED, False)),
            Entry(inco, INCO_PAPER, f"{hetero} + InCo's cross-layer step on same-shape layers (authors' code "
                  "variant, per 3x3 kernel)", _layered(inco, base, SHARED, True))]
  out += [Entry("FedCross", FEDCROSS_PAPER, "K middleware models trained by the sampled clients, cross-aggregated "
                "w_i = a v_i + (1-a) v_partner(i) (one architecture group)", fedcross),
          Entry("FedGen", FEDCROSS_PAPER, "per-group federations with a server-trained feature generator and "
                "FedGen's generative regularizer on the clients (Zhu et al. 2021)", fedgen),
          Entry("CluSamp", FEDCROSS_PAPER, "FedAvg with clients drawn by clustered sampling on representative-"
                "gradient similarity (Fraboni et al. 2021, Alg. 2; one architecture group)", clusamp),
          Entry("FedImpro", FEDIMPRO_PAPER, "FedAvg (layer-wise over groups) + the high part also trained on features "
                "drawn from the clients' shared per-class Gaussians at a cut point (Eqs. 6-8)", fedimpro),
          Entry("FedFA", FEDFA_PAPER, "mean of the clients' weights after layer grafting (a shallow stage's last "
                "block fills its deeper slots, Alg. 2) and per-kernel norm scaling (Alg. 1; --fedfa-*)", fedfa),
          Entry("FlexiFed", FEDFA_PAPER, "mean of the clients' weights over the holders of each layer (Max-Common "
                "on ResNet stages); = HeteroAvg --aggregate weights", flexifed),
          Entry("HeteroFL", FEDFA_PAPER, "HeteroAvg over leading channel slices + Scaler, static BN and masked "
                "absent-class logits (Diao et al. 2021; --heterofl-*)", heterofl),
          Entry("NeFL", FEDFA_PAPER, "HeteroAvg over ResNets with learnable per-block step sizes, depth groups "
                "skipping middle blocks; step sizes and BatchNorm kept and averaged per group (Kang et al.; --nefl-*)",
                nefl),
          Entry("FedRolex", FEDROLEX_PAPER, "HeteroAvg over rolling channel windows that move one step per round "
                "(models with pooled features: not the CNNs)", fedrolex),
          Entry("FedIN", FEDIN_PAPER, "HeteroProx + regression of the intermediate layers on the server's feature "
                "pairs (Eq. 8), gradients combined Z = G_IN + G_local / 2 (Eq. 14); ablations: HeteroProx (w/o IN), "
                "--fedin-rule sum (w/o the rule), project (Eq. 13)", fedin),
          Entry("InclusiveFL", FEDIN_PAPER, "HeteroAvg + momentum distillation: a stage's last block in a shallow "
                "group also moves by beta x the momentum of the deeper blocks' update (Liu et al. 2022)", inclusivefl)]
  return out


METHODS: dict[str, Entry] = {e.name.lower(): e for e in _entries()}


def get_entry(name: str) -> Entry:
  try:
    return METHODS[name.lower()]
  except (KeyError, AttributeError):
    raise ValueError(f"unknown method {name!r}; accepted: {', '.join(e.name for e in METHODS.values())}") from None


class _ReadsRecorded:
  """A LocalConfig that notes the settings a method's build reads (see `Method.local_settings`)."""

  def __init__(self, local: LocalConfig):
    self._local, self.read = local, {}

  def __getattr__(self, name: str) -> Any:
    value = getattr(self._local, name)
    self.read[name] = value
    return value


def build_method(name: str, options: MethodOptions = MethodOptions(), local: LocalConfig = LocalConfig()) -> Method:
  """The method called ``name`` (case-insensitive), with ``options``; ``prox_mu``/``moon_mu``
  override a method's own mu, and a nonzero value adds the term to a method without it."""
  entry = get_entry(name)
  reads = _ReadsRecorded(local)
  method = dataclasses.replace(entry.build(options, reads), summary=entry.summary,
                               local_settings=tuple(sorted(reads.read.items())))
  names = [s.name for s in method.server]
  if (options.inco_variant or options.inco_granularity) and "inco" not in names:
    raise ValueError(f"--inco-variant/--inco-granularity apply to the InCo* methods, not {entry.name}")
  fedfa_options = (options.fedfa_graft, options.fedfa_scale, options.fedfa_norm, options.fedfa_percentile)
  if any(v is not None for v in fedfa_options) and "fedfa" not in names:
    raise ValueError(f"--fedfa-graft/--fedfa-scale/--fedfa-norm/--fedfa-percentile apply to FedFA, not {entry.name}")
  if options.fedin != FedINConfig() and entry.name != "FedIN":
    raise ValueError(f"--fedin-* apply to FedIN, not {entry.name}")
  inclusive = (options.inclusivefl_beta, options.inclusivefl_momentum)
  if inclusive != (INCLUSIVE_BETA, INCLUSIVE_MOMENTUM) and entry.name != "InclusiveFL":
    raise ValueError(f"--inclusivefl-beta/--inclusivefl-momentum apply to InclusiveFL, not {entry.name}")
  heterofl_options = (options.heterofl_scaler, options.heterofl_static_bn, options.heterofl_bn_samples,
                      options.heterofl_mask_logits)
  if any(v is not None for v in heterofl_options) and entry.name != "HeteroFL":
    raise ValueError(f"--heterofl-* apply to HeteroFL, not {entry.name}")
  if (options.nefl_skip is not None or options.nefl_step_sizes is not None) and entry.name != "NeFL":
    raise ValueError(f"--nefl-skip/--nefl-step-sizes apply to NeFL, not {entry.name}")
  if options.heterofl_bn_samples is not None and options.heterofl_static_bn is False:
    raise ValueError("--heterofl-bn-samples sets static BN's re-estimation, which --no-heterofl-static-bn turns off")
  if (options.fedfa_norm or options.fedfa_percentile) and options.fedfa_scale is False:
    raise ValueError("--fedfa-norm/--fedfa-percentile set the scalable aggregation, which --no-fedfa-scale turns off")
  moon = lambda mu: terms.model_contrastive(mu, options.moon_temperature)
  for term_name, mu, make in (("prox", options.prox_mu, terms.proximal), ("moon", options.moon_mu, moon)):
    if mu is None:
      continue
    kept = tuple(t for t in method.terms if t.name != term_name)
    method = dataclasses.replace(method, terms=kept + ((make(mu),) if mu else ()))
  return method


def methods_by_paper() -> dict[str, list[Entry]]:
  out: dict[str, list[Entry]] = {}
  for entry in METHODS.values():
    out.setdefault(entry.paper, []).append(entry)
  return out
