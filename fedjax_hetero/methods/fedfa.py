"""FedFA as client terms and a server step (Park and Joe-Wong, ECML-PKDD 2024; rule in `aggregators.fedfa`).

Clients of every width and depth train their slice of one global model (the
first blocks of each stage, the leading channels: Alg. 3). After local
training the "fedfa" server step averages the clients' *weights* over the
holders of every element, with

* layer grafting (Alg. 2): a client shallower than the global model in a stage
  also holds every deeper block of it, as a copy of its last block of that
  stage: global block j takes the client's block min(j, d_c - 1). The pairs
  come from the models' declared stages (`ResNet.stage_blocks()`), read in
  `graft_pairs`; `hetero.maps.graft` adds them to the group's map;
* scalable aggregation (Alg. 1 lines 12-22): every client's kernels are
  scaled by alpha_c = (cohort mean of ||M_95||) / ||M_95,c||. The "fedfa"
  client term uploads the kernels divided by their own trimmed norms (summed
  inside the group like any weighted upload) and "fedfa_norms" the norms
  themselves, one row per client; the step multiplies by the cohort mean.

Both parts can be switched off (the paper's ablations): with neither, the step
is the layer-wise mean of the uploaded weights (FlexiFed's rule).

Where the paper is silent (spec fedfa.md §7.7): a stage's first block usually
changes stride and width (it then has a downsample branch), so its leaves have
other shapes than the deeper blocks'. A block is grafted only onto blocks whose
leaves have its shapes: a client whose stage holds only such a transition block
is not grafted into that stage's deeper blocks, which then average over the
clients that hold them (the spec recommends depth >= 2 per stage for this).
Grafting happens on the server after local training, as in Alg. 1 line 11:
what each client receives is unchanged.

Why in the step and not in `Method.submodel`: a map builder sees only the
variables' shapes, and the stage layout must come from the model's own
declaration, which the federation (`server.steps.Federation.models`) carries.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax

from fedjax_hetero import aggregators
from fedjax_hetero.aggregators.fedfa import NORMS, PERCENTILE, client_parts
from fedjax_hetero.client.terms import ClientTerm, Upload
from fedjax_hetero.hetero.maps import Path, SubmodelMap, Variables, graft
from fedjax_hetero.server.steps import Federation, ServerStep

NAME = "fedfa"
NORMS_NAME = "fedfa_norms"
Pair = tuple[Path, Path]  # (global block, client block), module paths without the collection


def declared_stages(model: nn.Module) -> tuple[tuple[Path, ...], ...] | None:
  stage_blocks = getattr(model, "stage_blocks", None)
  return None if stage_blocks is None else tuple(tuple(tuple(b) for b in stage) for stage in stage_blocks())


def _block_shapes(global_shapes: dict[Path, tuple[int, ...]], block: Path) -> dict[Path, tuple[int, ...]]:
  """The leaves under module path ``block`` (any collection), keyed by collection + path inside the block."""
  width = len(block)
  return {path[:1] + path[1 + width:]: shape for path, shape in global_shapes.items()
          if path[1:1 + width] == tuple(block)}


def graft_pairs(client: nn.Module, largest: nn.Module, group_map: SubmodelMap,
                group_name: str = "group") -> tuple[Pair, ...]:
  """FedFA's grafting pairs (Alg. 2) of a client model into the global one, from their declared stages.

  In every stage where the client has ``d_c`` blocks and the global model ``D > d_c``, global blocks
  ``d_c .. D-1`` take the client's block ``d_c - 1`` when their leaves have its shapes (see the module
  docstring for a stage's first block). A client that holds every global leaf needs no pair; otherwise
  both models must declare ``stage_blocks()``. Raises ValueError naming ``group_name`` if the client is
  deeper than the global model in a stage or its stages are not a prefix of the global ones.
  """
  global_shapes = dict(group_map.global_shapes)
  held = {link.global_ for link in group_map.push}
  own, full = declared_stages(client), declared_stages(largest)
  if own is None or full is None:
    if held >= set(global_shapes):
      return ()
    missing = type(client if own is None else largest).__name__
    raise ValueError(f"{group_name}: FedFA's layer grafting needs the models to declare their stages "
                     f"(stage_blocks(), as ResNet does); {missing} does not. Pass --no-fedfa-graft")
  if len(own) != len(full):
    raise ValueError(f"{group_name}: {len(own)} stages, the global model has {len(full)}; FedFA grafts blocks "
                     "within a stage")
  pairs = []
  for stage, (blocks, global_blocks) in enumerate(zip(own, full), start=1):
    if len(blocks) > len(global_blocks):
      raise ValueError(f"{group_name}: stage {stage} has {len(blocks)} blocks, deeper than the global model's "
                       f"{len(global_blocks)}; grafting fills shallower clients up to the global depth only")
    if tuple(blocks) != tuple(global_blocks[:len(blocks)]):
      raise ValueError(f"{group_name}: the blocks of stage {stage} are not the first {len(blocks)} of the global "
                       "model's")
    if not blocks:
      continue
    donor = blocks[-1]
    for target in global_blocks[len(blocks):]:
      if _block_shapes(global_shapes, donor) == _block_shapes(global_shapes, target):
        pairs.append((target, donor))
  return tuple(pairs)


def grafted_maps(federation: Federation) -> tuple[SubmodelMap, ...]:
  """The federation's member maps with FedFA's grafting pushes added (`graft_pairs`, `hetero.maps.graft`)."""
  return tuple(graft(m, graft_pairs(model, federation.largest, m, name), name)
               for m, model, name in zip(federation.maps, federation.models, federation.group_names))


def scaled_upload(percentile: float = PERCENTILE, norm: str = "l2") -> tuple[ClientTerm, ClientTerm]:
  """FedFA's client side of the scalable aggregation: "fedfa" uploads the final kernels divided by their
  trimmed norms (and the zero-norm ones unscaled), summed with the client's weight; "fedfa_norms" the
  norms, one row per client (`aggregators.fedfa.client_parts`)."""

  def parts(final):
    return client_parts(final.variables, percentile, norm)

  def kernels(_, final, memory, share):
    p = parts(final)
    return ScaledKernels(p.fallback, p.scaled)

  def norms(_, final, memory, share):
    return parts(final).norms

  return (ClientTerm(NAME, upload=Upload(kernels, "weighted")), ClientTerm(NORMS_NAME, upload=Upload(norms, "stack")))


class ScaledKernels(NamedTuple):
  """FedFA's weighted upload: the zero-norm kernels unscaled, and the others divided by their trimmed norms."""

  fallback: Variables
  scaled: Variables


def fedfa_aggregation(graft_layers: bool = True, scaled: tuple[ClientTerm, ClientTerm] | None = None,
                      center: str = "mean") -> ServerStep:
  """FedFA's server step: the mean of the clients' (grafted, scaled) weights over the holders of every
  element, as an update of the federation's model (old values where nobody held an element); logs
  alpha's range and the zero-norm fallbacks under "fedfa" when scaling, i.e. given the `scaled_upload`
  terms ``scaled``, whose uploads it reads, to the cohort's ``center`` norm (`aggregators.fedfa_scalable_sums`)."""

  def maps_of(federation: Federation) -> Sequence[SubmodelMap]:
    return grafted_maps(federation) if graft_layers else federation.maps

  def init(model, federation):
    maps_of(federation)  # raises here, before any compute, if the models cannot be grafted
    return ()

  def update(carry, state, inputs, plan):
    maps = maps_of(inputs.federation)
    weight_sums = [jax.tree.map(lambda d, s, w=r.weight_sum: d + w * s, r.delta_sum, start)
                   for r, start in zip(inputs.results, inputs.starts)]
    metrics = carry.metrics
    if scaled:
      sums = inputs.uploads(scaled[0])
      num, den, stats = aggregators.fedfa_scalable_sums(
          carry.model, maps, weight_sums, inputs.weights, [u.scaled for u in sums],
          [u.fallback for u in sums], inputs.uploads(scaled[1]), inputs.valid, inputs.offset, center)
      metrics = {**metrics, NAME: stats}
    else:
      num, den = aggregators.heterogeneous_sums(weight_sums, inputs.weights, maps, carry.model, inputs.offset)
    new = aggregators.masked_mean(num, den, carry.model)
    delta = jax.tree.map(lambda a, b: a - b, new, carry.model)
    return carry._replace(delta=delta, coverage=den, metrics=metrics), state

  return ServerStep(NAME, update, init, reads=tuple(scaled or ()))


__all__ = ["NAME", "NORMS", "NORMS_NAME", "PERCENTILE", "declared_stages", "fedfa_aggregation", "graft_pairs",
           "grafted_maps", "scaled_upload"]
