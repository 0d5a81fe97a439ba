"""fedjax_hetero: federated learning with heterogeneous client models, in JAX (see docs/architecture.md)."""

from fedjax_hetero import compilation as _compilation

_compilation.use_cpu_fusions()  # before jax first computes: XLA reads its flags once
