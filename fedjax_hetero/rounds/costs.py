"""What a run costs, per architecture group and per round: parameters held, bytes each way, client training FLOPs.

Static costs (`GroupCost`) come from a built `RoundSpec` with nothing trained, once per run (`static_costs`):

- ``parameters``: the scalars of the group's ``params``, the model a client holds and trains;
- ``bytes_down``: what one client receives when its round starts: its group's variables (parameters, and
  statistics such as BatchNorm's) and what the server steps share with the group (SCAFFOLD's control variate,
  FedImpro's global feature statistics), at the dtypes the program holds them in;
- ``bytes_up``: what one client's local training hands back: its update and every client term's upload
  (SCAFFOLD's control change, FedImpro's feature statistics, FedIN's feature pairs), at their dtypes, less what
  depends on nothing the client computed (HeteroFL's zeros in place of the statistics it drops); an upload
  that is a function of the client's final variables, its start and its update alone (FedCross's and FedGen's
  uploaded models, CluSamp's flattened update, FedFA's scaled kernels) is what the server rebuilds from the update
  and the model it sent, so it is not counted (``derived_uploads`` names those terms; an upload that reads
  leaves a term changes in the update, as FedNova's normalization changes all of them, counts);
- ``train_flops_per_example``: XLA's cost analysis of one local training step (forward, backward, the client
  terms and the optimizer update) of the lowered program at the run's batch size, divided by the batch size.

Each is the shape of the method's own pieces (`jax.eval_shape` of the group's start variables and share, and of
its trainer's ``init_state`` and ``finish``; the trainer's ``train_step`` lowered), so a user's method and its terms
are counted with no code of their own. Per round (`round_costs`), a group's bytes are its clients times the static
bytes and its FLOPs the examples its clients trained times the FLOPs per example; `costed_row` adds them to a
metrics row with the running totals carried from the row before it (so a resume continues them from the rows it
restores). See docs/costs.md.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from fedjax_hetero.client.terms import ClientFinal
from fedjax_hetero.compilation import in_background
from fedjax_hetero.rounds.spec import RoundSpec

Row = dict[str, Any]
# Per round and in the running totals: the bytes each way and the FLOPs of the clients' local training.
ROUND_KEYS = ("bytes_down", "bytes_up", "client_flops")


class GroupCost(NamedTuple):
  """One architecture group's static costs, per client (see the module docstring)."""

  parameters: int
  bytes_down: int
  bytes_up: int
  train_flops_per_example: float | None  # None where the backend gives no FLOP count
  derived_uploads: tuple[str, ...] = ()  # the terms whose upload the server rebuilds from the update (not counted)


def tree_bytes(tree: Any) -> int:
  """The bytes of every array (or shape) in ``tree`` at its dtype."""
  return sum(math.prod(x.shape) * jax.dtypes.itemsize_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def tree_size(tree: Any) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _one_client(tree: Any) -> Any:
  """A row of a tree stacked over clients (client memory; stacked sharing's model slots)."""
  return jax.tree.map(lambda x: x[0], tree)


def client_start(spec: RoundSpec, group: int) -> tuple[Any, Any, Any, Any]:
  """Shapes of what one client of ``group`` starts a round with: the variables and the share it receives, its
  memory row and its local state, from the spec's server state shapes."""
  trainer = spec.trainers[group]

  def start_of(state):
    start = spec.start_variables(state, group)
    if spec.method.sharing.stacked:
      start = _one_client(start)
    share, memory = spec.group_share(state, group), _one_client(state.memory[group])
    return start, share, memory, trainer.init_state(start, memory, share, jax.random.key(0))

  return jax.eval_shape(start_of, spec.state_shapes)


def varying_outputs(fn: Any, *args: Any) -> list[bool]:
  """Per leaf of ``fn``'s result, whether it depends on ``args`` at all (a constant, such as the zeros a term sends in
  place of what it drops, is known to the server): one pass over ``fn``'s jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  varying = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in varying for v in eqn.invars):
      varying.update(eqn.outvars)
  return [not isinstance(v, Literal) and v in varying for v in jaxpr.outvars]


def used_inputs(fn: Any, *args: Any) -> list[bool]:
  """Per leaf of ``args``, whether ``fn``'s result depends on it: the inputs of every operation one of whose
  outputs is used, walking ``fn``'s jaxpr back from its outputs (an operation with a body counts as a whole)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if not isinstance(v, Literal))
  return [v in live for v in jaxpr.invars]


def _per_term(values: Any, count: int) -> tuple[Any, ...]:
  return tuple(values) if values else ((),) * count  # (as `LocalTrainer.finish` reads them)


def kept_update_leaves(trainer: Any, start: Any, share: Any, memory: Any, local: Any) -> list[bool]:
  """Per leaf of the update, whether it is the client's own change (final variables minus start) as sent: no
  term's ``delta`` replaces it (HeteroFL's static BatchNorm replaces only the statistics' leaves with zeros)."""
  terms = getattr(trainer, "terms", ())

  def update(local, memory, share, start, delta):
    final = ClientFinal(start, local.variables, delta, local.num_steps)
    for term, state, row, part in zip(terms, local.terms, _per_term(memory, len(terms)), _per_term(share, len(terms))):
      if term.delta:
        final = final._replace(delta=term.delta(state, final, row, part))
    return final.delta

  jaxpr = jax.make_jaxpr(update)(local, memory, share, start, start).jaxpr
  given = jaxpr.invars[-len(jax.tree.leaves(start)):]
  if len(jaxpr.outvars) != len(given):  # a term's delta of another structure: nothing is sent as computed
    return [False] * len(given)
  return [out is delta for out, delta in zip(jaxpr.outvars, given)]


def derived_uploads(trainer: Any, start: Any, share: Any, memory: Any, local: Any) -> tuple[bool, ...]:
  """Per client term, whether its upload is a function of the client's final variables, start and update alone
  (see the module docstring) and reads, of the variables and the update, only leaves that the update sends as the
  client computed them (`kept_update_leaves`; FedNova's normalization changes every one)."""
  terms = getattr(trainer, "terms", ())
  kept = kept_update_leaves(trainer, start, share, memory, local)
  out = []
  for term, state, row, part in zip(terms, local.terms, _per_term(memory, len(terms)), _per_term(share, len(terms))):
    if term.upload is None:
      out.append(False)
      continue
    own = (state, row, part, local.num_steps)  # what the server does not have
    value = lambda own, start, variables, delta, term=term: term.upload.value(
        own[0], ClientFinal(start, variables, delta, own[3]), own[1], own[2])
    used = used_inputs(value, own, start, start, start)
    mine, leaves = len(jax.tree.leaves(own)), len(jax.tree.leaves(start))
    variables, delta = used[mine + leaves:mine + 2 * leaves], used[mine + 2 * leaves:]
    rebuilt = all(k or not (v or d) for k, v, d in zip(kept, variables, delta))
    out.append(not any(used[:mine]) and rebuilt)
  return tuple(out)


def bytes_sent(trainer: Any, start: Any, share: Any, memory: Any, local: Any) -> tuple[int, tuple[str, ...]]:
  """The bytes one client sends (its update and its terms' uploads, less their constant leaves and the uploads
  the server rebuilds from the update), and the names of the terms of those."""
  derived = derived_uploads(trainer, start, share, memory, local)
  sent = lambda local, start, memory, share: tuple(trainer.finish(local, start, memory, share))[:2]
  update, uploads = jax.eval_shape(sent, local, start, memory, share)
  derived_leaves = jax.tree.leaves((jax.tree.map(lambda _: False, update),
                                    tuple(jax.tree.map(lambda _, d=d: d, u) for u, d in zip(uploads, derived))))
  leaves = jax.tree.leaves((update, uploads))
  counted = [x for x, d, v in zip(leaves, derived_leaves, varying_outputs(sent, local, start, memory, share))
             if v and not d]
  return tree_bytes(counted), tuple(t.name for t, d in zip(getattr(trainer, "terms", ()), derived) if d)


def step_flops(trainer: Any, local: Any, image_shape: Sequence[int], image_dtype: Any, label_dtype: Any,
               batch_size: int) -> float | None:
  """XLA's FLOP count of one ``trainer.train_step`` on a full batch of ``batch_size`` examples, from the lowered
  program's cost analysis (nothing compiled: on a CPU it agrees with the compiled program's within a few percent,
  docs/costs.md); None where the backend gives none."""
  images = jax.ShapeDtypeStruct((batch_size, *image_shape), image_dtype)
  labels = jax.ShapeDtypeStruct((batch_size,), label_dtype)
  mask = jax.ShapeDtypeStruct((batch_size,), jnp.bool_)

  def step(state, images, labels, mask):
    schedule = jnp.arange(batch_size)[None]  # (the terms that read the schedule's labels: one step's)
    return trainer.train_step(state, images, labels, mask, trainer.schedule_labels(labels, schedule, mask[None]))

  analysis = jax.jit(step).lower(local, images, labels, mask).cost_analysis()
  if isinstance(analysis, (list, tuple)):  # (older jax: one dict per program)
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get("flops")
  return float(flops) if flops is not None and flops >= 0 else None


def group_cost(spec: RoundSpec, group: int) -> GroupCost:
  """Group ``group``'s `GroupCost` (see the module docstring)."""
  start, share, memory, local = client_start(spec, group)
  trainer, store = spec.trainers[group], spec.store
  sent, derived = bytes_sent(trainer, start, share, memory, local)
  flops = step_flops(trainer, local, store.images.shape[1:], store.images.dtype, store.labels.dtype,
                     spec.local.batch_size)
  return GroupCost(tree_size(start["params"]), tree_bytes((start, share)), sent,
                   None if flops is None else flops / spec.local.batch_size, derived)


def static_costs(spec: RoundSpec) -> dict[str, GroupCost]:
  """Every group's `GroupCost`, by group name."""
  return {g.name: group_cost(spec, i) for i, g in enumerate(spec.groups)}


_IN_TURN = threading.Lock()  # (several runs' accounting: one after another, as one GIL runs them anyway)


def _static_costs_in_turn(spec: RoundSpec) -> dict[str, GroupCost]:
  with _IN_TURN:
    return static_costs(spec)


class InBackground(Mapping):
  """`static_costs` of a spec, traced on a thread of their own from `start` on: a run starts them once its first
  program is traced (`Simulation.run_call`'s ``while_compiling``: their Python would slow the tracing), and XLA
  compiles it meanwhile, outside Python, so the accounting adds little to the run's time. Read as the mapping it
  becomes (the first read starts it if nothing has, and waits for it)."""

  def __init__(self, spec: RoundSpec):
    self._spec, self._costs = spec, None

  def start(self) -> None:
    if self._costs is None:
      self._costs = in_background(lambda: _static_costs_in_turn(self._spec))

  def _result(self) -> dict[str, GroupCost]:
    self.start()
    return self._costs.result()

  def __getitem__(self, group: str) -> GroupCost:
    return self._result()[group]

  def __iter__(self) -> Iterator[str]:
    return iter(self._result())

  def __len__(self) -> int:
    return len(self._result())


def round_costs(static: Mapping[str, GroupCost], clients: Mapping[str, int], examples: Mapping[str, int]) -> Row:
  """A round's costs from its groups' ``clients`` and the ``examples`` they trained (a group absent: none): the
  totals and ``per_group`` (groups that trained)."""
  per_group = {}
  for name, cost in static.items():
    count = clients.get(name, 0)
    if count:
      flops = None if cost.train_flops_per_example is None else round(cost.train_flops_per_example *
                                                                      examples.get(name, 0))
      per_group[name] = {"bytes_down": count * cost.bytes_down, "bytes_up": count * cost.bytes_up,
                         "client_flops": flops}
  return {**{key: _total(g[key] for g in per_group.values()) for key in ROUND_KEYS}, "per_group": per_group}


def _total(values: Any) -> int | None:
  values = list(values)
  return None if any(v is None for v in values) else sum(values)


def _plus(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a + b


def cumulative(costs: Row, previous: Row | None) -> Row | None:
  """The running totals after a round of ``costs``, from the row before it (None: the first round). None where the
  row before has none (a folder written before costs were counted): its history's costs are unknown."""
  before = dict.fromkeys(ROUND_KEYS, 0) if previous is None else (previous.get("costs") or {}).get("cumulative")
  if before is None:
    return None
  totals = {key: _plus(before[key], costs[key]) for key in ROUND_KEYS}
  return {**totals, "bytes": _plus(totals["bytes_down"], totals["bytes_up"])}


def costed_row(row: Row, static: Mapping[str, GroupCost], previous: Row | None) -> Row:
  """``row`` (a `rows.call_row`) with its ``costs``: the round's (`round_costs`) and the ``cumulative`` totals
  carried from ``previous``, the row of the round before (None for round 1)."""
  costs = round_costs(static, row.get("clients_per_group") or {}, row.get("examples_per_group") or {})
  return {**row, "costs": {**costs, "cumulative": cumulative(costs, previous)}}


def summary_costs(static: Mapping[str, GroupCost], rows: Sequence[Row]) -> Row:
  """summary.json's ``costs``: every group's static costs and the totals after the last row."""
  last = (rows[-1].get("costs") or {}).get("cumulative") if rows else dict.fromkeys(ROUND_KEYS + ("bytes",), 0)
  return {"per_group": {name: cost._asdict() for name, cost in static.items()}, "cumulative": last,
          "flops_from": "XLA cost analysis of one lowered local training step / batch size"}
