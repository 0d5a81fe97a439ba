"""Splitting a labelled dataset across federated clients (host-side numpy).

Every partitioner returns one int64 index array per client and is
deterministic in `seed`. All schemes here assign every sample exactly once; a
partition file (`load_partition_file`) may leave samples out.
"""

from __future__ import annotations

import json
import math
import numbers
import zipfile
from typing import Sequence

import numpy as np

from fedjax_hetero.data.checks import check_sample_ids
from fedjax_hetero.validation import check_integer

SCHEMES: tuple[str, ...] = ("iid", "iid_imbalanced", "dirichlet", "shards")
DIRICHLET_MAX_TRIES = 1000
DIRICHLET_MIN_SIZE = 10  # the fewest samples a client of a Dirichlet split gets (redrawn until it holds)


def _check_labels(labels: np.ndarray) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
  if labels.size and labels.min() < 0:
    raise ValueError(f"labels must be >= 0, got {labels.min()}")
  return labels


def _check_num_clients(labels: np.ndarray, num_clients: int) -> None:
  if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool):
    raise ValueError(f"num_clients must be an integer, got {num_clients!r}")
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}")
  if num_clients > len(labels):
    raise ValueError(f"num_clients={num_clients} exceeds the {len(labels)} training samples")


def _check_seed(seed: int) -> None:
  check_integer("seed", seed, minimum=0)  # (numpy's generators take no negative seed)


def _check_alpha(alpha: float) -> None:
  if not 0 < alpha < float("inf"):  # Also rejects NaN.
    raise ValueError(f"alpha must be a finite number > 0, got {alpha}")


def _check_min_size(labels: np.ndarray, num_clients: int, min_size: int) -> None:
  if not isinstance(min_size, (int, np.integer)) or isinstance(min_size, bool):
    raise ValueError(f"min_size must be an integer, got {min_size!r}")
  if min_size < 0:
    raise ValueError(f"min_size must be >= 0, got {min_size}")
  if min_size * num_clients > len(labels):
    raise ValueError(
        f"min_size={min_size} is infeasible: {num_clients} clients x {min_size} > "
        f"{len(labels)} samples")


def _check_classes_per_client(labels: np.ndarray, num_clients: int, classes_per_client: int) -> None:
  if not isinstance(classes_per_client, (int, np.integer)) or isinstance(classes_per_client, bool):
    raise ValueError(f"classes_per_client must be an integer, got {classes_per_client!r}")
  num_classes = len(np.unique(labels))
  if not 1 <= classes_per_client <= num_classes:
    raise ValueError(
        f"classes_per_client must be in [1, {num_classes}] (the number of classes), "
        f"got {classes_per_client}")
  if num_clients * classes_per_client > len(labels):
    raise ValueError(
        f"num_clients * classes_per_client = {num_clients * classes_per_client} shards "
        f"exceeds the {len(labels)} training samples")


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
  """Uniformly random split into clients whose sizes differ by at most 1."""
  labels = _check_labels(labels)
  _check_num_clients(labels, num_clients)
  _check_seed(seed)
  perm = np.random.default_rng(seed).permutation(len(labels))
  return np.array_split(perm.astype(np.int64), num_clients)


def iid_imbalanced(
    labels: np.ndarray, num_clients: int, seed: int, sigma: float = 0.5
) -> list[np.ndarray]:
  """Random split with client sizes proportional to lognormal(0, sigma) draws, each >= 1."""
  labels = _check_labels(labels)
  _check_num_clients(labels, num_clients)
  if not 0 <= sigma < float("inf"):
    raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
  _check_seed(seed)
  rng = np.random.default_rng(seed)
  weights = rng.lognormal(0.0, sigma, size=num_clients)
  # One guaranteed sample each; the rest shared by weight, remainder to the
  # largest fractional parts so sizes sum to exactly len(labels).
  spare = len(labels) - num_clients
  share = weights / weights.sum() * spare
  sizes = np.floor(share).astype(np.int64)
  leftover = spare - int(sizes.sum())
  sizes[np.argsort(sizes - share, kind="stable")[:leftover]] += 1
  sizes += 1
  perm = rng.permutation(len(labels)).astype(np.int64)
  return np.split(perm, np.cumsum(sizes)[:-1])


def _dirichlet_attempt(
    class_indices: list[np.ndarray], num_samples: int, num_clients: int, alpha: float,
    rng: np.random.Generator,
) -> tuple[list[list[np.ndarray]], np.ndarray] | None:
  """One pass of the NIID-Bench split over all classes; None if it degenerates."""
  chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
  sizes = np.zeros(num_clients, dtype=np.int64)
  for idx in class_indices:
    idx = rng.permutation(idx)
    p = rng.dirichlet(np.full(num_clients, alpha))
    p = np.where(sizes < num_samples / num_clients, p, 0.0)
    total = p.sum()
    if total == 0:  # Tiny alpha can underflow all uncapped clients to 0.
      return None
    cuts = (np.cumsum(p / total) * len(idx)).astype(np.int64)[:-1]
    for j, chunk in enumerate(np.split(idx, cuts)):
      chunks[j].append(chunk)
      sizes[j] += len(chunk)
  return chunks, sizes


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = DIRICHLET_MIN_SIZE
) -> list[np.ndarray]:
  """Label-skewed split, per class p ~ Dir(alpha), as in NIID-Bench/FedML ("hetero").

  Clients already holding >= N/num_clients samples get no more; the whole split is
  redrawn until every client holds >= min_size samples.
  """
  labels = _check_labels(labels)
  _check_num_clients(labels, num_clients)
  _check_alpha(alpha)
  _check_min_size(labels, num_clients, min_size)
  _check_seed(seed)
  rng = np.random.default_rng(seed)
  class_indices = [np.flatnonzero(labels == k).astype(np.int64) for k in np.unique(labels)]
  for _ in range(DIRICHLET_MAX_TRIES):
    attempt = _dirichlet_attempt(class_indices, len(labels), num_clients, alpha, rng)
    if attempt is not None and attempt[1].min() >= min_size:
      return [rng.permutation(np.concatenate(c)) for c in attempt[0]]
  raise ValueError(
      f"dirichlet split found no assignment with every client >= min_size={min_size} samples "
      f"in {DIRICHLET_MAX_TRIES} tries (alpha={alpha}, num_clients={num_clients}, "
      f"{len(labels)} samples): lower num_clients (--num-clients) or raise alpha (--alpha), or use more samples "
      f"(--max-train-samples); a library call may also lower min_size")


def shards(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
  """FedAvg's pathological split: label-sorted data cut into equal shards, dealt at random.

  A client holds at most classes_per_client labels only when shard boundaries align
  with class boundaries (e.g. equal class sizes divisible by the shard size).
  """
  labels = _check_labels(labels)
  _check_num_clients(labels, num_clients)
  _check_classes_per_client(labels, num_clients, classes_per_client)
  _check_seed(seed)
  rng = np.random.default_rng(seed)
  num_shards = num_clients * classes_per_client
  # Shuffle before the stable sort so the order within a class is random.
  perm = rng.permutation(len(labels)).astype(np.int64)
  by_label = perm[np.argsort(labels[perm], kind="stable")]
  pieces = np.array_split(by_label, num_shards)
  dealt = rng.permutation(num_shards).reshape(num_clients, classes_per_client)
  return [rng.permutation(np.concatenate([pieces[s] for s in ids])) for ids in dealt]


def partition(
    labels: np.ndarray,
    scheme: str,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = DIRICHLET_MIN_SIZE,
) -> list[np.ndarray]:
  """Splits sample indices across clients by `scheme` (one of SCHEMES).

  `alpha`/`min_size` apply to "dirichlet" and `classes_per_client` to "shards" only.
  """
  if scheme not in SCHEMES:
    raise ValueError(f"unknown partition scheme {scheme!r}; accepted: {', '.join(SCHEMES)}")
  labels = _check_labels(labels)
  _check_num_clients(labels, num_clients)
  _check_seed(seed)
  if scheme == "dirichlet":
    _check_alpha(alpha)
    _check_min_size(labels, num_clients, min_size)
    return dirichlet(labels, num_clients, alpha, seed, min_size)
  if scheme == "shards":
    _check_classes_per_client(labels, num_clients, classes_per_client)
    return shards(labels, num_clients, classes_per_client, seed)
  if scheme == "iid_imbalanced":
    return iid_imbalanced(labels, num_clients, seed)
  return iid(labels, num_clients, seed)


def held_out_size(size: int, fraction: float) -> int:
  """How many of a client's ``size`` samples `hold_out` keeps back: ceil(fraction * size) (rounded to 9 digits
  first, so that 0.1 * 30 is 3, not 4)."""
  return math.ceil(round(fraction * size, 9))


def hold_out(parts: Sequence[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Every client's samples split once into a training part and a held-out part of `held_out_size` samples, drawn
  without replacement from ``seed`` and the client's id (a client's split does not depend on the others'); both
  parts keep the client's order. ValueError naming the first client whose split would leave it no training
  sample (``fraction`` in (0, 1) needs at least 2 samples per client, more for a larger fraction)."""
  if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
    raise TypeError(f"hold_out's fraction must be a number in (0, 1), got {fraction!r}")
  if not 0 < fraction < 1:
    raise ValueError(f"--client-eval-fraction must be in (0, 1), got {fraction}")
  _check_seed(seed)
  train, held = [], []
  for client, part in enumerate(parts):
    part = check_sample_ids(f"parts[{client}]", part)
    count = held_out_size(len(part), fraction)
    if count < 1 and len(part):
      raise ValueError(f"--client-eval-fraction {fraction:g} holds out none of client {client}'s {len(part)} samples "
                       "(the fraction of them rounds to 0 at 9 digits), so it would have no held-out accuracy: use "
                       "a larger fraction")
    if len(part) - count < 1:
      raise ValueError(f"--client-eval-fraction {fraction:g}: client {client} holds {len(part)} sample"
                       f"{'s' if len(part) != 1 else ''}; holding out {count} of them leaves it none to train on "
                       "(use a smaller fraction, fewer clients or more samples)")
    chosen = np.zeros(len(part), bool)
    chosen[np.random.default_rng([seed, 5, client]).permutation(len(part))[:count]] = True
    train.append(part[~chosen])
    held.append(part[chosen])
  return train, held


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
  """[num_clients, num_classes] int64 matrix of per-client label counts."""
  labels = _check_labels(labels)
  if labels.size and labels.max() >= num_classes:
    raise ValueError(f"labels must be < num_classes={num_classes}, got {labels.max()}")
  counts = np.zeros((len(parts), num_classes), dtype=np.int64)
  for i, part in enumerate(parts):
    ids = check_sample_ids(f"parts[{i}]", part, len(labels), "samples of labels")
    counts[i] = np.bincount(labels[ids], minlength=num_classes)
  return counts


def partition_report(
    labels: np.ndarray, parts: list[np.ndarray], num_classes: int, max_rows: int = 20
) -> str:
  """Human-readable summary: client sizes, classes per client, per-client class counts."""
  counts = class_counts(labels, parts, num_classes)
  sizes = counts.sum(axis=1)
  lines = [
      f"clients: {len(parts)}    samples assigned: {int(sizes.sum())} / {len(labels)}",
      f"client size: min {sizes.min()}  median {np.median(sizes):g}  max {sizes.max()}",
      f"classes per client (count > 0): mean {(counts > 0).sum(axis=1).mean():.2f}",
      "",
  ]
  width = max(5, len(str(counts.max())) + 1)
  lines.append(f"{'client':>6} {'size':>7} | " + "".join(f"{k:>{width}}" for k in range(num_classes)))
  for i in range(min(len(parts), max_rows)):
    lines.append(f"{i:>6} {sizes[i]:>7} | " + "".join(f"{c:>{width}}" for c in counts[i]))
  if len(parts) > max_rows:
    lines.append(f"... showing the first {max_rows} of {len(parts)} clients")
  return "\n".join(lines)


def plot_partition(
    counts: np.ndarray, path: str, title: str = "Label distribution across clients"
) -> None:
  """Saves a bubble plot (x: client, y: class, area ~ count) of a [clients, classes] matrix as PNG."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator

  counts = np.asarray(counts)
  if counts.ndim != 2:
    raise ValueError(f"counts must be [num_clients, num_classes], got shape {counts.shape}")
  num_clients, num_classes = counts.shape
  clients, classes = np.nonzero(counts)
  values = counts[clients, classes]
  # Largest bubble ~ 300 pt^2, shrinking as the plot gets crowded.
  max_area = 300.0 * min(1.0, 30.0 / max(num_clients, num_classes, 1))
  areas = max_area * values / max(values.max(initial=0), 1)

  width = min(max(4.0, 0.25 * num_clients + 2.0), 24.0)
  height = min(max(3.0, 0.3 * num_classes + 1.5), 16.0)
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)  # Attaches an Agg canvas without touching pyplot's global backend.
  ax = fig.add_subplot()
  ax.scatter(clients, classes, s=areas, alpha=0.6, edgecolors="none")
  ax.set_xlim(-1, num_clients)
  ax.set_ylim(-1, num_classes)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.yaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("client")
  ax.set_ylabel("class")
  ax.set_title(title)
  ax.grid(True, linewidth=0.3, alpha=0.5)
  # Margins in inches, fixed: `tight_layout` measures the texts by drawing the figure once more (a third of the time).
  fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.55 / height, top=1 - 0.35 / height)
  fig.savefig(path, format="png", dpi=100)


def load_partition_file(path: str) -> list[np.ndarray]:
  """Clients' sample indices from a file, client 0 first: an ``.npz`` holding one 1-D integer array per client
  under the keys "0", "1", ..., "K-1", or a ``.json`` list of K lists of integers. A client's indices are kept in
  the file's order; they may cover only part of the training set. Raises ValueError on a malformed file."""
  if path.endswith(".npz"):
    if not zipfile.is_zipfile(path):  # np.load would read a .npy or a pickle as well
      raise ValueError("is not an .npz file (not a zip archive)")
    try:
      with np.load(path, allow_pickle=False) as saved:
        expected = [str(c) for c in range(len(saved.files))]
        if set(saved.files) != set(expected):
          raise ValueError(f"an .npz partition needs the keys 0..{len(expected) - 1}, one per client, got "
                           f"{', '.join(sorted(saved.files)[:5])}{', ...' if len(expected) > 5 else ''}")
        parts = [saved[k] for k in expected]
    except (OSError, EOFError, zipfile.BadZipFile) as e:
      raise ValueError(f"cannot be read as an .npz file ({type(e).__name__}: {e})") from e
  elif path.endswith(".json"):
    with open(path) as f:
      parts = json.load(f)
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
      raise ValueError("a .json partition must be a list with one list of sample indices per client")
    if not all(isinstance(i, int) and not isinstance(i, bool) for p in parts for i in p):
      raise ValueError("a .json partition's sample indices must be integers")
    _check_int64(parts)
    parts = [np.asarray(p, np.int64) for p in parts]
  else:
    raise ValueError("a partition file must end in .npz (one array per client, keys 0..K-1) or .json "
                     "(a list of lists)")
  for client, part in enumerate(parts):
    if part.ndim != 1 or not np.issubdtype(part.dtype, np.integer):
      raise ValueError(f"client {client}'s indices must be a 1-D integer array, got {part.dtype} {part.shape}")
    if part.size == 0:
      raise ValueError(f"client {client} has no samples")
    if part.dtype == np.uint64:
      _check_int64([[part.max()]], client)
  return [part.astype(np.int64) for part in parts]


def _check_int64(parts: Sequence[Sequence[int]], first_client: int = 0) -> None:
  """Every index fits an int64 (ValueError naming the client and the index, not numpy's OverflowError)."""
  for client, part in enumerate(parts, first_client):
    bad = next((int(i) for i in part if not -2 ** 63 <= int(i) < 2 ** 63), None)
    if bad is not None:
      raise ValueError(f"client {client} holds sample index {bad}, outside the range of a 64-bit integer (no training "
                       "set has that many samples)")


def save_partition_file(path: str, parts: list[np.ndarray]) -> None:
  """Writes ``parts`` as `load_partition_file` reads an ``.npz`` (``path`` must end in .npz)."""
  if not path.endswith(".npz"):
    raise ValueError(f"the partition file must end in .npz, got {path!r}")
  parts = [check_sample_ids(f"parts[{client}]", part) for client, part in enumerate(parts)]
  np.savez_compressed(path, **{str(c): np.asarray(p, np.int64) for c, p in enumerate(parts)})
