"""Federated methods as declarations (`Method`), and the registry of the papers' methods."""

from fedjax_hetero.config.methods import AGGREGATE_MODES, FEDPROX_MU, MOON_MU, MethodConfig
from fedjax_hetero.methods.api import PER_GROUP, SHARED, STACKED, Method, Sharing
from fedjax_hetero.methods.catalog import (METHODS, Entry, build_method, check_options, get_entry, methods_by_paper,
                                           register_method)

__all__ = ["AGGREGATE_MODES", "Entry", "FEDPROX_MU", "METHODS", "MOON_MU", "Method", "MethodConfig",
           "PER_GROUP", "SHARED", "STACKED", "Sharing", "build_method", "check_options", "get_entry",
           "methods_by_paper", "register_method"]
