"""Sub-model maps: where each client model sits in the global (largest) model."""

from fedjax_hetero.hetero.maps import (
    Link,
    SubmodelMap,
    Window,
    build_group_map,
    coverage,
    embed,
    extract,
    graft,
    identity_map,
    pick_global,
)

__all__ = ["Link", "SubmodelMap", "Window", "build_group_map", "coverage", "embed", "extract", "graft",
           "identity_map", "pick_global"]
