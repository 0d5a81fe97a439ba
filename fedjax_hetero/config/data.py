"""The data and its partition over clients: `DataConfig`."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from fedjax_hetero import data as fdata
from fedjax_hetero.config.declare import Integer, Number, OneOf, Settings, Text, cli_name, setting, validate
from fedjax_hetero.data.checks import check_disjoint
from fedjax_hetero.data.partition import DIRICHLET_MIN_SIZE

NORMALIZATIONS = ("dataset", "none")  # the dataset's mean/std, or pixels in [0, 1] (mean 0, std 1)


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
  TITLE = "data and partition"

  dataset: str = setting("fashion_mnist", "the dataset (each experiments.<dataset> module sets its own)",
                         OneOf(fdata.DATASETS))
  data_dir: str | None = setting(
      None, "directory holding the dataset files (Fashion-MNIST IDX files, or prepared tfds data); default: the "
      "system/tfds locations", Text(), metavar="DIR")
  num_clients: int = setting(100, "number of simulated clients", Integer(1))
  partition: str = setting("dirichlet", "how data is split over clients", OneOf(fdata.SCHEMES))
  alpha: float = setting(0.5, "Dirichlet concentration (partition=dirichlet)", Number(above=0))
  classes_per_client: int = setting(2, "shards per client (partition=shards): label-sorted runs of samples, so "
                                    "this many classes where the shard size divides every class's count (a "
                                    "warning says when it does not)", Integer(1))
  max_train_samples: int | None = setting(None, "use a class-balanced subset of the training set (quick runs)",
                                          Integer(1))
  max_test_samples: int | None = setting(None, "evaluate on a class-balanced random subset of the test set (for a "
                                         "seed, the same whatever --max-train-samples is)", Integer(1))
  # The InCo authors' pipeline (docs/reproduction.md): images resized to image_size x image_size, pixels in
  # [0, 1], clients' indices from a partition file, and only the first test_first test images evaluated.
  image_size: int | None = setting(
      None, "resize train and test images to N x N once when loaded (bilinear, as torchvision's Resize on "
      "tensors); default: the dataset's size", Integer(1), metavar="N")
  normalize: str = setting("dataset", "dataset: (x - the dataset's mean) / its std; none: pixels in [0, 1] "
                           "(torchvision's ToTensor alone)", OneOf(NORMALIZATIONS))
  partition_file: str | None = setting(
      None, "clients' sample indices from a file instead of --partition: an .npz with one integer array per client "
      "under the keys 0..K-1 (scripts/convert_inco_split.py writes one), or a .json list of lists; K must equal "
      "--num-clients; samples no client holds are not used", Text(), metavar="PATH")
  client_eval_fraction: float = setting(
      0.0, "per-client evaluation: hold out this fraction of every client's samples (ceil; drawn once from --seed), "
      "and every --eval-every rounds report each client's accuracy on them with its group's model: the mean, worst "
      "10% and spread per group (docs/client-evaluation.md); 0: off, every sample trains", Number(minimum=0, below=1),
      metavar="F")
  test_first: int | None = setting(None, "evaluate on the first N test images (the InCo authors': 9728, 19 batches "
                                   "of 512)", Integer(1), metavar="N")

  def __post_init__(self):
    validate(self)
    # A training subset renumbers the images a partition file's indices refer to.
    for first, second in (("partition_file", "max_train_samples"), ("test_first", "max_test_samples")):
      if getattr(self, first) is not None and getattr(self, second) is not None:
        raise ValueError(f"{cli_name(self, first)} and {cli_name(self, second)} exclude each other")
    if self.max_train_samples is not None:
      self._check_train_samples(self.max_train_samples, cli_name(self, 'max_train_samples'))

  def _samples_needed(self) -> tuple[int, str]:
    """The fewest training samples the partition can split over the clients, and why."""
    if self.partition_file is not None:
      return self.num_clients, "one per client"
    if self.partition == "dirichlet":
      return self.num_clients * DIRICHLET_MIN_SIZE, (f"{DIRICHLET_MIN_SIZE} per client for the Dirichlet partition; "
                                                     "at that bound a draw rarely gives every client as many, so "
                                                     "pass a few times more")
    if self.partition == "shards":
      return (self.num_clients * self.classes_per_client,
              f"{cli_name(self, 'classes_per_client')} {self.classes_per_client} shards per client")
    return self.num_clients, "one per client"

  def _check_train_samples(self, available: int, what: str) -> None:
    needed, why = self._samples_needed()
    if available < needed:
      raise ValueError(f"{what} {available} is too few for {cli_name(self, 'num_clients')} {self.num_clients}: "
                       f"partition {self.partition} needs at least {needed} ({why})")

  def client_parts(self, num_train: int | None = None) -> list[np.ndarray]:
    """The clients' sample indices from ``partition_file``; ValueError naming the flag if the file cannot be
    read, holds another number of clients than ``num_clients``, or (given ``num_train``) an index outside the
    training set."""
    flag = f"{cli_name(self, 'partition_file')} {self.partition_file!r}"
    try:
      parts = fdata.load_partition_file(self.partition_file)
    except ValueError as e:
      raise ValueError(f"{flag}: {e}") from None
    if len(parts) != self.num_clients:
      raise ValueError(f"{flag} holds {len(parts)} clients, but {cli_name(self, 'num_clients')} is {self.num_clients}")
    if num_train is not None:
      for client, part in enumerate(parts):
        if part.min() < 0 or part.max() >= num_train:
          bad = part.min() if part.min() < 0 else part.max()
          raise ValueError(f"{flag}: client {client} holds sample index {bad}, outside the {num_train} training "
                           f"samples of {self.dataset}")
    try:
      check_disjoint("client", parts)
    except ValueError as e:
      raise ValueError(f"{flag}: {e}") from None
    return parts

  def check_paths(self) -> None:
    """Raises ValueError if ``data_dir`` is given but is no readable directory, or ``partition_file`` is no
    readable partition of ``num_clients`` clients (checked when a run starts, not when a saved config is read:
    a resumed run may point at another copy)."""
    if self.partition_file is not None:
      flag = cli_name(self, 'partition_file')
      if not os.path.isfile(self.partition_file):
        raise ValueError(f"{flag} {self.partition_file!r} is not a file")
      if not os.access(self.partition_file, os.R_OK):
        raise ValueError(f"{flag} {self.partition_file!r} cannot be read (no permission)")
      self.client_parts()
    if self.data_dir is None:
      return
    flag = cli_name(self, 'data_dir')
    if not os.path.exists(self.data_dir):
      raise ValueError(f"{flag} {self.data_dir!r} does not exist")
    if not os.path.isdir(self.data_dir):
      raise ValueError(f"{flag} {self.data_dir!r} is a file, not a directory")
    if not os.access(self.data_dir, os.R_OK | os.X_OK):
      raise ValueError(f"{flag} {self.data_dir!r} cannot be read (no permission)")

  def check_sizes(self, num_train: int, num_test: int, num_classes: int) -> None:
    """Raises ValueError if the loaded dataset (``num_train``/``num_test`` samples, ``num_classes`` classes)
    is too small for these settings; the runner's check after loading, before partitioning."""
    for path, wanted, available, split in (("max_train_samples", self.max_train_samples, num_train, "training"),
                                           ("max_test_samples", self.max_test_samples, num_test, "test")):
      if wanted is not None and wanted > available:
        raise ValueError(f"{cli_name(self, path)} {wanted} exceeds the {available} {split} samples of {self.dataset}")
    if self.max_test_samples is not None and self.max_test_samples < num_classes:
      flag = cli_name(self, 'max_test_samples')
      raise ValueError(f"{flag} {self.max_test_samples} is fewer than the {num_classes} classes of {self.dataset}: a "
                       f"class-balanced test subset needs at least one sample of each; pass at least {num_classes}")
    if self.test_first is not None and self.test_first > num_test:
      raise ValueError(f"{cli_name(self, 'test_first')} {self.test_first} exceeds the {num_test} test samples of "
                       f"{self.dataset}")
    if self.test_first is not None and self.test_first < num_classes:
      raise ValueError(f"{cli_name(self, 'test_first')} {self.test_first} is fewer than the {num_classes} classes of "
                       f"{self.dataset}: its accuracy could not see every class; pass at least {num_classes}")
    if self.partition == "shards" and self.classes_per_client > num_classes:
      raise ValueError(f"{cli_name(self, 'classes_per_client')} {self.classes_per_client} exceeds the {num_classes} "
                       f"classes of {self.dataset}")
    used = num_train if self.max_train_samples is None else self.max_train_samples
    self._check_train_samples(used, f"{self.dataset}'s training set of" if self.max_train_samples is None
                              else cli_name(self, 'max_train_samples'))
