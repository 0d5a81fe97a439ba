"""One run's settings as one tree of frozen dataclasses: `RunConfig`.

It holds the data, the architecture groups, the clients' local training, the method and its options, how
rounds are drawn, the backend, the divergence guard and the output. Every setting is declared once
(`fedjax_hetero.config.declare`) and also reachable by its flat *flag name* (the command-line flag without
dashes, e.g. ``learning_rate`` for ``client.learning_rate``): `RunConfig.from_flags` builds the tree from those
names, which is what the CLI and the presets use. Building a config checks each value and the cross-field
rules that need no model or method; the run's build step (`fedjax_hetero.run.build`) checks the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Iterator

import numpy as np

from fedjax_hetero import models
from fedjax_hetero.config.client import LocalConfig
from fedjax_hetero.config.data import DataConfig
from fedjax_hetero.config.declare import (Custom, Flag, Integer, Number, OneOf, Settings, Text, cli_name, flag_table,
                                          in_messages, leaves, setting, validate)
from fedjax_hetero.config.distributed import DistributedConfig
from fedjax_hetero.config.federation import FederationConfig, check_federation
from fedjax_hetero.config.methods import MethodConfig
from fedjax_hetero.config.privacy import PrivacyConfig, check_privacy
from fedjax_hetero.config.server import ServerOptimizerConfig
from fedjax_hetero.validation import show

# The names `fedjax_hetero.rounds.backends.make_backend` accepts (tests/test_config.py holds the two equal).
BACKEND_NAMES = ("auto", "sequential", "vmap", "sharded")
# How `engine.Simulation.run_rounds` runs rounds: one device program per call of rounds, or the host loop.
ROUND_PROGRAMS = ("auto", "union", "fused", "host")
AUTO_ROUNDS_PER_CALL = 25  # the runner also ends a call at every checkpoint and at the last round
DIVERGENCE_ACTIONS = ("stop", "rollback", "off")
LOG_WRITERS = ("csv", "tensorboard", "wandb")  # `fedjax_hetero.run.reporting.WRITERS`


@dataclasses.dataclass(frozen=True)
class DivergenceConfig(Settings):
  """When a run counts as diverged (`fedjax_hetero.run.guard`), and what the runner does then.

  ``action``: "stop" ends the run with an error (the best checkpoint is kept); "rollback" restores the
  best checkpoint, multiplies the clients' learning rate by ``rollback_lr_factor`` (and a server optimizer's by a
  tenth: `guard.rolled_back`) and goes on, at most ``max_rollbacks`` times; "off" only keeps the engine's
  non-finite-loss error.
  """

  FLAG_PREFIX = "divergence"
  TITLE = "divergence guard"

  action: str = setting(
      "stop", "when the loss is not finite, rises above --divergence-loss-factor x its lowest, or accuracy "
      "collapses to chance: stop (the best checkpoint is kept), rollback (restore the best checkpoint, lower the "
      "learning rates, the clients' and a server optimizer's, go on), or off (stop only on a non-finite loss)",
      OneOf(DIVERGENCE_ACTIONS), flag="on_divergence")
  loss_factor: float = setting(
      10.0, "a group's training loss above this multiple of its lowest so far (at least ln C / 2; ln C before its "
      "first round) counts as divergence", Number(above=1))
  chance_evals: int = setting(3, "evaluations in a row at chance accuracy (after reaching twice chance) that count "
                              "as divergence", Integer(1))
  rollback_lr_factor: float = setting(0.5, "rollback multiplies the clients' learning rate by this",
                                      Number(above=0, below=1))
  max_rollbacks: int = setting(3, "rollbacks allowed in the whole run (across resumes) before it stops", Integer(0))

  def __post_init__(self):
    validate(self)


def parse_list(text: str) -> tuple[str, ...]:
  return tuple(item.strip() for item in text.split(",") if item.strip())


def _check_writers(name: str, writers: Any) -> None:
  if not isinstance(writers, (tuple, list)) or not all(w in LOG_WRITERS for w in writers):
    raise ValueError(f"{name} must be a list of {', '.join(LOG_WRITERS)}, got {show(writers)}")
  if len(set(writers)) != len(writers):
    raise ValueError(f"{name} names a writer twice: {', '.join(writers)}")


@dataclasses.dataclass(frozen=True)
class OutputConfig(Settings):
  TITLE = "results folder"

  dir: str = setting("runs/fmnist", "results folder", Text(), flag="output_dir", metavar="DIR")
  resume: bool = setting(
      False, "continue from the last checkpoint in --output-dir; the other settings must match its config.json, "
      "except --rounds, --eval-every, --backend, --round-program, --rounds-per-call, --stop-after, "
      "--steps-per-call, --data-dir, the local optimizer, --server-lr, the divergence guard's and the results "
      "folder's settings (docs/running.md)", Flag())
  resume_or_start: bool = setting(
      False, "continue the run in --output-dir if it holds one, else start it (for jobs a scheduler may restart); "
      "--resume alone refuses a folder without a run", Flag())
  overwrite: bool = setting(
      False, "delete --output-dir first if it holds a run (config.json, metrics.jsonl or checkpoints/); a folder of "
      "other files is refused", Flag())
  resume_unchecked: bool = setting(
      False, "with --resume: continue a folder whose config.json (and summary.json) cannot be read or is gone, or "
      "whose data fingerprint differs, with this command's settings, unchecked (the unreadable file is kept as "
      "*.unreadable, a summary.json beside it as *.set-aside)", Flag())
  repair_metrics: bool = setting(
      False, "with --resume: rebuild a damaged metrics.jsonl: keep the rows of rounds 1..k before the first missing "
      "one, drop the rest with a note, and train the later rounds again from the latest checkpoint up to round k "
      "(later checkpoints are moved to dropped_checkpoints/)", Flag())
  checkpoint_every: int = setting(10, "checkpoint every N rounds", Integer(1))
  keep_checkpoints: int = setting(2, "checkpoints kept: the latest N, and besides them the one with the best mean "
                                  "test accuracy", Integer(1))
  progress: bool = setting(True, "show a progress bar on a terminal (without one, or with --no-progress: one "
                           "line per evaluation)", Flag())
  log: tuple[str, ...] = setting(
      (), "also write the metrics to: csv (metrics.csv), tensorboard (event files under tensorboard/; needs "
      "tensorboardX), wandb (a Weights & Biases run; needs wandb, WANDB_MODE=offline keeps it on disk); "
      "comma-separated", Custom(_check_writers, parse_list), metavar="WRITER,...")

  def __post_init__(self):
    validate(self)
    for name in ("resume_unchecked", "repair_metrics"):
      if getattr(self, name) and not (self.resume or self.resume_or_start):
        raise ValueError(f"{cli_name(self, name)} applies to {cli_name(self, 'resume')}; add it")

  def check_paths(self) -> None:
    """Raises ValueError if the results folder cannot be used: it, or a folder above it, is a file, or it
    cannot be created or written; or if --resume and --overwrite are both given. Checked when a run starts,
    not when a saved config is read (like `DataConfig.check_paths`)."""
    flag = cli_name(self, "dir")
    for resume in ("resume", "resume_or_start"):
      if getattr(self, resume) and self.overwrite:
        raise ValueError(f"{cli_name(self, resume)} and {cli_name(self, 'overwrite')} exclude each other: "
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


def _check_groups(name: str, groups: Any) -> None:
  if not isinstance(groups, (tuple, list)):
    raise ValueError(f"{name} must be a sequence of group specs (NAME or NAME@WIDTH), got {show(groups)}")
  if not groups:
    raise ValueError(f"at least one architecture group is needed ({name})")
  for spec in groups:
    if not isinstance(spec, str):
      raise ValueError(f"{name}: a group spec is a string such as 'cnn@0.5', got {show(spec)}")
    try:
      models.parse_group_spec(spec)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None


_COMBINATIONS_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("fedjax_hetero_combinations_checked",
                                                                          default=True)


@contextlib.contextmanager
def combinations_unchecked() -> Iterator[None]:
  """Within it, a `RunConfig` checks each setting but not how they combine (a cohort larger than the clients):
  the command line's defaults read from a config file, which the flags given may still change before the run's
  config, checked whole, is made."""
  token = _COMBINATIONS_CHECKED.set(False)
  try:
    yield
  finally:
    _COMBINATIONS_CHECKED.reset(token)


@dataclasses.dataclass(frozen=True)
class RunConfig(Settings):
  TITLE = "run"

  data: DataConfig = DataConfig()
  groups: tuple[str, ...] = setting(
      ("cnn@1", "cnn@0.5", "cnn@0.25"), "comma-separated architecture groups, each NAME or NAME@WIDTH; names: "
      f"{', '.join(models.MODEL_NAMES)}. Clients are split into equal contiguous blocks, one per group, in the "
      "order given", Custom(_check_groups, parse_list), metavar="NAME@WIDTH,...")
  client: LocalConfig = LocalConfig(batch_size=32)
  method: MethodConfig = MethodConfig()
  federation: FederationConfig = FederationConfig()
  rounds: int = setting(100, "communication rounds", Integer(1))
  eval_every: int = setting(5, "evaluate every N rounds (and the last)", Integer(1))
  backend: str = setting("auto", "how clients are mapped onto hardware", OneOf(BACKEND_NAMES))
  round_program: str = setting(
      "auto", "fused: every round (up to --rounds-per-call of them) is one device program, each group's clients "
      "vmapped on its model; union: the same program with every sampled client a masked member of the largest "
      "model, one step for all (methods and models that allow it, docs/performance.md); host: the host loop "
      "launches each group's programs; auto: on an accelerator union where allowed, else fused where the method "
      "allows (not CluSamp); host on CPU", OneOf(ROUND_PROGRAMS))
  rounds_per_call: int | None = setting(
      None, "rounds per device program of --round-program fused or union (a call also ends at every checkpoint and "
      f"the last round); default: {AUTO_ROUNDS_PER_CALL}", Integer(1), metavar="K")
  stop_after: float | None = setting(
      None, "end the run at the end of the first call that passes SECONDS of training (from its first round), "
      "with a checkpoint, and exit with status 75; --resume continues it bit for bit (a protocol in pieces: "
      "Colab, a GPU rented by the hour)", Number(above=0), metavar="SECONDS")
  server: ServerOptimizerConfig = ServerOptimizerConfig()
  privacy: PrivacyConfig = PrivacyConfig()
  dissimilarity: bool = setting(
      True, "log every round's gradient dissimilarity of the client updates, for the low and the high part, per "
      "group (any method; fedjax_hetero.methods.dissimilarity)", Flag())
  divergence: DivergenceConfig = DivergenceConfig()
  output: OutputConfig = OutputConfig()

  def __post_init__(self):
    validate(self)
    if _COMBINATIONS_CHECKED.get():
      check_federation(self.federation, self.data.num_clients, self.groups)
      check_privacy(self.privacy, self.federation)

  @classmethod
  def from_flags(cls, **flags: Any) -> "RunConfig":
    """The library's defaults with the given flat flag names set (see the module docstring)."""
    return cls().replace(**flags)

  def replace(self, **flags: Any) -> "RunConfig":
    """A copy with the given flat flag names changed; unknown names are an error."""
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
      raise ValueError(f"unknown settings {', '.join(unknown)}; accepted: {', '.join(sorted(FLAGS))}")
    tree = as_dict(self)
    for flag, value in flags.items():
      *parents, leaf = FLAGS[flag].path.split(".")
      node = tree
      for p in parents:
        node = node[p]
      node[leaf] = value
    return from_dict(tree)

  def flags(self) -> dict[str, Any]:
    """The tree's settings by flag name."""
    return {leaf.flag: leaf.default for leaf in leaves(self)}


def as_dict(config: Any) -> dict[str, Any]:
  """The config's tree of plain Python values (a numpy scalar given as a setting becomes its int or float), as
  config.json and summary.json hold it."""
  return dataclasses.asdict(config, dict_factory=lambda pairs: {key: _plain(value) for key, value in pairs})


def _plain(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (list, tuple)):
    return type(value)(_plain(v) for v in value)
  return value


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


def from_dict(tree: dict[str, Any], ignored: list[str] | None = None, base: RunConfig | None = None) -> RunConfig:
  """A `RunConfig` from its nested dict (e.g. a results folder's config.json), every setting it leaves out
  (a section's too) as in ``base`` (the library's defaults); validates it. A name this version does not know is a
  ValueError naming it, unless ``ignored`` is given: then it is skipped and appended to ``ignored`` (as a results
  folder of another version is read)."""
  if not isinstance(tree, dict):
    raise TypeError(f"from_dict takes a dict of settings (as config.json holds them), got {type(tree).__name__}")
  return _build(RunConfig() if base is None else base, tree, "", ignored)


def _build(base: Any, values: dict[str, Any], prefix: str, ignored: list[str] | None) -> Any:
  fields = {f.name: f for f in dataclasses.fields(base)}
  kwargs = {name: getattr(base, name) for name in fields}
  for name, value in values.items():
    if name not in fields and ignored is None:
      raise ValueError(f"from_dict: unknown setting {prefix + name!r}; {prefix.rstrip('.') or 'the top level'} "
                       f"takes {', '.join(fields)}")
    if name not in fields:
      ignored.append(prefix + name)
      continue
    if dataclasses.is_dataclass(kwargs[name]) and isinstance(value, dict):
      value = _build(kwargs[name], value, f"{prefix}{name}.", ignored)
    elif dataclasses.is_dataclass(kwargs[name]) and not isinstance(value, type(kwargs[name])):
      raise ValueError(f"from_dict: {prefix + name!r} must be a dict of its settings, got {value!r}")
    elif isinstance(value, list):  # JSON turns tuples (the architecture groups) into lists
      value = tuple(value)
    elif isinstance(kwargs[name], tuple) and isinstance(value, (int, float)) and not isinstance(value, bool):
      value = (value,)  # (one number where a list is declared, as its flag takes one: --client-dropout 0.3)
    kwargs[name] = value
  return type(base)(**kwargs)


# Flag name -> its declared setting in the tree, for every setting of a run; and dotted path -> the same.
FLAGS = flag_table(RunConfig())
FLAGS_BY_PATH = {leaf.path: leaf for leaf in FLAGS.values()}
# Dotted path -> command-line flag, of every setting of a run and of a process's (under ``distributed.``).
_SPELLINGS = {**{leaf.path: leaf.cli for leaf in leaves(RunConfig())},
              **{f"distributed.{leaf.path}": leaf.cli for leaf in leaves(DistributedConfig())}}


def typed_flag(flag: str, value: Any) -> str:
  """``flag`` with ``value`` as a command line takes it: a switch alone for a bool (``--drop-last``,
  ``--no-drop-last``), else the flag and the value (a sequence comma-separated: ``--groups cnn@1,cnn@0.5``)."""
  if isinstance(value, bool):
    return flag if value else "--no-" + flag[2:]
  return f"{flag} {','.join(map(str, value)) if isinstance(value, (tuple, list)) else value}"


def cli_flag(path: str) -> str:
  """How a message names the setting at dotted path ``path``: its command-line flag (``client.learning_rate`` ->
  ``--lr``), or where its value came from (`declare.named_from`)."""
  return in_messages(_SPELLINGS[path])
