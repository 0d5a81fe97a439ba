"""torchvision-style BasicBlock ResNets (ResNet10..26 as in InCo, ResNet18-CIFAR).

Layers are named by structural position (`stem_conv`, `stage2_block1/conv1`,
`head`), so a shallower/narrower ResNet of the same family has a variable tree
that is a subtree of a deeper/wider one, with every leaf a leading slice.
`ResNet.stage_blocks()` declares the stages and their blocks (FedFA's sections).

Which blocks a shallower ResNet of the family holds of a deeper one's stage is
its ``skip`` reading: "last" (the default) names a stage's blocks ``block0 ..
block{d-1}``, so a stage of d blocks is the first d of a deeper one (FedFA's
extraction; the deeper blocks are the ones skipped); "middle" names the
stage's last block ``block_last``, so a stage of d >= 2 blocks is the first
d - 1 and the last of a deeper one (NeFL's depthwise sub-models skip blocks in
the middle of a stage). ``step_sizes`` adds NeFL's learnable step size to every
block's residual branch (`common.StepSize`).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_hetero.models.common import (Part, StagedCuts, StepSize, bn_mask, convolution, lax_convolution, max_pool,
                                         run_parts, scale_channels, scaler)

Array = jax.Array

# Kaiming normal, fan_out, ReLU gain (torchvision's conv init). JAX's "normal" is
# untruncated; truncation is the separate "truncated_normal" distribution.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
# PyTorch's nn.Linear weight init, U(+-1/sqrt(fan_in)); the bias is zero-initialised
# (PyTorch draws it uniformly too, which needs the fan-in and is not worth the code).
dense_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


SKIPS = ("last", "middle")  # which blocks of a deeper stage a shallower model lacks (see the module docstring)


def block_name(stage: int, block: int, blocks: int | None = None, skip: str = "last") -> str:
  """The module name of block ``block`` (0-based) of stage ``stage`` (0-based) of ``blocks`` blocks: with
  ``skip`` "middle" a stage's last block (of two or more) is ``block_last``."""
  if skip == "middle" and blocks is not None and blocks >= 2 and block == blocks - 1:
    return f"stage{stage + 1}_block_last"
  return f"stage{stage + 1}_block{block}"


def _batch_norm(train: bool, dtype: Any, name: str) -> nn.BatchNorm:
  # PyTorch's defaults; its momentum=0.1 is 0.9 in flax, which weights the running value.
  return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=dtype, name=name)


class BasicBlock(nn.Module):
  """Two 3x3 conv-BN layers with a residual connection (1x1 conv-BN downsample if needed)."""

  channels: int
  strides: int = 1
  dtype: Any = jnp.float32
  rate: float | None = None  # HeteroFL's Scaler: conv outputs divided by it in training (None: off)
  step_size: bool = False  # NeFL: the residual branch times a learnable step size (`StepSize`)

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None) -> Array:
    conv = functools.partial(nn.Conv, use_bias=False, kernel_init=conv_init, dtype=self.dtype,
                             conv_general_dilated=convolution)
    m = bn_mask(mask, x)
    y = conv(self.channels, (3, 3), (self.strides,) * 2, padding=((1, 1), (1, 1)), name="conv1")(x)
    y = nn.relu(_batch_norm(train, self.dtype, "bn1")(scaler(y, self.rate, train), mask=m))
    y = conv(self.channels, (3, 3), padding=((1, 1), (1, 1)), name="conv2")(y)
    y = _batch_norm(train, self.dtype, "bn2")(scaler(y, self.rate, train), mask=m)
    if self.step_size:
      y = StepSize(name="step")(y)
    if self.strides != 1 or x.shape[-1] != self.channels:
      x = conv(self.channels, (1, 1), (self.strides,) * 2, padding="VALID", name="downsample_conv")(x)
      x = scaler(x, self.rate, train)
      x = _batch_norm(train, self.dtype, "downsample_bn")(x, mask=m)
    return nn.relu(x + y)


class ResNet(StagedCuts, nn.Module):
  """BasicBlock ResNet with cut points input, stem, stage1..stageN, features, logits.

  Attributes:
    stage_sizes: number of blocks per stage; stage i has base_channels * 2**i channels.
    num_classes: logits size (never scaled by `width`).
    width: multiplier of every hidden channel count.
    base_channels: channels of the stem and the first stage at width 1.
    stem: "imagenet" (7x7/2 conv + 3x3/2 max pool) or "cifar" (3x3/1 conv).
    dtype: computation dtype; parameters stay float32 and logits are returned in float32.
    scaler: HeteroFL's Scaler: every conv's output divided by the rate `width / scaler_of` in training.
    scaler_of: the width the Scaler's rate is relative to: the global model's (`RoundSpec.build` sets it).
    step_sizes: NeFL's learnable step size s_j on every block's residual branch, x + s_j F_j(x) (s_j = 1
      at initialization; off: no such parameter).
    skip: which blocks of a deeper stage this model lacks, "last" or "middle" (see the module docstring).
  """

  stage_sizes: Sequence[int]
  num_classes: int = 10
  width: float = 1.0
  base_channels: int = 64
  stem: str = "imagenet"
  dtype: Any = jnp.float32
  scaler: bool = False
  scaler_of: float = 1.0
  step_sizes: bool = False
  skip: str = "last"

  @nn.nowrap
  def cross_layer_pairs(self) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """InCo's (target, source) 'params' kernel paths, from `stage_sizes` (InCo Sec. 3.2).

    As in the authors' code: in every stage, conv1 and conv2 of each block
    b >= 1 (all Cout x Cout x 3 x 3) take the stage's block-0 conv2 as their
    source ("Layer 0"); stem, BN, downsample, block-0 convs and head are left
    out. ResNet10 ([1,1,1,1]) has no pair, ResNet26 ([3,3,3,3]) has 16.
    """
    pairs = []
    for stage in self.stage_blocks():
      source = ("params",) + stage[0] + ("conv2", "kernel")
      for block in stage[1:]:
        for conv in ("conv1", "conv2"):
          pairs.append((("params",) + block + (conv, "kernel"), source))
    return tuple(pairs)

  @nn.nowrap
  def stage_blocks(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """The module path of every block, per stage, in order of depth (FedFA's sections, Alg. 2).

    From `stage_sizes`: ``((("stage1_block0",), ("stage1_block1",)), ...)``. A stage's first block
    changes stride or width where the stage does (it then has a downsample branch); the others all
    have one shape.
    """
    return tuple(tuple((block_name(stage, b, blocks, self.skip),) for b in range(blocks))
                 for stage, blocks in enumerate(self.stage_sizes))

  @nn.compact
  def __call__(self, x: Array, train: bool = False, mask: Array | None = None, start: str = "input",
               stop: str = "logits") -> Array:
    if self.stem not in ("imagenet", "cifar"):
      raise ValueError(f"unknown stem {self.stem!r}; expected 'imagenet' or 'cifar'")
    if self.skip not in SKIPS:
      raise ValueError(f"unknown skip {self.skip!r}; expected one of {', '.join(SKIPS)}")
    rate = self.width / self.scaler_of if self.scaler else None

    def stem(h: Array) -> Array:
      channels = scale_channels(self.base_channels, self.width)
      if self.stem == "imagenet":
        kernel, strides, pad = (7, 7), (2, 2), ((3, 3), (3, 3))
      else:
        kernel, strides, pad = (3, 3), (1, 1), ((1, 1), (1, 1))
      h = nn.Conv(channels, kernel, strides, padding=pad, use_bias=False, kernel_init=conv_init,
                  dtype=self.dtype, conv_general_dilated=lax_convolution, name="stem_conv")(h)
      h = scaler(h, rate, train)
      h = nn.relu(_batch_norm(train, self.dtype, "stem_bn")(h, mask=bn_mask(mask, h)))
      if self.stem == "imagenet":
        h = max_pool(h, (3, 3), (2, 2), ((1, 1), (1, 1)))  # padded with -inf, like PyTorch
      return h

    def stage(index: int, h: Array) -> Array:
      channels = scale_channels(self.base_channels * 2**index, self.width)
      blocks = self.stage_sizes[index]
      for b in range(blocks):
        strides = 2 if index > 0 and b == 0 else 1
        h = BasicBlock(channels, strides, self.dtype, rate, self.step_sizes,
                       name=block_name(index, b, blocks, self.skip))(h, train, mask)
      return h

    def head(h: Array) -> Array:
      h = nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(h)
      return h.astype(jnp.float32)

    parts: list[Part] = [("stem", stem)]
    parts += [(f"stage{i + 1}", functools.partial(stage, i)) for i in range(len(self.stage_sizes))]
    parts += [("features", lambda h: jnp.mean(h, axis=(1, 2))), ("logits", head)]
    return run_parts(parts, x, start, stop)


# name -> (stage_sizes, stem). ResNet10..26 follow the InCo paper; resnet18_cifar is FedImpro's.
RESNET_PRESETS: dict[str, tuple[tuple[int, ...], str]] = {
    "resnet10": ((1, 1, 1, 1), "imagenet"),
    "resnet14": ((1, 1, 2, 2), "imagenet"),
    "resnet18": ((2, 2, 2, 2), "imagenet"),
    "resnet22": ((2, 2, 3, 3), "imagenet"),
    "resnet26": ((3, 3, 3, 3), "imagenet"),
    "resnet18_cifar": ((2, 2, 2, 2), "cifar"),
}


def resnet_preset(name: str, num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  """Builds a preset ResNet; `overrides` replace any ResNet field (e.g. base_channels=8)."""
  stage_sizes, stem = RESNET_PRESETS[name]
  kwargs = dict(stage_sizes=stage_sizes, stem=stem, num_classes=num_classes, width=width)
  kwargs.update(overrides)
  return ResNet(**kwargs)


def resnet10(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet10", num_classes, width, **overrides)


def resnet14(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet14", num_classes, width, **overrides)


def resnet18(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet18", num_classes, width, **overrides)


def resnet22(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet22", num_classes, width, **overrides)


def resnet26(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet26", num_classes, width, **overrides)


def resnet18_cifar(num_classes: int = 10, width: float = 1.0, **overrides: Any) -> ResNet:
  return resnet_preset("resnet18_cifar", num_classes, width, **overrides)
