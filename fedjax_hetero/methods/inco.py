"""InCo Aggregation (Chan et al., ICLR 2024): the cross-layer server step on the aggregated delta.

The pure cross-layer rules are `aggregators.inco` (public); InCo's methods are a base method's terms and
steps with this step before ``apply`` (`methods.catalog`).
"""

from __future__ import annotations

from fedjax_hetero import aggregators
from fedjax_hetero.server.steps import Federation, ServerStep


def inco(variant: str = "code", granularity: str = "kernel") -> ServerStep:
  """InCo Aggregation's cross-layer step on the aggregated delta (Chan et al. 2024, Alg. 1 lines 6-11;
  `aggregators.inco`), on the (target, source) pairs of the federation's largest model. Logs θ and
  the fraction of b > 0 per target layer."""

  def pairs(federation: Federation) -> tuple:
    pairs_of = getattr(federation.largest, "cross_layer_pairs", None)
    if pairs_of is None:
      raise ValueError(f"InCo's cross-layer step needs cross-layer pairs, but the largest model "
                       f"({type(federation.largest).__name__}) has no cross_layer_pairs(); use a ResNet or ViT")
    return tuple(pairs_of())

  def init(model, federation):
    aggregators.check_pairs(pairs(federation), model)
    return ()

  def update(carry, state, inputs, plan):
    delta, stats = aggregators.inco(carry.delta, pairs(inputs.federation), variant, granularity,
                                    coverage=carry.coverage)
    return carry._replace(delta=delta, metrics={**carry.metrics, "inco": stats}), state

  return ServerStep("inco", update, init)
