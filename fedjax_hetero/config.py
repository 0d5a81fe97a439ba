"""One run's settings as one tree of frozen dataclasses, validated once when it is built.

``RunConfig`` holds the data, the architecture groups, the clients' local
training, the method and its hyper-parameters, how rounds are drawn, the
backend and the output. Every leaf is also reachable by a flat *flag name*
(the ``python -m experiments.<dataset>`` flag without dashes, e.g.
``learning_rate`` for ``client.learning_rate``): `RunConfig.from_flags` builds
the tree from those names, which is what the CLI, the presets and older
results folders' flat ``config.json`` files use.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fedjax_hetero import data as fdata
from fedjax_hetero import models
from fedjax_hetero.algorithms.fedgen import FedGenConfig
from fedjax_hetero.backends import BACKENDS
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.engine import FederationConfig
from fedjax_hetero.guard import DivergenceConfig
from fedjax_hetero.methods import MethodOptions, build_method


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dataset: str = "fashion_mnist"
  data_dir: str | None = None
  num_clients: int = 100
  partition: str = "dirichlet"
  alpha: float = 0.5  # Dirichlet concentration
  classes_per_client: int = 2  # shards
  max_train_samples: int | None = None  # a class-balanced subset (quick runs)
  max_test_samples: int | None = None

  def __post_init__(self):
    if self.dataset not in fdata.DATASETS:
      raise ValueError(f"unknown dataset {self.dataset!r}; accepted: {', '.join(fdata.DATASETS)}")
    if self.partition not in fdata.SCHEMES:
      raise ValueError(f"unknown partition {self.partition!r}; accepted: {', '.join(fdata.SCHEMES)}")
    if self.partition == "dirichlet" and not self.alpha > 0:
      raise ValueError(f"alpha must be > 0, got {self.alpha}")
    if self.num_clients < 1:
      raise ValueError(f"num_clients must be >= 1, got {self.num_clients}")

  def check_paths(self) -> None:
    """Raises ValueError if ``data_dir`` is given but missing (checked when a run starts, not when a
    saved config is read: a resumed run may point at another copy)."""
    if self.data_dir is not None and not os.path.isdir(self.data_dir):
      raise ValueError(f"data directory {self.data_dir!r} does not exist")


@dataclasses.dataclass(frozen=True)
class MethodConfig(MethodOptions):
  """The method by its paper name (case-insensitive) and its hyper-parameters."""

  name: str = "HeteroAvg"


@dataclasses.dataclass(frozen=True)
class OutputConfig:
  dir: str = "runs/fmnist"
  resume: bool = False
  overwrite: bool = False
  checkpoint_every: int = 10
  keep_checkpoints: int = 2  # the latest N, besides the one with the best mean test accuracy
  progress: bool = True

  def __post_init__(self):
    if self.checkpoint_every < 1:
      raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
    if self.keep_checkpoints < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  data: DataConfig = DataConfig()
  groups: tuple[str, ...] = ("cnn@1", "cnn@0.5", "cnn@0.25")  # NAME or NAME@WIDTH, smallest first
  client: LocalConfig = LocalConfig(batch_size=32)
  method: MethodConfig = MethodConfig()
  federation: FederationConfig = FederationConfig()
  rounds: int = 100
  eval_every: int = 5
  backend: str = "auto"
  dissimilarity: bool = True  # log the clients' gradient dissimilarity per round (`fedjax_hetero.dissimilarity`)
  divergence: DivergenceConfig = DivergenceConfig()
  output: OutputConfig = OutputConfig()

  def __post_init__(self):
    if not self.groups:
      raise ValueError("at least one architecture group is needed (--groups)")
    for spec in self.groups:
      models.parse_group_spec(spec)
    method = build_method(self.method.name, self.method, self.client)  # checks the method's own settings
    if method.one_group and len(self.groups) != 1:
      raise ValueError(f"{method.name} trains one architecture group, got {len(self.groups)} "
                       f"({', '.join(self.groups)}); pass one (e.g. --groups cnn)")
    if self.data.num_clients < len(self.groups):
      raise ValueError(f"num_clients={self.data.num_clients} is fewer than the {len(self.groups)} architecture groups")
    if not self.federation.clients_per_round <= self.data.num_clients:
      raise ValueError(f"clients_per_round={self.federation.clients_per_round} must be between 1 and "
                       f"num_clients={self.data.num_clients}")
    if self.backend not in BACKENDS:
      raise ValueError(f"unknown backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
    for name in ("rounds", "eval_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for spec in self.groups:  # the low/high split of FedImpro and of the dissimilarity metric
      name, width = models.parse_group_spec(spec)
      try:
        models.resolve_cut(models.build_model(name, 10, width), self.method.fedimpro.cut)
      except ValueError as e:
        raise ValueError(f"--fedimpro-cut, group {spec}: {e}") from None

  @classmethod
  def from_flags(cls, **flags: Any) -> "RunConfig":
    """The library's defaults with the given flat flag names set (see the module docstring)."""
    return cls().replace(**flags)

  def replace(self, **flags: Any) -> "RunConfig":
    """A copy with the given flat flag names changed; unknown names are an error. ``fedgen_preset``
    sets all of FedGen's settings from `FedGenConfig.preset`."""
    unknown = sorted(set(flags) - set(FLAGS) - {"fedgen_preset"})
    if unknown:
      raise ValueError(f"unknown settings {', '.join(unknown)}; accepted: {', '.join(sorted(FLAGS))}, "
                       "fedgen_preset")
    tree = as_dict(self)
    for flag, value in flags.items():
      if flag == "fedgen_preset":
        path, value = "method.fedgen", as_dict(FedGenConfig.preset(value))
      else:
        path = FLAGS[flag]
      *parents, leaf = path.split(".")
      node = tree
      for p in parents:
        node = node[p]
      node[leaf] = value
    return from_dict(tree)

  def flags(self) -> dict[str, Any]:
    """The tree's leaves by flag name (FedGen's settings are not flags: only their preset is)."""
    flat = flatten(self)
    return {flag: flat[path] for flag, path in FLAGS.items()}


def as_dict(config: Any) -> dict[str, Any]:
  return dataclasses.asdict(config)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
  """``{"client.learning_rate": 0.001, ...}`` for a config tree (or its dict)."""
  tree = as_dict(config) if dataclasses.is_dataclass(config) else config
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, path + "."))
    else:
      out[path] = value
  return out


def from_dict(tree: dict[str, Any], ignored: list[str] | None = None) -> RunConfig:
  """A `RunConfig` from its nested dict (e.g. a results folder's config.json); validates it. Names this
  version does not know are skipped and, if ``ignored`` is given, appended to it."""
  return _build(RunConfig, tree, "", [] if ignored is None else ignored)


def _build(cls: type, values: dict[str, Any], prefix: str, ignored: list[str]) -> Any:
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for name, value in values.items():
    if name not in fields:
      ignored.append(prefix + name)
      continue
    default = fields[name].default
    if dataclasses.is_dataclass(default) and isinstance(value, dict):
      value = _build(type(default), value, f"{prefix}{name}.", ignored)
    elif isinstance(value, list):  # JSON turns tuples (the architecture groups) into lists
      value = tuple(value)
    kwargs[name] = value
  return cls(**kwargs)


def _flag_table() -> dict[str, str]:
  """Flag name -> dotted path, for every leaf with a flag."""
  renamed = {"method.name": "method", "output.dir": "output_dir", "method.fedcross.global_from": "fedcross_global",
             "divergence.action": "on_divergence"}
  table = {}
  for path in flatten(RunConfig()):
    if path.startswith("method.fedgen."):
      continue
    leaf = path.rsplit(".", 1)[-1]
    prefixed = next((f"{family.rsplit('.', 1)[-1]}_{leaf}" for family in ("method.fedcross", "method.fedimpro", "divergence")
                     if path.startswith(f"{family}.")), None)
    flag = renamed.get(path) or prefixed or leaf
    if flag in table:
      raise AssertionError(f"two settings share the flag name {flag!r}")
    table[flag] = path
  return table


FLAGS: dict[str, str] = _flag_table()
