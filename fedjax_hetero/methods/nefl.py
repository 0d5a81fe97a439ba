"""NeFL as a client term and per-group leaves (Kang et al., "NeFL: Nested Model Scaling for Federated Learning
with System Heterogeneous Clients", arXiv 2308.07761): FedFA's width+depth baseline (spec fedfa.md §3.1).

NeFL nests sub-models in one global model along both axes:

* forward propagation is read as an ODE solver with a learnable step size per
  residual block, x_{j+1} = x_j + s_j F_j(x_j) (s_j = 1 at the start).
  `nested_model` turns on the ResNet's ``step_sizes`` (`models.common.StepSize`
  after each block's last BatchNorm, before the shortcut is added, as the
  authors' code does);
* a depthwise sub-model skips residual blocks, a widthwise one keeps the leading
  channels of every layer (as HeteroFL: the default sub-model map);
* parameters are split in two. *Consistent* ones, the convolution
  and linear weights, are shared and averaged element-wise over the clients
  whose sub-model holds the element ("NeFedAvg": the layer-wise mean over
  holders of the shared federation). *Inconsistent* ones, the step sizes and
  every BatchNorm's scale, bias and running statistics, are kept per sub-model
  and averaged over that sub-model's clients only: `inconsistent_leaves` finds
  them by module type (`nn.BatchNorm`, `StepSize`) from a traced forward pass,
  and `Method.own_leaves` makes every architecture group keep its own copy
  (`hetero.maps.separate`). The largest group keeps its copy in place, so the
  federation's model is the largest sub-model with its own BatchNorm and step
  sizes, as the authors' global model carries the largest sub-model's.

Each group is evaluated with its own inconsistent parameters (its variables are
extracted through its map).

Which blocks a depth sub-model skips (spec fedfa.md open choice 22): NeFL's
sub-models are hand-picked per architecture to meet parameter budgets (its
appendix tables; the authors' code runs the skipped blocks with a fixed step
size 0). A stage's first (downsampling) block is always kept, and the NeFL-WD
tables of ResNet34 and ResNet110 keep a stage's *last* block too, skipping
blocks in the middle. ``skip="middle"`` (the default) is that rule for every
stage: a stage of d of D blocks holds blocks 0 .. d-2 and D-1 (the ResNets'
``skip`` attribute names a stage's last block ``block_last``, so the default
map aligns it with the deeper model's last block). ``skip="last"`` holds the
first d blocks of each stage, FedFA's own extraction (and NeFL's NeFL-WD
ResNet56 table), which isolates FedFA's grafting and scaling from the choice
of blocks.

Simplified relative to the paper and its code:

* the skip pattern is one of the two rules above, not a per-model table, and
  widths are the groups' ``@WIDTH`` as given (NeFL picks sqrt(gamma) widths
  and block sets to hit parameter ratios gamma);
* a skipped block is absent from the sub-model rather than run with s_j = 0
  (the same function: its input is a ReLU output, so relu(0 + x) = x);
* averages weight clients by the run's ``--weighting`` (NeFedAvg counts
  clients: ``uniform``);
* step sizes apply to the BasicBlock ResNets (`models.ResNet`) only; NeFL's
  ViT and pre-trained starts are not covered. ``step_sizes=False`` leaves the
  step sizes out (s_j = 1 fixed), the inconsistent BatchNorm still kept per group.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from fedjax_hetero.client.terms import ClientTerm
from fedjax_hetero.config.methods import SKIP  # the default reading (see the module docstring)
from fedjax_hetero.hetero.maps import Path
from fedjax_hetero.models.common import StepSize, module_leaves
from fedjax_hetero.models.resnet import SKIPS

NAME = "nefl"
INCONSISTENT: tuple[type, ...] = (nn.BatchNorm, StepSize)  # the modules whose leaves each sub-model keeps


def inconsistent_leaves(model: nn.Module, sample_input: jax.Array) -> frozenset[Path]:
  """NeFL's inconsistent parameters of ``model``: every leaf (any collection) of its BatchNorm and `StepSize`
  modules, found from a traced forward pass (`models.common.module_leaves`). For `Method.own_leaves`."""
  return module_leaves(model, sample_input, INCONSISTENT)


def nested_model(skip: str = SKIP, step_sizes: bool = True) -> ClientTerm:
  """NeFL's model side: every group's ResNet with learnable step sizes (``step_sizes``) and the depth
  reading ``skip`` ("middle" or "last", see the module docstring)."""
  if skip not in SKIPS:
    raise ValueError(f"NeFL's skip must be one of {', '.join(SKIPS)}, got {skip!r}")
  changes = {**({"step_sizes": True} if step_sizes else {}), **({"skip": skip} if skip != "last" else {})}

  def wrap(model: nn.Module) -> nn.Module:
    missing = sorted(set(changes) - {f.name for f in dataclasses.fields(model)})
    if missing:
      raise ValueError(f"NeFL's {' and '.join(missing)} need a ResNet (models.ResNet); {type(model).__name__} has "
                       f"no {', '.join(missing)} (--no-nefl-step-sizes --nefl-skip last: any model)")
    return model.clone(**changes)

  return ClientTerm(NAME, wrap_model=wrap)


__all__ = ["INCONSISTENT", "NAME", "SKIP", "SKIPS", "inconsistent_leaves", "nested_model"]
