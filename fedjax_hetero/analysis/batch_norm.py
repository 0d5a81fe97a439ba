"""BatchNorm statistics re-estimated from data ("precise BN").

With layer-wise heterogeneous aggregation, a shared BatchNorm layer's running
statistics are averaged over clients of every group that owns it, and so
describe the activations of the *deeper* models as much as the group's own.
Re-estimating them per group model shows how much of a group's test accuracy
is lost to that mismatch rather than to its weights (see docs/reproduction.md,
InCo).
"""

from __future__ import annotations

from typing import Any, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.hetero.maps import Variables


def batch_norm_momenta(model: nn.Module, variables: Variables, sample: jax.Array) -> list[float]:
  """The ``momentum`` of every `nn.BatchNorm` call of a training forward pass, in call order."""
  momenta: list[float] = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
      momenta.append(float(context.module.momentum))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]), variables, sample)
  return momenta


def recalibrate_batch_stats(model: nn.Module, variables: Variables, batches: Iterable[jax.Array]) -> Variables:
  """``variables`` with every BatchNorm's running mean and variance re-estimated on ``batches``.

  Each layer gets the mean over the batches of its batch mean and (biased)
  batch variance, all other variables unchanged: the model's own
  normalization, computed on the given inputs (already normalized as the model
  expects) instead of accumulated during federated training. A training pass
  from zero statistics stores ``(1 - momentum) * batch statistic``, which is
  divided back out, so the result does not depend on the momentum.
  """
  if "batch_stats" not in variables:
    raise ValueError("the model has no BatchNorm statistics to re-estimate")
  batches = iter(batches)
  first = next(batches, None)
  if first is None:
    raise ValueError("re-estimating BatchNorm statistics needs at least one batch")
  momenta = set(batch_norm_momenta(model, variables, first))
  if len(momenta) != 1:
    raise ValueError(f"expected one BatchNorm momentum in the model, found {sorted(momenta)}")
  keep = 1.0 - momenta.pop()
  zeros = jax.tree.map(jnp.zeros_like, variables["batch_stats"])

  @jax.jit
  def batch_statistics(x: jax.Array) -> Any:
    _, updated = model.apply({**variables, "batch_stats": zeros}, x, train=True, mutable=["batch_stats"])
    return jax.tree.map(lambda s: s / keep, updated["batch_stats"])

  total, count = batch_statistics(first), 1
  for x in batches:
    total, count = jax.tree.map(jnp.add, total, batch_statistics(x)), count + 1
  return {**variables, "batch_stats": jax.tree.map(lambda s: s / count, total)}
