"""FedIN's pieces as pure functions (Chan, Jiang, Deng, Ngai: "FedIN: Federated Intermediate Layers
Learning for Model Heterogeneity"; the method and its open choices are read in the project's FedIN spec).

Every model is split into an extractor E, intermediate layers I and a classifier C, so that
``logits = C(I(E(x)))``. Clients upload, besides their update, one batch of feature pairs
``(s_in, s_out) = (E(x), I(E(x)))``; the server keeps them in a feature bank and sends every sampled
client the same batch S of pairs each round. Local training adds the IN loss ``MSE(I(s_in), s_out)``
on S (Eq. 8), which reaches I only, and combines its gradient with the local one (Eq. 14 by default).

Choices where the paper is silent (each is a `FedINConfig` field or documented here):

* the gradient rule (``rule``): ``"eq14"`` is Z = G_IN + (lambda/2) G_local with lambda = 1, what
  the paper's experiments use; ``"project"`` is Eq. 13, G_IN projected onto the half-space
  {Z : <Z, G_local> >= 0}, per tensor or over all of I (``projection``) -- on E and C, which G_IN does
  not reach, Z is G_local (Eq. 13 read literally would freeze them); ``"sum"`` is G_IN + G_local, the
  plain sum of the ablation without the gradient rule. The paper describes that ablation ("w/o Opt")
  as a step on G_local followed by one on G_IN; the sum is one step with both.
* the bank (``bank``): ``"latest"`` holds the latest round's pairs (the default: stale features
  regress onto a target the current I no longer produces); ``"history"`` keeps every round's pairs in a
  ring buffer of ``bank_capacity`` pairs, the oldest overwritten first.
* S is ``num_pairs`` pairs (the paper: one batch, 16) drawn without replacement; from a bank smaller
  than that they are drawn with replacement.
* the uploaded pairs are those of the client's last local batch, detached (the spec's default).
* a client's pairs with a non-finite value are left out of the bank, and counted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_hetero.config.options import (BANK_CAPACITY, BANK_MODES, NUM_PAIRS, PROJECTIONS,  # re-exported
                                          RULES, FedINConfig)

class FeaturePairs(NamedTuple):
  """A batch of feature pairs; ``valid`` marks the rows in use."""

  s_in: jax.Array  # [N, *E output]
  s_out: jax.Array  # [N, *I output]
  valid: jax.Array  # bool [N]


class FeatureBank(NamedTuple):
  """The server's feature pairs, a ring buffer (``next`` is the slot the next pair goes to), and the batch
  S that every client of the next round regresses on (``ready`` is False until the bank has a pair)."""

  pairs: FeaturePairs
  next: jax.Array  # int
  batch: FeaturePairs
  ready: jax.Array  # bool


def empty_pairs(num: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> FeaturePairs:
  return FeaturePairs(jnp.zeros((num,) + tuple(in_shape)), jnp.zeros((num,) + tuple(out_shape)),
                      jnp.zeros((num,), bool))


def empty_bank(capacity: int, num_pairs: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> FeatureBank:
  return FeatureBank(empty_pairs(capacity, in_shape, out_shape), jnp.int32(0),
                     empty_pairs(num_pairs, in_shape, out_shape), jnp.bool_(False))


def in_loss(prediction: jax.Array, target: jax.Array) -> jax.Array:
  """Eq. 8: the mean squared error over all elements (PyTorch's default reduction)."""
  return jnp.mean(jnp.square(prediction - target))


def finite_rows(pairs: FeaturePairs) -> jax.Array:
  """bool [clients]: whether each client's rows (pairs stacked ``[clients, B, ...]``) are all finite."""
  finite = lambda x: jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
  return finite(pairs.s_in) & finite(pairs.s_out)


def add_to_bank(bank: FeaturePairs, next_slot: jax.Array, new: FeaturePairs, mode: str
                ) -> tuple[FeaturePairs, jax.Array]:
  """The bank after this round's valid pairs ``new`` (flat rows): ``"latest"`` replaces it by them (unless
  none is valid, when it keeps the last round's); ``"history"`` writes them into the ring buffer."""
  capacity = bank.valid.shape[0]
  order = jnp.argsort(~new.valid, stable=True)  # valid rows first, in their order
  count = new.valid.sum()
  taken = min(capacity, new.valid.shape[0])
  rows = jax.tree.map(lambda x: x[order[:taken]], new)
  rows = rows._replace(valid=rows.valid & (jnp.arange(taken) < count))
  if mode == "latest":
    fresh = jax.tree.map(lambda x, r: jnp.zeros_like(x).at[:taken].set(r), bank, rows)
    kept = jax.tree.map(lambda a, b: jnp.where(count > 0, a, b), fresh, bank)
    return kept, jnp.int32(0)
  slots = (next_slot + jnp.arange(taken)) % capacity
  slots = jnp.where(rows.valid, slots, capacity)  # out of range: dropped
  written = jax.tree.map(lambda x, r: x.at[slots].set(r, mode="drop"), bank, rows)
  return written, (next_slot + jnp.minimum(count, taken)) % capacity


def sample_batch(bank: FeaturePairs, num: int, key: jax.Array) -> FeaturePairs:
  """S: ``num`` of the bank's valid pairs, drawn without replacement, or with replacement when it holds
  fewer; all rows invalid if the bank is empty."""
  count = bank.valid.sum()
  noise = jax.random.uniform(key, bank.valid.shape)
  order = jnp.argsort(jnp.where(bank.valid, noise, 2.0))  # valid pairs first, shuffled
  draws = jax.random.randint(jax.random.fold_in(key, 1), (num,), 0, jnp.maximum(count, 1))
  picks = jnp.where(count >= num, order[jnp.arange(num) % order.shape[0]], order[draws])
  batch = jax.tree.map(lambda x: x[picks], bank)
  return batch._replace(valid=batch.valid & (count > 0))


def combine(g_in, g_local, config: FedINConfig = FedINConfig()):
  """Z from the IN and the local gradient (pytrees of one structure).

  ``"eq14"``: Z = G_IN + (lam / 2) G_local (Eq. 14). ``"sum"``: Z = G_IN + G_local. ``"project"``: on
  the tensors G_IN reaches (I's: exactly zero elsewhere, and everywhere while the bank is empty),
  Z = G_IN - min(0, b) / a * G_local with a = <G_local, G_local> and b = <G_local, G_IN> (Eq. 13), per
  tensor or over all of them; on the other tensors (E and C) Z = G_local.
  """
  if config.rule == "eq14":
    return jax.tree.map(lambda i, g: i + config.lam / 2 * g, g_in, g_local)
  if config.rule == "sum":
    return jax.tree.map(jnp.add, g_in, g_local)
  reached = jax.tree.map(lambda i: jnp.any(i != 0), g_in)

  def project(i, g, a, b, m):
    return jnp.where(m, i - jnp.minimum(b, 0.0) / jnp.where(a > 0, a, 1.0) * g, g)

  if config.projection == "global":
    terms = lambda f: sum(jnp.where(m, f(i, g), 0.0) for i, g, m in
                          zip(jax.tree.leaves(g_in), jax.tree.leaves(g_local), jax.tree.leaves(reached)))
    a, b = terms(lambda i, g: jnp.vdot(g, g)), terms(lambda i, g: jnp.vdot(g, i))
    return jax.tree.map(lambda i, g, m: project(i, g, a, b, m), g_in, g_local, reached)
  return jax.tree.map(lambda i, g, m: project(i, g, jnp.vdot(g, g), jnp.vdot(g, i), m), g_in, g_local, reached)
