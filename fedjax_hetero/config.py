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

import numpy as np

from fedjax_hetero import data as fdata
from fedjax_hetero import models
from fedjax_hetero.algorithms.fedgen import FedGenConfig
from fedjax_hetero.backends import BACKENDS
from fedjax_hetero.client.backdoor import num_malicious
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.client.terms import term_cuts
from fedjax_hetero.engine import ROUND_PROGRAMS, FederationConfig
from fedjax_hetero.guard import DivergenceConfig
from fedjax_hetero.data.partition import DIRICHLET_MIN_SIZE
from fedjax_hetero.methods import Method, MethodOptions, build_method, get_entry
from fedjax_hetero.validation import (check_bool, check_choice, check_integer, check_number, check_text, cli_flag,
                                      flag_name, has_flag, show)

NORMALIZATIONS = ("dataset", "none")  # the dataset's mean/std, or pixels in [0, 1] (mean 0, std 1)


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
  # The InCo authors' pipeline (docs/inco_fidelity.md, section C/D): images resized to image_size x image_size
  # (None: the dataset's size), pixels in [0, 1] (normalize "none"), clients' indices from partition_file
  # instead of a partitioner, and only the first test_first test images evaluated.
  image_size: int | None = None
  normalize: str = "dataset"
  partition_file: str | None = None
  test_first: int | None = None

  def __post_init__(self):
    if self.dataset not in fdata.DATASETS:
      raise ValueError(f"unknown dataset {self.dataset!r}; accepted: {', '.join(fdata.DATASETS)}")
    check_text("data.data_dir", self.data_dir, optional=True)
    check_integer("data.num_clients", self.num_clients, minimum=1)
    check_choice("data.partition", self.partition, fdata.SCHEMES)
    check_number("data.alpha", self.alpha, above=0)
    check_integer("data.classes_per_client", self.classes_per_client, minimum=1)
    check_integer("data.max_train_samples", self.max_train_samples, minimum=1, optional=True)
    check_integer("data.max_test_samples", self.max_test_samples, minimum=1, optional=True)
    check_integer("data.image_size", self.image_size, minimum=1, optional=True)
    check_choice("data.normalize", self.normalize, NORMALIZATIONS)
    check_text("data.partition_file", self.partition_file, optional=True)
    check_integer("data.test_first", self.test_first, minimum=1, optional=True)
    # A training subset renumbers the images a partition file's indices refer to.
    for first, second in (("partition_file", "max_train_samples"), ("test_first", "max_test_samples")):
      if getattr(self, first) is not None and getattr(self, second) is not None:
        raise ValueError(f"{cli_flag('data.' + first)} and {cli_flag('data.' + second)} exclude each other")
    if self.max_train_samples is not None:
      self._check_train_samples(self.max_train_samples, cli_flag("data.max_train_samples"))

  def _samples_needed(self) -> tuple[int, str]:
    """The fewest training samples the partition can split over the clients, and why."""
    if self.partition_file is not None:
      return self.num_clients, "one per client"
    if self.partition == "dirichlet":
      return self.num_clients * DIRICHLET_MIN_SIZE, f"{DIRICHLET_MIN_SIZE} per client for the Dirichlet partition"
    if self.partition == "shards":
      return (self.num_clients * self.classes_per_client,
              f"{cli_flag('data.classes_per_client')} {self.classes_per_client} shards per client")
    return self.num_clients, "one per client"

  def _check_train_samples(self, available: int, what: str) -> None:
    needed, why = self._samples_needed()
    if available < needed:
      raise ValueError(f"{what} {available} is too few for {cli_flag('data.num_clients')} {self.num_clients}: "
                       f"partition {self.partition} needs at least {needed} ({why})")

  def client_parts(self, num_train: int | None = None) -> list[np.ndarray]:
    """The clients' sample indices from ``partition_file``; ValueError naming the flag if the file cannot be
    read, holds another number of clients than ``num_clients``, or (given ``num_train``) an index outside the
    training set."""
    flag = f"{cli_flag('data.partition_file')} {self.partition_file!r}"
    try:
      parts = fdata.load_partition_file(self.partition_file)
    except ValueError as e:
      raise ValueError(f"{flag}: {e}") from None
    if len(parts) != self.num_clients:
      raise ValueError(f"{flag} holds {len(parts)} clients, but {cli_flag('data.num_clients')} is {self.num_clients}")
    if num_train is not None:
      for client, part in enumerate(parts):
        if part.min() < 0 or part.max() >= num_train:
          bad = part.min() if part.min() < 0 else part.max()
          raise ValueError(f"{flag}: client {client} holds sample index {bad}, outside the {num_train} training "
                           f"samples of {self.dataset}")
    return parts

  def check_paths(self) -> None:
    """Raises ValueError if ``data_dir`` is given but is no readable directory, or ``partition_file`` is no
    readable partition of ``num_clients`` clients (checked when a run starts, not when a saved config is read:
    a resumed run may point at another copy)."""
    if self.partition_file is not None:
      flag = cli_flag("data.partition_file")
      if not os.path.isfile(self.partition_file):
        raise ValueError(f"{flag} {self.partition_file!r} is not a file")
      if not os.access(self.partition_file, os.R_OK):
        raise ValueError(f"{flag} {self.partition_file!r} cannot be read (no permission)")
      self.client_parts()
    if self.data_dir is None:
      return
    flag = cli_flag("data.data_dir")
    if not os.path.exists(self.data_dir):
      raise ValueError(f"{flag} {self.data_dir!r} does not exist")
    if not os.path.isdir(self.data_dir):
      raise ValueError(f"{flag} {self.data_dir!r} is a file, not a directory")
    if not os.access(self.data_dir, os.R_OK | os.X_OK):
      raise ValueError(f"{flag} {self.data_dir!r} cannot be read (no permission)")

  def check_sizes(self, num_train: int, num_test: int, num_classes: int) -> None:
    """Raises ValueError if the loaded dataset (``num_train``/``num_test`` samples, ``num_classes`` classes)
    is too small for these settings; the runner's check after loading, before partitioning."""
    for path, wanted, available, split in (("data.max_train_samples", self.max_train_samples, num_train, "training"),
                                           ("data.max_test_samples", self.max_test_samples, num_test, "test")):
      if wanted is not None and wanted > available:
        raise ValueError(f"{cli_flag(path)} {wanted} exceeds the {available} {split} samples of {self.dataset}")
    if self.test_first is not None and self.test_first > num_test:
      raise ValueError(f"{cli_flag('data.test_first')} {self.test_first} exceeds the {num_test} test samples of "
                       f"{self.dataset}")
    if self.partition == "shards" and self.classes_per_client > num_classes:
      raise ValueError(f"{cli_flag('data.classes_per_client')} {self.classes_per_client} exceeds the {num_classes} "
                       f"classes of {self.dataset}")
    used = num_train if self.max_train_samples is None else self.max_train_samples
    self._check_train_samples(used, f"{self.dataset}'s training set of" if self.max_train_samples is None
                              else cli_flag("data.max_train_samples"))


@dataclasses.dataclass(frozen=True)
class MethodConfig(MethodOptions):
  """The method by its paper name (case-insensitive) and its hyper-parameters."""

  name: str = "HeteroAvg"

  def __post_init__(self):
    super().__post_init__()
    check_text("method.name", self.name)
    try:
      get_entry(self.name)
    except ValueError as e:
      raise ValueError(f"{cli_flag('method.name')}: {e}") from None


@dataclasses.dataclass(frozen=True)
class OutputConfig:
  dir: str = "runs/fmnist"
  resume: bool = False
  overwrite: bool = False
  checkpoint_every: int = 10
  keep_checkpoints: int = 2  # the latest N, besides the one with the best mean test accuracy
  progress: bool = True
  # Reliability (issue 35, `fedjax_hetero.results_folder`): resume a folder whose saved settings cannot be read
  # (its checkpoints continue with the given settings, unchecked); rebuild a damaged metrics.jsonl.
  resume_unchecked: bool = False
  repair_metrics: bool = False

  def __post_init__(self):
    check_text("output.dir", self.dir)
    for path, value in (("output.resume", self.resume), ("output.overwrite", self.overwrite),
                        ("output.progress", self.progress), ("output.resume_unchecked", self.resume_unchecked),
                        ("output.repair_metrics", self.repair_metrics)):
      check_bool(path, value)
    check_integer("output.checkpoint_every", self.checkpoint_every, minimum=1)
    check_integer("output.keep_checkpoints", self.keep_checkpoints, minimum=1)
    for path in ("output.resume_unchecked", "output.repair_metrics"):  # (reliability, issue 35)
      if getattr(self, path.split(".")[1]) and not self.resume:
        raise ValueError(f"{cli_flag(path)} applies to {cli_flag('output.resume')}; add it")

  def check_paths(self) -> None:
    """Raises ValueError if the results folder cannot be used: it, or a folder above it, is a file, or it
    cannot be created or written; or if --resume and --overwrite are both given. Checked when a run starts,
    not when a saved config is read (like `DataConfig.check_paths`)."""
    flag = cli_flag("output.dir")
    if self.resume and self.overwrite:
      raise ValueError(f"{cli_flag('output.resume')} and {cli_flag('output.overwrite')} exclude each other: "
                       f"continue {flag} {self.dir!r}, or delete it and start over")
    path = os.path.abspath(self.dir)
    if os.path.exists(path) and not os.path.isdir(path):
      raise ValueError(f"{flag} {self.dir!r} is a file, not a directory")
    existing = path
    while not os.path.exists(existing):  # the nearest folder that exists: where the new ones would be made
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
      raise ValueError(f"{flag} {self.dir!r} cannot be created: {existing!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
      raise ValueError(f"{flag} {self.dir!r} cannot be written: no write permission on {existing!r}")


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
  round_program: str = "auto"  # a round (or rounds_per_call of them) as one device program; see engine.Simulation
  rounds_per_call: int | None = None  # None: auto (engine.AUTO_ROUNDS_PER_CALL)
  dissimilarity: bool = True  # log the clients' gradient dissimilarity per round (`fedjax_hetero.dissimilarity`)
  divergence: DivergenceConfig = DivergenceConfig()
  output: OutputConfig = OutputConfig()

  def __post_init__(self):
    groups_flag = cli_flag("groups")
    if not isinstance(self.groups, (tuple, list)):
      raise ValueError(f"{groups_flag} must be a sequence of group specs (NAME or NAME@WIDTH), got {show(self.groups)}")
    if not self.groups:
      raise ValueError(f"at least one architecture group is needed ({groups_flag})")
    for spec in self.groups:
      if not isinstance(spec, str):
        raise ValueError(f"{groups_flag}: a group spec is a string such as 'cnn@0.5', got {show(spec)}")
      try:
        models.parse_group_spec(spec)
      except ValueError as e:
        raise ValueError(f"{groups_flag}: {e}") from None
    for path in ("rounds", "eval_every"):
      check_integer(path, getattr(self, path), minimum=1)
    check_choice("backend", self.backend, BACKENDS)
    check_choice("round_program", self.round_program, ROUND_PROGRAMS)
    check_integer("rounds_per_call", self.rounds_per_call, minimum=1, optional=True)
    check_bool("dissimilarity", self.dissimilarity)
    method = build_method(self.method.name, self.method, self.client)  # checks the method's own settings
    if method.one_group and len(self.groups) != 1:
      raise ValueError(f"{method.name} trains one architecture group, got {len(self.groups)} "
                       f"({', '.join(self.groups)}); pass one (e.g. {groups_flag} cnn)")
    self._check_counts(method)
    self._check_scaler(method)
    for spec in self.groups:  # the low/high split of FedImpro and of the dissimilarity metric
      name, width = models.parse_group_spec(spec)
      try:
        models.resolve_cut(models.build_model(name, 10, width), self.method.fedimpro.cut)
      except ValueError as e:
        raise ValueError(f"{cli_flag('method.fedimpro.cut')}, group {spec}: {e}") from None

  def _check_scaler(self, method: Method) -> None:
    """Every group's model takes the method's terms (their wrappers and cut points); HeteroFL's Scaler divides
    by a group's ``width``, its rate only if the widest group has width 1."""
    specs = [(spec, *models.parse_group_spec(spec)) for spec in self.groups]
    widest = max(w for _, _, w in specs)
    for spec, name, width in specs:
      try:
        wrapped = method.wrap_model(models.build_model(name, 10, width))
      except ValueError as e:
        raise ValueError(f"{cli_flag('groups')}, group {spec}: {e}") from None
      try:
        for term in method.terms:  # the cut points a term reads exist (FedIN's declared split, FedImpro's cut)
          term_cuts(term, wrapped)
      except ValueError as e:
        raise ValueError(f"{cli_flag('groups')}, group {spec}: {e}") from None
      if getattr(wrapped, "scaler", False) and widest != 1:
        raise ValueError(f"{method.name}'s Scaler divides each group's outputs by its width, which is its rate "
                         f"of the global model only when the widest group has width 1; {cli_flag('groups')} "
                         f"widest is {widest:g} (add a width-1 group, or --no-heterofl-scaler)")

  def _check_counts(self, method: Method) -> None:
    """Clients, groups and per-round cohort sizes that fit together."""
    num_clients, per_round = self.data.num_clients, self.federation.clients_per_round
    clients_flag, per_round_flag = cli_flag("data.num_clients"), cli_flag("federation.clients_per_round")
    if num_clients < len(self.groups):
      raise ValueError(f"{clients_flag} {num_clients} is fewer than the {len(self.groups)} architecture groups "
                       f"({cli_flag('groups')}); every group needs a client")
    if per_round > num_clients:
      raise ValueError(f"{per_round_flag} {per_round} exceeds {clients_flag} {num_clients}")
    fraction = self.federation.malicious_fraction
    if fraction > 0 and num_malicious(num_clients, fraction) == 0:
      raise ValueError(f"{cli_flag('federation.malicious_fraction')} {fraction} of {clients_flag} {num_clients} "
                       f"rounds to no malicious client; pass at least {0.5 / num_clients:g}, or 0 for a clean run")
    draw = self.federation.group_draw
    if draw and len(draw) != len(self.groups):
      raise ValueError(f"{cli_flag('federation.group_draw')} needs one probability per architecture group "
                       f"({len(self.groups)}), got {len(draw)}")
    if method.sharing.stacked:
      if per_round < 2:
        raise ValueError(f"{per_round_flag} must be >= 2 for {method.name}: it cross-aggregates one middleware "
                         f"model per client of a round, got {per_round}")
      cross = self.method.fedcross
      if cross.propeller_rounds and cross.propellers > per_round - 1:
        raise ValueError(f"{cli_flag('method.fedcross.propellers')} must be at most {per_round - 1} "
                         f"({per_round_flag} {per_round} minus 1: each propeller is another client's model), "
                         f"got {cross.propellers}")

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
  table = {}
  for path in flatten(RunConfig()):
    if not has_flag(path):
      continue
    flag = flag_name(path)
    if flag in table:
      raise AssertionError(f"two settings share the flag name {flag!r}")
    table[flag] = path
  return table


FLAGS: dict[str, str] = _flag_table()
