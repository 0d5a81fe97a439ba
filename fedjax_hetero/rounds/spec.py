"""What a simulation's rounds are made of, built once and frozen: `RoundSpec`.

The spec holds the architecture groups and their sub-model maps, the federations (one server model and the
groups that train it: one per group, the InCo paper's per-architecture baselines, or one shared by all groups,
layer-wise averaging), each group's trainer, the method, the data and the sampling; and, as methods, the pure
functions of it that a round reads: what a group's clients start from, what the server shares with them, the
variables a group is evaluated with, who takes part in a round. Nothing in it changes while a run trains; a
rollback or a job of many runs makes another spec (`RoundSpec.with_values`). See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client import attack
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.compilation import light_jit, program_cache
from fedjax_hetero.config import FederationConfig, LocalConfig, check_federation
from fedjax_hetero.config.declare import cli_name
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, complete, extract, identity_map, pick_global, separate
from fedjax_hetero.methods.api import Method
from fedjax_hetero.models.common import variable_shapes
from fedjax_hetero.random_batching import batch_random_draws
from fedjax_hetero.rounds.checks import check_simulation_inputs
from fedjax_hetero.rounds.held_out import ClientEval
from fedjax_hetero.rounds.state import ServerState, server_key
from fedjax_hetero.sampling.availability import Availability, availability, read_trace
from fedjax_hetero.sampling.samplers import Participants, SamplingInfo
from fedjax_hetero.server.steps import Federation, check_tree_kept, server_program


@dataclasses.dataclass(frozen=True)
class ArchGroup:
  """An architecture and the clients that train it."""

  name: str
  model: nn.Module
  clients: np.ndarray


def assign_groups(num_clients: int, num_groups: int) -> list[np.ndarray]:
  """Contiguous blocks of client ids per group, in the groups' order (as InCo's code)."""
  if num_groups > num_clients:
    raise ValueError(f"{num_groups} architecture groups need at least as many clients, got {num_clients}")
  return np.array_split(np.arange(num_clients), num_groups)


def _scalers_relative_to_global(groups: tuple[ArchGroup, ...], global_index: int) -> tuple[ArchGroup, ...]:
  """Each model with HeteroFL's Scaler on divides by its rate of the global model, its width over the global
  model's (the authors' ``model_rate / global_model_rate``): with a widest group at width 0.25, that group's rate
  is 1 and a group at 0.125 has 0.5, where the widths alone (0.25, 0.125) would scale outputs by 4 and 8."""
  def inner(model):  # through a term's wrapper (MOON's projection head keeps the model it wraps as ``base``)
    return inner(model.base) if isinstance(getattr(model, "base", None), nn.Module) else model

  def relative(model, reference):
    if isinstance(getattr(model, "base", None), nn.Module):
      return model.clone(base=relative(model.base, reference))
    return model.clone(scaler_of=reference) if getattr(model, "scaler", False) else model

  reference = getattr(inner(groups[global_index].model), "width", 1.0)
  return tuple(dataclasses.replace(g, model=relative(g.model, reference)) for g in groups)


def _federations(groups: Sequence[ArchGroup], shapes: Sequence[Variables], maps: Sequence[SubmodelMap],
                 global_index: int, method: Method, config: FederationConfig,
                 store: FederatedStore) -> tuple[Federation, ...]:
  """One federation for all groups (``shared``: maps onto the largest model) or one per group (identity)."""
  members = [list(range(len(groups)))] if method.sharing.shared else [[g] for g in range(len(groups))]
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
        config.seed, functools.partial(server_key, config.seed, 0, store.num_clients, len(groups) + index),
        method.terms))
  return tuple(out)


def _trainers(groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, method: Method,
              config: FederationConfig, malicious: np.ndarray) -> tuple[Any, ...]:
  """Every group's trainer; under the backdoor attack each is wrapped (`client.attack`)."""
  wrap = attack.trainer_wrapper(config, malicious, store.num_clients)
  return tuple(wrap(LocalTrainer(g.model, local, store.mean, store.std, method.terms, method.combine)) for g in groups)


def initialization(model: nn.Module):
  """``(seed, sample) -> variables``, ``model.init``'s values: the key is made inside (made on the device, it
  costs programs of its own), and the parameters' draws are made together (`batch_random_draws`: a sixth of a
  ResNet's initialization ops as jax lowers it for a GPU)."""

  def initialize(seed, sample):
    return model.init(jax.random.key(seed), sample)

  return batch_random_draws(initialize)


@program_cache
def _init_program(model: nn.Module):
  return light_jit(initialization(model))


@program_cache
def _extract_program(group_map: SubmodelMap):
  return light_jit(lambda variables, offset: extract(variables, group_map, offset))


def _trace(config: FederationConfig, num_clients: int) -> list[tuple[int, int]]:
  if config.availability_trace is None:
    return []
  try:
    return read_trace(config.availability_trace, num_clients)
  except ValueError as e:
    raise ValueError(f"{cli_name(FederationConfig, 'availability_trace')} {config.availability_trace!r}: {e}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class RoundSpec:
  """Everything static about a simulation's rounds (see the module docstring); build it with `RoundSpec.build`."""

  groups: tuple[ArchGroup, ...]  # models as the clients train them (with what the method's terms add)
  store: FederatedStore
  local: LocalConfig
  method: Method
  config: FederationConfig
  test_images: jax.Array
  test_labels: jax.Array
  maps: tuple[SubmodelMap, ...]  # every group's map into its federation's (largest) model
  base_maps: tuple[SubmodelMap, ...]  # the same before `hetero.maps.separate` (NeFL): where own leaves start
  global_index: int  # the group whose model is the largest
  federations: tuple[Federation, ...]
  federation_of: tuple[int, ...]  # per group
  member_of: tuple[int, ...]  # per group: its position among its federation's members
  group_of_client: np.ndarray  # per client: its assigned architecture group
  row_of_client: np.ndarray  # per client: its row in its group's client memory
  malicious_clients: np.ndarray  # the backdoor attack's clients (sorted ids; none without attack)
  trainers: tuple[Any, ...]  # per group: its `LocalTrainer` (or the attack's wrapper of one)
  sampling: SamplingInfo
  availability: Availability  # which sampled clients answer a round
  seed: Any  # of the rounds' randomness: the config's, or one run's traced seed in a job of many runs
  client_eval: ClientEval | None = None  # every group's clients' held-out samples (None: no per-client evaluation)

  @classmethod
  def build(cls, groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, method: Method,
            config: FederationConfig, test_images: jax.Array, test_labels: jax.Array,
            held_out: Sequence[np.ndarray] | None = None, compile_init: bool = False) -> "RoundSpec":
    """The spec of ``groups`` training ``method`` on ``store``; ValueError naming the argument that does not fit
    (`rounds.checks`), before anything is traced or computed. ``held_out``: every client's held-out sample ids
    (into the store's images, none of them in its training part: `data.hold_out`), for per-client evaluation.
    ``compile_init``: the initialization starts compiling on a thread once the global model is chosen, while the
    rest is built in Python (for a caller that initializes next, as the experiment driver does)."""
    check_simulation_inputs(groups, store, local, method, config, test_images, test_labels)
    check_federation(config, store.num_clients, [g.name for g in groups], method)
    if config.group_draw and any(t.memory for t in method.terms):
      raise ValueError(f"{method.name} keeps per-client memory in its group's shape; it cannot redraw groups")
    groups = tuple(dataclasses.replace(g, model=method.wrap_model(g.model)) for g in groups)
    sample = np.zeros((1,) + tuple(store.images.shape[1:]), np.float32)
    shapes = [variable_shapes(g.model, sample.shape[1:]) for g in groups]
    global_index = pick_global(shapes, [g.name for g in groups])
    groups = _scalers_relative_to_global(groups, global_index)
    if compile_init:
      _init_program(groups[global_index].model).compile_beside(np.uint32(config.seed), sample)
    base_maps = tuple(method.submodel(shapes[global_index], s, g.name) for g, s in zip(groups, shapes))
    maps = base_maps
    if method.own_leaves and method.sharing.shared and len(groups) > 1:
      own = [method.own_leaves(g.model, sample) for g in groups]
      maps = tuple(separate(base_maps, own, global_index, [g.name for g in groups]))
    group_of_client, row_of_client = np.full(store.num_clients, -1), np.full(store.num_clients, -1)
    for i, g in enumerate(groups):
      group_of_client[g.clients] = i
      row_of_client[g.clients] = np.arange(len(g.clients))
    if (group_of_client < 0).any():
      raise ValueError("every client must belong to an architecture group")
    federations = _federations(groups, shapes, maps, global_index, method, config, store)
    federation_of = tuple(next(f.index for f in federations if g in f.members) for g in range(len(groups)))
    malicious = attack.malicious_clients(store.num_clients, config.malicious_fraction, config.seed,
                                         groups[global_index].clients if config.malicious_group == "largest" else None)
    parameter_count = sum(x.size for x in jax.tree.leaves(shapes[global_index]["params"]))
    sample_seed = config.seed if config.sample_seed is None else config.sample_seed
    answering = availability(config.client_dropout, _trace(config, store.num_clients), len(groups), store.num_clients,
                             sample_seed)
    spec = cls(groups, store, local, method, config, test_images, test_labels, maps, base_maps, global_index,
               federations, federation_of, tuple(federations[f].members.index(g) for g, f in enumerate(federation_of)),
               group_of_client, row_of_client, malicious, _trainers(groups, store, local, method, config, malicious),
               SamplingInfo(store.sizes, config.clients_per_round, sample_seed, config.weighting, parameter_count),
               answering, config.seed,
               None if held_out is None else ClientEval.build(held_out, [g.clients for g in groups]))
    spec.state_shapes  # runs every step's and the sampler's checks (e.g. InCo's layer pairs) before any compute
    return spec

  def with_values(self, *, local: LocalConfig | None = None, method: Method | None = None,
                  federation: FederationConfig | None = None, seed: Any = None, label_counts: Any = None
                  ) -> "RoundSpec":
    """The same rounds with other values: the local training's settings, the method's and the attack's (a lower
    learning rate after a rollback; inside a job's program, one run's traced settings), the rounds' seed and the
    partition's label counts (both traced per run in a job). The method must have this one's terms and steps, in
    the same order, and the federation this one's clients and cohorts."""
    local, method, federation = local or self.local, method or self.method, federation or self.config
    store = self.store if label_counts is None else self.store.with_label_counts(label_counts)
    return dataclasses.replace(
        self, local=local, method=method, config=federation, store=store, seed=self.seed if seed is None else seed,
        federations=tuple(f._replace(terms=method.terms, store=store) for f in self.federations),
        trainers=_trainers(self.groups, store, local, method, federation, self.malicious_clients))

  # ------------------------------------------------------------------------------------------ derived, cached

  @functools.cached_property
  def state_shapes(self) -> ServerState:
    """The server state's shapes: the template a checkpoint is restored into."""
    return jax.eval_shape(self.init_state)

  @functools.cached_property
  def server_programs(self) -> tuple[Any, ...]:
    """Per federation, its server steps as one jitted program (`server.steps.server_program`)."""
    return tuple(server_program(self.method.server, f) for f in self.federations)

  @functools.cached_property
  def _extract(self) -> tuple[Any, ...]:
    return tuple(_extract_program(self.federations[f].maps[i]) for f, i in zip(self.federation_of, self.member_of))

  # ------------------------------------------------------------------------------------ the round's functions

  def init_state(self) -> ServerState:
    """Every federation starts from one initialization of the largest model."""
    sample = np.zeros((1,) + tuple(self.store.images.shape[1:]), np.float32)
    # One jitted program: eager init compiles a random kernel per leaf shape.
    global_vars = _init_program(self.groups[self.global_index].model)(np.uint32(self.config.seed), sample)
    if self.maps is not self.base_maps:
      global_vars = complete(global_vars, self.base_maps, self.maps)
    models = []
    for f in self.federations:
      model = global_vars if len(f.members) > 1 else _extract_program(self.maps[f.members[0]])(global_vars, 0)
      if self.method.sharing.stacked:
        model = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.config.clients_per_round,) + x.shape), model)
      models.append(model)
    steps = tuple(tuple(s.init(m, f) if s.init else () for s in self.method.server)
                  for m, f in zip(models, self.federations))
    sampler = self.initial_sampler_state()
    memory = []
    for group, trainer, group_map in zip(self.groups, self.trainers, self.maps):
      row = trainer.init_memory(_extract_program(group_map)(global_vars, 0)) if trainer.keeps_memory else ()
      memory.append(jax.tree.map(lambda x, n=len(group.clients): jnp.broadcast_to(x, (n,) + x.shape), row))
    return ServerState(0, tuple(models), steps, sampler, tuple(memory))

  def initial_sampler_state(self) -> Any:
    """The method's sampler's state before round 1 (``()`` for a sampler that keeps none)."""
    return self.method.sampler.init(self.sampling) if self.method.sampler.init else ()

  def start_variables(self, state: ServerState, group: int) -> Variables:
    """What the group's clients start from: their federation's model through the group's map (stacked sharing:
    every slot's model)."""
    f = self.federation_of[group]
    if self.method.sharing.stacked:
      return state.models[f]
    return self._extract[group](state.models[f], state.round)

  def group_share(self, state: ServerState, group: int) -> tuple[Any, ...]:
    """What the group's clients get from the server steps besides the model: per client term, the broadcast of
    the step that reads it (empty for a term that takes none)."""
    f, member = self.federation_of[group], self.member_of[group]
    steps, states = self.method.server, state.steps[f]
    return tuple(() if i is None else steps[i].broadcast(states[i], self.federations[f], member, state.round)
                 for i in self.method.share_writers)

  def server_variables(self, state: ServerState, federation: int = 0) -> Variables:
    """The variables a federation stands for: a server step's (FedCross's global model) or its model."""
    for step, step_state in zip(self.method.server, state.steps[federation]):
      if step.evaluate:
        return step.evaluate(step_state)
    return state.models[federation]

  def group_variables(self, state: ServerState, group: int) -> Variables:
    """The variables group ``group`` stands for: its federation's through the group's map."""
    f = self.federation_of[group]
    if any(step.evaluate for step in self.method.server):
      return self.server_variables(state, f)
    return self._extract[group](state.models[f], state.round)

  def evaluated_variables(self, variables: Variables, group: int) -> Variables:
    """``variables`` of group ``group`` as the method evaluates them (e.g. HeteroFL's re-estimated BatchNorm)."""
    if not self.method.evaluation_variables:
      return variables
    evaluated = self.method.evaluation_variables(self.groups[group].model, variables, self.store)
    check_tree_kept(f"the evaluation_variables of method {self.method.name!r}", "variables", "the variables'",
                    "it must keep the variables'", variables, evaluated)
    return evaluated

  def evaluated_group_variables(self, state: ServerState, group: int) -> Variables:
    """Group ``group``'s variables as the method evaluates them (HeteroFL's static BatchNorm re-estimates the
    statistics its training never kept)."""
    return self.evaluated_variables(self.group_variables(state, group), group)

  def stack_size(self, group: int) -> int:
    """The most clients of the group one round can have: the rows of its stacked uploads."""
    return self.federations[self.federation_of[group]].stack_sizes[self.member_of[group]]

  def groups_of_round(self, round_index: int) -> np.ndarray:
    """Every client's architecture group in round ``round_index``."""
    if not self.config.group_draw:
      return self.group_of_client
    rng = np.random.default_rng([self.config.seed, round_index, 2])
    return rng.choice(len(self.groups), size=self.store.num_clients, p=np.asarray(self.config.group_draw))

  def participants(self, sampler_state: Any, round_index: int) -> tuple[Participants, list[np.ndarray],
                                                                        list[np.ndarray], np.ndarray]:
    """The round's participants (the method's sampler), per architecture group its cohort (the participants that
    answered) and their weights, and the participants that did not answer (`sampling.availability`)."""
    chosen = self.method.sampler.sample(sampler_state, round_index, self.sampling)
    group_of_chosen = self.groups_of_round(round_index)[chosen.clients]
    answered = np.ones(len(chosen.clients), bool)
    if self.availability.on:
      answered = self.availability.answers(chosen.clients, group_of_chosen, round_index)
    cohorts = [chosen.clients[(group_of_chosen == g) & answered] for g in range(len(self.groups))]
    weights = [chosen.weights[(group_of_chosen == g) & answered] for g in range(len(self.groups))]
    return chosen, cohorts, weights, chosen.clients[~answered]
