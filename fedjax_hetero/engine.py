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

import dataclasses
from typing import Any, Collection, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.backends import Backend, copy_tree
from fedjax_hetero.client import attack
from fedjax_hetero.client.local import LocalConfig, LocalTrainer
from fedjax_hetero.config.federation import FederationConfig, check_federation  # (FederationConfig re-exported)
from fedjax_hetero.config.run import AUTO_ROUNDS_PER_CALL, ROUND_PROGRAMS  # (re-exported)
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.evaluation import ACCELERATOR_EVAL_BATCH, EVAL_BATCH, correct_predictions
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, complete, extract, identity_map, pick_global, separate
from fedjax_hetero.methods.api import Method
from fedjax_hetero import round_program
from fedjax_hetero.host_round import HostLoop
from fedjax_hetero.state import ServerState, round_key, server_key  # (re-exported)
from fedjax_hetero.round_program import RoundProgram
from fedjax_hetero.round_rows import NonFiniteLossError, accuracies  # (NonFiniteLossError re-exported)
from fedjax_hetero.sampling.samplers import Participants, SamplingInfo
from fedjax_hetero.server.steps import Federation, server_program
from fedjax_hetero.simulation_checks import check_simulation_inputs
from fedjax_hetero.validation import check_choice, check_integer, cli_flag


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
        config.seed, server_key(config.seed, 0, store.num_clients, len(groups) + index), method.terms))
  return tuple(out)


class Simulation:
  """Runs rounds of one method over architecture groups on a federated store."""

  def __init__(self, groups: Sequence[ArchGroup], store: FederatedStore, local: LocalConfig, method: Method,
               config: FederationConfig, backend: Backend, test_images: jax.Array, test_labels: jax.Array,
               round_program: str = "auto", rounds_per_call: int | None = None):
    """``round_program``: "fused" runs `run_rounds` as one device program per ``rounds_per_call`` rounds
    (`fedjax_hetero.round_program`), "host" as the host loop of `run_round`; "auto" picks the program on an
    accelerator when the method and backend allow it, the host loop on CPU (see docs/performance.md).
    ``rounds_per_call`` None: `AUTO_ROUNDS_PER_CALL`."""
    check_simulation_inputs(groups, store, local, method, config, backend, test_images, test_labels)
    check_federation(config, store.num_clients, [g.name for g in groups], method)
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
    if config.group_draw and any(t.memory for t in method.terms):
      raise ValueError(f"{method.name} keeps per-client memory in its group's shape; it cannot redraw groups")
    self.federations = _federations(self.groups, shapes, self.maps, self.global_index, method, config, store)
    self.federation_of = [next(f.index for f in self.federations if g in f.members) for g in range(len(self.groups))]
    self.member_of = [self.federations[f].members.index(g) for g, f in enumerate(self.federation_of)]
    # The attack's malicious clients (sorted ids; none by default); under attack every trainer is wrapped.
    self.malicious_clients = attack.malicious_clients(store.num_clients, config.malicious_fraction, config.seed)
    wrap = attack.trainer_wrapper(config, self.malicious_clients, store.num_clients)
    self.trainers = [wrap(LocalTrainer(g.model, local, store.mean, store.std, method.terms, method.combine))
                     for g in self.groups]
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
    self.host_loop = HostLoop(self)
    self.round_program = self._round_program(round_program, rounds_per_call)

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

  def cohorts_of_round(self, sampler_state: Any, round_index: int) -> tuple[Participants, list[np.ndarray],
                                                                          list[np.ndarray]]:
    """The round's participants (the method's sampler) and, per architecture group, its cohort and weights."""
    chosen = self.method.sampler.sample(sampler_state, round_index, self.sampling)
    group_of_chosen = self.groups_of_round(round_index)[chosen.clients]
    cohorts = [chosen.clients[group_of_chosen == gi] for gi in range(len(self.groups))]
    weights = [chosen.weights[group_of_chosen == gi] for gi in range(len(self.groups))]
    return chosen, cohorts, weights

  def _round_program(self, choice: str, rounds_per_call: int | None) -> RoundProgram | None:
    check_choice("round_program", choice, ROUND_PROGRAMS)
    check_integer("rounds_per_call", rounds_per_call, minimum=1, optional=True)
    why_not = round_program.unsupported(self)
    if choice == "fused" and why_not:
      raise ValueError(f"{self.method.name} cannot run as one program per round: {why_not}; use "
                       f"{cli_flag('round_program')} host (or auto)")
    if choice == "host" or why_not or (choice == "auto" and jax.default_backend() == "cpu"):
      return None
    mapping = "map" if self.backend.name == "sequential" else "vmap"
    eval_batch = EVAL_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_EVAL_BATCH
    return RoundProgram(self, rounds_per_call or AUTO_ROUNDS_PER_CALL, mapping, eval_batch)

  def run_rounds(self, state: ServerState, count: int, *, evaluate: Collection[int] = (),
                 consume: bool = False) -> tuple[ServerState, list[dict[str, Any]]]:
    """``count`` rounds from ``state``: the new state and one metrics row per round, whose ``test_accuracy``
    holds every group's test accuracy after the rounds in ``evaluate`` (1-based round numbers), else None.

    On the round program (``self.round_program``) the rounds run in calls of at most ``rounds_per_call`` rounds,
    each one device program whose metrics are read once; a non-finite loss raises `NonFiniteLossError` for
    the first such round after its call, whose rounds are then all dropped. ``consume`` as in `run_round`."""
    rows: list[dict[str, Any]] = []
    if self.round_program is None:
      for _ in range(count):
        state, row = self.run_round(state, consume=consume)
        consume = True  # every later round's state is this loop's own
        row["test_accuracy"] = self.evaluate(state) if state.round in evaluate else None
        rows.append(row)
      return state, rows
    if not consume:
      state = state._replace(memory=copy_tree(state.memory))
    for length in self.round_program.call_lengths(state.round, count):
      state, call_rows = self.round_program.run(state, length, evaluate)
      rows += call_rows
    return state, rows

  def run_round(self, state: ServerState, *, consume: bool = False) -> tuple[ServerState, dict[str, Any]]:
    """One round on the host loop (`fedjax_hetero.host_round`); returns the new state and its metrics row.

    With ``consume`` the round may update ``state``'s per-client memory in place (its buffers are
    donated), so ``state`` must not be used again; a loop that only keeps the new state should pass it.
    Without it the memory is copied first, a cost that grows with the total number of clients
    (SCAFFOLD's control variates, MOON's previous models), not with the round's work."""
    return self.host_loop.run_round(state, consume)

  def aggregate(self, federation: int, state: ServerState, starts: Sequence[Variables], shares: Sequence[Any],
                results: Sequence[Any], cohorts: Sequence[np.ndarray]) -> tuple[Variables, tuple[Any, ...], dict]:
    """The host loop's server program of one federation (`host_round.HostLoop.aggregate`)."""
    return self.host_loop.aggregate(federation, state, starts, shares, results, cohorts)

  def groups_of_round(self, round_index: int) -> np.ndarray:
    """Every client's architecture group in round ``round_index``."""
    if not self.config.group_draw:
      return self.group_of_client
    rng = np.random.default_rng([self.config.seed, round_index, 2])
    return rng.choice(len(self.groups), size=self.store.num_clients, p=np.asarray(self.config.group_draw))

  def stack_size(self, group: int) -> int:
    return self.federations[self.federation_of[group]].stack_sizes[self.member_of[group]]

  def evaluate(self, state: ServerState, batch_size: int = EVAL_BATCH) -> dict[str, float]:
    """Test accuracy of every group's model, and their mean under ``"mean"``.

    It runs on this process's own copy of the model (`Backend.local`), with no collective: in a
    multi-process run every process evaluates the whole test set and gets the same numbers, which its
    divergence guard and checkpoint ranking then agree on."""
    correct = []
    for gi, group in enumerate(self.groups):
      variables = self.evaluated_variables(self.backend.local(self.group_variables(state, gi)), gi)
      correct.append(correct_predictions(group.model, variables, self.test_images, self.test_labels,
                                         self.store.mean, self.store.std, batch_size))
    return accuracies(correct, [g.name for g in self.groups], len(self.test_labels))

  def evaluated_variables(self, variables: Variables, group: int) -> Variables:
    """``variables`` of group ``group`` as the method evaluates them (e.g. HeteroFL's re-estimated BatchNorm)."""
    if self.method.evaluation_variables:
      return self.method.evaluation_variables(self.groups[group].model, variables, self.store)
    return variables

