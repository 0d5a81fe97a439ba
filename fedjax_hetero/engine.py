"""The federated round: sample -> extract -> map clients -> aggregate -> evaluate.

`Simulation` runs any `methods.Method` and knows none: the method's sampler
picks the round's clients; each architecture group's clients start from their
federation's model seen through the group's sub-model map (or, in the stacked
sharing, from the model slot of their position in the cohort) and train with
the method's client terms on a backend (`backends`); each federation then runs
the method's server pipeline as one jitted program; a stateful sampler observes
the uploads. A *federation* is one server model and the groups that train it:
one per group (the InCo paper's per-architecture baselines) or one shared by
all groups (layer-wise averaging). See docs/architecture.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import dissimilarity
from fedjax_hetero.backends import Backend, copy_tree, empty_group_result
from fedjax_hetero.client import backdoor
from fedjax_hetero.client.local import LocalConfig, LocalTrainer
from fedjax_hetero.compilation import mapping_headroom
from fedjax_hetero.config.federation import FederationConfig  # re-exported: configs live in fedjax_hetero.config
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.evaluation import EVAL_BATCH, accuracy
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, complete, extract, identity_map, pick_global, separate
from fedjax_hetero.methods.api import Method
from fedjax_hetero.models import parameter_split, resolve_cut
from fedjax_hetero.sampling.samplers import SamplingInfo
from fedjax_hetero.server.steps import Federation, Plan, server_program
from fedjax_hetero.validation import cli_flag


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


def round_key(seed: int, round_index: int) -> jax.Array:
  """The round's randomness; client c trains with ``fold_in(round_key, c)``."""
  return jax.random.fold_in(jax.random.key(seed), round_index)


def server_key(seed: int, round_index: int, num_clients: int, stream: int) -> jax.Array:
  """Server-side randomness of a round; no client shares it (client ids are < num_clients)."""
  return jax.random.fold_in(round_key(seed, round_index), num_clients + stream)


class ServerState(NamedTuple):
  round: int  # rounds completed
  models: tuple[Variables, ...]  # one per federation (stacked sharing: one model per cohort slot)
  steps: tuple[tuple[Any, ...], ...] = ()  # per federation: every server step's state
  sampler: Any = ()  # the sampler's state
  memory: tuple[dict[str, Any], ...] = ()  # per group: its clients' memory by term name, stacked over clients


class NonFiniteLossError(FloatingPointError):
  """Local training diverged; names the round and architecture group."""


def _host_metrics(tree: Any) -> Any:
  """Device metrics as Python floats; NaN (e.g. nothing to average this round) as None."""
  def value(x):
    x = float(x)
    return x if math.isfinite(x) else None
  return jax.tree.map(value, jax.device_get(tree))


def _federations(groups: Sequence[ArchGroup], shapes: Sequence[Variables], maps: Sequence[SubmodelMap],
                 global_index: int, shared: bool, config: FederationConfig,
                 store: FederatedStore) -> tuple[Federation, ...]:
  """One federation for all groups (``shared``: maps onto the largest model) or one per group (identity)."""
  members = [list(range(len(groups)))] if shared else [[g] for g in range(len(groups))]
  out = []
  for index, group_ids in enumerate(members):
    one = len(group_ids) == 1
    chosen = [groups[g] for g in group_ids]
    stack_sizes = tuple(config.clients_per_round if config.group_draw else min(config.clients_per_round,
                                                                               len(g.clients)) for g in chosen)
    out.append(Federation(
        index, chosen[0].name if one else "global", tuple(group_ids), tuple(g.name for g in chosen),
        tuple(g.model for g in chosen), tuple(identity_map(shapes[g]) if one else maps[g] for g in group_ids),
        tuple(g.clients for g in chosen), stack_sizes, groups[group_ids[0] if one else global_index].model, store,
        config.seed, server_key(config.seed, 0, store.num_clients, len(groups) + index)))
  return tuple(out)


class Simulation:
  """Runs rounds of one method over architecture groups on a federated store."""

  def __init__(self, groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, method: Method,
               config: FederationConfig, backend: Backend, test_images: jax.Array, test_labels: jax.Array,
               track_dissimilarity: bool = False, dissimilarity_cut: str | None = None):
    """``track_dissimilarity``: log every round's gradient dissimilarity (`fedjax_hetero.dissimilarity`) per
    group, split at ``dissimilarity_cut`` (None: each model's `decoupling_cut`). It adds an upload to the
    client programs, which can change results in the last float bits; off by default."""
    if config.clients_per_round > store.num_clients:
      raise ValueError(f"clients_per_round={config.clients_per_round} exceeds the {store.num_clients} clients")
    if method.one_group and len(groups) != 1:
      raise ValueError(f"{method.name} trains one architecture {method.one_group}, got {len(groups)} groups; pass "
                       "one group (e.g. --groups cnn)")
    if method.sharing.stacked and config.clients_per_round < 2:
      raise ValueError(f"{method.name} needs clients_per_round >= 2 (one model per sampled client)")
    self.method, self.store, self.config, self.backend, self.local = method, store, config, backend, local
    self.groups = tuple(dataclasses.replace(g, model=method.wrap_model(g.model)) for g in groups)
    self.test_images, self.test_labels = test_images, test_labels
    self._sample_input = jnp.zeros((1,) + tuple(store.images.shape[1:]), jnp.float32)
    shapes = [jax.eval_shape(g.model.init, jax.random.key(0), self._sample_input) for g in self.groups]
    self.global_index = pick_global(shapes, [g.name for g in self.groups])
    self.maps = [method.submodel(shapes[self.global_index], s, g.name) for g, s in zip(self.groups, shapes)]
    self._base_maps = self.maps  # before `separate`: where a group's own leaves start from
    if method.own_leaves and method.sharing.shared and len(self.groups) > 1:
      own = [method.own_leaves(g.model, self._sample_input) for g in self.groups]
      self.maps = list(separate(self.maps, own, self.global_index, [g.name for g in self.groups]))
    self.group_of_client = np.full(store.num_clients, -1)
    self.row_of_client = np.full(store.num_clients, -1)
    for i, g in enumerate(self.groups):
      self.group_of_client[g.clients] = i
      self.row_of_client[g.clients] = np.arange(len(g.clients))
    if (self.group_of_client < 0).any():
      raise ValueError("every client must belong to an architecture group")
    if config.group_draw and len(config.group_draw) != len(self.groups):
      raise ValueError(f"group_draw needs one probability per architecture group ({len(self.groups)}), got "
                       f"{len(config.group_draw)}")
    if config.group_draw and any(t.init_memory for t in method.terms):
      raise ValueError(f"{method.name} keeps per-client memory in its group's shape; it cannot redraw groups")
    self.federations = _federations(self.groups, shapes, self.maps, self.global_index, method.sharing.shared, config,
                                    store)
    self.federation_of = [next(f.index for f in self.federations if g in f.members) for g in range(len(self.groups))]
    self.member_of = [self.federations[f].members.index(g) for g, f in enumerate(self.federation_of)]
    terms = method.terms + ((dissimilarity.update_norms(),) if track_dissimilarity else ())
    # The backdoor attack's malicious clients (sorted ids; none by default) and their traced inputs.
    self.malicious_clients = backdoor.malicious_clients(store.num_clients, config.malicious_fraction, config.seed)
    if config.malicious_fraction > 0 and not len(self.malicious_clients):
      raise ValueError(f"{cli_flag('federation.malicious_fraction')} {config.malicious_fraction} of "
                       f"{store.num_clients} clients rounds to no malicious client; pass at least "
                       f"{0.5 / store.num_clients:g}, or 0 for a clean run")
    attack = (backdoor.Backdoor(config.backdoor_scale, config.backdoor_delta) if len(self.malicious_clients)
              else None)
    self._attack = (backdoor.attack_table(store.num_clients, self.malicious_clients, config.seed) if attack
                    else None)
    self.trainers = [LocalTrainer(g.model, local, store.mean, store.std, terms, method.combine, attack)
                     for g in self.groups]
    self._dissimilarity = [self._dissimilarity_program(g.model, dissimilarity_cut) for g in self.groups
                           if track_dissimilarity]
    self._extract = [jax.jit(lambda v, offset, m=self.federations[f].maps[i]: extract(v, m, offset))
                     for f, i in zip(self.federation_of, self.member_of)]
    # One jitted server program per federation (public so that benchmarks can time it).
    self.server_programs = [server_program(method.server, f) for f in self.federations]
    parameter_count = sum(x.size for x in jax.tree.leaves(shapes[self.global_index]["params"]))
    sample_seed = config.seed if config.sample_seed is None else config.sample_seed
    self.sampling = SamplingInfo(store.sizes, config.clients_per_round, sample_seed, config.weighting,
                                 parameter_count)
    # Shapes only: runs every step's and the sampler's checks (e.g. InCo's layer pairs) before any compute;
    # also the template a checkpoint is restored into.
    self.state_shapes = jax.eval_shape(self.init_state)
    self._compiled = False  # see run_round and _compile_every_federation
    self._empty_results: dict[int, Any] = {}

  def init_state(self) -> ServerState:
    """Every federation starts from one initialization of the largest model."""
    # One jitted program: eager init compiles a random kernel per leaf shape.
    global_vars = jax.jit(self.groups[self.global_index].model.init)(jax.random.key(self.config.seed),
                                                                    self._sample_input)
    if self.maps is not self._base_maps:
      global_vars = complete(global_vars, self._base_maps, self.maps)
    models = []
    for f in self.federations:
      model = global_vars if len(f.members) > 1 else extract(global_vars, self.maps[f.members[0]])
      if self.method.sharing.stacked:
        model = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.config.clients_per_round,) + x.shape), model)
      models.append(model)
    steps = tuple(tuple(s.init(m, f) if s.init else () for s in self.method.server)
                  for m, f in zip(models, self.federations))
    sampler = self.method.sampler.init(self.sampling) if self.method.sampler.init else ()
    memory = []
    for group, trainer, group_map in zip(self.groups, self.trainers, self.maps):
      row = trainer.init_memory(extract(global_vars, group_map))
      memory.append(jax.tree.map(lambda x, n=len(group.clients): jnp.broadcast_to(x, (n,) + x.shape), row))
    return self.place(ServerState(0, tuple(models), steps, sampler, tuple(memory)))

  def place(self, state: ServerState) -> ServerState:
    """``state`` where the backend keeps server state (e.g. after a restore), so every round sees one placement."""
    return ServerState(state.round, *self.backend.place((state.models, state.steps, state.sampler, state.memory)))

  def server_variables(self, state: ServerState, federation: int = 0) -> Variables:
    """The variables a federation stands for: a server step's (FedCross's global model) or its model."""
    for step, step_state in zip(self.method.server, state.steps[federation]):
      if step.evaluate:
        return step.evaluate(step_state)
    return state.models[federation]

  def group_variables(self, state: ServerState, group: int) -> Variables:
    """The variables group ``group`` is evaluated with: its federation's through the group's map."""
    f = self.federation_of[group]
    if any(step.evaluate for step in self.method.server):
      return self.server_variables(state, f)
    return self._extract[group](state.models[f], state.round)

  def _start(self, state: ServerState, group: int) -> Variables:
    f = self.federation_of[group]
    if self.method.sharing.stacked:
      return state.models[f]
    return self._extract[group](state.models[f], state.round)

  def group_share(self, state: ServerState, group: int) -> dict[str, Any]:
    """What the group's clients get from the server steps besides the model, by step name."""
    f, member = self.federation_of[group], self.member_of[group]
    return {s.name: s.broadcast(st, self.federations[f], member, state.round)
            for s, st in zip(self.method.server, state.steps[f]) if s.broadcast}

  def _check_loss(self, r: int, group: ArchGroup, result) -> float:
    loss = float(result.loss_sum) / max(float(result.num_examples), 1.0)
    if not math.isfinite(loss):
      raise NonFiniteLossError(f"round {r + 1}: training loss of group {group.name} is {loss}")
    return loss

  def run_round(self, state: ServerState, *, consume: bool = False) -> tuple[ServerState, dict[str, Any]]:
    """One round; returns the new state and host-side metrics for it.

    With ``consume`` the round may update ``state``'s per-client memory in place (its buffers are
    donated), so ``state`` must not be used again; a loop that only keeps the new state should pass it.
    Without it the memory is copied first, a cost that grows with the total number of clients
    (SCAFFOLD's control variates, MOON's previous models), not with the round's work."""
    t0 = time.perf_counter()
    r, seed = state.round, self.config.seed
    key = round_key(seed, r)
    chosen = self.method.sampler.sample(state.sampler, r, self.sampling)
    group_of_chosen = self.groups_of_round(r)[chosen.clients]
    cohorts = [chosen.clients[group_of_chosen == gi] for gi in range(len(self.groups))]
    weights = [chosen.weights[group_of_chosen == gi] for gi in range(len(self.groups))]
    starts = [self._start(state, gi) for gi in range(len(self.groups))]
    shares = [self.group_share(state, gi) for gi in range(len(self.groups))]

    def train(gi: int):
      cohort, group_weights = cohorts[gi], weights[gi]
      if len(cohort) == 0:
        if self._compiled:
          return None
        # This object's first round: the group trains one client, result dropped, so that its programs
        # compile now rather than in the first round that samples it.
        cohort, group_weights = self.groups[gi].clients[:1], np.ones(1)
      group_memory = state.memory[gi]
      if group_memory and not (consume and len(cohorts[gi])):  # (a compile-only result is dropped: keep it)
        group_memory = copy_tree(group_memory)
      return self.backend.train(self.trainers[gi], starts[gi], self.store, cohort, group_weights, key,
                                memory=group_memory, rows=self.row_of_client[cohort], server=shares[gi],
                                per_client_start=self.method.sharing.stacked, capacity=self._stack_size(gi),
                                attack=None if self._attack is None else backdoor.cohort_inputs(self._attack, cohort))

    # In the first round the groups compile side by side (XLA compiles on one core), except in a multi-process
    # run: there every process must launch the programs, whose collectives pair up across processes, in one order.
    if not self._compiled:
      mapping_headroom()
    if self._compiled or jax.process_count() > 1:
      trained = [train(gi) for gi in range(len(self.groups))]
    else:
      with concurrent.futures.ThreadPoolExecutor(len(self.groups)) as pool:
        trained = list(pool.map(train, range(len(self.groups))))
    if not self._compiled:
      self._compile_every_federation(state, starts, shares, cohorts)
    memory, results = list(state.memory), []
    losses: dict[str, float] = {}
    dissimilarities: dict[str, dict[str, float]] = {}
    examples = 0.0
    for gi, (group, result) in enumerate(zip(self.groups, trained)):
      if self._dissimilarity and result is not None:  # (a first round's dropped result compiles it too)
        spread = self._dissimilarity[gi](result.delta_sum, result.weight_sum, result.uploads[dissimilarity.NAME])
      if len(cohorts[gi]) == 0:
        results.append(None)
        continue
      memory[gi] = result.memory
      losses[group.name] = self._check_loss(r, group, result)
      if self._dissimilarity:
        dissimilarities[group.name] = _host_metrics(spread)
      examples += float(result.num_examples)
      results.append(result._replace(memory={}))
    models, steps = list(state.models), list(state.steps)
    metrics: dict[str, Any] = {}
    for f in self.federations:
      if any(results[g] is not None for g in f.members):
        models[f.index], steps[f.index], federation_metrics = self.aggregate(f.index, state, starts, shares,
                                                                            results, cohorts)
        _merge(metrics, federation_metrics)
    sampler_state = state.sampler
    if self.method.sampler.observe:
      for gi, result in enumerate(results):
        if result is not None:
          sampler_state = self.method.sampler.observe(sampler_state, cohorts[gi],
                                                      result.uploads[self.method.sampler.name], self.sampling)
    jax.block_until_ready((models, steps, sampler_state))
    seconds = time.perf_counter() - t0
    metrics = {"round": r + 1, "train_loss": sum(losses.values()) / max(len(losses), 1),
               "train_loss_per_group": losses, "clients": [int(c) for c in chosen.draws], "examples": int(examples),
               "round_seconds": seconds, "samples_per_s": examples / seconds, **metrics}
    if dissimilarities:
      metrics[dissimilarity.NAME] = dissimilarities
    return ServerState(r + 1, tuple(models), tuple(steps), sampler_state, tuple(memory)), metrics

  def _dissimilarity_program(self, model: nn.Module, cut: str | None):
    low, high = parameter_split(model, self._sample_input, resolve_cut(model, cut))
    return jax.jit(lambda delta_sum, weight_sum, norms: dissimilarity.gradient_dissimilarity(
        delta_sum, weight_sum, norms, {"low": low, "high": high}))

  def _compile_every_federation(self, state: ServerState, starts: Sequence[Variables], shares: Sequence[Any],
                                cohorts: Sequence[np.ndarray]) -> None:
    """In this object's first round, runs (and drops) the server program of every federation the round
    leaves out, and keeps every group's empty result (the stand-in for a group with no client in a
    round), so that no later round compiles."""
    for gi in range(len(self.groups)):
      self._empty_result(gi, starts[gi], shares[gi], state)
    no_results = [None] * len(self.groups)
    for f in self.federations:
      if not any(len(cohorts[g]) for g in f.members):
        jax.block_until_ready(self.aggregate(f.index, state, starts, shares, no_results, cohorts)[:2])
    self._compiled = True

  def aggregate(self, federation: int, state: ServerState, starts: Sequence[Variables], shares: Sequence[Any],
                results: Sequence[Any], cohorts: Sequence[np.ndarray]) -> tuple[Variables, tuple[Any, ...], dict]:
    """The server pipeline of one federation on the round's group results (None: nobody of that group
    was sampled; per group as in `run_round`): its new model, step states and host metrics."""
    f, r = self.federations[federation], state.round
    plans = [s.plan(r) if s.plan else Plan() for s in self.method.server]
    filled = tuple(results[g] or self._empty_result(g, starts[g], shares[g], state) for g in f.members)
    sizes = [self._stack_size(g) for g in f.members]
    valid = tuple(np.arange(n) < len(cohorts[g]) for g, n in zip(f.members, sizes))
    ids = tuple(np.concatenate([cohorts[g], np.full(n - len(cohorts[g]), self.store.num_clients)])
                for g, n in zip(f.members, sizes))
    model, steps, metrics = self.server_programs[federation](
        state.models[federation], state.steps[federation], tuple(starts[g] for g in f.members), filled, valid, ids, r,
        server_key(self.config.seed, r, self.store.num_clients, federation), tuple(p.inputs for p in plans),
        statics=tuple(p.static for p in plans))
    metrics = _host_metrics(metrics)
    for p in plans:
      metrics.update(p.log)
    return model, steps, metrics

  def groups_of_round(self, round_index: int) -> np.ndarray:
    """Every client's architecture group in round ``round_index``."""
    if not self.config.group_draw:
      return self.group_of_client
    rng = np.random.default_rng([self.config.seed, round_index, 2])
    return rng.choice(len(self.groups), size=self.store.num_clients, p=np.asarray(self.config.group_draw))

  def _stack_size(self, group: int) -> int:
    return self.federations[self.federation_of[group]].stack_sizes[self.member_of[group]]

  def _empty_result(self, group: int, start: Variables, share: dict[str, Any], state: ServerState):
    """Zeros shaped as the group's result, made once (made again, they would compile in a later round)."""
    if group not in self._empty_results:
      # Shapes only: the round that calls this may have consumed the state's memory.
      row = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.memory[group])
             if state.memory and state.memory[group] else {})
      # Placed as the backend places real results, so the server program sees one input placement every round.
      self._empty_results[group] = self.backend.place(empty_group_result(self.trainers[group], start, row, share,
                                                                         self._stack_size(group)))
    return self._empty_results[group]

  def evaluate(self, state: ServerState, batch_size: int = EVAL_BATCH) -> dict[str, float]:
    """Test accuracy of every group's model, and their mean under ``"mean"``.

    It runs on this process's own copy of the model (`Backend.local`), with no collective: in a
    multi-process run every process evaluates the whole test set and gets the same numbers, which its
    divergence guard and checkpoint ranking then agree on."""
    accs = {}
    for gi, group in enumerate(self.groups):
      variables = self.backend.local(self.group_variables(state, gi))
      if self.method.evaluation_variables:
        variables = self.method.evaluation_variables(group.model, variables, self.store)
      accs[group.name] = accuracy(group.model, variables, self.test_images, self.test_labels, self.store.mean,
                                  self.store.std, batch_size)
    accs["mean"] = float(np.mean(list(accs.values())))
    return accs


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
  """Deep-merges nested metric dicts (per-federation entries of one metric side by side)."""
  for k, v in new.items():
    if isinstance(v, dict) and isinstance(into.get(k), dict):
      _merge(into[k], v)
    else:
      into[k] = v
