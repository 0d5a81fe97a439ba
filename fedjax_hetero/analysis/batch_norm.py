"""BatchNorm statistics re-estimated from data ("precise BN").

With layer-wise heterogeneous aggregation, a shared BatchNorm layer's running
statistics are averaged over clients of every group that owns it, and so
describe the activations of the *deeper* models as much as the group's own.
Re-estimating them per group model shows how much of a group's test accuracy
is lost to that mismatch rather than to its weights (see docs/reproduction.md,
InCo).
"""

from __future__ import annotations

from typing import Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.models.common import without_scaler
from fedjax_hetero.models.evaluation import batch_norm_keep, batch_norm_momenta, zero_start_statistics

__all__ = ["batch_norm_momenta", "recalibrate_batch_stats"]


def recalibrate_batch_stats(model: nn.Module, variables: Variables, batches: Iterable[jax.Array]) -> Variables:
  """``variables`` with every BatchNorm's running mean and variance re-estimated on ``batches``.

  Each layer gets the mean over the batches of its batch mean and (biased)
  batch variance, all other variables unchanged: the model's own
  normalization, computed on the given inputs (already normalized as the model
  expects) instead of accumulated during federated training. A training pass
  from zero statistics stores ``(1 - momentum) * batch statistic``, which is
  divided back out, so the result does not depend on the momentum. The pass runs with the model's Scaler off
  (HeteroFL's, which acts in training only), as the statistics are for evaluation.
  """
  if "batch_stats" not in variables:
    raise ValueError("the model has no BatchNorm statistics to re-estimate")
  batches = iter(batches)
  first = next(batches, None)
  if first is None:
    raise ValueError("re-estimating BatchNorm statistics needs at least one batch")
  model = without_scaler(model)
  keep = batch_norm_keep(model, variables, first)
  batch_statistics = jax.jit(lambda x: zero_start_statistics(model, variables, x, keep))

  total, count = batch_statistics(first), 1
  for x in batches:
    total, count = jax.tree.map(jnp.add, total, batch_statistics(x)), count + 1
  return {**variables, "batch_stats": jax.tree.map(lambda s: s / count, total)}
