"""The federated round: sample -> extract -> map clients -> aggregate -> evaluate.

A *federation* is one server model and the architecture groups that train it.
HeteroAvg has one federation (the global, largest model, shared layer-wise by
all groups); the InCo paper's per-architecture "FedAvg" baseline has one
federation per group, so groups never exchange weights. Both are the same
loop below with different federation layouts. The base methods (Avg, Prox,
Scaffold, Nova, MOON) differ in the clients' objective and upload (see
`client_config`) and in the server step; InCo* adds the cross-layer step on the
aggregated delta. FedCross keeps K middleware models instead of one.

FedCross's further baselines are per-group methods with extra server state in
``ServerState.server`` (so checkpoints cover it):

* FedGen (Zhu et al. 2021): every federation also keeps a feature generator
  (``server["generator"]``: params, batch_stats, Adam state). Clients add its
  generative regularizer to their loss; after aggregation the server trains it
  on the round's uploaded models and the clients' label counts. Several
  architecture groups are supported: each group gets its own generator.
* CluSamp (Fraboni et al. 2021, Algorithm 2): FedAvg whose participants are
  drawn by `ClusteredSampler` from the clients' representative gradients
  (``server["clusamp"]``: ``gradients`` [num_clients, D] float32, the last
  flattened parameter delta of every client, and ``updated`` [num_clients]
  bool). One architecture group only: the gradients must share one shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax import serialization

from fedjax_hetero import aggregators
from fedjax_hetero.algorithms import fedgen
from fedjax_hetero.backends import Backend, extras_like, empty_result
from fedjax_hetero.client.local import LocalConfig, LocalTrainer
from fedjax_hetero.data.partition import class_counts
from fedjax_hetero.data.store import FederatedStore, sample_clients
from fedjax_hetero.evaluation import accuracy
from fedjax_hetero.models.projection import with_projection_head
from fedjax_hetero.hetero.maps import GroupMap, Variables, build_group_map, extract, identity_map, pick_global
from fedjax_hetero.sampling import SIMILARITIES, ClusteredSampler, flatten_update


LAYOUTS = ("group", "hetero", "cross")
CLIENT_OBJECTIVES = ("avg", "prox", "scaffold", "nova", "moon", "fedgen")
SAMPLINGS = ("uniform", "clustered")


@dataclasses.dataclass(frozen=True)
class Method:
  """A federated method: its paper name, its server layout and its client objective.

  Layouts: ``group`` (every architecture group is its own federation, the InCo
  paper's baselines), ``hetero`` (one global model, layer-wise averaging across
  groups) and ``cross`` (FedCross's K middleware models, one group).
  Sampling: ``uniform`` without replacement, or ``clustered`` (CluSamp).
  """

  name: str
  layout: str
  summary: str
  client: str = "avg"  # the base method's client side, see CLIENT_OBJECTIVES
  # InCo's cross-layer step on the aggregated delta before it is applied (aggregators.inco); None: off.
  inco_variant: str | None = None
  inco_granularity: str = "kernel"
  sampling: str = "uniform"  # who takes part in a round, see SAMPLINGS

  @property
  def per_group(self) -> bool:
    return self.layout == "group"

  @property
  def one_group(self) -> bool:
    """Whether the method trains a single architecture group (FedCross, CluSamp)."""
    return self.layout == "cross" or self.sampling == "clustered"


# InCo paper: "The hyper-parameter mu/2 for FedProx and InCoProx is 0.05", so mu = 0.1.
FEDPROX_MU = 0.1
# MOON (Li, He, Song 2021): mu = 5 and tau = 0.5 are its CIFAR-10 settings; the InCo paper gives none.
MOON_MU, MOON_TEMPERATURE = 5.0, 0.5
_BASES = {  # client objective -> (per-group name, suffix of the Hetero*/InCo* names, what the client does)
    "avg": ("FedAvg", "Avg", "plain cross-entropy"),
    "prox": ("FedProx", "Prox", f"CE + mu/2 ||w - w_glob||^2 (FedProx, default mu {FEDPROX_MU})"),
    "scaffold": ("Scaffold", "Scaffold", "SCAFFOLD's control-variate correction (option II), per-client c_i on "
                 "the device"),
    "nova": ("FedNova", "Nova", "FedNova's normalized averaging by each client's local step count"),
    "moon": ("MOON", "MOON", f"CE + mu * model-contrastive loss on a projection head (MOON, default mu "
             f"{MOON_MU:g}, tau {MOON_TEMPERATURE})"),
}


def _method_table() -> dict[str, Method]:
  methods = []
  for client, (base_name, suffix, what) in _BASES.items():
    methods += [
        Method(base_name, "group", f"every architecture group is its own federation; clients: {what}", client),
        Method(f"Hetero{suffix}", "hetero", f"one global model, layer-wise averaging across groups; clients: {what}",
               client),
        Method(f"InCo{suffix}", "hetero", "Hetero" + suffix + " + InCo's cross-layer step on same-shape layers "
               "(authors' code variant, per 3x3 kernel)", client, inco_variant="code"),
    ]
  methods.append(Method("FedCross", "cross", "K middleware models trained by the sampled clients, then "
                        "cross-aggregated w_i = a v_i + (1-a) v_partner(i) (one architecture group)"))
  methods.append(Method("FedGen", "group", "every architecture group is its own federation with its own feature "
                        "generator, trained by the server on the uploaded models (Zhu et al. 2021); clients: CE + "
                        "FedGen's generative regularizer", "fedgen"))
  methods.append(Method("CluSamp", "group", "FedAvg with clients drawn by clustered sampling on representative-"
                        "gradient similarity (Fraboni et al. 2021, Alg. 2; one architecture group)",
                        sampling="clustered"))
  return {m.name.lower(): m for m in methods}


METHODS: dict[str, Method] = _method_table()
WEIGHTINGS = ("uniform", "num_samples")
AGGREGATE_MODES = ("deltas", "weights")


def get_method(name: str) -> Method:
  try:
    return METHODS[name.lower()]
  except KeyError:
    accepted = ", ".join(m.name for m in METHODS.values())
    raise ValueError(f"unknown method {name!r}; accepted: {accepted}") from None


def client_config(method: Method, local: LocalConfig, prox_mu: float | None = None,
                  moon_mu: float | None = None, fedgen_config: fedgen.FedGenConfig | None = None,
                  fedprox_mu: float = FEDPROX_MU) -> LocalConfig:
  """``local`` with the client terms of ``method`` switched on (and only those).

  ``prox_mu``/``moon_mu`` override the method's defaults (a nonzero value also adds the term
  to methods without it, e.g. FedProx's term on InCoAvg); ``fedprox_mu`` is the default of the
  methods with FedProx's term. FedGen's regularizer needs the server's generator, so it is on
  for FedGen only, with ``fedgen_config``'s generated batch.
  """
  if prox_mu is None:
    prox_mu = local.prox_mu or (fedprox_mu if method.client == "prox" else 0.0)
  if moon_mu is None:
    moon_mu = local.moon_mu or (MOON_MU if method.client == "moon" else 0.0)
  fedgen_batch_size = local.fedgen_batch_size
  if method.client == "fedgen":
    fedgen_batch_size = fedgen_batch_size or (fedgen_config or fedgen.FedGenConfig()).gen_batch_size
  elif fedgen_batch_size:
    raise ValueError(f"FedGen's generative regularizer needs the server's generator; {method.name} has none")
  return dataclasses.replace(local, prox_mu=float(prox_mu), moon_mu=float(moon_mu),
                             fedgen_batch_size=int(fedgen_batch_size),
                             scaffold=local.scaffold or method.client == "scaffold",
                             normalize_delta=local.normalize_delta or method.client == "nova")


@dataclasses.dataclass(frozen=True)
class ArchGroup:
  """An architecture and the clients that train it."""

  name: str
  model: nn.Module
  clients: np.ndarray


def assign_groups(num_clients: int, num_groups: int) -> list[np.ndarray]:
  """Contiguous blocks of client ids per group, smallest architecture first (as InCo's code)."""
  if num_groups > num_clients:
    raise ValueError(f"{num_groups} architecture groups need at least as many clients, got {num_clients}")
  return np.array_split(np.arange(num_clients), num_groups)


@dataclasses.dataclass(frozen=True)
class FedCrossConfig:
  """FedCross's server options (Hu et al. 2024, Alg. 1 and Sec. III-D); see `aggregators.fedcross`."""

  alpha: float = 0.99
  strategy: str = "lowest_similarity"
  similarity: str = "layerwise"  # the authors' code: sum of per-layer cosines
  global_from: str = "middleware"  # paper: mean of the new middleware models; "uploaded": the authors' code
  warmup_rounds: int = 0  # authors' code (fedcross_first_stage_bound): FedAvg (all slots := mean) before this
  propellers: int = 0  # Sec. III-D PM: P in-order propeller models per slot during the first stage
  propeller_rounds: int = 0  # length of that first stage
  dynamic_alpha_rounds: int = 0  # Sec. III-D DA: alpha linear 0.5 -> alpha over the first N rounds

  def __post_init__(self):
    if not 0 <= self.alpha <= 1:
      raise ValueError(f"fedcross alpha must be in [0, 1], got {self.alpha}")
    if self.strategy not in aggregators.fedcross.STRATEGIES:
      raise ValueError(f"unknown FedCross strategy {self.strategy!r}; accepted: "
                       f"{', '.join(aggregators.fedcross.STRATEGIES)}")
    if self.similarity not in aggregators.fedcross.SIMILARITY_KINDS:
      raise ValueError(f"unknown FedCross similarity {self.similarity!r}; accepted: "
                       f"{', '.join(aggregators.fedcross.SIMILARITY_KINDS)}")
    if self.global_from not in ("middleware", "uploaded"):
      raise ValueError(f"unknown FedCross global model {self.global_from!r}; accepted: middleware, uploaded")
    for name in ("warmup_rounds", "propellers", "propeller_rounds", "dynamic_alpha_rounds"):
      if getattr(self, name) < 0:
        raise ValueError(f"fedcross {name} must be >= 0, got {getattr(self, name)}")

  def alpha_at(self, round_index: int) -> float:
    if round_index < self.dynamic_alpha_rounds:
      return float(aggregators.dynamic_alpha(round_index, 0, self.dynamic_alpha_rounds, 0.5, self.alpha))
    return self.alpha


@dataclasses.dataclass(frozen=True)
class FLConfig:
  method: str = "HeteroAvg"
  rounds: int = 50
  clients_per_round: int = 10
  weighting: str = "uniform"
  aggregate: str = "deltas"
  seed: int = 0
  prox_mu: float | None = None  # FedProx's mu; None: the method's default (see client_config)
  moon_mu: float | None = None  # MOON's mu; None: the method's default
  fedprox_mu: float = FEDPROX_MU  # the *Prox methods' default mu (FedCross paper, CIFAR-10: 0.01)
  fedcross: FedCrossConfig = FedCrossConfig()
  fedgen: fedgen.FedGenConfig = fedgen.FedGenConfig()  # FedGen's generator and regularizer (CIFAR-10 values)
  clusamp_similarity: str = "L1"  # CluSamp's gradient dissimilarity (the FedCross framework's default)
  # InCo* methods: the cross-layer rule (aggregators.INCO_VARIANTS, e.g. an ablation) and its granularity;
  # None: the method's own ("code", "kernel").
  inco_variant: str | None = None
  inco_granularity: str | None = None

  def __post_init__(self):
    method = get_method(self.method)
    for name in ("prox_mu", "moon_mu", "fedprox_mu"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if self.weighting not in WEIGHTINGS:
      raise ValueError(f"unknown weighting {self.weighting!r}; accepted: {', '.join(WEIGHTINGS)}")
    if self.aggregate not in AGGREGATE_MODES:
      raise ValueError(f"unknown aggregate mode {self.aggregate!r}; accepted: {', '.join(AGGREGATE_MODES)}")
    if self.aggregate == "weights" and method.client in ("nova", "scaffold"):
      raise ValueError(f"{method.name} aggregates deltas; --aggregate weights is not defined for it")
    for name in ("rounds", "clients_per_round"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if method.layout == "cross" and self.clients_per_round < 2:
      raise ValueError("FedCross needs clients_per_round >= 2 (one middleware model per sampled client)")
    if self.clusamp_similarity not in SIMILARITIES:
      raise ValueError(f"unknown CluSamp similarity {self.clusamp_similarity!r}; accepted: {', '.join(SIMILARITIES)}")
    if self.inco_variant is not None and self.inco_variant not in aggregators.INCO_VARIANTS:
      raise ValueError(f"unknown InCo variant {self.inco_variant!r}; accepted: {', '.join(aggregators.INCO_VARIANTS)}")
    if self.inco_granularity is not None and self.inco_granularity not in aggregators.INCO_GRANULARITIES:
      raise ValueError(f"unknown InCo granularity {self.inco_granularity!r}; accepted: "
                       f"{', '.join(aggregators.INCO_GRANULARITIES)}")
    if (self.inco_variant or self.inco_granularity) and method.inco_variant is None:
      raise ValueError(f"--inco-variant/--inco-granularity apply to the InCo* methods, not {method.name}")


class ServerState(NamedTuple):
  round: int  # rounds completed
  models: tuple[Variables, ...]  # one per federation (FedCross: the K middleware models, stacked)
  # SCAFFOLD's server control variate per federation ({"params": c}), FedCross's global model, FedGen's
  # generator, CluSamp's representative gradients (see the module docstring)
  server: tuple[dict[str, Any], ...] = ()
  memory: tuple[dict[str, Any], ...] = ()  # per architecture group: its clients' state, stacked over clients


class NonFiniteLossError(FloatingPointError):
  """Local training diverged; names the round and architecture group."""


# Server state the methods' own steps (generator training, the sampler) keep, outside the jitted aggregation.
_OWN_SERVER_STATE = ("generator", "clusamp")


def client_label_counts(store: FederatedStore) -> np.ndarray:
  """[num_clients, num_classes] label counts of every client (what FedGen's clients upload)."""
  table = np.asarray(store.index_table)
  parts = [table[c, :n] for c, n in enumerate(store.sizes)]
  return class_counts(np.asarray(store.labels), parts, store.num_classes)


def _generator_tree(state: fedgen.GeneratorState) -> dict[str, Any]:
  """FedGen's generator state as nested dicts (checkpointable; optax's NamedTuples are not plain trees)."""
  return {"params": state.params, "batch_stats": state.batch_stats,
          "opt_state": serialization.to_state_dict(state.opt_state)}


def _generator_state(tree: dict[str, Any], weight_decay: float) -> fedgen.GeneratorState:
  template = jax.eval_shape(fedgen.generator_optimizer(weight_decay).init, tree["params"])
  return fedgen.GeneratorState(tree["params"], tree["batch_stats"],
                               serialization.from_state_dict(template, tree["opt_state"]))


@jax.jit
def _flat_deltas(uploads: Variables, start: Variables) -> jax.Array:
  """Fraboni et al.'s representative gradients ``theta_i^local - theta^sent``, flattened: [K, D]."""
  return jax.vmap(flatten_update)(uploads) - flatten_update(start)


@jax.jit
def _store_gradients(stored: dict[str, jax.Array], clients: jax.Array, rows: jax.Array) -> dict[str, jax.Array]:
  return {"gradients": stored["gradients"].at[clients].set(rows), "updated": stored["updated"].at[clients].set(True)}


class Simulation:
  """Runs rounds of one method over architecture groups on a federated store."""

  def __init__(self, groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, config: FLConfig,
               backend: Backend, test_images: jax.Array, test_labels: jax.Array):
    if config.clients_per_round > store.num_clients:
      raise ValueError(f"clients_per_round={config.clients_per_round} exceeds the {store.num_clients} clients")
    self.method = get_method(config.method)
    if self.method.inco_variant is not None:
      self.method = dataclasses.replace(self.method, inco_variant=config.inco_variant or self.method.inco_variant,
                                        inco_granularity=config.inco_granularity or self.method.inco_granularity)
    if self.method.one_group and len(groups) != 1:
      why = (" (clustering compares all clients' representative gradients, so they need one shape)"
             if self.method.sampling == "clustered" else "")
      raise ValueError(f"{self.method.name} trains one architecture{why}, got {len(groups)} groups; pass one group "
                       "(e.g. --groups cnn)")
    if self.method.client == "fedgen" and not self.method.per_group:
      raise ValueError(f"{self.method.name}: FedGen's generator needs one federation per architecture group")
    if self.method.client == "moon":
      groups = [dataclasses.replace(g, model=with_projection_head(g.model)) for g in groups]
    self.groups = tuple(groups)
    self.store, self.config, self.backend = store, config, backend
    self.local = client_config(self.method, local, config.prox_mu, config.moon_mu, config.fedgen,
                               config.fedprox_mu)
    self.prox_mu = self.local.prox_mu
    self.test_images, self.test_labels = test_images, test_labels
    self._sample_input = jnp.zeros((1,) + tuple(store.images.shape[1:]), jnp.float32)
    shapes = [jax.eval_shape(g.model.init, jax.random.key(0), self._sample_input) for g in groups]
    self.global_index = pick_global(shapes, [g.name for g in groups])
    self.maps = [build_group_map(shapes[self.global_index], s, g.name) for g, s in zip(groups, shapes)]
    self.group_of_client = np.full(store.num_clients, -1)
    self.row_of_client = np.full(store.num_clients, -1)
    for i, g in enumerate(groups):
      self.group_of_client[g.clients] = i
      self.row_of_client[g.clients] = np.arange(len(g.clients))
    if (self.group_of_client < 0).any():
      raise ValueError("every client must belong to an architecture group")
    if self.method.per_group:
      self.federation_of = list(range(len(groups)))
      self.federation_maps = [identity_map(s) for s in shapes]
    else:
      self.federation_of = [0] * len(groups)
      self.federation_maps = list(self.maps)
    self.inco_pairs = self._cross_layer_pairs(shapes[self.global_index]) if self.method.inco_variant else ()
    self.generators: list[fedgen.Generator | None] = [None] * len(groups)
    if self.method.client == "fedgen":
      self.generators = [self._make_generator(g) for g in groups]
      self.label_counts = client_label_counts(store)
      # FedGen's clients draw generated labels uniformly from those their federation holds.
      self._label_probs = [fedgen.present_label_probs(self.label_counts[g.clients]) for g in groups]
    self._sampler: tuple[jax.Array, ClusteredSampler] | None = None  # CluSamp: (gradients it mirrors, sampler)
    self.trainers = [LocalTrainer(g.model, self.local, store.mean, store.std, gen)
                     for g, gen in zip(groups, self.generators)]
    self._extract = [jax.jit(lambda v, m=m: extract(v, m)) for m in self.federation_maps]
    members = [[i for i, f in enumerate(self.federation_of) if f == fed] for fed in range(max(self.federation_of) + 1)]
    self._members = members
    self._aggregate = [self._make_aggregate([self.federation_maps[i] for i in m]) for m in members]
    self._cross = self._make_cross_aggregate() if self.method.layout == "cross" else None

  def _make_generator(self, group: ArchGroup) -> fedgen.Generator:
    if "features" not in tuple(getattr(group.model, "cut_points", ())):
      raise ValueError(f"FedGen generates the features its clients' heads classify, but {group.name} "
                       f"({type(group.model).__name__}) has no 'features' cut point")
    width = fedgen.feature_width(group.model, self._sample_input)
    return fedgen.make_generator(self.config.fedgen, self.store.num_classes, width)

  def _server_key(self, round_index: int, stream: int) -> jax.Array:
    """Server-side randomness; no client shares it (clients use ``fold_in(round_key, id)``, id < num_clients)."""
    round_key = jax.random.fold_in(jax.random.key(self.config.seed), round_index)
    return jax.random.fold_in(round_key, self.store.num_clients + stream)

  def _cross_layer_pairs(self, global_shapes: Variables) -> tuple:
    """InCo's (target, source) paths, from the global (largest) model's architecture."""
    group = self.groups[self.global_index]
    pairs_of = getattr(group.model, "cross_layer_pairs", None)
    if pairs_of is None:
      raise ValueError(f"method {self.method.name} needs cross-layer pairs, but the global model {group.name} "
                       f"({type(group.model).__name__}) has no cross_layer_pairs(); use a ResNet or ViT")
    pairs = tuple(pairs_of())
    aggregators.check_pairs(pairs, global_shapes)
    return pairs

  def _make_aggregate(self, maps: Sequence[GroupMap]):
    """The jitted server update of one federation:
    ``(model, server, starts, results) -> (new model, new server, InCo stats or {})``."""
    weights_mode = self.config.aggregate == "weights"
    variant, granularity, pairs = self.method.inco_variant, self.method.inco_granularity, self.inco_pairs
    client = self.method.client
    param_maps = [m.restrict("params") for m in maps]

    @jax.jit
    def aggregate(model, server, starts, results):
      weights = [r.weight_sum for r in results]
      sums = [r.delta_sum for r in results]
      zeros = jax.tree.map(jnp.zeros_like, model)
      if client == "nova":  # FedNova (Eq. 7) on the normalized deltas
        delta = aggregators.fednova_delta(sums, weights, [r.extra_sums["nova_a"] for r in results], maps, model)
        den = aggregators.weighted_coverage(weights, maps, model)
      elif weights_mode:
        uploads = [jax.tree.map(lambda d, s, w=w: d + w * s, ds, st) for ds, st, w in zip(sums, starts, weights)]
        num, den = aggregators.heterogeneous_sums(uploads, weights, maps, model)
        delta = jax.tree.map(jnp.subtract, aggregators.masked_mean(num, den, model), model)
      else:
        num, den = aggregators.heterogeneous_sums(sums, weights, maps, model)
        delta = aggregators.masked_mean(num, den, zeros)
      stats = {}
      if variant is not None:  # InCo Algorithm 1: heterogeneous mean delta -> cross-layer step -> w += delta
        delta, stats = aggregators.inco(delta, pairs, variant, granularity, coverage=den)
      new_server = dict(server)
      if client == "scaffold":
        new_server["control"] = aggregators.scaffold_server_control(
            server["control"], [{"params": r.extra_sums["control_delta"]} for r in results], weights, param_maps)
      return jax.tree.map(jnp.add, model, delta), new_server, stats

    return aggregate

  def _make_cross_aggregate(self):
    """FedCross's server step (Alg. 1): partner selection, cross-aggregation, global model."""
    fc = self.config.fedcross

    @functools.partial(jax.jit, static_argnames=("stage",))
    def cross(uploads, round_index, alpha, stage):
      num_models = jax.tree.leaves(uploads)[0].shape[0]
      if stage == "warmup":  # the authors' code's first stage: every slot becomes the mean (FedAvg)
        mean = aggregators.global_model(uploads)
        middleware = jax.tree.map(lambda m, u: jnp.broadcast_to(m, u.shape), mean, uploads)
        return middleware, mean, {}
      if stage == "propellers":
        middleware = aggregators.propeller_aggregate(
            uploads, aggregators.propeller_partners(num_models, round_index, fc.propellers))
      else:
        partners = aggregators.select_partners(uploads, round_index, fc.strategy, fc.similarity)
        middleware = aggregators.cross_aggregate(uploads, partners, alpha)
      glob = aggregators.global_model(middleware if fc.global_from == "middleware" else uploads)
      return middleware, glob, aggregators.middleware_similarity_stats(middleware)

    return cross

  def init_state(self) -> ServerState:
    """All groups start from one initialization of the largest model."""
    model = self.groups[self.global_index].model
    # One jitted program: eager init compiles a random kernel per leaf shape.
    global_vars = jax.jit(model.init)(jax.random.key(self.config.seed), self._sample_input)
    if self.method.per_group:
      models = tuple(extract(global_vars, m) for m in self.maps)
    else:
      models = (global_vars,)
    server = tuple({} for _ in models)
    if self.method.client == "scaffold":
      server = tuple({"control": {"params": jax.tree.map(jnp.zeros_like, m["params"])}} for m in models)
    if self.method.layout == "cross":
      k = self.config.clients_per_round
      server = ({"global": global_vars},)
      models = (jax.tree.map(lambda x: jnp.broadcast_to(x, (k,) + x.shape), global_vars),)
    if self.method.client == "fedgen":
      init = jax.jit(fedgen.init_generator, static_argnums=(0, 2))
      server = tuple({"generator": _generator_tree(init(gen, self._server_key(0, len(self.groups) + fed),
                                                         self.config.fedgen.weight_decay))}
                     for fed, gen in enumerate(self.generators))
    if self.method.sampling == "clustered":  # every representative gradient starts at zero (Fraboni et al.)
      dim = sum(x.size for x in jax.tree.leaves(models[0]["params"]))
      num = self.store.num_clients
      server = ({"clusamp": {"gradients": jnp.zeros((num, dim), jnp.float32), "updated": jnp.zeros(num, bool)}},)
    memory = []
    for gi, (group, trainer) in enumerate(zip(self.groups, self.trainers)):
      start = extract(global_vars, self.maps[gi])
      row = trainer.init_memory(start)
      memory.append(jax.tree.map(lambda x, n=len(group.clients): jnp.broadcast_to(x, (n,) + x.shape), row))
    return ServerState(0, *self.backend.place((models, server, tuple(memory))))

  def group_variables(self, state: ServerState, group: int) -> Variables:
    """The variables group ``group`` trains from (FedCross: the global model, for evaluation)."""
    if self.method.layout == "cross":
      return state.server[0]["global"]
    return self._extract[group](state.models[self.federation_of[group]])

  def _group_server(self, state: ServerState, group: int) -> dict[str, Any]:
    """What the group's clients get besides the model: SCAFFOLD's c, FedGen's generator and coefficients."""
    server = state.server[self.federation_of[group]] if state.server else {}
    out = {}
    if "control" in server:
      out["control"] = self._extract_params[group](server["control"])["params"]
    if self.method.client == "fedgen":
      generator = server["generator"]
      out["generator"] = {"params": generator["params"], "batch_stats": generator["batch_stats"]}
      out["fedgen_coefficients"] = jnp.asarray(self.config.fedgen.client_coefficients(state.round), jnp.float32)
      out["label_probs"] = self._label_probs[group]
    return out

  @functools.cached_property
  def _extract_params(self):
    return [jax.jit(lambda v, m=m.restrict("params"): extract(v, m)) for m in self.federation_maps]

  def sampled_clients(self, round_index: int) -> np.ndarray:
    """Uniform sampling's participants of round ``round_index`` (CluSamp: see `clustered_sampler`)."""
    return sample_clients(self.store.num_clients, self.config.clients_per_round, self.config.seed, round_index)

  def clustered_sampler(self, state: ServerState) -> ClusteredSampler:
    """CluSamp's sampler as of ``state``: a pure function of its stored representative gradients.

    The last round's sampler is reused (and updated in place by the round run from ``state``) while
    ``state`` holds the gradients it was updated to; otherwise (a resumed run, an older state) it is
    rebuilt from them. A rebuild gives the incrementally updated sampler's dissimilarities bit for bit
    for L1 and L2: each pair's sum is over the same two rows in the same order either way.
    """
    stored = state.server[0]["clusamp"]
    if self._sampler is not None and self._sampler[0] is stored["gradients"]:
      return self._sampler[1]
    sampler = ClusteredSampler(self.store.sizes, self.config.clients_per_round, self.config.seed,
                               self.config.clusamp_similarity)
    updated = np.flatnonzero(np.asarray(stored["updated"]))
    if len(updated):
      sampler.update(updated, np.asarray(stored["gradients"])[updated])
    self._sampler = (stored["gradients"], sampler)
    return sampler

  def _participants(self, state: ServerState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The round's distinct clients (sorted), their aggregation weights, and the draws (for the log).

    CluSamp draws one client per distribution and may draw one twice (Fraboni et al. 2021). Such a
    client trains once, since its randomness is fixed by the round and its id (a second run would
    repeat the first), and its update counts once per draw. Weights per draw: ``1/m`` (Fraboni's
    unbiased scheme) under ``weighting="uniform"``, ``n_i / sum of the drawn n_j`` (the FedCross
    framework's) under ``"num_samples"``.
    """
    if self.method.sampling == "clustered":
      sampler = self.clustered_sampler(state)
      draws = sampler.sample(state.round)
      per_draw = sampler.aggregation_weights(draws, "size" if self.config.weighting == "num_samples" else "uniform")
      clients, which = np.unique(draws, return_inverse=True)
      return clients, np.bincount(which, weights=per_draw, minlength=len(clients)), draws
    sampled = self.sampled_clients(state.round)
    return sampled, self._client_weights(sampled), sampled

  def _client_weights(self, cohort: np.ndarray) -> np.ndarray:
    if self.config.weighting == "uniform":
      return np.ones(len(cohort))
    return self.store.sizes[cohort].astype(float)

  def _check_loss(self, r: int, group: ArchGroup, result) -> float:
    loss = float(result.loss_sum) / max(float(result.num_examples), 1.0)
    if not math.isfinite(loss):
      raise NonFiniteLossError(f"round {r + 1}: training loss of group {group.name} is {loss}")
    return loss

  def run_round(self, state: ServerState) -> tuple[ServerState, dict[str, Any]]:
    """One round; returns the new state and host-side metrics for it."""
    if self.method.layout == "cross":
      return self._run_cross_round(state)
    t0 = time.perf_counter()
    r = state.round
    round_key = jax.random.fold_in(jax.random.key(self.config.seed), r)
    sampled, weights, draws = self._participants(state)
    keep_uploads = self.method.client == "fedgen" or self.method.sampling == "clustered"
    starts, results, servers, cohorts, uploads = [], [], [], [], []
    memory = list(state.memory) or [{} for _ in self.groups]
    losses: dict[str, float] = {}
    examples = 0.0
    for gi, group in enumerate(self.groups):
      start = self.group_variables(state, gi)
      server = self._group_server(state, gi)
      in_group = self.group_of_client[sampled] == gi
      cohort = sampled[in_group]
      starts.append(start)
      servers.append(server)
      cohorts.append(cohort)
      if len(cohort) == 0:
        results.append(None)
        uploads.append(None)
        continue
      result = self.backend.train(self.trainers[gi], start, self.store, cohort, weights[in_group], round_key,
                                  memory=memory[gi], rows=self.row_of_client[cohort], server=server,
                                  keep_uploads=keep_uploads)
      memory[gi] = result.memory
      losses[group.name] = self._check_loss(r, group, result)
      examples += float(result.num_examples)
      uploads.append(result.uploads)
      results.append(result._replace(memory={}, uploads=None))
    models, server_states = list(state.models), list(state.server) or [{} for _ in state.models]
    inco_stats = {}
    for fed, members in enumerate(self._members):
      if all(results[i] is None for i in members):
        continue
      filled = [results[i] or self._empty_result(i, starts[i], servers[i], state) for i in members]
      own = {k: v for k, v in server_states[fed].items() if k not in _OWN_SERVER_STATE}
      models[fed], own, stats = self._aggregate[fed](models[fed], own, [starts[i] for i in members], filled)
      server_states[fed] = {**server_states[fed], **own}
      inco_stats.update(stats)
    generator_stats = {}
    if self.method.client == "fedgen":
      generator_stats = self._train_generators(r, server_states, cohorts, uploads)
    if self.method.sampling == "clustered":
      server_states[0] = self._update_sampler(state, server_states[0], cohorts[0], uploads[0], starts[0])
    jax.block_until_ready((models, server_states))
    metrics = self._round_metrics(r, draws, losses, examples, time.perf_counter() - t0)
    if generator_stats:
      metrics["fedgen_generator"] = generator_stats
    if inco_stats:  # per target layer; None where no sampled client owned it
      metrics["inco"] = {name: {k: (float(v) if math.isfinite(float(v)) else None) for k, v in s.items()}
                         for name, s in jax.device_get(inco_stats).items()}
    return ServerState(r + 1, tuple(models), tuple(server_states), tuple(memory)), metrics

  def _train_generators(self, r: int, server_states: list[dict[str, Any]], cohorts: list[np.ndarray],
                        uploads: list[Variables | None]) -> dict[str, dict[str, float]]:
    """FedGen's server step (Zhu et al. 2021, Alg. 1): each federation's generator learns from the
    round's uploaded models and their label counts (in place in ``server_states``); per-group mean losses."""
    stats = {}
    for gi, group in enumerate(self.groups):
      if uploads[gi] is None:
        continue
      fed, cohort = self.federation_of[gi], cohorts[gi]
      # Padded to the largest possible cohort (weight 0), so every round runs one compiled program.
      size = min(self.config.clients_per_round, len(group.clients))
      pad = size - len(cohort)
      heads = uploads[gi]
      if pad:
        heads = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]), heads)
      counts = np.concatenate([self.label_counts[cohort], np.zeros((pad, self.store.num_classes), np.int64)])
      generator = _generator_state(server_states[fed]["generator"], self.config.fedgen.weight_decay)
      generator, parts = fedgen.train_generator_round(
          generator, self.config.fedgen, self.generators[gi], fedgen.feature_head(group.model), heads,
          jnp.asarray(counts, jnp.float32), r, self._server_key(r, fed), valid=jnp.arange(size) < len(cohort))
      server_states[fed] = {**server_states[fed], "generator": _generator_tree(generator)}
      stats[group.name] = {k: float(v.mean()) for k, v in parts.items()}
    return stats

  def _update_sampler(self, state: ServerState, server: dict[str, Any], cohort: np.ndarray, uploads: Variables,
                      start: Variables) -> dict[str, Any]:
    """CluSamp's step 6: the participants' representative gradients become their parameter deltas."""
    rows = _flat_deltas(uploads["params"], start["params"])
    stored = _store_gradients(server["clusamp"], jnp.asarray(cohort), rows)
    sampler = self.clustered_sampler(state)
    sampler.update(cohort, np.asarray(rows))
    self._sampler = (stored["gradients"], sampler)
    return {**server, "clusamp": stored}

  def _empty_result(self, group: int, start, server, state: ServerState):
    """Zero sums for a group nobody of which was sampled, shaped as a real result."""
    trainer = self.trainers[group]
    row = jax.tree.map(lambda x: x[0], state.memory[group]) if state.memory and state.memory[group] else {}
    return empty_result(start, extras_like(trainer, start, row, server))

  def _run_cross_round(self, state: ServerState) -> tuple[ServerState, dict[str, Any]]:
    """FedCross (Alg. 1): slot i is trained by the i-th of the shuffled sampled clients."""
    t0 = time.perf_counter()
    r, fc = state.round, self.config.fedcross
    round_key = jax.random.fold_in(jax.random.key(self.config.seed), r)
    clients = np.random.default_rng([self.config.seed, r, 1]).permutation(self.sampled_clients(r))
    result = self.backend.train(self.trainers[0], state.models[0], self.store, clients, np.ones(len(clients)),
                                round_key, memory=state.memory[0], rows=self.row_of_client[clients],
                                per_client_start=True, keep_uploads=True)
    losses = {self.groups[0].name: self._check_loss(r, self.groups[0], result)}
    if r < fc.warmup_rounds:
      stage = "warmup"
    elif r < fc.propeller_rounds and fc.propellers:
      stage = "propellers"
    else:
      stage = "cross"
    middleware, glob, similarity = self._cross(result.uploads, r, fc.alpha_at(r), stage=stage)
    jax.block_until_ready(middleware)
    metrics = self._round_metrics(r, clients, losses, float(result.num_examples), time.perf_counter() - t0)
    metrics["fedcross_stage"] = stage
    metrics["fedcross_alpha"] = fc.alpha_at(r)
    if similarity:
      metrics["middleware_similarity"] = {k: float(v) for k, v in similarity.items()}
    return ServerState(r + 1, (middleware,), ({"global": glob},), (result.memory,)), metrics

  def _round_metrics(self, r, clients, losses, examples, seconds) -> dict[str, Any]:
    total_loss = sum(losses.values()) / max(len(losses), 1)
    return {"round": r + 1, "train_loss": total_loss, "train_loss_per_group": losses,
            "clients": [int(c) for c in clients], "examples": int(examples),
            "round_seconds": seconds, "samples_per_s": examples / seconds}

  def evaluate(self, state: ServerState, batch_size: int = 1000) -> dict[str, float]:
    """Test accuracy of every group's model, and their mean under ``"mean"``."""
    accs = {}
    for gi, group in enumerate(self.groups):
      accs[group.name] = accuracy(group.model, self.group_variables(state, gi), self.test_images,
                                  self.test_labels, self.store.mean, self.store.std, batch_size)
    accs["mean"] = float(np.mean(list(accs.values())))
    return accs
