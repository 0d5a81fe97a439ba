"""Aggregation rules as pure, jittable functions of pytrees.

Usable without the engine: give them the server variables, each architecture
group's weighted sum of client updates, the groups' total weights and their
`GroupMap`s (see `fedjax_hetero.hetero`).
"""

from fedjax_hetero.aggregators.hetero_avg import (
    fedavg,
    hetero_avg,
    hetero_avg_weights,
    heterogeneous_mean_delta,
    heterogeneous_sums,
    masked_mean,
)

__all__ = ["fedavg", "hetero_avg", "hetero_avg_weights", "heterogeneous_mean_delta", "heterogeneous_sums",
           "masked_mean"]
