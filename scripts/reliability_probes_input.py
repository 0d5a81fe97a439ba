"""The survey's input probes: operating-system errors on the paths a run uses, and settings that do nothing.

See `scripts/reliability_probes_cli.py` for the probes' environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from scripts.reliability_probes_cli import FMNIST, TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS, CliProbe, Env
from scripts.survey_common import BASE_ARGS, Error, Result, cli, without


# ------------------------------------------------------------------------------------------------ OS errors


def _dangling_link(env: Env) -> Result:
  link = env.out("link")
  os.symlink(env.out("nowhere"), link)
  return env.cli(link)


def _file_as_data(env: Env) -> Result:
  folder = env.out("data")
  os.makedirs(folder)
  for name in (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS):
    os.symlink(os.path.join(FMNIST, name), os.path.join(folder, name))
  os.remove(os.path.join(folder, TEST_LABELS))
  os.makedirs(os.path.join(folder, TEST_LABELS))  # a folder where a file should be
  return env.cli(env.out(), "--data-dir", folder)


OS_ERRORS = [
    CliProbe("OS errors", "--output-dir under /proc", lambda env: env.cli("/proc/fedjax_survey/run"),
             Error(("/proc/fedjax_survey",))),
    CliProbe("OS errors", "--output-dir name longer than 255 bytes", lambda env: env.cli(env.out("x" * 300)),
             Error(("xxxx", "too long"))),
    CliProbe("OS errors", "--output-dir a dangling symlink", _dangling_link, Error(("link",))),
    CliProbe("OS errors", "--image-size 1 with CNN groups",
             lambda env: env.cli(env.out(), "--groups", "cnn@0.25", "--image-size", "1"), Error(("--image-size",))),
    CliProbe("OS errors", "--image-size 8 with a CIFAR CNN",
             lambda env: env.cli(env.out(), "--groups", "cnn_cifar@0.25", "--image-size", "8"),
             Error(("--image-size",))),
    CliProbe("OS errors", "a dataset file that is a folder", _file_as_data, Error(("--data-dir",))),
    CliProbe("OS errors", "--compile-cache under /proc",
             lambda env: cli(env.out(), "--compile-cache", "/proc/fedjax_survey_cache", cache="/proc/fedjax_survey_cache"),
             Error(("--compile-cache",))),
    CliProbe("OS errors", "--partition-file a folder",
             lambda env: env.cli(env.out(), "--partition-file", env.root, base=without(BASE_ARGS, "--max-train-samples")),
             Error(("--partition-file",))),
]


# -------------------------------------------------------------------------------------------------- no-ops


def _partition_file(env: Env) -> str:
  path = env.out("parts.json")
  with open(path, "w") as f:
    json.dump([list(range(c * 50, c * 50 + 50)) for c in range(6)], f)
  return path


def _fresh(*args: str) -> Callable[[Env], Result]:
  return lambda env: env.cli(env.out(), *args)


def _with_partition_file(*args: str) -> Callable[[Env], Result]:
  base = without(BASE_ARGS, "--max-train-samples")  # the two exclude each other
  return lambda env: env.cli(env.out(), "--partition-file", _partition_file(env), *args, base=base)


def _overwrite_foreign(env: Env) -> Result:
  out = env.out()
  os.makedirs(out)
  with open(os.path.join(out, "thesis.tex"), "w") as f:
    f.write("years of work")
  result = env.cli(out, "--overwrite")
  return dataclasses.replace(result, harmed=os.listdir(out) != ["thesis.tex"])


NO_OPS = [
    CliProbe("no-op", "--lr 1e-50 (0 in float32)", _fresh("--lr", "1e-50"), Error(("--lr",))),
    CliProbe("no-op", "--lr 1e-40 (below float32's normal range)", _fresh("--lr", "1e-40"), Error(("--lr",))),
    CliProbe("no-op", "--resume with --lr 1e-50",
             lambda env: env.cli(env.copy(), "--resume", "--rounds", "3", "--lr", "1e-50"), Error(("--lr",))),
    CliProbe("no-op", "--batch-size 100000", _fresh("--batch-size", "100000"), Error(("--batch-size",))),
    CliProbe("no-op", "--drop-last with a batch larger than every client",
             _fresh("--drop-last", "--batch-size", "200"), Error(("--batch-size",))),
    CliProbe("no-op", "--partition-file with --alpha 0.1", _with_partition_file("--alpha", "0.1"),
             Error(("--alpha", "--partition-file"))),
    CliProbe("no-op", "--partition-file with --partition shards", _with_partition_file("--partition", "shards"),
             Error(("--partition shards", "--partition-file"))),
    CliProbe("no-op", "--partition-file with --classes-per-client 3",
             _with_partition_file("--classes-per-client", "3"), Error(("--classes-per-client", "--partition-file"))),
    CliProbe("no-op", "--overwrite on a folder of unrelated files", _overwrite_foreign, Error(("thesis.tex",))),
]

PROBES = [*OS_ERRORS, *NO_OPS]
