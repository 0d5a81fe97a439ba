"""A method's server side: pipelines of pure steps over typed state (see `steps`)."""

from fedjax_hetero.server.cross import CrossState, FedCrossConfig, cross_aggregation
from fedjax_hetero.server.steps import (Carry, ControlState, Federation, Plan, RoundInputs, ServerStep, apply_delta,
                                        inco, insert_before, mean_delta, mean_of_weights, nova_mean, scaffold_control)

__all__ = ["Carry", "ControlState", "CrossState", "FedCrossConfig", "Federation", "Plan", "RoundInputs", "ServerStep", "apply_delta",
           "cross_aggregation", "inco", "insert_before", "mean_delta", "mean_of_weights", "nova_mean",
           "scaffold_control"]
