"""The federated round: sample -> extract -> map clients -> aggregate -> evaluate.

A *federation* is one server model and the architecture groups that train it.
HeteroAvg has one federation (the global, largest model, shared layer-wise by
all groups); the InCo paper's per-architecture "FedAvg" baseline has one
federation per group, so groups never exchange weights. Both are the same
loop below with different federation layouts. The *Prox methods change only
the clients' objective (FedProx's proximal term, see `effective_prox_mu`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import aggregators
from fedjax_hetero.backends import Backend, empty_result
from fedjax_hetero.client.local import LocalConfig, LocalTrainer
from fedjax_hetero.data.store import FederatedStore, sample_clients
from fedjax_hetero.evaluation import accuracy
from fedjax_hetero.hetero.maps import GroupMap, Variables, build_group_map, extract, identity_map, pick_global


@dataclasses.dataclass(frozen=True)
class Method:
  """A federated method: its paper name and how its server is laid out."""

  name: str
  per_group: bool  # each architecture group is its own federation
  summary: str
  # InCo's cross-layer step on the mean delta before it is applied (aggregators.inco); None: off.
  inco_variant: str | None = None
  inco_granularity: str = "kernel"
  # FedProx's mu for the clients' proximal term (Li et al. 2020, Eq. 2) unless the run sets one; None: off.
  prox_mu: float | None = None


# InCo paper: "The hyper-parameter mu/2 for FedProx and InCoProx is 0.05", so mu = 0.1.
FEDPROX_MU = 0.1
METHODS: dict[str, Method] = {
    m.name.lower(): m for m in (
        Method("FedAvg", per_group=True,
               summary="each architecture group is its own FedAvg federation (InCo paper's baseline)"),
        Method("HeteroAvg", per_group=False,
               summary="one global model; every layer averaged over the sampled clients that own it"),
        Method("InCoAvg", per_group=False,
               summary="HeteroAvg + InCo's cross-layer step on same-shape layers of a stage (authors' code "
               "variant, per 3x3 kernel)", inco_variant="code"),
        Method("FedProx", per_group=True, prox_mu=FEDPROX_MU,
               summary="FedAvg per architecture group, clients minimize CE + mu/2 ||w - w_glob||^2 "
               f"(default mu {FEDPROX_MU})"),
        Method("HeteroProx", per_group=False, prox_mu=FEDPROX_MU,
               summary=f"HeteroAvg with FedProx's proximal client objective (default mu {FEDPROX_MU})"),
        Method("InCoProx", per_group=False, prox_mu=FEDPROX_MU, inco_variant="code",
               summary=f"InCoAvg with FedProx's proximal client objective (default mu {FEDPROX_MU})"),
    )
}
WEIGHTINGS = ("uniform", "num_samples")
AGGREGATE_MODES = ("deltas", "weights")


def get_method(name: str) -> Method:
  try:
    return METHODS[name.lower()]
  except KeyError:
    accepted = ", ".join(m.name for m in METHODS.values())
    raise ValueError(f"unknown method {name!r}; accepted: {accepted}") from None


def effective_prox_mu(method: Method, prox_mu: float | None, local_prox_mu: float = 0.0) -> float:
  """The mu of FedProx's ``mu/2 ||w - w^t||^2`` (Li et al. 2020, Eq. 2) that the clients train with.

  ``prox_mu`` (the run's setting) wins when given, 0 included; otherwise a nonzero
  ``LocalConfig.prox_mu``, then the method's default, then 0 (no proximal term).
  """
  if prox_mu is not None:
    return float(prox_mu)
  if local_prox_mu:
    return float(local_prox_mu)
  return float(method.prox_mu or 0.0)


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
class FLConfig:
  method: str = "HeteroAvg"
  rounds: int = 50
  clients_per_round: int = 10
  weighting: str = "uniform"
  aggregate: str = "deltas"
  seed: int = 0
  prox_mu: float | None = None  # FedProx's mu; None: the method's default (see effective_prox_mu)

  def __post_init__(self):
    get_method(self.method)
    if self.prox_mu is not None and not 0 <= self.prox_mu < float("inf"):
      raise ValueError(f"prox_mu must be finite and >= 0, got {self.prox_mu}")
    if self.weighting not in WEIGHTINGS:
      raise ValueError(f"unknown weighting {self.weighting!r}; accepted: {', '.join(WEIGHTINGS)}")
    if self.aggregate not in AGGREGATE_MODES:
      raise ValueError(f"unknown aggregate mode {self.aggregate!r}; accepted: {', '.join(AGGREGATE_MODES)}")
    for name in ("rounds", "clients_per_round"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ServerState(NamedTuple):
  round: int  # rounds completed
  models: tuple[Variables, ...]  # one per federation


class NonFiniteLossError(FloatingPointError):
  """Local training diverged; names the round and architecture group."""


class Simulation:
  """Runs rounds of one method over architecture groups on a federated store."""

  def __init__(self, groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, config: FLConfig,
               backend: Backend, test_images: jax.Array, test_labels: jax.Array):
    if config.clients_per_round > store.num_clients:
      raise ValueError(f"clients_per_round={config.clients_per_round} exceeds the {store.num_clients} clients")
    self.groups = tuple(groups)
    self.store, self.local, self.config, self.backend = store, local, config, backend
    self.method = get_method(config.method)
    self.test_images, self.test_labels = test_images, test_labels
    self._sample_input = jnp.zeros((1,) + tuple(store.images.shape[1:]), jnp.float32)
    shapes = [jax.eval_shape(g.model.init, jax.random.key(0), self._sample_input) for g in groups]
    self.global_index = pick_global(shapes, [g.name for g in groups])
    self.maps = [build_group_map(shapes[self.global_index], s, g.name) for g, s in zip(groups, shapes)]
    self.group_of_client = np.full(store.num_clients, -1)
    for i, g in enumerate(groups):
      self.group_of_client[g.clients] = i
    if (self.group_of_client < 0).any():
      raise ValueError("every client must belong to an architecture group")
    if self.method.per_group:
      self.federation_of = list(range(len(groups)))
      self.federation_maps = [identity_map(s) for s in shapes]
    else:
      self.federation_of = [0] * len(groups)
      self.federation_maps = list(self.maps)
    self.inco_pairs = self._cross_layer_pairs(shapes[self.global_index]) if self.method.inco_variant else ()
    self.prox_mu = effective_prox_mu(self.method, config.prox_mu, local.prox_mu)
    if self.prox_mu != local.prox_mu:
      local = dataclasses.replace(local, prox_mu=self.prox_mu)
      self.local = local
    self.trainers = [LocalTrainer(g.model, local, store.mean, store.std) for g in groups]
    self._extract = [jax.jit(lambda v, m=m: extract(v, m)) for m in self.federation_maps]
    members = [[i for i, f in enumerate(self.federation_of) if f == fed] for fed in range(max(self.federation_of) + 1)]
    self._members = members
    self._aggregate = [self._make_aggregate([self.federation_maps[i] for i in m]) for m in members]

  def _cross_layer_pairs(self, global_shapes: Variables) -> tuple:
    """InCo's (target, source) paths, from the global (largest) model's architecture."""
    group = self.groups[self.global_index]
    pairs_of = getattr(group.model, "cross_layer_pairs", None)
    if pairs_of is None:
      raise ValueError(f"method {self.method.name} needs cross-layer pairs, but the global model {group.name} "
                       f"({type(group.model).__name__}) has no cross_layer_pairs(); use a ResNet")
    pairs = tuple(pairs_of())
    aggregators.check_pairs(pairs, global_shapes)
    return pairs

  def _make_aggregate(self, maps: Sequence[GroupMap]):
    """The jitted server update of one federation: ``(model, ...) -> (new model, InCo stats or {})``."""
    weights_mode = self.config.aggregate == "weights"
    variant, granularity, pairs = self.method.inco_variant, self.method.inco_granularity, self.inco_pairs

    @jax.jit
    def aggregate(model, starts, delta_sums, weights):
      if weights_mode:
        uploads = [jax.tree.map(lambda d, s, w=w: d + w * s, ds, st) for ds, st, w in zip(delta_sums, starts, weights)]
      if variant is not None:
        # InCo Algorithm 1: heterogeneous mean delta -> cross-layer step -> w += delta.
        if weights_mode:
          num, den = aggregators.heterogeneous_sums(uploads, weights, maps, model)
          delta = jax.tree.map(jnp.subtract, aggregators.masked_mean(num, den, model), model)
        else:
          num, den = aggregators.heterogeneous_sums(delta_sums, weights, maps, model)
          delta = aggregators.masked_mean(num, den, jax.tree.map(jnp.zeros_like, model))
        delta, stats = aggregators.inco(delta, pairs, variant, granularity, coverage=den)
        return jax.tree.map(jnp.add, model, delta), stats
      if weights_mode:
        return aggregators.hetero_avg_weights(model, uploads, weights, maps), {}
      return aggregators.hetero_avg(model, delta_sums, weights, maps), {}

    return aggregate

  def init_state(self) -> ServerState:
    """All groups start from one initialization of the largest model."""
    model = self.groups[self.global_index].model
    # One jitted program: eager init compiles a random kernel per leaf shape.
    global_vars = jax.jit(model.init)(jax.random.key(self.config.seed), self._sample_input)
    if self.method.per_group:
      models = tuple(extract(global_vars, m) for m in self.maps)
    else:
      models = (global_vars,)
    return ServerState(0, self.backend.place(models))

  def group_variables(self, state: ServerState, group: int) -> Variables:
    return self._extract[group](state.models[self.federation_of[group]])

  def sampled_clients(self, round_index: int) -> np.ndarray:
    return sample_clients(self.store.num_clients, self.config.clients_per_round, self.config.seed, round_index)

  def run_round(self, state: ServerState) -> tuple[ServerState, dict[str, Any]]:
    """One round; returns the new state and host-side metrics for it."""
    t0 = time.perf_counter()
    r = state.round
    round_key = jax.random.fold_in(jax.random.key(self.config.seed), r)
    sampled = self.sampled_clients(r)
    starts, results = [], []
    losses: dict[str, float] = {}
    examples = 0.0
    for gi, group in enumerate(self.groups):
      start = self.group_variables(state, gi)
      cohort = sampled[self.group_of_client[sampled] == gi]
      starts.append(start)
      if len(cohort) == 0:
        results.append(None)
        continue
      weights = np.ones(len(cohort)) if self.config.weighting == "uniform" else self.store.sizes[cohort].astype(float)
      result = self.backend.train(self.trainers[gi], start, self.store, cohort, weights, round_key)
      count = float(result.num_examples)
      loss = float(result.loss_sum) / max(count, 1.0)
      if not math.isfinite(loss):
        raise NonFiniteLossError(f"round {r + 1}: training loss of group {group.name} is {loss}")
      losses[group.name] = loss
      examples += count
      results.append(result)
    models = list(state.models)
    inco_stats = {}
    for fed, members in enumerate(self._members):
      if all(results[i] is None for i in members):
        continue
      filled = [results[i] or empty_result(starts[i]) for i in members]
      models[fed], stats = self._aggregate[fed](models[fed], [starts[i] for i in members],
                                                [f.delta_sum for f in filled], [f.weight_sum for f in filled])
      inco_stats.update(stats)
    jax.block_until_ready(models)
    seconds = time.perf_counter() - t0
    total_loss = sum(losses[g] for g in losses) / max(len(losses), 1)
    metrics = {"round": r + 1, "train_loss": total_loss, "train_loss_per_group": losses,
               "clients": [int(c) for c in sampled], "examples": int(examples),
               "round_seconds": seconds, "samples_per_s": examples / seconds}
    if inco_stats:  # per target layer; None where no sampled client owned it
      metrics["inco"] = {name: {k: (float(v) if math.isfinite(float(v)) else None) for k, v in s.items()}
                         for name, s in jax.device_get(inco_stats).items()}
    return ServerState(r + 1, tuple(models)), metrics

  def evaluate(self, state: ServerState, batch_size: int = 1000) -> dict[str, float]:
    """Test accuracy of every group's model, and their mean under ``"mean"``."""
    accs = {}
    for gi, group in enumerate(self.groups):
      accs[group.name] = accuracy(group.model, self.group_variables(state, gi), self.test_images,
                                  self.test_labels, self.store.mean, self.store.std, batch_size)
    accs["mean"] = float(np.mean(list(accs.values())))
    return accs

