"""The golden regression setting: every method on a tiny fixed federation, recorded at full precision.

``python -m tests.golden`` (from the repository root) runs every method on the sequential and vmap
backends and writes ``tests/golden_methods.json``; `tests/test_golden.py` reruns them and requires the
same numbers bit for bit. The record was made before the method API was rebuilt (issue 14), so it
pins the behaviour every refactor must keep. The vmap entries were re-recorded once, in the speed work
(issue 21), when the vmap backend began padding a group's cohort to the largest cohort it can have instead
of the next power of two: the old engine padded that way reproduces the new record bit for bit, and
every sequential entry stayed as it was.

The setting: 6 synthetic clients of unequal sizes (`tiny_federation`), two depth groups of a small MLP
(hidden 16-16 and 16-16-16, so InCo has a same-shape pair, hidden3 <- hidden2), 3 clients per round,
2 local epochs of batch 8, Adam 1e-2, 3 rounds, evaluation after every round. FedCross and CluSamp
train the deeper group alone. One extra entry runs InCoAvg on two tiny ResNets (BatchNorm, conv
kernels) on the sequential backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from fedjax_hetero.models import MLP, build_model

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_methods.json")
ROUNDS = 3
BACKENDS = ("sequential", "vmap")
METHODS = ("FedAvg", "HeteroAvg", "InCoAvg", "FedProx", "HeteroProx", "InCoProx", "Scaffold", "HeteroScaffold",
           "InCoScaffold", "FedNova", "HeteroNova", "InCoNova", "MOON", "HeteroMOON", "InCoMOON", "FedCross", "FedGen",
           "CluSamp")
ONE_GROUP = ("FedCross", "CluSamp")
RESNET_ENTRY = ("InCoAvg", "sequential", "resnet")


class PairedMLP(MLP):
  """The MLP with InCo's same-shape pair: the last hidden kernel takes hidden2's as its source."""

  @nn.nowrap
  def cross_layer_pairs(self):
    return tuple((("params", f"hidden{i}", "kernel"), ("params", "hidden2", "kernel"))
                 for i in range(3, len(self.hidden) + 1))


def group_models(num_classes: int, family: str) -> list[tuple[str, nn.Module]]:
  if family == "resnet":
    tiny = dict(stem="cifar", base_channels=4)
    return [("resnet_1_1", build_model("resnet10", num_classes, stage_sizes=(1, 1), **tiny)),
            ("resnet_1_2", build_model("resnet10", num_classes, stage_sizes=(1, 2), **tiny))]
  return [("mlp_16_16", PairedMLP(num_classes=num_classes, hidden=(16, 16))),
          ("mlp_16_16_16", PairedMLP(num_classes=num_classes, hidden=(16, 16, 16)))]


def fingerprint(variables) -> dict[str, Any]:
  """sha256 of every leaf's bytes in path order, and the float64 sum of all leaves."""
  flat = traverse_util.flatten_dict(jax.device_get(dict(variables)))
  digest = hashlib.sha256()
  total = 0.0
  for path in sorted(flat):
    leaf = np.ascontiguousarray(flat[path])
    digest.update("/".join(path).encode())
    digest.update(leaf.tobytes())
    total += float(leaf.astype(np.float64).sum())
  return {"sha256": digest.hexdigest(), "sum": total}


def record(method: str, backend: str, family: str = "mlp",
           compiled: list[list[str]] | None = None) -> list[dict[str, Any]]:
  """Per round: train losses, examples, clients, test accuracies and each group model's fingerprint.

  ``compiled``, if given, receives per round the names of the programs the round and its evaluation
  lowered (not part of the record)."""
  from fedjax_hetero.compilation import CompileLog
  from tests.golden_setting import golden_simulation  # the API-specific part

  sim = golden_simulation(method, backend, family)
  state, rows = sim.init_state(), []
  for _ in range(ROUNDS):
    with CompileLog() as log:
      state, metrics = sim.run_round(state)
      sim.evaluate(state)
    if compiled is not None:
      compiled.append(log.names)
    rows.append({"train_loss": metrics["train_loss"], "train_loss_per_group": metrics["train_loss_per_group"],
                 "examples": metrics["examples"], "clients": metrics["clients"],
                 "test_accuracy": sim.evaluate(state),
                 "models": {name: fingerprint(v) for name, v in sim.eval_variables(state).items()}})
  return rows


def entries():
  for method in METHODS:
    for backend in BACKENDS:
      yield method, backend, "mlp"
  yield RESNET_ENTRY


def key(method: str, backend: str, family: str) -> str:
  return f"{method}/{backend}/{family}"


def main() -> None:
  out = {"jax": jax.__version__, "platform": jax.default_backend(), "runs": {}}
  for entry in entries():
    print(key(*entry), file=sys.stderr, flush=True)
    out["runs"][key(*entry)] = record(*entry)
  with open(GOLDEN_PATH, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
