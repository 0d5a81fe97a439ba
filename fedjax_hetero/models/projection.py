"""MOON's projection head on top of any model of the zoo (Li, He, Song 2021, Sec. 3.1).

`ProjectedModel(base)` behaves exactly like ``base`` (same call signature, cut
points and logits, so evaluation and the hetero maps are unchanged apart from
the extra head), and its ``project`` method maps the base model's "features"
``h`` to ``z = W2 relu(W1 h)``, which MOON's model-contrastive loss compares
(``model.apply(variables, h, method="project")``). MOON puts its classifier on the
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
  def decoupling_cut(self) -> str:
    """The base model's."""
    return self.base.decoupling_cut

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
      self.project(self.base(x, train=train, mask=mask, stop="features"))
    return self.base(x, train=train, mask=mask, start=start, stop=stop)

  @nn.compact
  def project(self, features: Array) -> Array:
    """MOON's projection ``z`` of the base model's "features" activation."""
    h = nn.relu(nn.Dense(features.shape[-1], name="projection_hidden")(features))
    return nn.Dense(self.projection_dim, name="projection_out")(h)


def with_projection_head(model: nn.Module, projection_dim: int = MOON_PROJECTION_DIM) -> ProjectedModel:
  """``model`` plus MOON's two-layer projection head (hidden width = the features' width); a model
  that has one already is returned as it is."""
  if isinstance(model, ProjectedModel):
    return model
  return ProjectedModel(model, projection_dim)
