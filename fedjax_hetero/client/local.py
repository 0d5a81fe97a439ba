"""A client's local training: shuffled, batched, masked, on the device.

The client's whole schedule (which sample goes in which slot of which step, and
whether the slot is real) is drawn on the device from its padded index row, so
no data leaves the device. Steps run in jitted *chunks* of fully unrolled
steps: XLA:CPU runs convolutions inside a while loop (or a ``lax.cond``) about
ten times slower than the same ops unrolled, and a chunk loop on the host costs
one dispatch per chunk (see DESIGN.md, performance facts). A client's step count
is covered exactly by chunks of ``steps_per_call`` steps followed by
power-of-two chunks (e.g. 19 = 8 + 8 + 2 + 1), so no padded step is computed
on the sequential path. A step whose batch holds no real example (vmapped
cohorts of unequal clients) leaves the whole state untouched, optimizer included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_hetero.hetero.maps import Variables

OPTIMIZERS = ("sgd", "adam")


@dataclasses.dataclass(frozen=True)
class LocalConfig:
  """How each client trains in a round (a fresh optimizer every round)."""

  epochs: int = 1
  batch_size: int = 64
  optimizer: str = "adam"
  learning_rate: float = 1e-3
  momentum: float = 0.0
  weight_decay: float = 0.0
  drop_last: bool = False
  steps_per_call: int = 8
  prox_mu: float = 0.0  # FedProx's mu; 0 trains on the plain cross-entropy

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    for name in ("epochs", "batch_size", "steps_per_call"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
    if not 0 <= self.prox_mu < float("inf"):
      raise ValueError(f"prox_mu must be finite and >= 0, got {self.prox_mu}")

  def steps_per_epoch(self, num_examples: int) -> int:
    if self.drop_last:
      return num_examples // self.batch_size
    return -(-num_examples // self.batch_size)

  def num_steps(self, num_examples: int) -> int:
    return self.epochs * self.steps_per_epoch(num_examples)

  def chunk_sizes(self, num_steps: int) -> list[int]:
    """Unrolled chunk lengths covering ``num_steps`` exactly: full chunks, then powers of two."""
    full, rest = divmod(num_steps, self.steps_per_call)
    sizes = [self.steps_per_call] * full
    size = 1 << max(self.steps_per_call.bit_length() - 1, 0)
    while rest:
      if size <= rest:
        sizes.append(size)
        rest -= size
      size >>= 1
    return sizes


def make_optimizer(config: LocalConfig) -> optax.GradientTransformation:
  if config.optimizer == "adam":
    tx = optax.adam(config.learning_rate)
  else:
    tx = optax.sgd(config.learning_rate, momentum=config.momentum or None)
  if config.weight_decay:
    tx = optax.chain(optax.add_decayed_weights(config.weight_decay), tx)
  return tx


class LocalState(NamedTuple):
  variables: Variables
  opt_state: Any
  loss_sum: jax.Array  # summed per-example cross-entropy over real examples seen (no proximal term)
  num_examples: jax.Array
  anchor: Variables | None = None  # FedProx's w^t: the params the client started from; None if prox_mu == 0


def normalize(images: jax.Array, mean: tuple[float, ...], std: tuple[float, ...]) -> jax.Array:
  x = images.astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean cross-entropy over real examples, and the summed loss."""
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels) * mask
  total = per_example.sum()
  return total / jnp.maximum(mask.sum(), 1.0), total


def proximal_term(params: Variables, anchor: Variables, mu: float) -> jax.Array:
  """FedProx's proximal term (Li et al. 2020, Eq. 2): ``mu/2 ||w - w^t||^2`` over all leaves of ``params``."""
  squares = jax.tree.map(lambda p, a: jnp.sum(jnp.square(p - a)), params, anchor)
  return 0.5 * mu * sum(jax.tree.leaves(squares))


def draw_schedule(index_row: jax.Array, num_examples: jax.Array, key: jax.Array, *, epochs: int,
                  batch_size: int, num_steps: int, drop_last: bool) -> tuple[jax.Array, jax.Array]:
  """Sample ids and realness masks of every step of one client's local training.

  Each epoch is a fresh permutation of the client's ``num_examples`` samples;
  steps are packed epoch after epoch, and steps past the client's own count are
  all-masked. Returns ``(ids [num_steps, B], mask [num_steps, B])``.
  """
  max_n = index_row.shape[0]
  if drop_last:
    per_epoch = num_examples // batch_size
  else:
    per_epoch = (num_examples + batch_size - 1) // batch_size

  def permutation(k):
    noise = jax.random.uniform(k, (max_n,))
    return jnp.argsort(jnp.where(jnp.arange(max_n) < num_examples, noise, 2.0))

  perms = jax.vmap(permutation)(jax.random.split(key, epochs))
  step = jnp.arange(num_steps)
  safe = jnp.maximum(per_epoch, 1)
  epoch, within = step // safe, step % safe
  active = step < epochs * per_epoch
  position = within[:, None] * batch_size + jnp.arange(batch_size)[None, :]
  mask = (position < num_examples) & active[:, None]
  local = perms[jnp.clip(epoch, 0, epochs - 1)[:, None], jnp.clip(position, 0, max_n - 1)]
  return index_row[local], mask


@dataclasses.dataclass(frozen=True, eq=False)
class LocalTrainer:
  """The pieces of local training for one architecture group (pure; jitted by backends)."""

  model: nn.Module
  config: LocalConfig
  mean: tuple[float, ...]
  std: tuple[float, ...]

  @property
  def tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.config)

  def init_state(self, variables: Variables) -> LocalState:
    """A client's state at the start of a round; the start params are FedProx's anchor when ``prox_mu > 0``."""
    zero = jnp.zeros((), jnp.float32)
    anchor = variables["params"] if self.config.prox_mu else None
    return LocalState(variables, self.tx.init(variables["params"]), zero, zero, anchor)

  def train_step(self, state: LocalState, images: jax.Array, labels: jax.Array, mask: jax.Array) -> LocalState:
    """One masked step on the mean cross-entropy of the real rows, plus FedProx's
    ``mu/2 ||w - w^t||^2`` on ``params`` when ``prox_mu > 0`` (Li et al. 2020, Eq. 2)."""
    x = normalize(images, self.mean, self.std)
    mu = self.config.prox_mu
    if mu and state.anchor is None:
      raise ValueError("prox_mu > 0 needs the anchor in LocalState; build the state with init_state")
    maskf = mask.astype(jnp.float32)
    has_stats = "batch_stats" in state.variables

    def loss_fn(params):
      variables = {**state.variables, "params": params}
      if has_stats:
        logits, updates = self.model.apply(variables, x, train=True, mask=mask, mutable=["batch_stats"])
      else:
        logits, updates = self.model.apply(variables, x, train=True, mask=mask), {}
      loss, total = masked_cross_entropy(logits, labels, maskf)
      if mu:  # a Python-level branch, so prox_mu == 0 traces exactly the plain program
        loss = loss + proximal_term(params, state.anchor, mu)
      return loss, (updates, total)

    (_, (model_updates, total)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.variables["params"])
    updates, opt_state = self.tx.update(grads, state.opt_state, state.variables["params"])
    variables = {**state.variables, **model_updates, "params": optax.apply_updates(state.variables["params"], updates)}
    stepped = LocalState(variables, opt_state, state.loss_sum + total, state.num_examples + maskf.sum(),
                         state.anchor)
    active = maskf.sum() > 0
    return jax.tree.map(lambda new, old: jnp.where(active, new, old), stepped, state)

  def run_steps(self, state: LocalState, images: jax.Array, labels: jax.Array, ids: jax.Array, mask: jax.Array,
                offset: jax.Array, count: int) -> LocalState:
    """Runs schedule steps ``[offset, offset + count)``, unrolled (``count`` is static)."""
    ids = jax.lax.dynamic_slice_in_dim(ids, offset, count)
    mask = jax.lax.dynamic_slice_in_dim(mask, offset, count)
    for i in range(count):
      state = self.train_step(state, images[ids[i]], labels[ids[i]], mask[i])
    return state

  def schedule(self, index_row: jax.Array, num_examples: jax.Array, key: jax.Array, num_steps: int):
    c = self.config
    return draw_schedule(index_row, num_examples, key, epochs=c.epochs, batch_size=c.batch_size,
                         num_steps=num_steps, drop_last=c.drop_last)


def tree_sub(a: Variables, b: Variables) -> Variables:
  return jax.tree.map(jnp.subtract, a, b)


def weighted_add(acc: Variables, tree: Variables, weight: jax.Array) -> Variables:
  return jax.tree.map(lambda a, t: a + weight * t, acc, tree)

