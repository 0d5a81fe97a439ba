"""Sub-model maps: where each client model sits in the global (largest) model."""

from fedjax_hetero.hetero.maps import (
    OWN,
    Link,
    SubmodelMap,
    Window,
    build_group_map,
    complete,
    coverage,
    embed,
    extract,
    graft,
    identity_map,
    pick_global,
    separate,
)

__all__ = ["OWN", "Link", "SubmodelMap", "Window", "build_group_map", "complete", "coverage", "embed", "extract",
           "graft", "identity_map", "pick_global", "separate"]
