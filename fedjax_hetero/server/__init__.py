"""A method's server side: pipelines of pure steps over typed state (see `steps`); the steps of single methods
live in their method's module (`fedjax_hetero.methods`)."""

from fedjax_hetero.server.steps import (Carry, Federation, Plan, RoundInputs, ServerStep, apply_delta, insert_before,
                                        mean_delta, mean_of_weights)

__all__ = ["Carry", "Federation", "Plan", "RoundInputs", "ServerStep", "apply_delta", "insert_before", "mean_delta",
           "mean_of_weights"]
