"""Pre-activation bottleneck ResNet-20 for CIFAR (FedCross's `ResNet20_cifar`, spec fedcross.md §3.2).

Each block is BN-ReLU-conv1x1, BN-ReLU-conv3x3(stride), BN-ReLU-conv1x1 to
4x the planes, plus a shortcut: the identity, or a bias-free 1x1 conv (no BN)
when the shape changes. Layers are named by structural position
(`stem_conv`, `stage2_block1/conv2`, `head`) so that width- and depth-reduced
models have variable trees that nest in the full one.

Decisions where the spec is silent or not portable:
- The projection shortcut reads the block's *raw* input by default, as in the
  pre-activation bottleneck ResNets for CIFAR that share this model's other
  features (bias-free 1x1 downsample without BN, BN scale 0.5, an unused final
  BN). `preact_shortcut=True` feeds it the pre-activated input instead (the
  variant of He et al.'s "Identity Mappings" blocks). Identity shortcuts are
  the raw input either way.
- The authors' final BN is defined but unused in their forward pass, so it is
  left out here: 218,970 parameters for 10 classes instead of the 219,482
  that PyTorch counts (the difference is that BN's 2 x 256 affine weights).
- The pooling is a global average, which equals the authors' AvgPool(8) on
  32x32 inputs (8x8 maps after stage 3) and also works on 28x28.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.models.common import (Part, StagedCuts, bn_mask, convolution, lax_convolution, run_parts,
                                         scale_channels)
from fedjax_hetero.models.resnet import conv_init, dense_init

Array = jax.Array

EXPANSION = 4


def _batch_norm(train: bool, dtype: Any, name: str) -> nn.BatchNorm:
  # PyTorch's BN defaults (momentum 0.1 is 0.9 in flax); the authors initialise the scale to 0.5.
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                      scale_init=nn.initializers.constant(0.5), dtype=dtype, name=name)


class PreActBottleneck(nn.Module):
  """BN-ReLU-conv1x1, BN-ReLU-conv3x3(strides), BN-ReLU-conv1x1 to `planes * 4`, plus the shortcut."""

  planes: int
  strides: int = 1
  preact_shortcut: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None) -> Array:
    conv = functools.partial(nn.Conv, use_bias=False, kernel_init=conv_init, dtype=self.dtype,
                             conv_general_dilated=convolution)
    m = bn_mask(mask, x)
    pre = nn.relu(_batch_norm(train, self.dtype, "bn1")(x, mask=m))
    y = conv(self.planes, (1, 1), name="conv1")(pre)
    y = nn.relu(_batch_norm(train, self.dtype, "bn2")(y, mask=m))
    y = conv(self.planes, (3, 3), (self.strides,) * 2, padding=((1, 1), (1, 1)), name="conv2")(y)
    y = nn.relu(_batch_norm(train, self.dtype, "bn3")(y, mask=m))
    y = conv(self.planes * EXPANSION, (1, 1), name="conv3")(y)
    shortcut = x
    if self.strides != 1 or x.shape[-1] != self.planes * EXPANSION:
      shortcut = conv(self.planes * EXPANSION, (1, 1), (self.strides,) * 2, padding="VALID",
                      name="downsample_conv")(pre if self.preact_shortcut else x)
    return y + shortcut


class PreActResNet(StagedCuts, nn.Module):
  """Pre-activation bottleneck ResNet; cut points input, stem, stage1..stageN, features, logits.

  Attributes:
    stage_sizes: blocks per stage; stage i has `base_channels * 2**i` planes
      (outputs 4x that) and stride 2 in its first block for i >= 1.
    num_classes: logits size (never scaled by `width`).
    width: multiplier of the stem channels and every stage's planes.
    base_channels: stem channels and stage-1 planes at width 1.
    preact_shortcut: feed projection shortcuts the pre-activated input (see the module docstring).
    dtype: computation dtype; parameters stay float32 and logits are returned in float32.
  """

  stage_sizes: Sequence[int] = (2, 2, 2)
  num_classes: int = 10
  width: float = 1.0
  base_channels: int = 16
  preact_shortcut: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:

    def stem(h: Array) -> Array:
      # No BN-ReLU here: the first block pre-activates its input.
      return nn.Conv(scale_channels(self.base_channels, self.width), (3, 3), padding=((1, 1), (1, 1)),
                     use_bias=False, kernel_init=conv_init, dtype=self.dtype,
                     conv_general_dilated=lax_convolution, name="stem_conv")(h)

    def stage(index: int, h: Array) -> Array:
      planes = scale_channels(self.base_channels * 2**index, self.width)
      for b in range(self.stage_sizes[index]):
        strides = 2 if index > 0 and b == 0 else 1
        h = PreActBottleneck(planes, strides, self.preact_shortcut, self.dtype,
                             name=f"stage{index + 1}_block{b}")(h, train, mask)
      return h

    def head(h: Array) -> Array:
      h = nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(h)
      return h.astype(jnp.float32)

    parts: list[Part] = [("stem", stem)]
    parts += [(f"stage{i + 1}", functools.partial(stage, i)) for i in range(len(self.stage_sizes))]
    parts += [("features", lambda h: jnp.mean(h, axis=(1, 2))), ("logits", head)]
    return run_parts(parts, x, start, stop)


def resnet20_preact(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> PreActResNet:
  """FedCross's ResNet-20: stages [2, 2, 2], planes 16/32/64 (outputs 64/128/256)."""
  kwargs = dict(stage_sizes=(2, 2, 2), num_classes=num_classes, width=width)
  kwargs.update(overrides)
  return PreActResNet(**kwargs)
