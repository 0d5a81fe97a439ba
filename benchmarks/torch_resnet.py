"""The torch ResNets of the peer benchmark: the library's ImageNet-stem ResNet presets written in PyTorch (same
channels, strides, BatchNorm, pooling, classifier and initialization; layers named alike, so a shallower
group's ``state_dict`` keys are a subset of the deepest one's)."""

from __future__ import annotations

import functools
from typing import Sequence

# Stage sizes of the library's ImageNet-stem ResNet presets (`models.resnet.RESNET_PRESETS`; not imported:
# it pulls in flax). The jax side's parameter counts check the torch models against them.
TORCH_RESNETS: dict[str, tuple[int, ...]] = {
    "resnet10": (1, 1, 1, 1), "resnet14": (1, 1, 2, 2), "resnet18": (2, 2, 2, 2), "resnet22": (2, 2, 3, 3),
    "resnet26": (3, 3, 3, 3)}


@functools.cache
def torch_resnet_class() -> type:
  """The torch ResNet (classes built on first use, so this module imports without torch)."""
  from torch import nn

  def scale(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))

  class BasicBlock(nn.Module):

    def __init__(self, cin: int, cout: int, stride: int):
      super().__init__()
      self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.bn1 = nn.BatchNorm2d(cout)
      self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.bn2 = nn.BatchNorm2d(cout)
      self.downsample = None
      if stride != 1 or cin != cout:
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
      y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
      return (y + (x if self.downsample is None else self.downsample(x))).relu()

  class ResNet(nn.Module):
    """`models.resnet.ResNet` with the ImageNet stem; modules named as our layers (stem_conv, stage2_block1, head)."""

    def __init__(self, stage_sizes: Sequence[int], num_classes: int, width: float, in_channels: int = 1):
      super().__init__()
      channels = scale(64, width)
      self.stem_conv = nn.Conv2d(in_channels, channels, 7, 2, 3, bias=False)
      self.stem_bn = nn.BatchNorm2d(channels)
      self.pool = nn.MaxPool2d(3, 2, 1)
      self.blocks = []
      cin = channels
      for stage, blocks in enumerate(stage_sizes):
        cout = scale(64 * 2**stage, width)
        for b in range(blocks):
          name = f"stage{stage + 1}_block{b}"
          self.add_module(name, BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
          self.blocks.append(name)
          cin = cout
      self.head = nn.Linear(cin, num_classes)
      for m in self.modules():
        if isinstance(m, nn.Conv2d):
          nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
      nn.init.zeros_(self.head.bias)

    def forward(self, x):
      x = self.pool(self.stem_bn(self.stem_conv(x)).relu())
      for name in self.blocks:
        x = getattr(self, name)(x)
      return self.head(x.mean(dim=(2, 3)))

  return ResNet
