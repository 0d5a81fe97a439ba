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
import inspect
from typing import Any, Callable, NamedTuple

from fedjax_hetero.client import terms
from fedjax_hetero.compilation import shared_by_value
from fedjax_hetero.config.client import LocalConfig
from fedjax_hetero.config.declare import changed_fields, cli_name, declaration, field_named, is_off
from fedjax_hetero.config.methods import (Averaging, ClusteredSampling, Contrastive, CrossLayer, FedFAOptions,
                                          HeteroFLOptions, MethodConfig, MomentumDistillation, NeFLOptions, Proximal)
from fedjax_hetero.config.options import FedCrossConfig, FedGenConfig, FedINConfig, FedImproConfig
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, build_group_map
from fedjax_hetero.methods import fednova, fedprox, moon, scaffold
from fedjax_hetero.methods.api import PER_GROUP, SHARED, STACKED, Method, Sharing
from fedjax_hetero.methods.fedcross import cross_aggregation
from fedjax_hetero.methods.fedfa import fedfa_aggregation, scaled_upload
from fedjax_hetero.methods.fedgen import generative_regularizer, generator_training
from fedjax_hetero.methods.fedimpro import feature_sharing, feature_statistics
from fedjax_hetero.methods.fedin import feature_bank, gradient_rule, intermediate_training, momentum_distillation
from fedjax_hetero.methods.heterofl import absent_class_logits, scaler, static_batch_norm, static_batch_norm_evaluation
from fedjax_hetero.methods.inco import inco as inco_step
from fedjax_hetero.methods.nefl import inconsistent_leaves, nested_model
from fedjax_hetero.sampling.samplers import clustered, shuffled
from fedjax_hetero.server import steps

INCO_PAPER = "InCo Aggregation (Chan et al., ICLR 2024) and its baselines"
FEDCROSS_PAPER = "FedCross (Hu et al., ICDE 2024) and its baselines"
FEDIMPRO_PAPER = "FedImpro (decoupled gradient dissimilarity; its baselines are FedAvg, FedProx, Scaffold, FedNova)"
FEDFA_PAPER = "FedFA (Park & Joe-Wong, ECML-PKDD 2024) and its depth, width and width+depth baselines"
FEDROLEX_PAPER = "FedRolex (Alam et al., NeurIPS 2022)"
FEDIN_PAPER = "FedIN (Chan et al., 2023) and its baseline InclusiveFL"


Terms = tuple[terms.ClientTerm, ...]
Steps = tuple[steps.ServerStep, ...]


class Base(NamedTuple):
  """A base method's client side and averaging rule: ``build(*options)`` of the option families ``options``."""

  name: str  # the per-group method's name
  suffix: str  # of the Hetero*/InCo* names
  client: str  # what the clients do, for --help
  build: Callable[..., tuple[Terms, Steps]]
  options: tuple[type, ...]


def _averaging(o: Averaging) -> steps.ServerStep:
  return steps.mean_of_weights() if o.aggregate == "weights" else steps.mean_delta()


def _proximal(o: Proximal) -> Terms:
  return () if is_off(o.mu) else (fedprox.proximal(o.mu),)


def _scaffold(local: LocalConfig) -> tuple[Terms, Steps]:
  correction = scaffold.scaffold_correction(local.learning_rate)
  return (correction,), (steps.mean_delta(), steps.apply_delta(), scaffold.scaffold_control(correction))


def _nova(local: LocalConfig) -> tuple[Terms, Steps]:
  normalization = fednova.nova_normalization(local.optimizer, local.momentum)
  return (normalization,), (fednova.nova_mean(normalization), steps.apply_delta())


BASES = (
    Base("FedAvg", "Avg", "plain cross-entropy", lambda avg: ((), (_averaging(avg), steps.apply_delta())),
         (Averaging,)),
    Base("FedProx", "Prox", "CE + mu/2 ||w - w_glob||^2 (FedProx; --prox-mu)",
         lambda avg, prox: (_proximal(prox), (_averaging(avg), steps.apply_delta())), (Averaging, Proximal)),
    Base("Scaffold", "Scaffold", "SCAFFOLD's control-variate correction (option II)", _scaffold, (LocalConfig,)),
    Base("FedNova", "Nova", "FedNova's normalized averaging by each client's local step count", _nova,
         (LocalConfig,)),
    Base("MOON", "MOON", "CE + mu * model-contrastive loss on a projection head (MOON; --moon-mu)",
         lambda avg, o: (() if is_off(o.mu) else (moon.model_contrastive(o.mu, o.temperature),),
                         (_averaging(avg), steps.apply_delta())), (Averaging, Contrastive)),
)


def _layered(name: str, base: Base, sharing: Sharing, inco: bool) -> Callable[..., Method]:
  def build(*options: Any) -> Method:
    client, server = base.build(*options[:len(base.options)])
    method = Method(name, INCO_PAPER, "", client, server, sharing)
    if inco:
      cross_layer: CrossLayer = options[-1]
      method = method.with_step_before("apply", inco_step(cross_layer.variant, cross_layer.granularity))
    return method

  return build


def fedcross(o: FedCrossConfig) -> Method:
  models = terms.upload_variables("cross")
  return Method("FedCross", FEDCROSS_PAPER, "", terms=(models,),
                server=(cross_aggregation(o, models),), sharing=STACKED, sampler=shuffled(),
                one_group="(its K middleware models share one shape)")


def fedgen(avg: Averaging, o: FedGenConfig) -> Method:
  regularizer = generative_regularizer(o)
  return Method("FedGen", FEDCROSS_PAPER, "", terms=(regularizer,),
                server=(_averaging(avg), steps.apply_delta(), generator_training(o, regularizer)), sharing=PER_GROUP)


def clusamp(avg: Averaging, o: ClusteredSampling) -> Method:
  sampler = clustered(o.similarity)
  return Method("CluSamp", FEDCROSS_PAPER, "", terms=(sampler.reads,),
                server=(_averaging(avg), steps.apply_delta()), sharing=PER_GROUP, sampler=sampler,
                one_group="(clustering compares all clients' representative gradients, so they need one shape)")


def fedimpro(avg: Averaging, o: FedImproConfig) -> Method:
  sharing = feature_sharing(o)
  return Method("FedImpro", FEDIMPRO_PAPER, "", terms=(sharing,),
                server=(_averaging(avg), steps.apply_delta(), feature_statistics(o, sharing)), sharing=SHARED)


def fedfa(o: FedFAOptions) -> Method:
  upload = scaled_upload(o.percentile, o.norm) if o.scale else ()
  static_bn = (static_batch_norm(),) if o.static_bn else ()
  return Method("FedFA", FEDFA_PAPER, "", terms=upload + static_bn,
                server=(fedfa_aggregation(o.graft, upload or None, o.center), steps.apply_delta()), sharing=SHARED,
                evaluation_variables=static_batch_norm_evaluation() if o.static_bn else None)


def flexifed() -> Method:
  return Method("FlexiFed", FEDFA_PAPER, "", server=(steps.mean_of_weights(), steps.apply_delta()), sharing=SHARED)


def heterofl(avg: Averaging, o: HeteroFLOptions) -> Method:
  """HeteroFL (Diao et al., ICLR 2021): the layer-wise mean over leading-channel slices, with its Scaler,
  static BN and absent-class logit masking, each on unless turned off."""
  parts = ((scaler(),) if o.scaler else ()) + ((static_batch_norm(),) if o.static_bn else ())
  parts += (absent_class_logits(),) if o.mask_logits else ()
  evaluation = static_batch_norm_evaluation(o.bn_samples) if o.static_bn else None
  return Method("HeteroFL", FEDFA_PAPER, "", terms=parts, server=(_averaging(avg), steps.apply_delta()),
                sharing=SHARED, evaluation_variables=evaluation)


def nefl(avg: Averaging, o: NeFLOptions) -> Method:
  """NeFL (Kang et al., arXiv 2308.07761; `methods.nefl`): ResNets with learnable step sizes whose depth
  sub-models skip blocks (``--nefl-skip``), shared weights averaged over their holders, and the step sizes and
  BatchNorm kept and averaged per architecture group."""
  return Method("NeFL", FEDFA_PAPER, "", terms=(nested_model(o.skip, o.step_sizes),),
                server=(_averaging(avg), steps.apply_delta()), sharing=SHARED, own_leaves=inconsistent_leaves)


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


def fedrolex(avg: Averaging) -> Method:
  return Method("FedRolex", FEDROLEX_PAPER, "", server=(_averaging(avg), steps.apply_delta()), sharing=SHARED,
                submodel=rolling_channels)


def fedin(avg: Averaging, prox: Proximal, o: FedINConfig) -> Method:
  """FedIN: HeteroProx (layer-wise mean, the proximal term with mu = --prox-mu) plus the IN loss on the
  server's feature pairs, its gradient combined with the local one by --fedin-rule."""
  training = intermediate_training(o)
  return Method("FedIN", FEDIN_PAPER, "", terms=_proximal(prox) + (training,),
                server=(_averaging(avg), steps.apply_delta(), feature_bank(o, training)), sharing=SHARED,
                combine=gradient_rule(o))


def inclusivefl(avg: Averaging, o: MomentumDistillation) -> Method:
  return Method("InclusiveFL", FEDIN_PAPER, "", server=(_averaging(avg), momentum_distillation(o.beta, o.momentum),
                                                        steps.apply_delta()), sharing=SHARED)


class Entry(NamedTuple):
  """A method by name: ``build(*families)`` makes it from the option families ``options`` (types of
  `MethodConfig`'s families, or `LocalConfig` for the run's local training), in that order."""

  name: str
  paper: str
  summary: str
  build: Callable[..., Method]
  options: tuple[type, ...] = ()


def _entries() -> list[Entry]:
  out = []
  for base in BASES:
    hetero, inco = f"Hetero{base.suffix}", f"InCo{base.suffix}"
    out += [Entry(base.name, INCO_PAPER, f"every architecture group its own federation; clients: {base.client}",
                  _layered(base.name, base, PER_GROUP, False), base.options),
            Entry(hetero, INCO_PAPER, f"one global model averaged layer-wise; clients: {base.client}",
                  _layered(hetero, base, SHARED, False), base.options),
            Entry(inco, INCO_PAPER, f"{hetero} + InCo's cross-layer step on same-shape layers (authors' code "
                  "variant, per 3x3 kernel)", _layered(inco, base, SHARED, True), base.options + (CrossLayer,))]
  out += [Entry("FedCross", FEDCROSS_PAPER, "K middleware models trained by the sampled clients, cross-aggregated "
                "w_i = a v_i + (1-a) v_partner(i) (one architecture group)", fedcross, (FedCrossConfig,)),
          Entry("FedGen", FEDCROSS_PAPER, "per-group federations with a server-trained feature generator and "
                "FedGen's generative regularizer on the clients (Zhu et al. 2021)", fedgen, (Averaging, FedGenConfig)),
          Entry("CluSamp", FEDCROSS_PAPER, "FedAvg with clients drawn by clustered sampling on representative-"
                "gradient similarity (Fraboni et al. 2021, Alg. 2; one architecture group)", clusamp,
                (Averaging, ClusteredSampling)),
          Entry("FedImpro", FEDIMPRO_PAPER, "FedAvg (layer-wise over groups) + the high part also trained on features "
                "drawn from the clients' shared per-class Gaussians at a cut point (Eqs. 6-8)", fedimpro,
                (Averaging, FedImproConfig)),
          Entry("FedFA", FEDFA_PAPER, "mean of the clients' weights after layer grafting (a shallow stage's last "
                "block fills its deeper slots, Alg. 2) and per-kernel norm scaling (Alg. 1; --fedfa-*)", fedfa,
                (FedFAOptions,)),
          Entry("FlexiFed", FEDFA_PAPER, "mean of the clients' weights over the holders of each layer (Max-Common "
                "on ResNet stages); = HeteroAvg --aggregate weights", flexifed),
          Entry("HeteroFL", FEDFA_PAPER, "HeteroAvg over leading channel slices + Scaler, static BN and masked "
                "absent-class logits (Diao et al. 2021; --heterofl-*)", heterofl, (Averaging, HeteroFLOptions)),
          Entry("NeFL", FEDFA_PAPER, "HeteroAvg over ResNets with learnable per-block step sizes, depth groups "
                "skipping middle blocks; step sizes and BatchNorm kept and averaged per group (Kang et al.; --nefl-*)",
                nefl, (Averaging, NeFLOptions)),
          Entry("FedRolex", FEDROLEX_PAPER, "HeteroAvg over rolling channel windows that move one step per round "
                "(models with pooled features: not the CNNs)", fedrolex, (Averaging,)),
          Entry("FedIN", FEDIN_PAPER, "HeteroProx + regression of the intermediate layers on the server's feature "
                "pairs (Eq. 8), gradients combined Z = G_IN + G_local / 2 (Eq. 14); ablations: HeteroProx (w/o IN), "
                "--fedin-rule sum (w/o the rule), project (Eq. 13)", fedin, (Averaging, Proximal, FedINConfig)),
          Entry("InclusiveFL", FEDIN_PAPER, "HeteroAvg + momentum distillation: a stage's last block in a shallow "
                "group also moves by beta x the momentum of the deeper blocks' update (Liu et al. 2022)", inclusivefl,
                (Averaging, MomentumDistillation))]
  return out


METHODS: dict[str, Entry] = {e.name.lower(): e for e in _entries()}
PAPER_METHODS = frozenset(METHODS)  # registered methods may not shadow them (registering a name again replaces it)


def get_entry(name: str, missing_ok: bool = False) -> Entry | None:
  """The entry of the method ``name`` (case-insensitive); ValueError naming the setting (--method, or where its
  value came from) if there is none (None with ``missing_ok``)."""
  entry = METHODS.get(name.lower()) if isinstance(name, str) else None
  if entry is None and not missing_ok:
    raise ValueError(f"{cli_name(MethodConfig, 'name')}: unknown method {name!r}; accepted: "
                     f"{', '.join(e.name for e in METHODS.values())}. A method of your own is known to the process "
                     "that registers it (register_method): run it from that script (docs/running.md#your-own-method)")
  return entry


class _ReadsRecorded:
  """A LocalConfig that notes the settings a method's build reads (see `Method.local_settings`)."""

  def __init__(self, local: LocalConfig):
    self._local, self.read = local, {}

  def __getattr__(self, name: str) -> Any:
    value = getattr(self._local, name)
    self.read[name] = value
    return value


def register_method(name: str, build: Callable[..., Method], options: tuple[type, ...] = (),
                    paper: str = "registered methods", summary: str = "") -> Entry:
  """Makes a method declared by value available by name: ``--method NAME`` in a command run by the process
  that registered it, `build_method`, and ``--resume`` of its results folders. ``build(*families)`` makes the
  method from the option families ``options`` (types of `MethodConfig`'s families, or `LocalConfig`), which its
  flags then set; the method it returns must be called ``name``. Registering a name again replaces it."""
  if not isinstance(name, str) or not name.strip():
    raise TypeError(f"register_method's name must be a non-empty string, got {name!r}")
  if not callable(build):
    raise TypeError(f"register_method({name!r}): build must be a function of the option families that returns the "
                    f"Method, got {build!r}")
  known = {type(family) for family in MethodConfig().families().values()} | {LocalConfig}
  unknown = [kind.__name__ for kind in options if kind not in known]
  if unknown:
    raise ValueError(f"{name}: options must be MethodConfig's option families or LocalConfig, got {unknown}")
  if name.lower() in PAPER_METHODS:
    raise ValueError(f"{name!r} is the name of a method of the papers: choose another")
  _check_takes_options(name, build, options)
  entry = Entry(name, paper, summary, build, tuple(options))
  METHODS[name.lower()] = entry
  return entry


def _check_takes_options(name: str, build: Callable[..., Method], options: tuple[type, ...]) -> None:
  """``build`` can be called with one value of each of ``options``, in their order (it is, when a run builds the
  method: a mismatch then failed naming only ``build``)."""
  try:
    signature = inspect.signature(build)
  except (TypeError, ValueError):  # (a callable Python cannot read: it answers for itself when called)
    return
  try:
    signature.bind(*options)
  except TypeError as e:
    given = ", ".join(kind.__name__ for kind in options)
    takes = f"one positional argument per option family in options ({given})" if options else "no argument"
    raise TypeError(f"register_method({name!r}): build{signature} must accept {takes}, as a run calls it: "
                    f"{e}") from None


def readers(kind: type) -> list[str]:
  """The methods whose entries take the option family ``kind``."""
  return [e.name for e in METHODS.values() if kind in e.options]


def check_options(entry: Entry, options: MethodConfig) -> None:
  """Raises ValueError if ``options`` changes a family the method does not read (``--fedfa-graft applies to
  FedFA, not HeteroAvg``); settings declared ``shared`` (read by the whole run) are exempt."""
  for kind, family in options.families().items():
    if kind in entry.options:
      continue
    changed = [name for name in changed_fields(family) if not declaration(field_named(kind, name)).shared]
    if changed:
      flags = "/".join(cli_name(kind, name) for name in changed)
      verb = "applies" if len(changed) == 1 else "apply"
      raise ValueError(f"{flags} {verb} to {', '.join(readers(kind)) or 'no method'}, not {entry.name}")


def build_method(name: str, options: MethodConfig = MethodConfig(), local: LocalConfig = LocalConfig(), *,
                 checked: bool = True) -> Method:
  """The method called ``name`` (case-insensitive), made from its option families in ``options`` (and the
  run's ``local`` training, for the methods that read it); ValueError if ``options`` changes a family the
  method does not read. Unless ``checked``, that is not asked: a job's program makes one run's method with its
  swept settings traced, each run's own settings having passed.

  Equal settings give the same method, client terms included: trainers built from them are equal, and
  share their compiled programs (`compilation.program_cache`)."""
  entry = get_entry(name)
  if checked:
    check_options(entry, options)
  return _build(entry, options, local)


@shared_by_value(64)  # (traced settings, in a job's program, build anew)
def _build(entry: Entry, options: MethodConfig, local: LocalConfig) -> Method:
  reads = _ReadsRecorded(local)
  families = [reads if kind is LocalConfig else options.family(kind) for kind in entry.options]
  method = entry.build(*families)
  if method.name.lower() != entry.name.lower():
    raise ValueError(f"the method registered as {entry.name!r} is called {method.name!r}")
  return dataclasses.replace(method, summary=entry.summary or method.summary,
                             local_settings=tuple(sorted(reads.read.items())))


def methods_by_paper() -> dict[str, list[Entry]]:
  out: dict[str, list[Entry]] = {}
  for entry in METHODS.values():
    out.setdefault(entry.paper, []).append(entry)
  return out
