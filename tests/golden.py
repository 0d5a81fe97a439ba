"""The golden regression setting: every method on a tiny fixed federation, recorded at full precision.

``python -m tests.golden`` (from the repository root) runs every method on the sequential and vmap
backends and writes ``tests/golden_methods.json``; `tests/test_golden.py` reruns them and requires the
same numbers bit for bit. The record was made before the method API was rebuilt, so it
pins the behaviour every refactor must keep. The vmap entries were re-recorded once, in the speed work,
when the vmap backend began padding a group's cohort to the largest cohort it can have instead
of the next power of two: the old engine padded that way reproduces the new record bit for bit, and
every sequential entry stayed as it was.

XLA:CPU compiles for the host's vector instructions, so float results differ in the last bits between CPUs
(AVX2 against AVX-512: ~1e-7 relative after three rounds; MOON's contrastive loss under Adam turns such bits
into percent-level differences), and so do XLA:CPU's LLVM optimization levels and emitters. The file therefore
holds one record per signature (`signature`: the instruction-set extensions XLA and its kernels dispatch on, and
the level, emitters and, with the older emitters, code parts ``XLA_FLAGS`` sets; the test suite runs at level 0
with the older emitters compiled as one part, see tests/conftest.py). A machine with a record of its own is held
to it bit for bit; another is compared within `TOLERANCE` with a record made under its XLA settings on another
CPU, or else with the first record (`expected`). ``python -m tests.golden`` adds
(or replaces) the record of the machine it runs on; record on the commit *before* a change, so the record pins the
old behaviour. The first record (cpu null) was made on the machines of the sessions before 2026-11-25, whose
signature was not recorded; the second on an AVX-512 AMD EPYC (Zen 4), from the same commit. The records at
level 0 were made on a commit that reproduced the default level's record bit for bit, the record with the older
emitters on one that reproduced the level-0 record bit for bit, and the one with the older emitters in one code
part on one that reproduced the older emitters' record (in 32 parts). The ResNet entries were re-recorded once, when
every local step began to train with `models.batch_norm` (flax's BatchNorm with its gradient written out, equal up to
the order of float sums): on this VM's three signatures, from the commit that made that change, after checking that
each new run was within `TOLERANCE` of the old one (losses within 1.5e-7 relative, the same accuracies; FedIN, which
amplifies such bits, 2.8e-3); the other machines' records lost their ResNet entries (a machine without one is
compared within tolerance; ``--missing`` records them anew).

The setting: 6 synthetic clients of unequal sizes (`tiny_federation`), two depth groups of a small MLP
(hidden 16-16 and 16-16-16, so InCo has a same-shape pair, hidden3 <- hidden2), 3 clients per round,
2 local epochs of batch 8, Adam 1e-2, 3 rounds, evaluation after every round, one local step per jitted call
(the library's default; steps grouped into chunks give the same bits, `tests/test_golden.py`). FedCross and
CluSamp train the deeper group alone. One extra entry runs InCoAvg on two tiny ResNets (BatchNorm, conv
kernels) on the sequential backend. The methods added later (`LATER_METHODS`) run on the sequential backend
only, to keep the suite's time: on the MLPs where the method accepts them, on the two tiny ResNets where it
needs declared stages, blocks or an extractor/intermediate/classifier split (FedFA, NeFL, FedIN, InclusiveFL).
Their records were made on the code before the configuration was rebuilt, so they pin its behaviour too.
``python -m tests.golden --missing`` records only the entries this machine's record lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
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
# The methods added after the first record: (method, model family), each on the sequential backend.
LATER_METHODS = (("FedImpro", "mlp"), ("FlexiFed", "mlp"), ("HeteroFL", "mlp"), ("FedRolex", "mlp"),
                 ("FedFA", "resnet"), ("NeFL", "resnet"), ("FedIN", "resnet"), ("InclusiveFL", "resnet"))
ONE_GROUP = ("FedCross", "CluSamp")
RESNET_ENTRY = ("InCoAvg", "sequential", "resnet")
# CPU extensions that change which kernels XLA:CPU and YNNPACK run, so the last bits of float results.
SIMD_FLAGS = frozenset({"sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
                        "avx512vl", "avx512cd", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni",
                        "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd",
                        "sve", "sve2"})
# On a CPU without a record of its own: relative tolerance of losses and parameter sums, absolute of accuracies.
TOLERANCE = dict(loss=1e-4, parameter_sum=1e-3, accuracy=1e-9)
# Methods whose numbers a foreign CPU (or another program of the same rounds) cannot be held to: MOON's
# model-contrastive loss under Adam turns last-bit differences of near-zero gradients into full steps (5-10% loss
# differences after three rounds); FedIN on the tiny ResNets amplifies them too (its vmap and sequential backends
# differ by 3e-3 in the third round's loss).
CPU_SENSITIVE = ("MOON", "HeteroMOON", "InCoMOON", "FedIN")


def cpu_signature() -> str:
  """``machine:ext1,ext2,...``: the architecture and its SIMD extensions (from /proc/cpuinfo where there is one)."""
  flags: set[str] = set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          flags = set(line.split(":", 1)[1].split())
          break
  except OSError:
    pass
  return f"{platform.machine()}:{','.join(sorted(flags & SIMD_FLAGS))}"


def signature() -> str:
  """`cpu_signature`, with the XLA:CPU settings of ``XLA_FLAGS`` that change the last bits of float results too:
  the LLVM optimization level, the older (non-fusion) emitters and, with them, the number of parts their code is
  compiled in (the test suite sets all three, tests/conftest.py; under the default emitters the entries checked there,
  tests/test_golden.py's chunked ones, keep their level-0 bits in one part)."""
  flags = os.environ.get("XLA_FLAGS", "")
  levels = re.findall(r"--xla_backend_optimization_level=(\d+)", flags)
  emitters = re.findall(r"--xla_cpu_use_fusion_emitters=(\w+)", flags)
  parts = re.findall(r"--xla_cpu_parallel_codegen_split_count=(\d+)", flags)
  older = bool(emitters) and emitters[-1].lower() in ("false", "0")
  return (cpu_signature() + (f" xla_backend_optimization_level={levels[-1]}" if levels else "")
          + (" xla_cpu_use_fusion_emitters=false" if older else "")
          + (f" xla_cpu_parallel_codegen_split_count={parts[-1]}" if older and parts else ""))


def expected(records: list[dict], entry_key: str, mine: str) -> list | None:
  """The runs of ``entry_key`` that a machine of signature ``mine`` is compared with: its own record's (held bit for
  bit), else those of a record made under its XLA settings on another CPU, else the first record's that has the
  entry (both within `TOLERANCE`; None: no record has it). The XLA settings come before the CPU: the Scaffold
  family's parameter sums move by 1% between LLVM levels, by 1e-6 between CPUs."""
  settings = lambda signature: (signature or "").partition(" ")[2]  # noqa: E731 (`signature`'s part after the CPU)
  own = [r for r in records if r["cpu"] == mine]
  alike = [r for r in records if r["cpu"] != mine and settings(r["cpu"]) == settings(mine)]
  return next((record["runs"][entry_key] for record in own + alike + records if entry_key in record["runs"]), None)


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


def record(method: str, backend: str, family: str = "mlp", compiled: list[list[str]] | None = None,
           steps_per_call: int = 1) -> list[dict[str, Any]]:
  """Per round: train losses, examples, clients, test accuracies and each group model's fingerprint.

  ``compiled``, if given, receives per round the names of the programs the round and its evaluation
  lowered (not part of the record). ``steps_per_call`` groups the same local steps into jitted calls."""
  from fedjax_hetero.compilation import CompileLog
  from tests.golden_setting import eval_variables, golden_simulation  # the API-specific part

  sim = golden_simulation(method, backend, family, steps_per_call=steps_per_call)
  state, rows = sim.init_state(), []
  for _ in range(ROUNDS):
    with CompileLog() as log:
      state, (metrics,) = sim.run_rounds(state, 1)
      sim.evaluate(state)
    if compiled is not None:
      compiled.append(log.names)
    rows.append({"train_loss": metrics["train_loss"], "train_loss_per_group": metrics["train_loss_per_group"],
                 "examples": metrics["examples"], "clients": metrics["clients"],
                 "test_accuracy": sim.evaluate(state),
                 "models": {name: fingerprint(v) for name, v in eval_variables(sim, state).items()}})
  return rows


def entries():
  for method in METHODS:
    for backend in BACKENDS:
      yield method, backend, "mlp"
  yield RESNET_ENTRY
  for method, family in LATER_METHODS:
    yield method, "sequential", family


def key(method: str, backend: str, family: str) -> str:
  return f"{method}/{backend}/{family}"


def main(missing_only: bool = False) -> None:
  """Records this machine's runs into the file (keeping the other machines' records); with ``missing_only``
  only the entries its record lacks, keeping the others as they are."""
  out = {"jax": jax.__version__, "platform": jax.default_backend(), "records": []}
  if os.path.exists(GOLDEN_PATH):
    with open(GOLDEN_PATH) as f:
      out = json.load(f)
    if out["jax"] != jax.__version__:
      raise SystemExit(f"the records were made with jax {out['jax']}; delete {GOLDEN_PATH} to start anew")
  mine = signature()
  own = next((r["runs"] for r in out["records"] if r["cpu"] == mine), {})
  runs = dict(own) if missing_only else {}
  for entry in entries():
    if key(*entry) in runs:
      continue
    print(key(*entry), file=sys.stderr, flush=True)
    runs[key(*entry)] = record(*entry)
  out["records"] = [r for r in out["records"] if r["cpu"] != mine] + [{"cpu": mine, "runs": runs}]
  with open(GOLDEN_PATH, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main(missing_only="--missing" in sys.argv[1:])
