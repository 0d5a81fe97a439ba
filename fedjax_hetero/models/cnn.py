"""Small two-conv CNN (the usual FedAvg-style model for MNIST-like data)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.models.common import Part, lax_convolution, max_pool, run_parts, scale_channels, scaler

Array = jax.Array


def flatten_channel_major(x: Array) -> Array:
  """Flattens NHWC in (C, H, W) order, as PyTorch does.

  With channels outermost, the flattened features of a width-sliced model are a
  leading slice of the full model's, so the next Dense kernel can be sliced too.
  """
  return jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)


class CNN(nn.Module):
  """conv3x3-ReLU-maxpool2 twice, Dense-ReLU ("features"), Dense head. No BN.

  Convs use SAME padding (28x28 -> 14x14 -> 7x7). `width` scales `channels`
  and `hidden`; `mask` is accepted for the common signature and unused. With `scaler`, the
  convs' and fc1's outputs are divided by the rate `width / scaler_of` in training (HeteroFL's Scaler;
  `scaler_of` is the global model's width, which `RoundSpec.build` sets).
  """

  num_classes: int = 10
  width: float = 1.0
  channels: Sequence[int] = (32, 64)
  hidden: int = 128
  scaler: bool = False
  scaler_of: float = 1.0

  cut_points = ("input", "conv1", "conv2", "features", "logits")
  decoupling_cut = "conv2"  # FedImpro's default low/high split (`models.resolve_cut`)

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    del mask  # no BN or dropout
    rate = self.width / self.scaler_of if self.scaler else None

    def conv(name: str, channels: int, h: Array) -> Array:
      h = nn.Conv(scale_channels(channels, self.width), (3, 3), padding="SAME", name=name,
                  conv_general_dilated=lax_convolution)(h)
      return max_pool(nn.relu(scaler(h, rate, train)), (2, 2), (2, 2))

    def features(h: Array) -> Array:
      h = flatten_channel_major(h)
      return nn.relu(scaler(nn.Dense(scale_channels(self.hidden, self.width), name="fc1")(h), rate, train))

    parts: list[Part] = [
        ("conv1", lambda h: conv("conv1", self.channels[0], h)),
        ("conv2", lambda h: conv("conv2", self.channels[1], h)),
        ("features", features),
        ("logits", lambda h: nn.Dense(self.num_classes, name="head")(h)),
    ]
    return run_parts(parts, x, start, stop)
