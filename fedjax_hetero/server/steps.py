"""The server side of a method: a pipeline of `ServerStep`s over typed, checkpointable state.

A round's server work for one federation is one jitted program: the steps run
in order, each reading the round's uploads (`RoundInputs`) and threading a
`Carry` -- the model being built, the aggregated update ``delta`` and its
``coverage`` (per element, the total weight of the clients that held it) --
in the manner of optax's ``update``: an averaging step fills ``delta``,
transforms (InCo's cross-layer step) change it, and `apply_delta` adds it to
the model. Each step owns its state (SCAFFOLD's ``c``, FedCross's global
model, FedGen's generator, each a typed pytree). A step with a client half owns
it: ``reads`` holds the client terms whose uploads it reads
(``inputs.uploads(term)``), and its ``broadcast`` goes to those of them that take
a ``share``. No step and no term is linked by name.

A step's ``plan(round)`` gives host-side, per-round settings: ``static``
values the program is specialized on (FedCross's stage), traced ``inputs``
(a learning rate), and ``log`` entries for the round's metrics.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_hetero import aggregators
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import SubmodelMap, Variables


class Federation(NamedTuple):
  """Static description of one federation: a server model and the architecture groups training it."""

  index: int
  name: str  # its group's name, or "global" when groups share it
  members: tuple[int, ...]  # indices of its architecture groups
  group_names: tuple[str, ...]
  models: tuple[nn.Module, ...]  # the member groups' models
  maps: tuple[SubmodelMap, ...]  # member group -> federation variables
  clients: tuple[np.ndarray, ...]  # the member groups' clients
  stack_sizes: tuple[int, ...]  # rows of a member's stacked uploads (its largest possible cohort)
  largest: nn.Module  # the model whose variables the federation keeps
  store: FederatedStore
  seed: int
  init_key: Callable[[], jax.Array]  # server randomness for the steps' init (made when called: made on a device,
  # a key costs a program compilation per operation, at the setup of every run that never reads it)
  terms: tuple = ()  # the method's client terms, in the order of every result's uploads


class MappedSums(NamedTuple):
  """What a round's mapping computed itself in one pass over its clients (`rounds.union`), in its own layout."""

  mean: Variables  # the layer-wise mean of the member groups' deltas (`aggregators.heterogeneous_sums`)
  coverage: Variables  # its denominator
  delta_norms: tuple[jax.Array, ...]  # per member group: ``sum(d ** 2)`` of each ``params`` leaf d of its delta sum


class RoundInputs(NamedTuple):
  """What every server step reads in a round (per member group where a tuple)."""

  model: Variables  # the federation's variables before the round
  starts: tuple[Variables, ...]  # what each member group's clients started from
  results: tuple[Any, ...]  # each member group's `backends.GroupResult`
  valid: tuple[jax.Array, ...]  # bool [stack size]: which rows of stacked uploads are real clients
  cohorts: tuple[jax.Array, ...]  # int [stack size]: their client ids (padding: num_clients)
  round: Any  # round index (0-based)
  key: jax.Array  # this federation's server key of the round
  federation: Federation
  mapped: MappedSums | None = None  # where the round's mapping computed them; else None

  def uploads(self, term) -> list[Any]:
    """Every member group's upload of client ``term`` (a term in the reading step's ``reads``)."""
    index = next((i for i, t in enumerate(self.federation.terms) if t is term), None)
    if index is None:
      raise ValueError(f"client term {getattr(term, 'name', term)!r} is not among the method's terms")
    return [r.uploads[index] for r in self.results]

  def delta_norm(self, member: int, leaves: Sequence[int]) -> jax.Array:
    """The squared norm of member group ``member``'s delta sum over its ``params`` leaves ``leaves`` (indices in the
    order of ``jax.tree.leaves``)."""
    if self.mapped is not None:
      return jnp.sum(jnp.take(self.mapped.delta_norms[member], np.asarray(leaves)))
    return squared_norm([jax.tree.leaves(self.results[member].delta_sum["params"])[k] for k in leaves])

  @property
  def weights(self) -> list[jax.Array]:
    return [r.weight_sum for r in self.results]

  @property
  def offset(self) -> Any:
    """The sub-model maps' window offset (FedRolex's rolling window moves one step per round)."""
    return self.round


def squared_norm(arrays: Sequence[jax.Array]) -> jax.Array:
  """``sum(x ** 2)`` over the elements of ``arrays`` as one vector (one reduction, where a sum per array is an XLA
  kernel per shape)."""
  return jnp.sum(jnp.square(jnp.concatenate([jnp.ravel(x) for x in arrays])))


class Carry(NamedTuple):
  model: Variables
  delta: Variables | None = None
  coverage: Variables | None = None
  metrics: dict[str, Any] = {}


class Plan(NamedTuple):
  static: Hashable = None
  inputs: Any = None
  log: dict[str, Any] = {}


class ServerStep(NamedTuple):
  """One step of a method's server pipeline (see the module docstring); all functions pure."""

  name: str
  update: Callable[[Carry, Any, RoundInputs, Plan], tuple[Carry, Any]]
  init: Callable[[Variables, Federation], Any] | None = None
  broadcast: Callable[[Any, Federation, int, int], Any] | None = None  # (state, federation, member, round)
  plan: Callable[[int], Plan] | None = None
  evaluate: Callable[[Any], Variables] | None = None  # the variables to evaluate, if not the federation's
  reads: tuple = ()  # its client half: the `ClientTerm`s whose uploads it reads and that take its broadcast


def run_server_steps(steps: Sequence[ServerStep], federation: Federation, model, states, starts, results, valid,
                     cohorts, round_index, key, inputs, statics, mapped=None
                     ) -> tuple[Variables, tuple[Any, ...], dict[str, Any]]:
  """The steps in order on one round's `RoundInputs`, as a pure function: ``(model, step states, metrics)``."""
  round_inputs = RoundInputs(model, starts, results, valid, cohorts, round_index, key, federation, mapped)
  carry, new_states = Carry(model), []
  for step, state, static, dynamic in zip(steps, states, statics, inputs):
    before, state_before = carry, state
    carry, state = _checked_result(step.name, step.update(carry, state, round_inputs, Plan(static, dynamic)))
    check_model_kept(step.name, model, carry.model)
    _check_kept(step.name, model, before, state_before, carry, state)
    new_states.append(state)
  return carry.model, tuple(new_states), carry.metrics


def _checked_result(step: str, result: Any) -> tuple[Carry, Any]:
  """A step's ``(carry, state)``, or a TypeError naming the step (a Carry alone unpacks into its four fields)."""
  if isinstance(result, Carry) or not (isinstance(result, (tuple, list)) and len(result) == 2
                                       and isinstance(result[0], Carry)):
    got = "a Carry alone" if isinstance(result, Carry) else f"a {type(result).__name__}"
    raise TypeError(f"server step {step!r} returned {got}; a step's update returns (carry, state): the Carry, "
                    "then the step's new state")
  return tuple(result)


def check_model_kept(step: str, before: Variables, after: Variables) -> None:
  """A step keeps the model's tree, shapes and dtypes (a static check, at trace time: it costs nothing per
  round); otherwise a ValueError naming the step, not a failure in the next round deep inside jax."""
  check_tree_kept(f"server step {step!r}", "a model", "the model's", "a server step keeps the model's", before, after)


def _check_kept(step: str, model: Variables, before: Carry, state_before: Any, after: Carry, state: Any) -> None:
  """A step that transforms the delta or the coverage keeps their tree, shapes and dtypes, and one that fills them
  in the model's tree gives them the model's shapes (other shapes would broadcast silently in `apply_delta`); its
  state keeps its own tree, shapes and dtypes (a round program carries it)."""
  for name in ("delta", "coverage"):
    old, new = getattr(before, name), getattr(after, name)
    if old is not None and new is not None:
      check_tree_kept(f"server step {step!r}", f"a {name}", f"the {name}'s",
                      f"a server step that transforms the {name} keeps its", old, new)
    elif new is not None and jax.tree.structure(new) == jax.tree.structure(model):
      for (path, m), x in zip(_paths(model).items(), jax.tree.leaves(new)):
        if np.shape(x) != np.shape(m):
          raise ValueError(f"server step {step!r} gave the {name} {path} the shape {list(np.shape(x))}, where the "
                           f"model's is {list(np.shape(m))}; a {name} has the model's shapes")
  check_tree_kept(f"server step {step!r}", "a state", "its state's", "a server step keeps its state's",
                  state_before, state)


def check_tree_kept(who: str, returned: str, owner: str, rule: str, before: Variables, after: Variables) -> None:
  """``after`` has ``before``'s tree, shapes and dtypes; otherwise a ValueError naming ``who`` returned it
  (``returned``, ``owner`` and ``rule`` name what it returned: "a model", "the model's", "a server step keeps the
  model's")."""
  if jax.tree.structure(after) != jax.tree.structure(before):
    missing = set(_paths(before)) ^ set(_paths(after))
    raise ValueError(f"{who} returned {returned} of another tree (leaves in one but not the other: "
                     f"{', '.join(sorted(missing)[:3]) or 'none; the containers differ'}); {rule} tree, shapes and "
                     "dtypes")
  for (path, a), b in zip(_paths(before).items(), jax.tree.leaves(after)):
    if (np.shape(a), jnp.result_type(a)) != (np.shape(b), jnp.result_type(b)):
      where = f"{owner} {path}" if path else owner.removesuffix("'s")  # (a leaf at the root: the tree itself)
      raise ValueError(f"{who} changed {where} from {jnp.result_type(a)}{list(np.shape(a))} to "
                       f"{jnp.result_type(b)}{list(np.shape(b))}; {rule} tree, shapes and dtypes")


def _paths(tree: Any) -> dict[str, Any]:
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def server_program(steps: Sequence[ServerStep], federation: Federation):
  """`run_server_steps` as one jitted program per round: ``(model, step states, starts, results, valid, cohorts,
  round, key, plan inputs, statics=plan statics, mapped=the mapping's `MappedSums` or None) -> (model, step states,
  metrics)``."""

  @functools.partial(jax.jit, static_argnames="statics")
  def run(model, states, starts, results, valid, cohorts, round_index, key, inputs, statics, mapped=None):
    return run_server_steps(steps, federation, model, states, starts, results, valid, cohorts, round_index, key,
                            inputs, statics, mapped)

  return run


def _zeros_like(tree: Variables) -> Variables:
  return jax.tree.map(jnp.zeros_like, tree)


def mean_delta() -> ServerStep:
  """Layer-wise mean of the client deltas over the clients holding each element (InCo Sec. 3.1,
  `aggregators.heterogeneous_mean_delta`); FedAvg (McMahan et al. 2017, Alg. 1) with one group.
  Elements nobody held get a zero update. Where the round's mapping computed the mean itself
  (`RoundInputs.mapped`), it is taken as it is."""

  def update(carry, state, inputs, plan):
    if inputs.mapped is not None:
      return carry._replace(delta=inputs.mapped.mean, coverage=inputs.mapped.coverage), state
    num, den = aggregators.heterogeneous_sums([r.delta_sum for r in inputs.results], inputs.weights,
                                              inputs.federation.maps, carry.model, inputs.offset)
    return carry._replace(delta=aggregators.masked_mean(num, den, _zeros_like(carry.model)), coverage=den), state

  return ServerStep("mean", update)


def mean_of_weights() -> ServerStep:
  """The mean of the uploaded weights ``start + delta`` over the holders of each element, as an
  update relative to the current model (untouched where nobody held an element)."""

  def update(carry, state, inputs, plan):
    uploads = [jax.tree.map(lambda d, s, w=r.weight_sum: d + w * s, r.delta_sum, start)
               for r, start in zip(inputs.results, inputs.starts)]
    num, den = aggregators.heterogeneous_sums(uploads, inputs.weights, inputs.federation.maps, carry.model,
                                              inputs.offset)
    delta = jax.tree.map(jnp.subtract, aggregators.masked_mean(num, den, carry.model), carry.model)
    return carry._replace(delta=delta, coverage=den), state

  return ServerStep("mean", update)


def apply_delta(optimizer: optax.GradientTransformation | None = None) -> ServerStep:
  """``w <- w + delta``; with a server ``optimizer`` (e.g. FedAvgM's ``optax.sgd(1.0, momentum)``)
  the negated delta is its pseudo-gradient (Reddi et al. 2021, Alg. 2), its state the step's."""

  def update(carry, state, inputs, plan):
    if optimizer is None:
      return carry._replace(model=jax.tree.map(jnp.add, carry.model, carry.delta)), state
    updates, state = optimizer.update(jax.tree.map(jnp.negative, carry.delta), state, carry.model)
    return carry._replace(model=optax.apply_updates(carry.model, updates)), state

  init = None if optimizer is None else lambda model, federation: optimizer.init(model)
  return ServerStep("apply", update, init)


def insert_before(steps: Sequence[ServerStep], name: str, step: ServerStep) -> tuple[ServerStep, ...]:
  """``steps`` with ``step`` inserted before the step called ``name``."""
  names = [s.name for s in steps]
  if name not in names:
    raise ValueError(f"no server step {name!r} in {names}")
  at = names.index(name)
  return tuple(steps[:at]) + (step,) + tuple(steps[at:])
