"""Settings a run would accept and then silently not use, or fail on deep inside compute; refused up front.

`check_settings` needs only the config (a run calls it before it takes its folder): partition settings a
``--partition-file`` overrides, and settings that act only beside a choice the run did not make
(`ACTS_ONLY_WITH`: ``--alpha`` without the Dirichlet partition, ``--momentum`` with Adam, ...). `check_fit` needs
the loaded data and the partition (before the store and the models are built): images too small for a group's
model, a batch larger than every client (every batch padded to it, for the same result: refused above twice the
largest client, a warning below), clients that take no local step, and warnings for a width that leaves a layer a
single unit, for static BatchNorm settings over models without BatchNorm and for shards that straddle
classes. Each error names the flag.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from fedjax_hetero import models
from fedjax_hetero.config import cli_flag, flatten, typed_flag
from fedjax_hetero.data import class_counts
from fedjax_hetero.methods import build_method, get_entry
from fedjax_hetero.run.reporting import check_writers
from fedjax_hetero.validation import first_line

# A batch this many times the largest client (every batch mostly padding) is refused; a smaller excess is a warning.
PADDING_REFUSED = 2
# The static BatchNorm settings (HeteroFL's, FedFA's): they act only on a model with BatchNorm.
STATIC_BN_SETTINGS = ("method.heterofl.static_bn", "method.heterofl.bn_samples", "method.fedfa.static_bn")
# The partition settings a partition file replaces, and the values that mean "not set".
PARTITION_FILE_OVERRIDES = ("partition", "alpha", "classes_per_client")


def _weighs_its_clients(config: Any) -> bool:
  """Whether the configured method weighs its clients by --weighting: not a method that trains one middleware model
  per client and weighs each 1 (stacked sharing: FedCross); a method given to the runner by value is not known here."""
  entry = get_entry(config.method.name, missing_ok=True)
  return entry is None or not build_method(entry.name, config.method, config.client).sharing.stacked


# Settings that act only beside another choice: (setting, whether it acts in this config, that choice). Set
# to anything but its default without that choice, it would be recorded in config.json and do nothing. (A
# method's options set for a method that does not read them are the build step's: `methods.check_options`.)
ACTS_ONLY_WITH: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("data.alpha", lambda c: c.data.partition == "dirichlet", "--partition dirichlet"),
    ("data.classes_per_client", lambda c: c.data.partition == "shards", "--partition shards"),
    ("client.momentum", lambda c: c.client.optimizer == "sgd", "--optimizer sgd (Adam has no momentum setting)"),
    ("federation.backdoor_scale", lambda c: c.federation.malicious_fraction > 0, "--malicious-fraction above 0"),
    ("federation.backdoor_delta", lambda c: c.federation.malicious_fraction > 0, "--malicious-fraction above 0"),
    ("federation.malicious_group", lambda c: c.federation.malicious_fraction > 0, "--malicious-fraction above 0"),
    ("federation.backdoor_leaves", lambda c: c.federation.malicious_fraction > 0, "--malicious-fraction above 0"),
    ("divergence.loss_factor", lambda c: c.divergence.action != "off", "--on-divergence stop or rollback"),
    ("divergence.chance_evals", lambda c: c.divergence.action != "off", "--on-divergence stop or rollback"),
    ("divergence.rollback_lr_factor", lambda c: c.divergence.action == "rollback", "--on-divergence rollback"),
    ("divergence.max_rollbacks", lambda c: c.divergence.action == "rollback", "--on-divergence rollback"),
    ("federation.weighting", _weighs_its_clients,
     "a method that weighs its clients (FedCross weighs every client's middleware model 1)"),
    ("rounds_per_call", lambda c: c.round_program != "host",
     "--round-program fused, union or auto (host runs every round from the host loop)"),
)


def _would_do_nothing(config: Any, base: Any = None, given: frozenset[str] = frozenset()
                      ) -> Iterator[tuple[str, str, str]]:
  """(dotted path, why, the other way out) of each setting changed from its default (``base``'s value: the
  dataset's defaults; the library's if None), or ``given`` at it, that ``config`` would not read."""
  flat, defaults = flatten(config), flatten(type(config)() if base is None else base)
  if config.data.partition_file is not None:
    for path in ("data." + name for name in PARTITION_FILE_OVERRIDES):
      if flat[path] != defaults[path] or path in given:
        yield path, (f"has no effect with {cli_flag('data.partition_file')}: the file gives every client its "
                     "samples"), ""
    return
  for path, acts, choice in ACTS_ONLY_WITH:
    if flat[path] != defaults[path] and not acts(config):
      yield path, f"has no effect without {choice}", "add that, or "


def check_settings(config: Any, sources: Mapping[str, str] = {}, base: Any = None,
                   given: frozenset[str] = frozenset()) -> None:
  """The config-only checks (see the module docstring); ValueError naming the setting where it was given.
  ``sources``: the dotted paths a config file or a preset set, and which (`fedjax_hetero.cli.run.parse`); the
  others are the caller's (a flag, or the library's caller). ``base``: the defaults the command started from (a
  dataset's: its SGD momentum beside ``--optimizer adam`` was not the user's to drop). ``given``: the paths the
  user gave (a flag at its default value that would do nothing is refused too)."""
  check_writers(config.output.log)  # (before any data is loaded)
  flat = flatten(config)
  for path, why, other in _would_do_nothing(config, base, given):
    source = sources.get(path, "")
    if source.startswith(("--preset", "--fedgen-preset")):
      continue  # the preset's value for a choice this run does not make: it reads nothing and asks nothing
    if source.startswith("--config"):
      raise ValueError(f"{path} {flat[path]} (from {source}) {why}; {other}remove it from that file")
    raise ValueError(f"{cli_flag(path)} {flat[path]} {why}; {other}drop it")


def _smallest_working_size(name: str, width: float, channels: int, start: int, limit: int = 256) -> int | None:
  for size in range(start + 1, limit + 1):
    if _image_problem(name, width, (size, size, channels)) is None:
      return size
  return None


def _image_problem(name: str, width: float, image_shape: tuple[int, ...]) -> str | None:
  """Why the group's model cannot take images of ``image_shape`` (an error tracing it, or a layer left with no
  values), None if it can; shapes only, nothing computed."""
  model = models.build_model(name, 10, width)
  try:
    shapes = models.variable_shapes(model, image_shape)
  except Exception as e:  # noqa: BLE001 - whatever the model raises on a too small input
    return first_line(e, 160)
  empty = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
           if 0 in leaf.shape]
  return f"its layer {empty[0]} would have no values" if empty else None


def _check_images(config: Any, image_shape: tuple[int, ...]) -> None:
  """Only with --image-size: every model takes the datasets' own sizes, and `Simulation` checks images
  handed to it in any case (`simulation_checks.check_models`), naming no flag."""
  size = config.data.image_size
  if size is None:
    return
  what = f"{cli_flag('data.image_size')} {size}"
  for spec in config.groups:
    name, width = models.parse_group_spec(spec)
    problem = _image_problem(name, width, image_shape)
    if problem is None:
      continue
    smallest = _smallest_working_size(name, width, image_shape[-1], image_shape[0])
    hint = f"; the smallest size it takes is {smallest}" if smallest else ""
    raise ValueError(f"{what} is too small for group {spec}: {problem}{hint}")


def _check_batches(config: Any, sizes: np.ndarray, log: Callable[[str], None]) -> None:
  local, flag = config.client, cli_flag("client.batch_size")
  largest = int(sizes.max()) if len(sizes) else 0
  if local.batch_size > largest and not local.drop_last:
    waste = (f"{flag} {local.batch_size} exceeds the largest client's {largest} samples: every batch is padded to "
             f"{local.batch_size} rows for the result a batch size of {largest} gives")
    if local.batch_size > PADDING_REFUSED * largest:
      raise ValueError(f"{waste} (over {PADDING_REFUSED}x the work); pass at most {largest}")
    log(f"warning: {waste} (up to {local.batch_size / max(largest, 1):.1f}x the work)")
  stepless = int(np.sum([local.num_steps(int(n)) == 0 for n in sizes]))
  why = (f"fewer than {flag} {local.batch_size} samples with {cli_flag('client.drop_last')}" if local.drop_last
         else "no samples")
  if stepless == len(sizes):
    raise ValueError(f"no client would take a local step ({why}; the largest client has {largest}), so no round "
                     f"would change the model; lower {flag}" + ("" if not local.drop_last else " or drop --drop-last"))
  if stepless:
    weighting = f"{cli_flag('federation.weighting')} {config.federation.weighting}"
    counted = (f"a sampled one uploads a zero update, which counts in the mean with its {weighting} weight (as the "
               "InCo authors' code does), and " if local.drop_last or config.federation.weighting == "uniform" else "")
    log(f"warning: {stepless} of {len(sizes)} clients take no local step ({why}): {counted}a round that samples "
        "only them changes nothing")


def _warn_collapsed_layers(config: Any, image_shape: tuple[int, ...], num_classes: int,
                           log: Callable[[str], None]) -> None:
  """A width so small that a layer keeps a single unit (its model can barely learn, silently): a warning."""
  for spec in config.groups:
    name, width = models.parse_group_spec(spec)
    if width >= 1:
      continue
    model = models.build_model(name, num_classes, width)
    shapes = models.variable_shapes(model, image_shape)
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    single = [jax.tree_util.keystr(path[:-1]) for path, leaf in leaves if len(leaf.shape) >= 2 and leaf.shape[-1] == 1]
    if single:
      size = sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
      log(f"warning: group {spec}: width {width:g} leaves {len(single)} layer(s) with a single unit "
          f"({', '.join(single[:3])}); its model has {size:,} parameters and may not learn at all")


def check_fit(config: Any, dataset: Any, parts: Sequence[np.ndarray], log: Callable[[str], None] = print) -> None:
  """The data-dependent checks (see the module docstring); ValueError naming the flag, before anything is built."""
  _check_images(config, tuple(dataset.image_shape))
  _warn_collapsed_layers(config, tuple(dataset.image_shape), dataset.num_classes, log)
  _warn_static_bn_without_batch_norm(config, tuple(dataset.image_shape), dataset.num_classes, log)
  _check_batches(config, np.array([len(p) for p in parts], np.int64), log)
  _warn_straddling_shards(config, dataset.train_labels, dataset.num_classes, parts, log)


def _warn_straddling_shards(config: Any, labels: np.ndarray, num_classes: int, parts: Sequence[np.ndarray],
                            log: Callable[[str], None]) -> None:
  """FedAvg's shards are runs of label-sorted samples: where the shard size does not divide the classes' counts, a
  shard straddles two classes and a client holds more classes than --classes-per-client, said as a warning."""
  data = config.data
  if data.partition != "shards" or data.partition_file is not None:
    return
  classes = (class_counts(labels, [p for p in parts if len(p)], num_classes) > 0).sum(axis=1)
  if len(classes) and classes.max() > data.classes_per_client:
    flag = cli_flag("data.classes_per_client")
    log(f"warning: {flag} {data.classes_per_client}: clients hold {classes.min()}-{classes.max()} classes (mean "
        f"{classes.mean():.2f}): the {data.num_clients * data.classes_per_client} shards of the label-sorted "
        f"samples (about {len(labels) // (data.num_clients * data.classes_per_client)} each) straddle class "
        "boundaries; each client has at most that many classes where the shard size divides every class's count")


def _warn_static_bn_without_batch_norm(config: Any, image_shape: tuple[int, ...], num_classes: int,
                                       log: Callable[[str], None]) -> None:
  """Static BatchNorm settings changed from their defaults where no group's model has BatchNorm (the MLP, the
  CNN): they change nothing, said as a warning (a preset may set them for the ResNets it usually runs)."""
  flat, defaults = flatten(config), flatten(type(config)())
  changed = [path for path in STATIC_BN_SETTINGS if flat[path] != defaults[path]]
  if not changed or any(_has_batch_norm(spec, image_shape, num_classes) for spec in config.groups):
    return
  flags = ", ".join(typed_flag(cli_flag(path), flat[path]) for path in changed)
  log(f"warning: {flags}: no group's model has BatchNorm ({', '.join(config.groups)}), so static BN changes nothing")


def _has_batch_norm(spec: str, image_shape: tuple[int, ...], num_classes: int) -> bool:
  name, width = models.parse_group_spec(spec)
  return "batch_stats" in models.variable_shapes(models.build_model(name, num_classes, width), image_shape)
