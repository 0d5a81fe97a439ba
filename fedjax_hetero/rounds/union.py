"""The union mapping: every sampled client of every group trains as a masked member of the union model.

When a run's architecture groups are one family (depth and width sub-models of the largest model, `hetero.maps`),
a client of group g computes what the union model computes on its variables with every element
outside the group's window set to zero:

- a width group's missing channels stay zero through convolutions, dense layers, ReLU, pooling and BatchNorm
  (whose scale and bias are zero there too), so they add nothing to the channels it holds;
- a depth group's missing block is all zeros, so its residual branch adds zero and the block passes its (ReLU'd,
  non-negative) input through: an identity residual.

Its gradient is masked to the group's window (the held elements), so the zeros stay zeros, the optimizer's state
of them stays zero, and a client's trajectory is its sub-model's up to the order of float sums. The round's
sampled clients (not groups x capacity) are the slots of one vmapped step, with no per-group branch; a slot's
variables are one vector per collection (`client.flat`: each elementwise pass of the step is then one kernel). After the
steps, a group whose trainer has no terms uploads only its weighted delta sum: every such group's is one product
over the slots in the union's layout, cut to the group's shape (and so does a group whose terms only upload
per-leaf sums of the update, as the dissimilarity metric's norms: summed per leaf in the layout,
`uploads_in_layout`). A group with other terms is taken back to its shape,
and its trainer finishes and reduces its clients as the per-group mapping does. Either way every method's server
steps, uploads and client memory see what they see there; where every group shares one model and uploads its plain
delta, the layer-wise mean of HeteroAvg (`server.steps.mean_delta`) is handed over ready, a masked weighted mean
in the union's layout. The step's BatchNorm is `models.batch_norm`'s (the same function, fewer kernels).

Each group starts from its own federation's model (one shared model, or one per group as the per-architecture
baselines), placed into the union's layout. `union_reason` says why a spec cannot train this way (one group, a
model per client, a method whose terms act during local training, an attacked or custom trainer, sub-models that
are not windows of the union, a model whose zeros leak, such as LayerNorm or HeteroFL's scaler, checked
numerically once); the per-group program then stays (`rounds.simulation`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from fedjax_hetero.aggregators.hetero_avg import masked_mean
from fedjax_hetero.client.flat import FlatLayout
from fedjax_hetero.client.local import LocalTrainer
from fedjax_hetero.client.terms import ClientTerm
from fedjax_hetero.hetero.maps import SubmodelMap, Variables, embed, extract
from fedjax_hetero.models.batch_norm import fused_batch_norm
from fedjax_hetero.models.cnn import CNN
from fedjax_hetero.models.common import variable_shapes
from fedjax_hetero.models.evaluation import EVAL_BATCH
from fedjax_hetero.models.resnet import ResNet
from fedjax_hetero.rounds import cohort
from fedjax_hetero.rounds.body import RoundData
from fedjax_hetero.rounds.inputs import RoundRows
from fedjax_hetero.rounds.mapping import ProgramCohorts
from fedjax_hetero.rounds.state import ServerState, round_key
from fedjax_hetero.server.steps import MappedSums

if TYPE_CHECKING:
  from fedjax_hetero.rounds.spec import RoundSpec

# Term pieces that act while a client trains: with them the union would train the term on union-shaped variables.
TRAINING_PIECES = ("loss", "logits", "grad", "update", "cuts", "wrap_model")
PROBE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def held_term() -> ClientTerm:
  """The union's one client term: the client's gradient masked to its group's window (the term's state: a boolean
  mask, a quarter of a float one's bytes, read by every local step)."""
  return ClientTerm("held", init=lambda r: r.share,
                    grad=lambda g, held: jax.tree.map(lambda a, h: jnp.where(h, a, jnp.zeros_like(a)), g, held),
                    share=True)


def _window_map(group_map: SubmodelMap) -> SubmodelMap:
  """``group_map`` pushing back exactly what it pulls (no grafting): the embedding of a client's window."""
  return dataclasses.replace(group_map, push=group_map.pull)


def held_mask(group_map: SubmodelMap, union: Variables) -> Variables:
  """1.0 on every element of the union variables (``union``: them or their shapes) the group holds, 0.0
  elsewhere."""
  ones = traverse_util.unflatten_dict({link.client: jnp.ones(link.window.shape, jnp.float32)
                                      for link in group_map.pull})
  return embed(ones, _window_map(group_map), union)


def held_vectors(layout: FlatLayout, group_map: SubmodelMap) -> dict[str, np.ndarray]:
  """`held_mask` in ``layout``'s vectors, as booleans computed on the host (for a union's group: every leaf it holds
  a leading window of the same leaf, `_structural_reason`)."""
  windows = {link.global_: link.window.shape for link in group_map.pull}
  vectors: dict[str, list[np.ndarray]] = {}
  for path, shape in layout.leaves:
    held = np.zeros(shape, bool)
    if path in windows:
      held[tuple(slice(0, n) for n in windows[path])] = True
    vectors.setdefault(path[0], []).append(held.ravel())
  return {name: np.concatenate(parts) for name, parts in vectors.items()}


class UnionInputs(NamedTuple):
  """What the union's program takes as arguments (`RoundData.mapping`) rather than building as constants."""

  offsets: tuple[Any, ...]  # every leaf's offset in its collection's vector (`client.flat.FlatLayout.at`)
  held: dict[str, jax.Array]  # every group's held elements, ``[G, P]`` booleans per collection
  param_leaf: jax.Array  # int32 [P]: which ``params`` leaf (in the layout's order) each element of that vector is


def uploads_in_layout(terms: Sequence[ClientTerm]) -> bool:
  """Whether the union computes every upload of ``terms`` in its own layout: each term only uploads a weighted
  per-leaf sum of its update's elements (`client.terms.update_leaf_sums`, e.g. the dissimilarity metric's norms),
  which the zeros outside a group's window leave unchanged."""
  return all(t == ClientTerm(t.name, upload=t.upload) and t.upload.update_leaf_sum is not None
             and t.upload.reduce == "weighted" for t in terms)


def _structural_reason(spec: "RoundSpec") -> str | None:
  if len(spec.groups) < 2:
    return "it has one architecture group: there is no union of groups to train"
  if spec.method.sharing.stacked:
    return f"{spec.method.name} starts every client from a model of its own (stacked sharing)"
  for term in spec.method.terms:
    acting = [p for p in TRAINING_PIECES if getattr(term, p)]
    if acting:
      return (f"{spec.method.name}'s client term {term.name!r} acts during local training ({', '.join(acting)}), "
              "on the group's model")
  if any(type(t) is not LocalTrainer for t in spec.trainers):
    return "its clients train through a trainer wrapper (e.g. the backdoor attack), not the plain local trainer"
  for group, group_map in zip(spec.groups, spec.maps):
    for link in group_map.pull:
      if link.client != link.global_ or link.window.rolled:
        return (f"group {group.name}'s leaf {'/'.join(link.client)} is not a leading window of the same leaf of the "
                "union (rolled or own copies)")
  return None


def _probe_reason(spec: "RoundSpec") -> str | None:
  """Checks on random variables and a batch of two that every group's model computes what the masked union
  computes (logits, new batch statistics, gradient): None, or the first group that does not. One program, in
  full float32 products (a GPU's default TF32 ones differ in the fourth digit), on the CPU."""
  union_model = spec.groups[spec.global_index].model
  shape = tuple(spec.store.images.shape[1:])
  windows = [_window_map(m) for m in spec.maps]

  def outputs(model, variables, x):
    def loss(params):
      logits, new = model.apply({**variables, "params": params}, x, train=True, mutable=["batch_stats"])
      return jnp.sum(jnp.tanh(logits)), (logits, new)
    with fused_batch_norm():  # (as a local step trains, `LocalTrainer.train_step`)
      grads, (logits, new) = jax.grad(loss, has_aux=True)(variables["params"])
    return logits, dict(new), grads

  def probe(key):
    union = union_model.init(key, jnp.zeros((1,) + shape, jnp.float32))
    x = jax.random.normal(jax.random.fold_in(key, 1), (2,) + shape)
    found = []
    for group, group_map, window in zip(spec.groups, spec.maps, windows):
      held = held_mask(group_map, union)
      logits, new, grads = outputs(group.model, extract(union, window), x)
      u_logits, u_new, u_grads = outputs(union_model, jax.tree.map(jnp.multiply, union, held), x)
      u_grads = extract({"params": jax.tree.map(jnp.multiply, u_grads, held["params"])}, window)["params"]
      found.append([(logits, u_logits), (new, extract(u_new, window) if new else {}), (grads, u_grads)])
    return found

  with jax.default_matmul_precision("float32"), jax.default_device(jax.devices("cpu")[0]):
    found = jax.device_get(jax.jit(probe)(jax.random.key(1)))
  for group, pairs in zip(spec.groups, found):
    for what, (own, masked) in zip(("logits", "batch statistics", "gradient"), pairs):
      if not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.allclose(a, b, **PROBE_TOLERANCE)), own, masked))):
        return (f"group {group.name}'s {what} differ from the masked union's ({type(group.model).__name__}: its "
                "missing elements do not stay zero, e.g. LayerNorm or a width scaler)")
  return None


def declared_exact(model) -> bool:
  """Whether ``model``'s family is known to compute a sub-model's function with the missing weights at zero (the
  ResNets and the CNN without HeteroFL's scaler; tests/test_union.py checks it with `_probe_reason`). Other models
  are probed, which costs a compilation of every group's model (about a minute on 2 CPU cores for five ResNets)."""
  return type(model) in (ResNet, CNN) and not model.scaler


@functools.lru_cache(maxsize=16)
def union_reason(spec: "RoundSpec") -> str | None:
  """Why ``spec``'s cohorts cannot train as one masked union model (None: they can). The numeric probe runs once
  per spec, for models `declared_exact` does not know."""
  why = _structural_reason(spec)
  if why is None and not all(declared_exact(g.model) for g in spec.groups):
    why = _probe_reason(spec)
  return why


class UnionCohorts(ProgramCohorts):
  """The mapping inside a device program that trains a round's sampled clients as one vmapped cohort of the union
  model (see the module docstring); build it for a spec that `union_reason` accepts."""

  def __init__(self, spec: "RoundSpec", eval_batch: int = EVAL_BATCH):
    super().__init__("vmap", eval_batch)
    self.name = "union"
    union = variable_shapes(spec.groups[spec.global_index].model, spec.store.images.shape[1:])
    self._union_shapes = union
    self.layout = FlatLayout.of(union)  # the slots' variables: one vector per collection
    # (path within ``params``, shape) of every leaf of the ``params`` vector, in its order
    self._param_leaves = [(path[1:], shape) for path, shape in self.layout.leaves if path[0] == "params"]
    self.capacity = spec.config.clients_per_round  # the slots: a round's participants, whatever their groups
    self._maps = spec.maps

  @functools.cached_property
  def _inputs(self) -> UnionInputs:
    """Placed once, at the first program's call (a job of many runs calls its first run's alone); built in the
    program, the masks were about 2,000 traced operations of every round."""
    sizes = [math.prod(shape) for _, shape in self._param_leaves]
    return UnionInputs(self.layout.offsets, jax.tree.map(
        lambda *h: jax.device_put(np.stack(h)), *[held_vectors(self.layout, m) for m in self._maps]),
                       jax.device_put(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)))

  def arguments(self) -> UnionInputs:
    return self._inputs

  def _one_union_model(self, spec: "RoundSpec", state: ServerState) -> bool:
    """Whether every group takes its window of one federation's union-shaped model."""
    layout = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    f = spec.federation_of[0]
    return all(spec.federation_of[g] == f and spec.federations[f].maps[spec.member_of[g]] == spec.maps[g]
               for g in range(len(spec.groups))) and layout(state.models[f]) == layout(self._union_shapes)

  def _mapped_sums(self, spec: "RoundSpec", state: ServerState, x: RoundRows, group_sums: dict[str, jax.Array],
                   mapping: UnionInputs, layout: FlatLayout, starts: Sequence[Any]) -> tuple[Any, ...]:
    """The one federation's `server.steps.MappedSums`, from the groups' weighted delta sums (``[G, P]``) and held
    masks in the slots' layout. The mean: HeteroAvg as a masked weighted mean, one kernel per collection, read into
    the model's leaves at the layout's offsets (a kernel per leaf shape, where the groups' sums cut to their shapes
    and embedded made one per leaf and set of groups holding it); the groups' per-leaf squared norms: one segment
    sum (cut to each group's shape, a kernel per leaf and group). Where every group takes its window of that
    federation's model, pushes back what it pulls (its held elements are its coverage) and uploads its plain delta
    (no terms, or only terms whose uploads the union sums itself, `uploads_in_layout`); else None."""
    if len(spec.federations) != 1 or not self._one_union_model(spec, state) \
        or not all(uploads_in_layout(t.terms) for t in spec.trainers) or any(m.push != m.pull for m in spec.maps):
      return (None,) * len(spec.federations)
    weights = jnp.stack([jnp.sum(c.weights) for c in x.cohorts])
    numerator = jax.tree.map(lambda s: jnp.sum(s, axis=0), group_sums)
    denominator = jax.tree.map(lambda h: jnp.tensordot(weights, h.astype(weights.dtype), axes=1), mapping.held)
    mean = masked_mean(numerator, denominator, jax.tree.map(jnp.zeros_like, numerator))
    tree = jax.tree.structure(state.models[0])
    in_model = lambda flat: jax.tree.unflatten(tree, jax.tree.leaves(layout.unravel(flat)))
    norms = self._leaf_sums(jnp.square(group_sums["params"]), mapping.param_leaf)  # [G, K]
    members = spec.federations[0].members
    group_norms = tuple(jnp.take(norms[g], self._leaf_indices(starts[g]["params"])) for g in members)
    return (MappedSums(in_model(mean), in_model(denominator), group_norms),)

  def _in_union(self, spec: "RoundSpec", state: ServerState, variables: Sequence[Variables], groups: jax.Array,
                held: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Groups ``groups``' ``variables`` (their federation's model through each group's map) in the slots' flat
    layout of the union, zeros outside each group's window, stacked ``[N, P]``; ``held`` is their held masks,
    ``[N, P]`` booleans. Where every group takes its window of one federation's union-shaped model, that is one
    select."""
    if self._one_union_model(spec, state):
      return jax.tree.map(lambda h, v: jnp.where(h, v, 0).astype(v.dtype), held,
                          self.layout.ravel(state.models[spec.federation_of[0]]))
    placed = [self.layout.ravel(embed(v, _window_map(m), self._union_shapes)) for v, m in zip(variables, spec.maps)]
    return jax.tree.map(lambda *v: jnp.stack(v)[groups], *placed)

  def _trainer(self, spec: "RoundSpec", layout: FlatLayout) -> LocalTrainer:
    store = spec.store
    return LocalTrainer(spec.groups[spec.global_index].model, spec.local, store.mean, store.std, (held_term(),),
                        flat=layout)


  def train(self, spec: "RoundSpec", x: RoundRows, state: ServerState, starts: Sequence[Any], shares: Sequence[Any],
            data: RoundData) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
    key = round_key(spec.seed, x.index)
    clients, sizes, slot_weights, group_of_slot, positions = pack_participants(x, self.capacity)
    offsets, group_held = data.mapping.offsets, data.mapping.held
    held = jax.tree.map(lambda h: h[group_of_slot], group_held)
    client_starts = self._in_union(spec, state, starts, group_of_slot, held)
    layout = self.layout.at(offsets)
    trainer = self._trainer(spec, layout)
    schedule = max(1, spec.local.num_steps(data.index_table.shape[1]))
    keys = jax.vmap(lambda c: jax.random.fold_in(key, c))(clients)  # (as `cohort.start`: a client's own draws)
    ids, mask = jax.vmap(lambda r, n, k: trainer.schedule(r, n, k, schedule))(data.index_table[clients], sizes, keys)
    begun = jax.vmap(lambda v, h, k: trainer.init_state(v, (), (h,), k))(client_starts, held["params"], keys)
    trained = jax.lax.fori_loop(0, x.steps, lambda i, s: cohort.steps(trainer, s, data.images, data.labels, ids,
                                                                       mask, i, 1), begun)
    # A group whose trainer has no terms uploads only its weighted delta: every group's sum in one product over
    # the slots, in the union's layout (zeros outside a group's window on both sides of the difference).
    weights = jnp.where(jnp.arange(len(spec.groups))[:, None] == group_of_slot, slot_weights, 0.0)  # [G, S]
    flat_sums = jax.tree.map(lambda new, old: jnp.tensordot(weights, new - old, axes=1), trained.variables,
                             client_starts)
    leaf_sums = {}  # per elementwise function of the layout's uploads: every group's weighted per-leaf sums [G, K]
    results, memory = [], list(state.memory)
    for g, rows in enumerate(x.cohorts):
      slots = jnp.minimum(positions[g], self.capacity - 1)
      terms = spec.trainers[g].terms
      if not uploads_in_layout(terms):
        result, memory[g] = self._group_result(spec, g, rows, trained, slots, starts[g], shares[g], memory[g], key,
                                               data, layout)
      else:
        count = lambda a: jnp.where(rows.real > 0, a[slots], 0.0).sum()
        # (the group's row read at the layout's runtime offsets: leaves of one shape share their kernels)
        own_sums = layout.unravel(jax.tree.map(lambda s: jax.lax.index_in_dim(s, g, keepdims=False), flat_sums))
        uploads = []
        for term in terms:
          f = term.upload.update_leaf_sum
          if f not in leaf_sums:
            leaf_sums[f] = weights @ self._leaf_sums(f(trained.variables["params"] - client_starts["params"]),
                                                     data.mapping.param_leaf)
          uploads.append(jnp.take(leaf_sums[f][g], self._leaf_indices(starts[g]["params"])))
        result = cohort.GroupResult(extract(own_sums, _window_map(spec.maps[g])), rows.weights.sum(),
                                    count(trained.loss_sum), count(trained.num_examples), tuple(uploads))
      results.append(result)
    return results, tuple(memory), self._mapped_sums(spec, state, x, flat_sums, data.mapping, layout, starts)

  def _leaf_sums(self, values: jax.Array, param_leaf: jax.Array) -> jax.Array:
    """``[N, K]``: the sums of ``values`` (``[N, P]``, in the layout's params vector) over each of its ``K`` leaves:
    one segment sum (a reduction per leaf would be a kernel per leaf size)."""
    count = len(self._param_leaves)
    return jax.vmap(lambda v: jax.ops.segment_sum(v, param_leaf, count, indices_are_sorted=True))(values)

  def _leaf_indices(self, params: Variables) -> np.ndarray:
    """The layout's index among its params leaves of each leaf of a group's ``params``, in the order of
    ``jax.tree.leaves`` (the group's leaves are the union's of the same paths, `_structural_reason`)."""
    index = {path: k for k, (path, _) in enumerate(self._param_leaves)}
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return np.array([index[tuple(k.key for k in path)] for path, _ in paths], np.int32)

  def _group_result(self, spec: "RoundSpec", g: int, rows: Any, trained: Any, slots: jax.Array, start: Any,
                    share: Any, memory: Any, key: jax.Array, data: RoundData, layout: FlatLayout
                    ) -> tuple[Any, Any]:
    """Group ``g``'s clients (union ``slots``) taken back to the group's shape, finished and reduced by the group's
    own trainer as the per-group program does: its result and its client memory with their rows written."""
    trainer, real = spec.trainers[g], rows.real > 0
    window = _window_map(spec.maps[g])
    final = jax.vmap(lambda v: extract(layout.unravel(v), window))(jax.tree.map(lambda v: v[slots], trained.variables))
    final = jax.tree.map(lambda f, s: jnp.where(real.reshape((-1,) + (1,) * s.ndim), f, s), final, start)
    memory_rows = jax.tree.map(lambda m: jnp.take(m, rows.rows, axis=0, mode="clip"), memory)
    # The group's terms' round state (e.g. FedNova's), from its own start; its schedule is not used.
    own = cohort.start(trainer, 1, start, data.index_table[rows.clients], rows.sizes, key, rows.clients, memory_rows,
                       share, rows.inputs, per_client_start=False)[0]
    count = lambda a: jnp.where(real, a[slots], 0.0)
    states = own._replace(variables=final, opt_state=(), loss_sum=count(trained.loss_sum),
                          num_examples=count(trained.num_examples), num_steps=count(trained.num_steps))
    result, new_rows, stacked_uploads = cohort.reduce(trainer, states, start, memory_rows, share, rows.weights,
                                                      rows.real, per_client_start=False)
    if memory:
      memory = jax.tree.map(lambda m, new: m.at[rows.rows].set(new, mode="drop"), memory, new_rows)
    return cohort.with_stacked(result, cohort.pad_stacked(stacked_uploads, rows.count), trainer.reductions), memory


class Slots(NamedTuple):
  """A round's sampled clients packed group after group into the union's slots (the rest padding: client 0 with no
  sample and weight 0)."""

  clients: jax.Array  # [S] int32 ids
  sizes: jax.Array  # [S] int32 sample counts
  weights: jax.Array  # [S] float32 aggregation weights
  groups: jax.Array  # [S] int32 architecture groups
  positions: list[jax.Array]  # per group, the slot of each of its cohort's rows (S for padding rows: dropped)


def pack_participants(x: RoundRows, slots: int) -> Slots:
  """The round's sampled clients packed group after group into ``slots`` (`Slots`)."""
  counts = jnp.stack([jnp.asarray(c.count, jnp.int32) for c in x.cohorts])
  offsets = jnp.cumsum(counts) - counts
  positions = [jnp.where(jnp.arange(len(c.clients)) < c.count, offsets[g] + jnp.arange(len(c.clients)), slots)
               for g, c in enumerate(x.cohorts)]
  clients, sizes, groups = (jnp.zeros((slots,), jnp.int32) for _ in range(3))
  weights = jnp.zeros((slots,), jnp.float32)
  for g, (c, p) in enumerate(zip(x.cohorts, positions)):
    clients = clients.at[p].set(c.clients, mode="drop")
    sizes = sizes.at[p].set(c.sizes, mode="drop")
    weights = weights.at[p].set(c.weights, mode="drop")
    groups = groups.at[p].set(g, mode="drop")
  return Slots(clients, sizes, weights, groups, positions)
