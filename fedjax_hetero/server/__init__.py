"""A method's server side: pipelines of pure steps over typed state (see `steps`); the steps of single methods
live in their method's module (`fedjax_hetero.methods`) and are re-exported here by their old names."""

from fedjax_hetero.server.steps import (Carry, Federation, Plan, RoundInputs, ServerStep, apply_delta, insert_before,
                                        mean_delta, mean_of_weights)
from fedjax_hetero.moved import forward_moved

_MOVED = {name: f"fedjax_hetero.methods.{module}" for name, module in {
    "ControlState": "scaffold", "scaffold_control": "scaffold", "nova_mean": "fednova", "inco": "inco",
    "CrossState": "fedcross", "FedCrossConfig": "fedcross", "cross_aggregation": "fedcross"}.items()}
__getattr__ = forward_moved(__name__, _MOVED)


__all__ = ["Carry", "ControlState", "CrossState", "FedCrossConfig", "Federation", "Plan", "RoundInputs", "ServerStep",
           "apply_delta", "cross_aggregation", "inco", "insert_before", "mean_delta", "mean_of_weights", "nova_mean",
           "scaffold_control"]
