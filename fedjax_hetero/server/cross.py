"""The old home of FedCross's server step, kept as an import path: see `fedjax_hetero.methods.fedcross`."""

from fedjax_hetero.methods.fedcross import CrossState, FedCrossConfig, cross_aggregation

__all__ = ["CrossState", "FedCrossConfig", "cross_aggregation"]
