"""Multi-layer perceptron, mostly for tests."""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax

from fedjax_hetero.models.common import Part, run_parts, scale_channels, scaler

Array = jax.Array


class MLP(nn.Module):
  """Flatten, then Dense-ReLU layers `hidden1..hiddenN`, then a Dense `head`.

  Cut points are input, hidden1..hiddenN, features, logits; "features" is the
  last hidden activation (the flattened input if `hidden` is empty). `width`
  scales the hidden sizes; `mask` is accepted and unused. With `scaler`, the hidden layers'
  outputs are divided by the rate `width / scaler_of` in training (HeteroFL's Scaler; `scaler_of` is the
  global model's width, which `RoundSpec.build` sets).
  """

  num_classes: int = 10
  width: float = 1.0
  hidden: Sequence[int] = (64,)
  scaler: bool = False
  scaler_of: float = 1.0

  @property
  def cut_points(self) -> tuple[str, ...]:
    return ("input",) + tuple(f"hidden{i + 1}" for i in range(len(self.hidden))) + ("features", "logits")

  @property
  def decoupling_cut(self) -> str:
    """FedImpro's default low/high split (`models.resolve_cut`): after the first hidden layer."""
    return "hidden1" if self.hidden else "features"

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    del mask  # no BN or dropout
    rate = self.width / self.scaler_of if self.scaler else None

    def layer(index: int, h: Array) -> Array:
      if index == 0:
        h = h.reshape(h.shape[0], -1)
      size = scale_channels(self.hidden[index], self.width)
      return nn.relu(scaler(nn.Dense(size, name=f"hidden{index + 1}")(h), rate, train))

    def features(h: Array) -> Array:
      # Identity after the last hidden layer; only flattens when there is none.
      return h.reshape(h.shape[0], -1)

    parts: list[Part] = [(f"hidden{i + 1}", functools.partial(layer, i)) for i in range(len(self.hidden))]
    parts += [("features", features), ("logits", lambda h: nn.Dense(self.num_classes, name="head")(h))]
    return run_parts(parts, x, start, stop)
