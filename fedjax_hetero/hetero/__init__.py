"""Architecture groups as static maps onto the global (largest) model."""

from fedjax_hetero.hetero.maps import (
    GroupMap,
    build_group_map,
    coverage,
    embed,
    extract,
    identity_map,
    pick_global,
)

__all__ = ["GroupMap", "build_group_map", "coverage", "embed", "extract", "identity_map", "pick_global"]
