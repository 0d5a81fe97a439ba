"""FedIN and InclusiveFL: FedIN's pure pieces, its client term and server step, and InclusiveFL's step.

FedIN (Chan, Jiang, Deng, Ngai: "FedIN: Federated Intermediate Layers Learning for Model Heterogeneity";
the method and its open choices are read in the project's FedIN spec): the "fedin" server step keeps the feature bank (typed state, checkpointed with the run), draws the
round's batch S from it and broadcasts S to every group; the "fedin" client term regresses the
intermediate layers on S (the IN loss, Eq. 8, a gradient of its own that the method's rule combines with
the local one, Eqs. 13-14) and uploads the feature pairs of its last local batch.

The E/I/C split is declared by the model family (`intermediate_split`: the ResNets' stem, stages and
head). Pairs from one group are regressed on by every other, so all groups must have one feature shape at
both ends of I (depth groups of one width do; width groups do not).

InclusiveFL (Liu et al., KDD 2022) as FedIN compares with it: the layer-wise mean over the holders of each
layer, plus its momentum knowledge distillation on the server (`momentum_distillation`).

Every model is split into an extractor E, intermediate layers I and a classifier C, so that
``logits = C(I(E(x)))``. Clients upload, besides their update, one batch of feature pairs
``(s_in, s_out) = (E(x), I(E(x)))``; the server keeps them in a feature bank and sends every sampled
client the same batch S of pairs each round. Local training adds the IN loss ``MSE(I(s_in), s_out)``
on S (Eq. 8), which reaches I only, and combines its gradient with the local one (Eq. 14 by default).

Choices where the paper is silent (each is a `FedINConfig` field or documented here):

* the gradient rule (``rule``): ``"eq14"`` is Z = G_IN + (lambda/2) G_local with lambda = 1, what
  the paper's experiments use; ``"project"`` is Eq. 13, G_IN projected onto the half-space
  {Z : <Z, G_local> >= 0}, per tensor or over all of I (``projection``) -- on E and C, which G_IN does
  not reach, Z is G_local (Eq. 13 read literally would freeze them); ``"sum"`` is G_IN + G_local, the
  plain sum of the ablation without the gradient rule. The paper describes that ablation ("w/o Opt")
  as a step on G_local followed by one on G_IN; the sum is one step with both.
* the bank (``bank``): ``"latest"`` holds the latest round's pairs (the default: stale features
  regress onto a target the current I no longer produces); ``"history"`` keeps every round's pairs in a
  ring buffer of ``bank_capacity`` pairs, the oldest overwritten first.
* S is ``num_pairs`` pairs (the paper: one batch, 16) drawn without replacement; from a bank smaller
  than that they are drawn with replacement.
* the uploaded pairs are those of the client's last local batch, detached (the spec's default).
* a client's pairs with a non-finite value are left out of the bank, and counted.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from fedjax_hetero.client.terms import ClientTerm, Loss, Upload
from fedjax_hetero.config.methods import INCLUSIVE_BETA, INCLUSIVE_MOMENTUM
from fedjax_hetero.config.options import FedINConfig
from fedjax_hetero.hetero.maps import flatten
from fedjax_hetero.methods.fedfa import declared_stages
from fedjax_hetero.models import cut_shape
from fedjax_hetero.server.steps import Federation, ServerStep

class FeaturePairs(NamedTuple):
  """A batch of feature pairs; ``valid`` marks the rows in use."""

  s_in: jax.Array  # [N, *E output]
  s_out: jax.Array  # [N, *I output]
  valid: jax.Array  # bool [N]


class FeatureBank(NamedTuple):
  """The server's feature pairs, a ring buffer (``next`` is the slot the next pair goes to), and the batch
  S that every client of the next round regresses on (``ready`` is False until the bank has a pair)."""

  pairs: FeaturePairs
  next: jax.Array  # int
  batch: FeaturePairs
  ready: jax.Array  # bool


def empty_pairs(num: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> FeaturePairs:
  return FeaturePairs(jnp.zeros((num,) + tuple(in_shape)), jnp.zeros((num,) + tuple(out_shape)),
                      jnp.zeros((num,), bool))


def empty_bank(capacity: int, num_pairs: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> FeatureBank:
  return FeatureBank(empty_pairs(capacity, in_shape, out_shape), jnp.int32(0),
                     empty_pairs(num_pairs, in_shape, out_shape), jnp.bool_(False))


def finite_rows(pairs: FeaturePairs) -> jax.Array:
  """bool [clients]: whether each client's rows (pairs stacked ``[clients, B, ...]``) are all finite."""
  finite = lambda x: jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
  return finite(pairs.s_in) & finite(pairs.s_out)


def add_to_bank(bank: FeaturePairs, next_slot: jax.Array, new: FeaturePairs, mode: str
                ) -> tuple[FeaturePairs, jax.Array]:
  """The bank after this round's valid pairs ``new`` (flat rows): ``"latest"`` replaces it by them (unless
  none is valid, when it keeps the last round's); ``"history"`` writes them into the ring buffer."""
  capacity = bank.valid.shape[0]
  order = jnp.argsort(~new.valid, stable=True)  # valid rows first, in their order
  count = new.valid.sum()
  taken = min(capacity, new.valid.shape[0])
  rows = jax.tree.map(lambda x: x[order[:taken]], new)
  rows = rows._replace(valid=rows.valid & (jnp.arange(taken) < count))
  if mode == "latest":
    fresh = jax.tree.map(lambda x, r: jnp.zeros_like(x).at[:taken].set(r), bank, rows)
    kept = jax.tree.map(lambda a, b: jnp.where(count > 0, a, b), fresh, bank)
    return kept, jnp.int32(0)
  slots = (next_slot + jnp.arange(taken)) % capacity
  slots = jnp.where(rows.valid, slots, capacity)  # out of range: dropped
  written = jax.tree.map(lambda x, r: x.at[slots].set(r, mode="drop"), bank, rows)
  return written, (next_slot + jnp.minimum(count, taken)) % capacity


def sample_batch(bank: FeaturePairs, num: int, key: jax.Array) -> FeaturePairs:
  """S: ``num`` of the bank's valid pairs, drawn without replacement, or with replacement when it holds
  fewer; all rows invalid if the bank is empty."""
  count = bank.valid.sum()
  noise = jax.random.uniform(key, bank.valid.shape)
  order = jnp.argsort(jnp.where(bank.valid, noise, 2.0))  # valid pairs first, shuffled
  draws = jax.random.randint(jax.random.fold_in(key, 1), (num,), 0, jnp.maximum(count, 1))
  picks = jnp.where(count >= num, order[jnp.arange(num) % order.shape[0]], order[draws])
  batch = jax.tree.map(lambda x: x[picks], bank)
  return batch._replace(valid=batch.valid & (count > 0))


def combine(g_in, g_local, config: FedINConfig = FedINConfig()):
  """Z from the IN and the local gradient (pytrees of one structure).

  ``"eq14"``: Z = G_IN + (lam / 2) G_local (Eq. 14). ``"sum"``: Z = G_IN + G_local. ``"project"``: on
  the tensors G_IN reaches (I's: exactly zero elsewhere, and everywhere while the bank is empty),
  Z = G_IN - min(0, b) / a * G_local with a = <G_local, G_local> and b = <G_local, G_IN> (Eq. 13), per
  tensor or over all of them; on the other tensors (E and C) Z = G_local.
  """
  if config.rule == "eq14":
    return jax.tree.map(lambda i, g: i + config.lam / 2 * g, g_in, g_local)
  if config.rule == "sum":
    return jax.tree.map(jnp.add, g_in, g_local)
  reached = jax.tree.map(lambda i: jnp.any(i != 0), g_in)

  def project(i, g, a, b, m):
    return jnp.where(m, i - jnp.minimum(b, 0.0) / jnp.where(a > 0, a, 1.0) * g, g)

  if config.projection == "global":
    terms = lambda f: sum(jnp.where(m, f(i, g), 0.0) for i, g, m in
                          zip(jax.tree.leaves(g_in), jax.tree.leaves(g_local), jax.tree.leaves(reached)))
    a, b = terms(lambda i, g: jnp.vdot(g, g)), terms(lambda i, g: jnp.vdot(g, i))
    return jax.tree.map(lambda i, g, m: project(i, g, a, b, m), g_in, g_local, reached)
  return jax.tree.map(lambda i, g, m: project(i, g, jnp.vdot(g, g), jnp.vdot(g, i), m), g_in, g_local, reached)


NAME = "fedin"
# The bank's draws come from their own stream of the federation's round key.
KEY_STREAM = 0x46496E


def intermediate_split(model: nn.Module) -> tuple[str, str]:
  """The cut points ending E and I of ``model``; a clear error if its family declares no split."""
  split = getattr(model, "intermediate_split", None)
  if split is None:
    raise ValueError(f"FedIN needs the model family to declare its extractor / intermediate layers / classifier "
                     f"split (intermediate_split); {type(model).__name__} declares none: use a ResNet")
  return tuple(split)


def _intermediate_output(model: nn.Module, variables, s_in: jax.Array, valid: jax.Array) -> jax.Array:
  """I(s_in) in training mode; BatchNorm normalizes the pairs by their own statistics and its running
  statistics are left as the real batch set them."""
  first, last = intermediate_split(model)
  if "batch_stats" in variables:
    out, _ = model.apply(variables, s_in, train=True, mask=valid, start=first, stop=last, mutable=["batch_stats"])
    return out
  return model.apply(variables, s_in, train=True, mask=valid, start=first, stop=last)


class INState(NamedTuple):
  """A FedIN client's round state."""

  batch: FeaturePairs  # S, the server's batch of feature pairs
  pairs: FeaturePairs  # the pairs to upload: the last real batch's first num_pairs


def intermediate_training(config: FedINConfig = FedINConfig()) -> ClientTerm:
  """FedIN's client side: the IN loss ``MSE(I(s_in), s_out)`` on the round's batch S (Eq. 8; zero while the
  bank is empty, so the first round is local training only) as gradient "in", and the upload of the last
  local batch's first ``num_pairs`` feature pairs, detached."""

  def init(r):
    return INState(r.share, jax.tree.map(jnp.zeros_like, r.share))

  def loss(variables, state, prepared, outputs, ctx):
    s = state.batch
    # While the bank is empty every row is invalid; BatchNorm then normalizes the (zero) rows all the same,
    # since statistics over no row would be NaN and reach the gradient through the zero weights below.
    prediction = _intermediate_output(ctx.model, variables, s.s_in, s.valid | ~s.valid.any())
    rows = s.valid.reshape((-1,) + (1,) * (prediction.ndim - 1)).astype(prediction.dtype)
    squared = jnp.square(prediction - s.s_out) * rows
    return squared.sum() / jnp.maximum(rows.sum() * squared[0].size, 1.0)  # Eq. 8 over the valid rows

  def update(state, outputs, ctx):
    first, last = intermediate_split(ctx.model)
    num = state.pairs.valid.shape[0]
    take = lambda x: jnp.zeros((num,) + x.shape[1:], x.dtype).at[:min(num, x.shape[0])].set(x[:num])
    pairs = FeaturePairs(take(outputs.activations[first]), take(outputs.activations[last]),
                            take(ctx.batch.mask))
    return state._replace(pairs=pairs)

  return ClientTerm(NAME, init=init, loss=Loss(loss, gradient="in"), update=update, cuts=intermediate_split,
                    upload=Upload(lambda state, final, memory, share: state.pairs, "stack"), share=True)


def gradient_rule(config: FedINConfig = FedINConfig()):
  """The method's rule for the "local" and "in" gradients (`combine`)."""
  return lambda grads: combine(grads["in"], grads["local"], config)


@functools.cache
def _feature_shapes(models: tuple[nn.Module, ...], names: tuple[str, ...],
                    input_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  sample = jnp.zeros((1,) + input_shape, jnp.float32)
  shapes = [tuple(cut_shape(m, sample, cut) for cut in intermediate_split(m)) for m in models]
  for name, shape in zip(names[1:], shapes[1:]):
    if shape != shapes[0]:
      raise ValueError(f"FedIN regresses every group's intermediate layers on every other group's feature pairs, "
                       f"so they need one shape: {names[0]} has (s_in, s_out) shapes {shapes[0]}, {name} {shape} "
                       "(groups of different widths cannot share pairs)")
  return shapes[0]


def feature_bank(config: FedINConfig, training: ClientTerm) -> ServerStep:
  """FedIN's server step (Alg. 1 lines 3-6): adds the round's finite pairs uploaded by the ``training`` term
  (`intermediate_training`) to the bank, draws the next round's S from it, and sends S to every group. Logs the bank's size and the clients whose pairs
  were dropped for a non-finite value."""

  def shapes(federation: Federation):
    return _feature_shapes(federation.models, federation.group_names, tuple(federation.store.images.shape[1:]))

  def init(model, federation):
    in_shape, out_shape = shapes(federation)
    capacity = sum(federation.stack_sizes) * config.num_pairs if config.bank == "latest" else config.bank_capacity
    return empty_bank(capacity, config.num_pairs, in_shape, out_shape)

  def update(carry, bank, inputs, plan):
    rows, dropped = [], jnp.int32(0)
    for upload, valid in zip(inputs.uploads(training), inputs.valid):
      finite = finite_rows(upload)
      dropped = dropped + (valid & ~finite).sum()
      keep = upload.valid & (valid & finite)[:, None]
      rows.append(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), upload._replace(valid=keep)))
    new = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)
    pairs, next_slot = add_to_bank(bank.pairs, bank.next, new, config.bank)
    batch = sample_batch(pairs, config.num_pairs, jax.random.fold_in(inputs.key, KEY_STREAM))
    metrics = {inputs.federation.name: {"dropped_clients": dropped, "bank_pairs": pairs.valid.sum()}}
    return (carry._replace(metrics={**carry.metrics, NAME: metrics}),
            FeatureBank(pairs, next_slot, batch, batch.valid.any()))

  def broadcast(bank, federation, member, round_index):
    return bank.batch

  return ServerStep(NAME, update, init, broadcast, reads=(training,))


# InclusiveFL -------------------------------------------------------------------------------------------------

def _stages(model: nn.Module, name: str):
  stages = declared_stages(model)
  if stages is None:
    raise ValueError(f"{name}: InclusiveFL's momentum distillation needs the models to declare their stages "
                     f"(stage_blocks(), as ResNet does); {type(model).__name__} does not")
  return stages


@functools.cache
def distillation_targets(models: tuple[nn.Module, ...], names: tuple[str, ...], largest: nn.Module,
                         global_shapes: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]):
  """Per distinct (stage, depth d) of a member shallower than the largest model there: pairs (top leaf
  path, deeper leaf paths) over the ``params`` leaves of the stage's block ``d - 1`` that every deeper
  block ``d..D-1`` has at the same place and shape."""
  shapes = dict(global_shapes)
  full = _stages(largest, "the global model")
  depths = set()
  for model, name in zip(models, names):
    for stage, blocks in enumerate(_stages(model, name)):
      if 0 < len(blocks) < len(full[stage]):
        depths.add((stage, len(blocks)))
  targets = []
  for stage, depth in sorted(depths):
    top, deeper = full[stage][depth - 1], full[stage][depth:]
    leaves = []
    for path, shape in shapes.items():
      if path[0] != "params" or path[1:1 + len(top)] != top:
        continue
      matches = tuple(("params",) + block + path[1 + len(top):] for block in deeper)
      if all(shapes.get(m) == shape for m in matches):
        leaves.append((path, matches))
    targets.append(tuple(leaves))
  return tuple(targets)


def _targets(federation: Federation):
  return distillation_targets(federation.models, federation.group_names, federation.largest,
                              federation.maps[0].global_shapes)


def momentum_distillation(beta: float = INCLUSIVE_BETA, momentum: float = INCLUSIVE_MOMENTUM) -> ServerStep:
  """InclusiveFL's momentum knowledge distillation, on the aggregated update (before it is applied): for
  each depth ``d`` a group has in a stage where the largest model is deeper, the top block ``d - 1``
  gets ``beta * m`` added, where ``m <- momentum * m + (1 - momentum) * mean_j delta[block j]`` over the
  deeper blocks ``j >= d`` (leaf by leaf where shapes match). Large models' deeper layers thus pass their
  update direction on to the layer that ends the small models' stage."""

  def init(model, federation):
    shapes = dict(federation.maps[0].global_shapes)
    return tuple(tuple(jnp.zeros(shapes[top]) for top, _ in target) for target in _targets(federation))

  def update(carry, state, inputs, plan):
    delta = flatten(carry.delta)
    new_state = []
    for target, moments in zip(_targets(inputs.federation), state):
      new_moments = []
      for (top, deeper), m in zip(target, moments):
        m = momentum * m + (1 - momentum) * sum(delta[p] for p in deeper) / len(deeper)
        delta[top] = delta[top] + beta * m
        new_moments.append(m)
      new_state.append(tuple(new_moments))
    return carry._replace(delta=traverse_util.unflatten_dict(delta)), tuple(new_state)

  return ServerStep("inclusive", update, init)
