"""Model zoo: CNNs, MLP, ResNets, VGG-16 and a small ViT, with named cut points.

Every model's `__call__(x, train=False, mask=None, start="input", stop="logits")`
runs its named parts after `start` through `stop`; `model.cut_points` lists the
names. Models of one family differ only in depth (trailing blocks) and width
(leading channels), so their variable trees nest.

`build_model` takes the names in `MODEL_NAMES` and, for ViT depth groups,
"vit_d<depth>" (e.g. "vit_d4@0.5" in a group spec is a 4-block ViT at half
width; plain "vit" is the default depth, 6).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.linen as nn

from fedjax_hetero.data.checks import check_num_classes
from fedjax_hetero.models.cnn import CNN
from fedjax_hetero.models.cnn_cifar import CNNCifar
from fedjax_hetero.models.common import (bn_mask, cut_shape, parameter_split, resolve_cut, run_parts, scale_channels,
                                         variable_shapes)
from fedjax_hetero.models.mlp import MLP
from fedjax_hetero.models.preact_resnet import PreActBottleneck, PreActResNet, resnet20_preact
from fedjax_hetero.models.resnet import (RESNET_PRESETS, BasicBlock, ResNet, resnet10, resnet14, resnet18,
                                         resnet18_cifar, resnet22, resnet26, resnet_preset)
from fedjax_hetero.models.vgg import VGG16
from fedjax_hetero.models.vit import ViT

MODEL_NAMES: tuple[str, ...] = ("cnn", "mlp", "resnet10", "resnet14", "resnet18", "resnet22", "resnet26",
                                "resnet18_cifar", "cnn_cifar", "resnet20_preact", "vgg16", "vit")
# ViT depth groups: "vit_d<depth>" is a ViT with `depth` blocks.
_VIT_DEPTH = re.compile(r"vit_d([1-9][0-9]*)")


def _check_width(width: float) -> float:
  if isinstance(width, bool) or not isinstance(width, (int, float)) or not math.isfinite(width) or width <= 0:
    raise ValueError(f"width must be a finite number > 0, got {width!r}")
  return float(width)


def _check_name(name: str) -> str:
  key = name.strip().lower() if isinstance(name, str) else name
  if key not in MODEL_NAMES and not (isinstance(key, str) and _VIT_DEPTH.fullmatch(key)):
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)} or vit_d<depth>")
  return key


_SIMPLE = {"cnn": CNN, "mlp": MLP, "cnn_cifar": CNNCifar, "vgg16": VGG16, "vit": ViT}


def _model_class(key: str) -> type:
  if key in _SIMPLE:
    return _SIMPLE[key]
  if key == "resnet20_preact":
    return PreActResNet
  return ViT if _VIT_DEPTH.fullmatch(key) else ResNet


def _check_overrides(name: str, key: str, overrides: dict[str, Any]) -> None:
  accepted = {f.name for f in dataclasses.fields(_model_class(key))} - {"parent", "name", "num_classes", "width"}
  unknown = sorted(set(overrides) - accepted)
  if unknown:
    raise ValueError(f"model {name!r} has no setting {unknown[0]!r}; accepted overrides: {', '.join(sorted(accepted))}")


def build_model(name: str, num_classes: int, width: float = 1.0, **overrides: Any) -> nn.Module:
  """Builds model `name` (case-insensitive) for ``num_classes`` (an integer >= 2); `overrides` replace
  constructor fields (an unknown one is a ValueError naming it).

  "vit_d<depth>" is `ViT(depth=<depth>)`; it takes no `depth` override.
  """
  key = _check_name(name)
  width = _check_width(width)
  check_num_classes("num_classes", num_classes)
  _check_overrides(name, key, overrides)
  simple = _SIMPLE
  if key in simple:
    return simple[key](num_classes=num_classes, width=width, **overrides)
  if key == "resnet20_preact":
    return resnet20_preact(num_classes, width, **overrides)
  vit_depth = _VIT_DEPTH.fullmatch(key)
  if vit_depth:
    if "depth" in overrides:
      raise ValueError(f"model {name!r} sets the depth; pass depth= only with 'vit'")
    return ViT(num_classes=num_classes, width=width, depth=int(vit_depth.group(1)), **overrides)
  return resnet_preset(key, num_classes, width, **overrides)


def parse_group_spec(spec: str) -> tuple[str, float]:
  """Parses "name" or "name@width", e.g. "cnn@0.5" -> ("cnn", 0.5); the name is lower-cased."""
  name, sep, width_text = spec.partition("@")
  if not sep:
    return _check_name(name), 1.0
  try:
    width = float(width_text)
  except ValueError:
    raise ValueError(f"bad width {width_text!r} in group spec {spec!r}; expected e.g. 'cnn@0.5'") from None
  try:
    return _check_name(name), _check_width(width)
  except ValueError as e:
    raise ValueError(f"bad group spec {spec!r}: {e}") from None


__all__ = [
    "BasicBlock", "CNN", "CNNCifar", "MLP", "MODEL_NAMES", "PreActBottleneck", "PreActResNet", "RESNET_PRESETS",
    "ResNet", "VGG16", "ViT", "bn_mask", "build_model", "cut_shape", "parameter_split", "parse_group_spec", "resnet10",
    "resnet14", "resnet18",
    "resnet18_cifar", "resnet20_preact", "resnet22", "resnet26", "resnet_preset", "resolve_cut", "run_parts",
    "scale_channels", "variable_shapes",
]
