"""The run's build step: a `RunConfig` turned into the simulation that runs it, checked on the way.

`run_method` makes the run's method once (from the catalog, or takes the one given) and checks the rules
that need it and the group models: the method fits the groups and the cohort, its terms find their cut
points on every group's model, HeteroFL's Scaler has a width-1 group. It loads no data, so the CLI calls it
to reject bad input before anything is computed. `build_simulation` then loads and partitions the data (holding
out part of every client's samples under per-client evaluation: `training_parts`) and builds the
`rounds.RoundSpec` and its `rounds.Simulation`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import os
import re
import socket
import urllib.parse
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from fedjax_hetero import models
from fedjax_hetero import data as fdata
from fedjax_hetero.client.terms import term_cuts
from fedjax_hetero.config import DataConfig, RunConfig, check_federation, declare
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.methods import Method, adaptive, build_method, check_options, dissimilarity, get_entry, privacy
from fedjax_hetero.rounds import ArchGroup, RoundSpec, Simulation, assign_groups, make_backend, make_simulation
from fedjax_hetero.run import history as run_history
from fedjax_hetero.run import preflight, results_folder

def run_method(config: RunConfig, method: Method | None = None) -> Method:
  """The run's method, checked against the config: built from the catalog by ``config.method`` (its name and
  option families), or ``method`` itself (a method declared by value, whose name the config must carry).
  Raises ValueError naming the flags, before any data is loaded."""
  if method is None:
    method = build_method(config.method.name, config.method, config.client)
  else:
    if method.name.lower() != config.method.name.lower():
      raise ValueError(f"the method given is {method.name!r} but the config names {config.method.name!r}; set "
                       f"{declare.cli_name(config.method, 'name')} {method.name}")
    registered = get_entry(method.name, missing_ok=True)
    if registered is not None:
      check_options(registered, config.method)
  check_federation(config.federation, config.data.num_clients, config.groups, method)
  _check_stacked(config, method)
  _check_models(config, method)
  privacy.with_privacy(method, config.privacy, config.federation)  # (refused here, before any data is loaded)
  return method


def _check_stacked(config: RunConfig, method: Method) -> None:
  cross, per_round = config.method.fedcross, config.federation.clients_per_round
  if method.sharing.stacked and cross.propeller_rounds and cross.propellers > per_round - 1:
    per_round_flag = declare.cli_name(config.federation, "clients_per_round")
    raise ValueError(f"{declare.cli_name(cross, 'propellers')} must be at most {per_round - 1} ({per_round_flag} "
                     f"{per_round} minus 1: each propeller is another client's model), got {cross.propellers}")


def _check_models(config: RunConfig, method: Method) -> None:
  """Every group's model takes the method's terms (their wrappers and cut points) and the low/high cut of
  FedImpro and the dissimilarity metric."""
  specs = [(spec, *models.parse_group_spec(spec)) for spec in config.groups]
  cut = config.method.fedimpro.cut
  for spec, name, width in specs:
    try:
      model = models.build_model(name, 10, width)
      models.resolve_cut(model, cut)
    except ValueError as e:
      raise ValueError(f"{declare.cli_name(config.method.fedimpro, 'cut')}, group {spec}: {e}") from None
    try:
      wrapped = method.wrap_model(model)
      for term in method.terms:
        term_cuts(term, wrapped)
    except ValueError as e:
      raise ValueError(f"{declare.cli_name(RunConfig, 'groups')}, group {spec}: {e}") from None


# Where tensorflow-datasets downloads each dataset from, the first time it prepares it.
TFDS_SOURCES = {"cifar10": "www.cs.toronto.edu", "cifar100": "www.cs.toronto.edu", "svhn_cropped": "ufldl.stanford.edu"}


def check_downloadable(data: DataConfig, timeout: float = 5.0) -> None:
  """For a tfds dataset not prepared on this machine, that the server tfds downloads it from (or the proxy in
  ``$HTTPS_PROXY``) answers: offline, tfds retries for minutes and leaves partial files, so this fails within
  seconds instead, with what to do. Prepared datasets (``<data dir>/<name>/<version>/dataset_info.json``) load
  without network and are not checked."""
  name = data.dataset.removesuffix("_coarse")
  if name not in TFDS_SOURCES:
    return
  root = (data.data_dir or os.environ.get("TFDS_DATA_DIR")
          or os.path.join(os.path.expanduser("~"), "tensorflow_datasets"))
  if glob.glob(os.path.join(root, name, "*", "dataset_info.json")):
    return
  proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
  address = urllib.parse.urlsplit(proxy) if proxy else None
  host, port = (address.hostname, address.port or 80) if address else (TFDS_SOURCES[name], 443)
  try:
    socket.create_connection((host, port), timeout=timeout).close()
  except OSError as e:
    raise fdata.DataNotFoundError(
        f"tfds dataset {name!r} is not prepared in {root!r}, and {host}:{port} (where it is downloaded from"
        f"{', the proxy' if address else ''}) cannot be reached: {type(e).__name__}: {e}\n"
        "tfds needs network access once to download and prepare it, e.g.\n"
        f"  python -c \"import tensorflow_datasets as tfds; tfds.builder('{name}').download_and_prepare()\"\n"
        "or pass --data-dir DIR pointing at a directory that holds prepared tfds data.") from None


def partitioned_dataset(config: RunConfig, dataset: fdata.ArrayDataset | None = None
                        ) -> tuple[fdata.ArrayDataset, list[np.ndarray]]:
  """The run's dataset (loaded unless given; its subset, first test images, resized images and normalization if
  configured) and its client partition (drawn, or read from the partition file)."""
  d, seed = config.data, config.federation.seed
  if dataset is None:
    check_downloadable(d)
    dataset = fdata.load_dataset(d.dataset, d.data_dir)
  d.check_sizes(len(dataset.train_labels), len(dataset.test_labels), dataset.num_classes)
  if d.partition_file is not None:  # checked before the images are resized
    parts = d.client_parts(len(dataset.train_labels))
  if d.max_train_samples or d.max_test_samples:
    dataset = dataset.subset(d.max_train_samples, d.max_test_samples, seed=seed)
  if d.test_first is not None:
    dataset = dataclasses.replace(dataset, test_images=dataset.test_images[:d.test_first],
                                  test_labels=dataset.test_labels[:d.test_first])
  if d.image_size is not None:
    dataset = dataclasses.replace(dataset, train_images=fdata.resize_images(dataset.train_images, d.image_size),
                                  test_images=fdata.resize_images(dataset.test_images, d.image_size))
  if d.normalize == "none":
    channels = dataset.image_shape[-1]
    dataset = dataclasses.replace(dataset, mean=(0.0,) * channels, std=(1.0,) * channels)
  if d.partition_file is None:
    try:
      parts = fdata.partition(dataset.train_labels, d.partition, d.num_clients, seed, alpha=d.alpha,
                              classes_per_client=d.classes_per_client)
    except ValueError as e:  # (the data layer names flags; a value a preset, file or sweep gave is named so)
      raise ValueError(re.sub(r"--[a-z][a-z-]+", lambda m: declare.in_messages(m.group(0)), str(e))) from None
  return dataset, parts


def training_parts(config: RunConfig, parts: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
  """The clients' training parts, and their held-out parts under per-client evaluation (``--client-eval-fraction``,
  drawn from the seed: `data.hold_out`; None without it)."""
  fraction = config.data.client_eval_fraction
  if not fraction:
    return parts, None
  try:
    return fdata.hold_out(parts, fraction, config.federation.seed)
  except ValueError as e:  # (a value a preset, file or sweep gave is named so)
    raise ValueError(re.sub(r"--[a-z][a-z-]+", lambda m: declare.in_messages(m.group(0)), str(e))) from None


def with_run_settings(config: RunConfig, method: Method) -> Method:
  """The run's method with what the run adds to any method: differential privacy (``--dp-clip``), its server
  optimizer (``--server-optimizer``) and what it measures besides (the gradient dissimilarity, ``--dissimilarity``,
  which reads the clipped updates)."""
  method = privacy.with_privacy(method, config.privacy, config.federation)
  method = adaptive.with_server_optimizer(method, config.server)
  return dissimilarity.tracked(method, config.method.fedimpro.cut) if config.dissimilarity else method


def build_simulation(config: RunConfig, dataset: fdata.ArrayDataset | None = None,
                     log: Callable[[str], None] = print, method: Method | None = None, compile_init: bool = False
                     ) -> tuple[Simulation, list[np.ndarray]]:
  """Loads and partitions the data and builds the simulation (no training yet); ``method``: the run's method
  as `run_method` made it (made here when not given). The parts returned are the clients' training parts.
  ``compile_init``: `RoundSpec.build`'s (a caller that initializes next)."""
  method = method or run_method(config)
  dataset, parts = partitioned_dataset(config, dataset)
  parts, held_out = training_parts(config, parts)
  preflight.check_fit(config, dataset, parts, log)  # sizes that would fail or do nothing
  store = FederatedStore.build(dataset.train_images, dataset.train_labels, parts, dataset.num_classes,
                               dataset.mean, dataset.std)
  groups = []
  for spec, clients in zip(config.groups, assign_groups(config.data.num_clients, len(config.groups))):
    name, width = models.parse_group_spec(spec)
    groups.append(ArchGroup(spec, models.build_model(name, dataset.num_classes, width), clients))
  backend = make_backend(config.backend)
  terms = ", ".join(t.name for t in method.terms)
  spec = RoundSpec.build(groups, store, config.client, with_run_settings(config, method), config.federation,
                         jax.device_put(dataset.test_images), jax.device_put(dataset.test_labels), held_out,
                         compile_init=compile_init)
  sim = make_simulation(spec, backend, config.round_program, config.rounds_per_call)
  split = config.data.partition_file or config.data.partition
  log(f"{dataset.name}: {len(dataset.train_labels)} train / {len(dataset.test_labels)} test samples, "
      f"{config.data.num_clients} clients ({split}), groups {', '.join(config.groups)}, "
      f"method {method.name}" + (f" (client terms: {terms})" if terms else "") +
      f", backend {backend.name} on {jax.default_backend()}, " + (
          f"{sim.rounds_per_call} rounds per device program" if sim.cohorts.in_program else
          "rounds as a host loop" + (f" ({declare.cli_name(RunConfig, 'rounds_per_call')} {config.rounds_per_call} "
                                     f"has no effect there: {declare.cli_name(RunConfig, 'round_program')} "
                                     f"{config.round_program} runs no round program for this run on "
                                     f"{jax.default_backend()})"
                                     if config.rounds_per_call is not None else "")) + (
          f" ({jax.device_count()} devices of {jax.process_count()} processes)" if jax.process_count() > 1 else ""))
  if held_out is not None:
    log(f"per-client evaluation: {sum(map(len, held_out))} samples held out ({config.data.client_eval_fraction:g} of "
        f"each client's, at least {min(map(len, held_out))}), the other {sum(map(len, parts))} train")
  malicious = spec.malicious_clients
  if len(malicious):
    attack = config.federation
    among = f" of {spec.groups[spec.global_index].name}" if attack.malicious_group == "largest" else ""
    leaves = {"all": "", "kernels": ", on the kernels alone", "others": ", on the parameters but kernels alone"}[
        attack.backdoor_leaves]
    log(f"backdoor attack: {len(malicious)} malicious clients{among} (lambda {attack.backdoor_scale:g}{leaves}, "
        f"delta_backdoor = {attack.backdoor_delta}): {id_list(malicious)}")
  return sim, parts


def id_list(ids: np.ndarray) -> str:
  return " ".join(str(int(c)) for c in ids)


def malicious_report(sim: Simulation) -> str:
  """The partition report's section on the backdoor attack's malicious clients (empty without attack)."""
  spec = sim.spec
  if not len(spec.malicious_clients):
    return ""
  lines = [f"\nmalicious clients (backdoor attack, fixed by the seed): {len(spec.malicious_clients)} of "
           f"{spec.store.num_clients}, by assigned architecture group"]
  for group, clients in ((g.name, np.intersect1d(g.clients, spec.malicious_clients)) for g in spec.groups):
    lines.append(f"  {group}: {id_list(clients) or '-'}")
  return "\n".join(lines) + "\n"


def write_partition(sim: Simulation, parts: Sequence[np.ndarray], out: str, main: bool, resumed: bool
                    ) -> concurrent.futures.Future:
  """partition.txt and partition.png, written beside what follows (`results_folder.write_beside`; process 0; a
  resume keeps the ones its run wrote: it trains on the same partition, `results_folder.check_data`): the plot is a
  second or two of matplotlib, which the initialization and the first round's compilation (XLA's, outside Python)
  hide."""
  written = all(os.path.exists(os.path.join(out, name)) for name in ("partition.txt", "partition.png"))
  if not main or (resumed and written):
    done = concurrent.futures.Future()
    done.set_result(None)
    return done
  store = sim.spec.store
  labels = np.asarray(store.labels)
  report = malicious_report(sim) + held_out_report(sim)

  def write():
    with open(os.path.join(out, "partition.txt"), "w") as f:
      f.write(fdata.partition_report(labels, parts, store.num_classes) + report)
    fdata.plot_partition(fdata.class_counts(labels, parts, store.num_classes), os.path.join(out, "partition.png"))

  return results_folder.write_beside(out, write)


def held_out_report(sim: Simulation) -> str:
  """partition.txt's line on the samples held out for per-client evaluation (not in the counts above it)."""
  held = sim.spec.client_eval
  if held is None:
    return ""
  return (f"\nheld out for per-client evaluation (--client-eval-fraction): {sum(int(s.sum()) for s in held.sizes)} "
          "samples more, not counted above\n")  # (the groups' clients partition the clients)


class Planned(NamedTuple):
  """A run checked and built, its folder not yet touched (`runner.plan`); `runner.open_run` prepares its folder."""
  config: RunConfig
  history: run_history.History
  changed: str | None
  method: Method
  sim: Simulation
  parts: list
  data: dict | None  # the data's fingerprint, recorded in the folder
