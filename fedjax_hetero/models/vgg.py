"""VGG-16 with BatchNorm for CIFAR-sized inputs (FedCross's `VGG16`, spec fedcross.md §3.2).

Thirteen conv3x3-BN-ReLU layers in five blocks, each closed by a 2x2 max
pool, then Dense 4096-ReLU-Dropout, Dense 4096-ReLU ("features"), Dropout and
the Dense head: 33,646,666 parameters for 32x32x3 inputs and 10 classes.

Decisions:
- Max pools use SAME padding (PyTorch's ceil_mode): identical to VALID on
  32x32 (32 -> 16 -> 8 -> 4 -> 2 -> 1), and 28x28 inputs (Fashion-MNIST) go
  28 -> 14 -> 7 -> 4 -> 2 -> 1 instead of shrinking to nothing. Both end in
  a 1x1x512 map, so fc1's kernel has the same shape for both input sizes.
- Dropout runs only when `train=True` *and* the caller passes a "dropout" RNG
  (``apply(..., rngs={"dropout": key})``). The local trainer calls
  ``apply(variables, x, train=True, mask=mask, mutable=["batch_stats"])``
  without RNGs, so it trains this model without dropout.
- Init follows torchvision's VGG: conv kernels Kaiming normal (fan_out),
  Dense kernels N(0, 0.01), biases zero, BN scale 1.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.models.cnn import flatten_channel_major
from fedjax_hetero.models.common import Part, bn_mask, convolution, max_pool, run_parts, scale_channels
from fedjax_hetero.models.resnet import conv_init

Array = jax.Array

# Conv channels per block; every block ends with a 2x2 max pool.
VGG16_BLOCKS: tuple[tuple[int, ...], ...] = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512),
                                             (512, 512, 512))
fc_init = nn.initializers.normal(0.01)


class VGG16(nn.Module):
  """VGG-16 with BN (other `blocks` give other VGGs); cut points input, block1..blockN, features, logits.

  Attributes:
    num_classes: logits size (never scaled by `width`).
    width: multiplier of every conv's channels and of the hidden Dense size.
    blocks: conv channels per block at width 1.
    hidden: size of the two hidden Dense layers at width 1.
    dropout_rate: rate of the two dropouts (active only with a "dropout" RNG in training).
    dtype: computation dtype; parameters stay float32 and logits are returned in float32.
  """

  num_classes: int = 10
  width: float = 1.0
  blocks: Sequence[Sequence[int]] = VGG16_BLOCKS
  hidden: int = 4096
  dropout_rate: float = 0.5
  dtype: Any = jnp.float32

  @property
  def cut_points(self) -> tuple[str, ...]:
    return ("input",) + tuple(f"block{i + 1}" for i in range(len(self.blocks))) + ("features", "logits")

  @property
  def decoupling_cut(self) -> str:
    """FedImpro's default low/high split (`models.resolve_cut`): after the middle block."""
    return f"block{(len(self.blocks) + 1) // 2}"

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    deterministic = not (train and self.has_rng("dropout"))
    dropout = functools.partial(nn.Dropout, self.dropout_rate, deterministic=deterministic)
    dense = functools.partial(nn.Dense, kernel_init=fc_init, dtype=self.dtype)

    def block(index: int, h: Array) -> Array:
      m = bn_mask(mask, h)
      for j, channels in enumerate(self.blocks[index]):
        prefix = f"block{index + 1}_"
        h = nn.Conv(scale_channels(channels, self.width), (3, 3), padding=((1, 1), (1, 1)), kernel_init=conv_init,
                    dtype=self.dtype, conv_general_dilated=convolution, name=f"{prefix}conv{j + 1}")(h)
        # PyTorch's BN defaults (momentum 0.1 is 0.9 in flax).
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                         name=f"{prefix}bn{j + 1}")(h, mask=m)
        h = nn.relu(h)
      return max_pool(h, (2, 2), (2, 2), "SAME")

    def features(h: Array) -> Array:
      size = scale_channels(self.hidden, self.width)
      h = dropout()(nn.relu(dense(size, name="fc1")(flatten_channel_major(h))))
      return nn.relu(dense(size, name="fc2")(h))

    def head(h: Array) -> Array:
      return dense(self.num_classes, name="head")(dropout()(h)).astype(jnp.float32)

    parts: list[Part] = [(f"block{i + 1}", functools.partial(block, i)) for i in range(len(self.blocks))]
    parts += [("features", features), ("logits", head)]
    return run_parts(parts, x, start, stop)

