"""FedCross's server step: partner selection and cross-aggregation of K middleware models.

Hu et al., "FedCross: Towards Accurate Federated Learning via Multi-Model
Cross-Aggregation" (ICDE 2024). The federation keeps the K middleware models
stacked on a leading axis (the ``stacked`` layout); slot i is trained by the
i-th client of the shuffled cohort, which uploads its final model (the "cross"
client term). The pure rules are in `aggregators.fedcross`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero import aggregators
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.server.steps import Plan, ServerStep
from fedjax_hetero.validation import check_choice, check_integer, check_number, cli_flag

GLOBAL_FROM = ("middleware", "uploaded")


@dataclasses.dataclass(frozen=True)
class FedCrossConfig:
  """FedCross's server options (Alg. 1 and Sec. III-D); see `aggregators.fedcross`."""

  alpha: float = 0.99
  strategy: str = "lowest_similarity"
  similarity: str = "layerwise"  # the authors' code: sum of per-layer cosines
  global_from: str = "middleware"  # paper: mean of the new middleware models; "uploaded": the authors' code
  warmup_rounds: int = 0  # authors' code (fedcross_first_stage_bound): FedAvg (all slots := mean) before this
  propellers: int = 0  # Sec. III-D PM: P in-order propeller models per slot during the first stage
  propeller_rounds: int = 0  # length of that first stage
  dynamic_alpha_rounds: int = 0  # Sec. III-D DA: alpha linear 0.5 -> alpha over the first N rounds

  def __post_init__(self):
    check_number("method.fedcross.alpha", self.alpha, minimum=0, maximum=1)
    check_choice("method.fedcross.strategy", self.strategy, aggregators.fedcross.STRATEGIES)
    check_choice("method.fedcross.similarity", self.similarity, aggregators.fedcross.SIMILARITY_KINDS)
    check_choice("method.fedcross.global_from", self.global_from, GLOBAL_FROM)
    for name in ("warmup_rounds", "propellers", "propeller_rounds", "dynamic_alpha_rounds"):
      check_integer(f"method.fedcross.{name}", getattr(self, name), minimum=0)
    propellers, rounds = cli_flag("method.fedcross.propellers"), cli_flag("method.fedcross.propeller_rounds")
    if self.propeller_rounds and not self.propellers:
      raise ValueError(f"{rounds} {self.propeller_rounds} needs {propellers} >= 1 (the propeller models per slot)")
    if self.propellers and not self.propeller_rounds:
      raise ValueError(f"{propellers} {self.propellers} needs {rounds} >= 1 (the length of the propeller stage)")

  def alpha_at(self, round_index: int) -> float:
    if round_index < self.dynamic_alpha_rounds:
      return float(aggregators.dynamic_alpha(round_index, 0, self.dynamic_alpha_rounds, 0.5, self.alpha))
    return self.alpha

  def stage_at(self, round_index: int) -> str:
    if round_index < self.warmup_rounds:
      return "warmup"
    if round_index < self.propeller_rounds and self.propellers:
      return "propellers"
    return "cross"


class CrossState(NamedTuple):
  global_model: Variables  # w_g, the mean of the middleware models (or of the uploads): evaluated, never sent


def cross_aggregation(config: FedCrossConfig) -> ServerStep:
  """CoModelSel + CrossAggr + global model (Alg. 1) on the uploads of the "cross" client term."""

  def update(carry, state, inputs, plan):
    uploads = inputs.uploads("cross")[0]
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

  return ServerStep("cross", update, init, plan=plan, evaluate=lambda state: state.global_model)
