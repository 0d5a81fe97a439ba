"""Per-client evaluation (``--client-eval-fraction``): every client's accuracy on a held-out part of its own data,
with its group's model as the method evaluates it, in evaluation rounds.

The build step splits every client's samples once (`data.hold_out`); the training store holds the training parts,
and `held_out.ClientEval` the held-out parts: per group, the sample ids of its clients' held-out samples (into the
store's images, which hold every sample) and each one's owner, as the client's position among the group's
clients. The evaluation seam of each driver (`rounds.mapping`) counts every client's correct predictions: the
group's model predicts its clients' held-out samples in batches and ``segment_sum`` adds each sample's hit to its
owner. The host loop runs each batch as its own jitted program (as XLA:CPU runs fastest), a device program runs
them as a device loop under the evaluation round's ``lax.cond``. `accuracy_row` turns the counts into the metrics
row's ``client_accuracy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.compilation import program_cache
from fedjax_hetero.data.store import normalize
from fedjax_hetero.rounds.held_out import HeldOut

if TYPE_CHECKING:
  from fedjax_hetero.rounds.body import RoundData
  from fedjax_hetero.rounds.spec import RoundSpec

WORST_SHARE = 0.1  # `worst_10pct`: the mean of this share of a group's clients with the lowest accuracy (at least one)


def _batch_counts(model: Any, mean: tuple[float, ...], std: tuple[float, ...], variables: Any, images: jax.Array,
                  labels: jax.Array, held: HeldOut, start: Any, size: int, num_clients: int) -> jax.Array:
  """Every client's correct predictions among the held-out samples ``start`` to ``start + size``."""
  ids = jax.lax.dynamic_slice_in_dim(held.ids, start, size)
  owners = jax.lax.dynamic_slice_in_dim(held.owners, start, size)
  logits = model.apply(variables, normalize(images[ids], mean, std), train=False)
  hits = (logits.argmax(-1) == labels[ids]).astype(jnp.int32)
  return jax.ops.segment_sum(hits, owners, num_segments=num_clients + 1)[:num_clients]  # (padding: the extra one)


@program_cache
def _batched(model: Any, mean: tuple[float, ...], std: tuple[float, ...], size: int, num_clients: int):
  return jax.jit(lambda variables, images, labels, held, start: _batch_counts(
      model, mean, std, variables, images, labels, held, start, size, num_clients))


def _batches(count: int, batch_size: int) -> tuple[int, int]:
  """The batch size of ``count`` samples' full batches, and where the rest (one smaller batch) starts."""
  size = max(1, min(batch_size, count))
  return size, count - count % size


def host_counts(spec: "RoundSpec", variables: Callable[[int], Any], data: "RoundData", batch_size: int
                ) -> tuple[jax.Array, ...]:
  """Every group's per-client correct predictions, on the host loop: ``variables(g)``, group ``g``'s evaluated
  variables, on its held-out samples, each batch its own jitted program."""
  counts = []
  for g, (group, held) in enumerate(zip(spec.groups, data.held_out)):
    model, clients, total = group.model, len(group.clients), int(held.ids.shape[0])
    size, full = _batches(total, batch_size)
    step, correct = _batched(model, spec.store.mean, spec.store.std, size, clients), jnp.zeros(clients, jnp.int32)
    for start in range(0, full, size):
      correct = correct + step(variables(g), data.images, data.labels, held, start)
    if full < total:
      rest = _batched(model, spec.store.mean, spec.store.std, total - full, clients)
      correct = correct + rest(variables(g), data.images, data.labels, held, full)
    counts.append(correct)
  return tuple(counts)


def program_counts(spec: "RoundSpec", variables: Sequence[Any], data: "RoundData", batch_size: int
                   ) -> tuple[jax.Array, ...]:
  """`host_counts` as one traceable computation (a device loop over the full batches, then the rest), for a
  device program; () without client evaluation."""
  if spec.client_eval is None:
    return ()
  counts = []
  for group, held, group_variables in zip(spec.groups, data.held_out, variables):
    clients, total = len(group.clients), int(held.ids.shape[0])
    size, full = _batches(total, batch_size)
    count = lambda start, n, m=group.model, v=group_variables, h=held, k=clients: _batch_counts(
        m, spec.store.mean, spec.store.std, v, data.images, data.labels, h, start, n, k)
    correct = jax.lax.fori_loop(0, full // size, lambda i, c: c + count(i * size, size), jnp.zeros(clients, jnp.int32))
    counts.append(correct + count(full, total - full) if full < total else correct)
  return tuple(counts)


def summary(accuracies: np.ndarray) -> dict[str, float]:
  """The mean, the worst 10% (the mean of the lowest `WORST_SHARE` of the clients, at least one) and the spread
  (population standard deviation) of clients' accuracies."""
  worst = max(1, int(len(accuracies) * WORST_SHARE))
  return {"mean": float(np.mean(accuracies)), "worst_10pct": float(np.mean(np.sort(accuracies)[:worst])),
          "std": float(np.std(accuracies))}


def accuracy_row(spec: "RoundSpec", counts: Sequence[Any]) -> dict[str, Any]:
  """The row's ``client_accuracy`` from every group's per-client correct predictions: per group its `summary` and
  its clients' accuracies (``clients``, in the order of their ids), and under ``"all"`` the `summary` of every
  client."""
  row, every = {}, []
  for group, correct, sizes in zip(spec.groups, counts, spec.client_eval.sizes):
    accuracies = np.asarray(correct, np.float64) / sizes
    row[group.name] = {**summary(accuracies), "clients": [float(a) for a in accuracies]}
    every.append(accuracies)
  row["all"] = summary(np.concatenate(every))
  return row


def final_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """summary.json's ``final_client_accuracy``: the last evaluation's ``client_accuracy`` without the per-client
  lists (None where no row has one)."""
  last = next((r["client_accuracy"] for r in reversed(rows) if r.get("client_accuracy")), None)
  if last is None:
    return None
  return {name: {k: v for k, v in values.items() if k != "clients"} for name, values in last.items()}
