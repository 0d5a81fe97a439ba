"""Aggregation rules as pure, jittable functions of pytrees.

Usable without the engine: give them the server variables, each architecture
group's weighted sum of client updates, the groups' total weights and their
`SubmodelMap`s (see `fedjax_hetero.hetero`). FedFA's scalable aggregation
(`fedfa`) adds per-kernel norm scaling to that mean. FedCross's cross-aggregation
(`fedcross`) works instead on K middleware models stacked along a leading axis.

Misuse raises a ValueError naming the argument and leaf (`checks`): sequence
lengths, tree structure and leaf shapes always; weights, partner indices, alpha
and the finiteness of what a weighted group or client uploads only where
concrete, so jitted callers pay nothing. Sums and inner products run in float32
at least; results keep the model's dtypes.
"""

from fedjax_hetero.aggregators.fedcross import (
    cross_aggregate,
    dynamic_alpha,
    fedcross_aggregate,
    global_model,
    highest_similarity_partners,
    in_order_partners,
    lowest_similarity_partners,
    middleware_similarity_stats,
    propeller_aggregate,
    propeller_partners,
    select_partners,
    similarity_matrix,
)
from fedjax_hetero.aggregators.fedfa import NORMS as FEDFA_NORMS
from fedjax_hetero.aggregators.fedfa import client_parts as fedfa_client_parts
from fedjax_hetero.aggregators.fedfa import scalable_aggregate as fedfa_aggregate
from fedjax_hetero.aggregators.fedfa import scalable_sums as fedfa_scalable_sums
from fedjax_hetero.aggregators.fedfa import trimmed_norm
from fedjax_hetero.aggregators.hetero_avg import (
    fedavg,
    hetero_avg,
    hetero_avg_weights,
    heterogeneous_mean_delta,
    heterogeneous_sums,
    masked_mean,
    weighted_coverage,
)
from fedjax_hetero.aggregators.fednova_scaffold import fednova_delta, scaffold_server_control
from fedjax_hetero.aggregators.inco import GRANULARITIES as INCO_GRANULARITIES
from fedjax_hetero.aggregators.inco import VARIANTS as INCO_VARIANTS
from fedjax_hetero.aggregators.inco import (
    check_pairs,
    cross_layer_theta,
    cross_layer_update,
    inco,
    projection_coefficients,
)

__all__ = ["FEDFA_NORMS", "fedfa_aggregate", "fedfa_client_parts", "fedfa_scalable_sums", "trimmed_norm",
           "INCO_GRANULARITIES", "INCO_VARIANTS", "check_pairs", "cross_aggregate", "cross_layer_theta",
           "cross_layer_update", "inco", "projection_coefficients", "dynamic_alpha", "fedavg", "fedcross_aggregate",
           "fednova_delta", "global_model", "hetero_avg", "hetero_avg_weights", "heterogeneous_mean_delta",
           "heterogeneous_sums", "highest_similarity_partners",
           "in_order_partners", "lowest_similarity_partners", "masked_mean", "middleware_similarity_stats",
           "propeller_aggregate", "propeller_partners", "scaffold_server_control", "select_partners",
           "similarity_matrix", "weighted_coverage"]
