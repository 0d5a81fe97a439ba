"""Clustered sampling (Fraboni et al., "Clustered Sampling: Low-Variance and
Improved Representativity for Clients Selection in Federated Learning", ICML 2021).

Client importance is ``p_i = n_i / n``. Clustered sampling builds ``m``
distributions ``r_k`` over the clients (``m`` = clients per round) with

  sum_i r_{k,i} = 1 for every k,   sum_k r_{k,i} = m * p_i for every client i,

and draws one client from each. Every client is then selected ``m * p_i``
times in expectation, as under multinomial sampling with ``m`` draws from
``p``, so weighting every draw by ``1/m`` gives an unbiased aggregate
(Sec. 3 of the paper), while grouping similar clients into one distribution
lowers its variance.

* Algorithm 1 groups clients by sample size only: clients in decreasing
  ``n_i`` fill the distributions one after another, a client split over two
  distributions where one fills up.
* Algorithm 2 (the variant the FedCross paper uses as "CluSamp") groups
  clients whose *representative gradients* (``theta_i^local - theta^sent`` of
  the client's last participation) are similar: Ward linkage on the rows of
  the N x N dissimilarity matrix, the dendrogram cut into the coarsest
  clusters of total importance at most ``1/m`` each, the ``m`` heaviest
  clusters seeding one distribution each and the clients of the remaining
  clusters filling the distributions' leftover mass as in Algorithm 1.

All bookkeeping is done in exact integer units: client ``i`` carries mass
``m * n_i`` and every distribution holds ``n``, so the two identities above
hold exactly rather than to a rounding tolerance.

Host-side (numpy + scipy); `flatten_update` is the on-device helper that turns
a pytree update into the 1-D vector `ClusteredSampler.update` stores.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from fedjax_hetero.config.methods import SIMILARITIES
from fedjax_hetero.validation import check_integer

COLD_STARTS = ("zeros", "algorithm1")
AGGREGATION_SCHEMES = ("uniform", "size")

# Rows of one block of the distance computation: bounds the temporary to about
# this many elements whatever the model size.
_BLOCK_ELEMENTS = 1 << 24


def flatten_update(tree: Any) -> jax.Array:
  """All leaves of ``tree`` raveled into one 1-D array (``ravel_pytree`` order).

  The representative gradient of Algorithm 2 is the flattened difference
  between a client's trained parameters and the parameters it was sent, e.g.
  ``flatten_update(tree_sub(local["params"], sent["params"]))``.
  """
  return ravel_pytree(tree)[0]


def pairwise_dissimilarity(a: np.ndarray, b: np.ndarray, similarity: str = "L1") -> np.ndarray:
  """Dissimilarities between the rows of ``a`` [P, D] and ``b`` [Q, D], as a [P, Q] float64 array.

  As in Fraboni et al.'s released code: "L1" is ``sum |a - b|``, "L2" the
  *squared* Euclidean distance, and "arccos" the angle ``arccos(cos(a, b))``,
  defined as 0 when either vector is zero (so a client that never trained is
  at angle 0 from everyone).
  """
  if similarity not in SIMILARITIES:
    raise ValueError(f"unknown similarity {similarity!r}; expected one of {SIMILARITIES}")
  a = np.asarray(a)
  b = np.asarray(b)
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"a and b must be [P, D] and [Q, D] arrays of the same D (rows of updates), got shapes "
                     f"{a.shape} and {b.shape}")
  out = np.empty((a.shape[0], b.shape[0]), np.float64)
  rows = max(1, _BLOCK_ELEMENTS // max(1, b.shape[1]))
  if similarity == "arccos":
    a_norm = np.sqrt(np.einsum("pd,pd->p", a, a, dtype=np.float64))
    b_norm = np.sqrt(np.einsum("qd,qd->q", b, b, dtype=np.float64))
  for p in range(a.shape[0]):
    for start in range(0, b.shape[0], rows):
      block = b[start:start + rows]
      if similarity == "L1":
        out[p, start:start + rows] = np.abs(block - a[p]).sum(axis=1, dtype=np.float64)
      elif similarity == "L2":
        out[p, start:start + rows] = np.square(block - a[p]).sum(axis=1, dtype=np.float64)
      else:  # float64: the angle between nearly parallel updates hinges on the dot product's last digits
        denom = a_norm[p] * b_norm[start:start + rows]
        dots = block.astype(np.float64) @ a[p].astype(np.float64)
        cos = np.divide(dots, denom, out=np.ones_like(denom), where=denom > 0)
        out[p, start:start + rows] = np.arccos(np.clip(cos, -1.0, 1.0))
  return out


def _fill(distributions: np.ndarray, order: Sequence[int], mass: np.ndarray, capacity: int) -> None:
  """Pours each client's mass, in ``order``, into the first distributions with room left (in place)."""
  k = 0
  for client in order:
    left = int(mass[client])
    while left > 0:
      while distributions[k].sum() >= capacity:
        k += 1
      take = min(left, capacity - int(distributions[k].sum()))
      distributions[k, client] += take
      left -= take


def _check_sizes(sizes: Any) -> np.ndarray:
  """Clients' sample counts: a 1-D array of integers >= 0, not all 0."""
  values = np.asarray(sizes)
  if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
    raise ValueError(f"sizes must be a 1-D array of integer sample counts, one per client, got {values.dtype} "
                     f"{values.shape}")
  if values.size and values.min() < 0:
    raise ValueError(f"sizes holds {int(values.min())} (client {int(values.argmin())}); a sample count is >= 0")
  if values.sum() <= 0:
    raise ValueError(f"sizes must count at least one sample (the importances are sizes / sizes.sum()), got "
                     f"{values.tolist()[:8]}")
  return values.astype(np.int64)


def size_clusters(sizes: np.ndarray, num_sampled: int) -> np.ndarray:
  """Algorithm 1 (sample-size clustering): the ``m`` distributions in integer units [m, N].

  Row k, divided by ``sizes.sum()``, is ``r_k``. Clients are poured in
  decreasing size (ties by id), so most clients sit in a single distribution.
  """
  sizes = _check_sizes(sizes)
  check_integer("num_sampled", num_sampled, minimum=1)
  mass = num_sampled * sizes
  distributions = np.zeros((num_sampled, len(sizes)), np.int64)
  order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  _fill(distributions, order, mass, int(sizes.sum()))
  return distributions


def weight_clusters(linkage: np.ndarray, sizes: np.ndarray, num_sampled: int) -> list[list[int]]:
  """The dendrogram cut of Algorithm 2: the coarsest clusters of importance at most ``1/m``.

  Walking down from the root, a node becomes a cluster as soon as its clients'
  total importance is at most ``1/m`` (``m * sum n_i <= n``); a single client
  heavier than that is a cluster on its own. Returns the clusters as sorted
  client-id lists. Equivalent to ``fcluster`` on the linkage whose merge
  heights are replaced by the merged importances, at threshold ``1/m``.
  """
  sizes = _check_sizes(sizes)
  num_clients, total = len(sizes), int(sizes.sum())
  weight = list(sizes) + [0] * (num_clients - 1)
  children = {}
  for t, (left, right) in enumerate(linkage[:, :2].astype(np.int64)):
    node = num_clients + t
    children[node] = (int(left), int(right))
    weight[node] = weight[left] + weight[right]
  clusters, stack = [], [2 * num_clients - 2]
  while stack:
    node = stack.pop()
    if node < num_clients or num_sampled * weight[node] <= total:
      clusters.append(sorted(_leaves(node, children, num_clients)))
    else:
      stack.extend(children[node])
  return clusters


def _leaves(node: int, children: dict[int, tuple[int, int]], num_clients: int) -> list[int]:
  out, stack = [], [node]
  while stack:
    node = stack.pop()
    if node < num_clients:
      out.append(node)
    else:
      stack.extend(children[node])
  return out


def similarity_clusters(dissimilarity: np.ndarray, sizes: np.ndarray, num_sampled: int) -> np.ndarray:
  """Algorithm 2 (similarity clustering): the ``m`` distributions in integer units [m, N].

  Ward linkage treats the rows of the dissimilarity matrix as feature vectors
  (``linkage(matrix, "ward")``, as the FedCross baseline code does). The ``m``
  heaviest clusters each seed one distribution (a seed heavier than one
  distribution spills its excess first); the remaining clusters, lightest
  first, then fill what is left. Ties are broken by smallest client id, and
  clients within a cluster are poured in id order, so the result is a pure
  function of the inputs (the released code shuffles them).
  """
  sizes = _check_sizes(sizes)
  num_clients, capacity = len(sizes), int(sizes.sum())
  if num_clients == 1:
    return np.full((num_sampled, 1), capacity, np.int64)
  with warnings.catch_warnings():  # the square matrix "looks like" a distance matrix; it is used as features
    from scipy.cluster import hierarchy  # (here, not above: it takes half a second of every command's start)
    warnings.simplefilter("ignore", hierarchy.ClusterWarning)
    linkage = hierarchy.linkage(np.asarray(dissimilarity, np.float64), "ward")
  clusters = weight_clusters(linkage, sizes, num_sampled)
  clusters.sort(key=lambda c: (-int(sizes[c].sum()), c[0]))
  mass = num_sampled * sizes
  distributions = np.zeros((num_sampled, num_clients), np.int64)
  spill = np.zeros_like(mass)
  for k, cluster in enumerate(clusters[:num_sampled]):
    for client in cluster:
      room = capacity - int(distributions[k].sum())
      distributions[k, client] = min(int(mass[client]), room)
      spill[client] = mass[client] - distributions[k, client]
  rest = [c for cluster in reversed(clusters[num_sampled:]) for c in cluster]
  spilled = [c for c in range(num_clients) if spill[c] > 0]
  _fill(distributions, spilled + rest, np.where(spill > 0, spill, mass), capacity)
  return distributions


class ClusteredSampler:
  """Clustered sampling by representative-gradient similarity (Fraboni et al. 2021, Algorithm 2).

  Args:
    sizes: sample count ``n_i`` of every client (importance ``p_i = n_i / n``).
    clients_per_round: ``m``, the number of distributions and of draws per round.
    seed: with the round index, fixes the draws (``default_rng([seed, round])``).
    similarity: "L1" (default: the FedCross framework's default, which the
      paper does not override), "L2" (squared Euclidean) or "arccos" (angle).
    cold_start: how to sample before any update is stored. "zeros" (default,
      as the spec and the FedCross framework): every representative gradient
      starts at zero and Algorithm 2 runs on the all-zero matrix, which groups
      clients by importance alone. "algorithm1": use Algorithm 1 until the
      first `update`.

  Representative gradients of clients that have not trained yet stay zero.
  Draws are independent across distributions, so a client split over two
  distributions can be drawn twice in one round (Fraboni et al. allow this;
  each draw then counts once in the aggregate). `sample` returns the draws in
  distribution order, length ``m``, possibly with repeats.
  """

  def __init__(self, sizes: Sequence[int] | np.ndarray, clients_per_round: int, seed: int,
               similarity: str = "L1", cold_start: str = "zeros"):
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or len(sizes) == 0:
      raise ValueError(f"sizes must be a non-empty 1-D array, got shape {sizes.shape}")
    if not np.all(np.equal(np.mod(sizes, 1), 0)) or np.any(sizes < 0) or sizes.sum() <= 0:
      raise ValueError("sizes must be non-negative integer sample counts with a positive total")
    if clients_per_round < 1:
      raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
    if similarity not in SIMILARITIES:
      raise ValueError(f"unknown similarity {similarity!r}; expected one of {SIMILARITIES}")
    if cold_start not in COLD_STARTS:
      raise ValueError(f"unknown cold_start {cold_start!r}; expected one of {COLD_STARTS}")
    self.sizes = sizes.astype(np.int64)
    self.clients_per_round = int(clients_per_round)
    self.seed = int(seed)
    self.similarity = similarity
    self.cold_start = cold_start
    self._gradients: np.ndarray | None = None  # [N, D], allocated at the first update
    self._dissimilarity = np.zeros((self.num_clients,) * 2, np.float64)
    self._units: np.ndarray | None = None  # cached distributions in integer units

  @property
  def num_clients(self) -> int:
    return len(self.sizes)

  @property
  def has_gradients(self) -> bool:
    return self._gradients is not None

  def update(self, client_ids: Sequence[int] | np.ndarray, flat_updates: Any) -> None:
    """Stores the representative gradients [len(client_ids), D] of this round's clients.

    A client listed twice keeps its last row. Only the changed rows and
    columns of the dissimilarity matrix are recomputed.
    """
    ids = np.asarray(client_ids, np.int64).reshape(-1)
    updates = np.asarray(flat_updates, np.float32)
    if updates.ndim != 2 or updates.shape[0] != len(ids):
      raise ValueError(f"flat_updates must be [len(client_ids)={len(ids)}, D], got shape {updates.shape}")
    if np.any((ids < 0) | (ids >= self.num_clients)):
      raise ValueError(f"client ids must lie in [0, {self.num_clients})")
    if self._gradients is None:
      self._gradients = np.zeros((self.num_clients, updates.shape[1]), np.float32)
    elif updates.shape[1] != self._gradients.shape[1]:
      raise ValueError(f"update length {updates.shape[1]} differs from the stored {self._gradients.shape[1]}")
    for client, row in zip(ids, updates):
      self._gradients[client] = row
    changed = np.unique(ids)
    rows = pairwise_dissimilarity(self._gradients[changed], self._gradients, self.similarity)
    self._dissimilarity[changed, :] = rows
    self._dissimilarity[:, changed] = rows.T
    self._dissimilarity[changed, changed] = 0.0
    self._units = None

  def dissimilarity_matrix(self) -> np.ndarray:
    """The current N x N dissimilarity matrix (a copy)."""
    return self._dissimilarity.copy()

  def _distribution_units(self) -> np.ndarray:
    if self._units is None:
      if self._gradients is None and self.cold_start == "algorithm1":
        self._units = size_clusters(self.sizes, self.clients_per_round)
      else:
        self._units = similarity_clusters(self._dissimilarity, self.sizes, self.clients_per_round)
    return self._units

  def distributions(self) -> np.ndarray:
    """The ``m`` sampling distributions ``r_k`` as a float64 [m, N] array (rows sum to 1)."""
    return self._distribution_units() / float(self.sizes.sum())

  def sample(self, round_index: int) -> np.ndarray:
    """One client id drawn from each ``r_k``: int64 [m], in distribution order, repeats possible.

    Deterministic given (seed, round_index) and the updates stored so far.
    """
    units = self._distribution_units()
    rng = np.random.default_rng([self.seed, int(round_index)])
    # Inverse-CDF draw on the integer masses: client j owns [cum_{j-1}, cum_j), so
    # zero-mass clients are never drawn.
    targets = rng.integers(0, int(self.sizes.sum()), size=self.clients_per_round)
    cumulative = np.cumsum(units, axis=1)
    return np.array([np.searchsorted(c, t, side="right") for c, t in zip(cumulative, targets)], np.int64)

  def aggregation_weights(self, client_ids: Sequence[int] | np.ndarray, scheme: str = "uniform") -> np.ndarray:
    """Aggregation weights of this round's draws (float64, sums to 1).

    "uniform": ``1/m`` per draw, Fraboni et al.'s unbiased weighting.
    "size": ``n_i / sum of the drawn n_j``, the FedCross framework's
    sample-weighted average (spec, CluSamp step 5). A repeated client counts
    once per draw under both.
    """
    ids = np.asarray(client_ids, np.int64).reshape(-1)
    if scheme == "uniform":
      return np.full(len(ids), 1.0 / len(ids))
    if scheme == "size":
      n = self.sizes[ids].astype(np.float64)
      return n / n.sum()
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {AGGREGATION_SCHEMES}")


__all__ = [
    "AGGREGATION_SCHEMES", "COLD_STARTS", "ClusteredSampler", "flatten_update",
    "pairwise_dissimilarity", "similarity_clusters", "size_clusters", "weight_clusters",
]
