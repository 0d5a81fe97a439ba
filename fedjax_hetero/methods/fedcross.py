"""FedCross's server step: partner selection and cross-aggregation of K middleware models (its method: `catalog`).

Hu et al., "FedCross: Towards Accurate Federated Learning via Multi-Model
Cross-Aggregation" (ICDE 2024). The federation keeps the K middleware models
stacked on a leading axis (the ``stacked`` layout); slot i is trained by the
i-th client of the shuffled cohort, which uploads its final model (the "cross"
client term). The pure rules are in `aggregators.fedcross`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero import aggregators
from fedjax_hetero.config.options import FedCrossConfig
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.server.steps import Plan, ServerStep


class CrossState(NamedTuple):
  global_model: Variables  # w_g, the mean of the middleware models (or of the uploads): evaluated, never sent


def cross_aggregation(config: FedCrossConfig, models) -> ServerStep:
  """CoModelSel + CrossAggr + global model (Alg. 1) on the final models the ``models`` client term uploads
  (`client.terms.upload_variables`)."""

  def update(carry, state, inputs, plan):
    uploads = inputs.uploads(models)[0]
    num_models = jax.tree.leaves(uploads)[0].shape[0]
    stage, alpha = plan.static, plan.inputs
    if stage == "warmup":  # the authors' code's first stage: every slot becomes the mean (FedAvg)
      mean = aggregators.global_model(uploads)
      middleware = jax.tree.map(lambda m, u: jnp.broadcast_to(m, u.shape), mean, uploads)
      return carry._replace(model=middleware), CrossState(mean)
    if stage == "propellers":
      middleware = aggregators.propeller_aggregate(
          uploads, aggregators.propeller_partners(num_models, inputs.round, config.propellers))
    else:
      partners = aggregators.select_partners(uploads, inputs.round, config.strategy, config.similarity)
      middleware = aggregators.cross_aggregate(uploads, partners, alpha)
    glob = aggregators.global_model(middleware if config.global_from == "middleware" else uploads)
    metrics = {**carry.metrics, "middleware_similarity": aggregators.middleware_similarity_stats(middleware)}
    return carry._replace(model=middleware, metrics=metrics), CrossState(glob)

  def init(middleware, federation):
    return CrossState(jax.tree.map(lambda x: x[0], middleware))

  def plan(round_index):
    stage, alpha = config.stage_at(round_index), config.alpha_at(round_index)
    return Plan(static=stage, inputs=alpha, log={"fedcross_stage": stage, "fedcross_alpha": alpha})

  return ServerStep("cross", update, init, plan=plan, evaluate=lambda state: state.global_model, reads=(models,))
