"""Federated methods as declarations (`Method`), and the registry of the papers' methods."""

from fedjax_hetero.methods.api import PER_GROUP, SHARED, STACKED, Method, Sharing
from fedjax_hetero.methods.catalog import (AGGREGATE_MODES, FEDPROX_MU, METHODS, MOON_MU, Entry, MethodOptions,
                                           build_method, get_entry, methods_by_paper)

__all__ = ["AGGREGATE_MODES", "Entry", "FEDPROX_MU", "METHODS", "MOON_MU", "Method", "MethodOptions",
           "PER_GROUP", "SHARED", "STACKED", "Sharing", "build_method", "get_entry", "methods_by_paper"]
