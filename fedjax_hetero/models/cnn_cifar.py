"""FedCross's LeNet-5-style CNN for CIFAR (the group's `CNNCifar`, spec fedcross.md §3.2)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax

from fedjax_hetero.models.cnn import flatten_channel_major
from fedjax_hetero.models.common import Part, lax_convolution, max_pool, run_parts, scale_channels
from fedjax_hetero.models.resnet import dense_init

Array = jax.Array


class CNNCifar(nn.Module):
  """Conv5x5(6)-ReLU-pool2, Conv5x5(16)-ReLU-pool2, Dense120-ReLU, Dense84-ReLU, Dense head.

  Convs are VALID (32x32 -> 28 -> 14 -> 10 -> 5, so fc1 sees 16*5*5 = 400
  inputs; 28x28 gives 16*4*4). No BN or dropout, so `train` and `mask` are
  unused. 62,006 parameters for 32x32x3 inputs and 10 classes. `width`
  scales `channels` and `hidden`. Weights use PyTorch's default
  U(+-1/sqrt(fan_in)); biases start at zero.
  """

  num_classes: int = 10
  width: float = 1.0
  channels: Sequence[int] = (6, 16)
  hidden: Sequence[int] = (120, 84)

  cut_points = ("input", "conv1", "conv2", "fc1", "features", "logits")
  decoupling_cut = "conv2"  # FedImpro's default low/high split (`models.resolve_cut`)

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    del train, mask  # no BN or dropout

    def conv(name: str, channels: int, h: Array) -> Array:
      h = nn.Conv(scale_channels(channels, self.width), (5, 5), padding="VALID", kernel_init=dense_init,
                  conv_general_dilated=lax_convolution, name=name)(h)
      return max_pool(nn.relu(h), (2, 2), (2, 2))

    def dense(name: str, size: int, h: Array) -> Array:
      return nn.relu(nn.Dense(scale_channels(size, self.width), kernel_init=dense_init, name=name)(h))

    parts: list[Part] = [
        ("conv1", lambda h: conv("conv1", self.channels[0], h)),
        ("conv2", lambda h: conv("conv2", self.channels[1], h)),
        ("fc1", lambda h: dense("fc1", self.hidden[0], flatten_channel_major(h))),
        ("features", lambda h: dense("fc2", self.hidden[1], h)),
        ("logits", lambda h: nn.Dense(self.num_classes, kernel_init=dense_init, name="head")(h)),
    ]
    return run_parts(parts, x, start, stop)
