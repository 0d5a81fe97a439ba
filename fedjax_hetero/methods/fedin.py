"""FedIN and InclusiveFL as client terms and server steps (pure pieces and FedIN's choices in `algorithms.fedin`).

FedIN: the "fedin" server step keeps the feature bank (typed state, checkpointed with the run), draws the
round's batch S from it and broadcasts S to every group; the "fedin" client term regresses the
intermediate layers on S (the IN loss, Eq. 8, a gradient of its own that the method's rule combines with
the local one, Eqs. 13-14) and uploads the feature pairs of its last local batch.

The E/I/C split is declared by the model family (`intermediate_split`: the ResNets' stem, stages and
head). Pairs from one group are regressed on by every other, so all groups must have one feature shape at
both ends of I (depth groups of one width do; width groups do not).

InclusiveFL (Liu et al., KDD 2022) as FedIN compares with it: the layer-wise mean over the holders of each
layer, plus its momentum knowledge distillation on the server (`momentum_distillation`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from fedjax_hetero.algorithms import fedin as fi
from fedjax_hetero.client.terms import ClientTerm, with_upload
from fedjax_hetero.config.methods import INCLUSIVE_BETA, INCLUSIVE_MOMENTUM
from fedjax_hetero.hetero.maps import flatten
from fedjax_hetero.methods.fedfa import declared_stages
from fedjax_hetero.models import cut_shape
from fedjax_hetero.server.steps import Federation, ServerStep

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

  batch: fi.FeaturePairs  # S, the server's batch of feature pairs
  pairs: fi.FeaturePairs  # the pairs to upload: the last real batch's first num_pairs


def intermediate_training(config: fi.FedINConfig = fi.FedINConfig()) -> ClientTerm:
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
    pairs = fi.FeaturePairs(take(outputs.activations[first]), take(outputs.activations[last]),
                            take(ctx.batch.mask))
    return state._replace(pairs=pairs)

  def finish(state, final, memory, share):
    return with_upload(final, state.pairs)

  return ClientTerm(NAME, init=init, loss=loss, update=update, finish=finish, upload="stack", share=True,
                    cuts=intermediate_split, gradient="in")


def gradient_rule(config: fi.FedINConfig = fi.FedINConfig()):
  """The method's rule for the "local" and "in" gradients (`algorithms.fedin.combine`)."""
  return lambda grads: fi.combine(grads["in"], grads["local"], config)


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


def feature_bank(config: fi.FedINConfig, training: ClientTerm) -> ServerStep:
  """FedIN's server step (Alg. 1 lines 3-6): adds the round's finite pairs uploaded by the ``training`` term
  (`intermediate_training`) to the bank, draws the next round's S from it, and sends S to every group. Logs the bank's size and the clients whose pairs
  were dropped for a non-finite value."""

  def shapes(federation: Federation):
    return _feature_shapes(federation.models, federation.group_names, tuple(federation.store.images.shape[1:]))

  def init(model, federation):
    in_shape, out_shape = shapes(federation)
    capacity = sum(federation.stack_sizes) * config.num_pairs if config.bank == "latest" else config.bank_capacity
    return fi.empty_bank(capacity, config.num_pairs, in_shape, out_shape)

  def update(carry, bank, inputs, plan):
    rows, dropped = [], jnp.int32(0)
    for upload, valid in zip(inputs.uploads(training), inputs.valid):
      finite = fi.finite_rows(upload)
      dropped = dropped + (valid & ~finite).sum()
      keep = upload.valid & (valid & finite)[:, None]
      rows.append(jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), upload._replace(valid=keep)))
    new = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)
    pairs, next_slot = fi.add_to_bank(bank.pairs, bank.next, new, config.bank)
    batch = fi.sample_batch(pairs, config.num_pairs, jax.random.fold_in(inputs.key, KEY_STREAM))
    metrics = {inputs.federation.name: {"dropped_clients": dropped, "bank_pairs": pairs.valid.sum()}}
    return (carry._replace(metrics={**carry.metrics, NAME: metrics}),
            fi.FeatureBank(pairs, next_slot, batch, batch.valid.any()))

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
