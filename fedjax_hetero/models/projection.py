"""MOON's projection head on top of any model of the zoo (Li, He, Song 2021, Sec. 3.1).

`ProjectedModel(base)` behaves exactly like ``base`` (same call signature, cut
points and logits, so evaluation and the hetero maps are unchanged apart from
the extra head), and `logits_and_projection` also returns the projected
representation ``z = W2 relu(W1 h)`` of the base model's "features" ``h``,
which MOON's model-contrastive loss compares. MOON puts its classifier on the
projection; we keep the base model's own head on ``h`` so that MOON and
non-MOON runs evaluate the same architecture.
"""

from __future__ import annotations

import flax.linen as nn
import jax


Array = jax.Array
MOON_PROJECTION_DIM = 256  # MOON's out_dim


class ProjectedModel(nn.Module):
  base: nn.Module
  projection_dim: int = MOON_PROJECTION_DIM

  @property
  def cut_points(self) -> tuple[str, ...]:
    return self.base.cut_points

  @property
  def cross_layer_pairs(self):
    """The base model's InCo pairs (None if it has none), re-rooted: its variables live under "base"."""
    pairs_of = getattr(self.base, "cross_layer_pairs", None)
    if pairs_of is None:
      return None
    return lambda: tuple(tuple((p[0], "base") + p[1:] for p in pair) for pair in pairs_of())

  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    # Touch the projection at init so the variables always hold it.
    if self.is_initializing():
      self.logits_and_projection(x, train, mask)
    return self.base(x, train=train, mask=mask, start=start, stop=stop)

  @nn.compact
  def logits_and_projection(self, x: Array, train: bool = False, mask: Array | None = None) -> tuple[Array, Array]:
    features = self.base(x, train=train, mask=mask, stop="features")
    logits = self.base(features, train=train, mask=mask, start="features")
    width = features.shape[-1]
    h = nn.relu(nn.Dense(width, name="projection_hidden")(features))
    return logits, nn.Dense(self.projection_dim, name="projection_out")(h)


def with_projection_head(model: nn.Module, projection_dim: int = MOON_PROJECTION_DIM) -> ProjectedModel:
  """``model`` plus MOON's two-layer projection head (hidden width = the features' width)."""
  return ProjectedModel(model, projection_dim)
