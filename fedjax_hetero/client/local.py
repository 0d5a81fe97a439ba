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

from fedjax_hetero.algorithms import fedgen
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
  # Client-side pieces of the base methods (InCo paper Table 2; FedCross baselines):
  prox_mu: float = 0.0  # FedProx's mu; 0 trains on the plain cross-entropy
  scaffold: bool = False  # SCAFFOLD's control-variate gradient correction (option II update of c_i)
  moon_mu: float = 0.0  # MOON's weight of the model-contrastive loss; 0: off
  moon_temperature: float = 0.5  # MOON's tau
  normalize_delta: bool = False  # FedNova: upload delta / a_i and a_i (see `nova_normalizer`)
  # FedGen's generative regularizer with this many generated labels per step; 0: off. Needs the trainer's
  # `generator` and the server's generator variables (see `LocalTrainer.init_state`).
  fedgen_batch_size: int = 0

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
    for name in ("epochs", "batch_size", "steps_per_call"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
    for name in ("prox_mu", "moon_mu"):
      if not 0 <= getattr(self, name) < float("inf"):
        raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
    if self.fedgen_batch_size < 0:
      raise ValueError(f"fedgen_batch_size must be >= 0, got {self.fedgen_batch_size}")
    if not self.moon_temperature > 0:
      raise ValueError(f"moon_temperature must be > 0, got {self.moon_temperature}")

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
  loss_sum: jax.Array  # summed per-example cross-entropy over real examples seen (no regularizers)
  num_examples: jax.Array
  num_steps: jax.Array  # steps that saw at least one real example (FedNova's tau_i)
  # What the round's objective needs besides the batch, fixed during the round (see `ClientContext`).
  context: dict[str, Any] = {}


class ClientOutput(NamedTuple):
  """What one client hands back after a round."""

  delta: Variables  # local - start (FedNova: divided by a_i)
  extras: dict[str, Any]  # further uploads, summed with the client's weight by the backends
  memory: dict[str, Any]  # the client's state kept across rounds (SCAFFOLD c_i, MOON's previous model)


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


def _cosine(u: jax.Array, v: jax.Array, eps: float = 1e-8) -> jax.Array:
  return jnp.sum(u * v, -1) / jnp.maximum(jnp.linalg.norm(u, axis=-1) * jnp.linalg.norm(v, axis=-1), eps)


def model_contrastive_loss(z: jax.Array, z_global: jax.Array, z_previous: jax.Array, temperature: float,
                           mask: jax.Array) -> jax.Array:
  """MOON's model-contrastive loss (Li, He, Song 2021, Eq. 3), mean over real rows.

  ``-log(e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}))`` with cosine
  similarity, i.e. ``softplus((sim(z, z_prev) - sim(z, z_glob)) / tau)``.
  """
  positive = _cosine(z, z_global) / temperature
  negative = _cosine(z, z_previous) / temperature
  return jnp.sum(jax.nn.softplus(negative - positive) * mask) / jnp.maximum(mask.sum(), 1.0)


def nova_normalizer(num_steps: jax.Array, optimizer: str, momentum: float) -> jax.Array:
  """FedNova's a_i (Wang et al. 2020, Sec. 4 and App. for momentum): the norm of the local
  aggregation vector. Plain SGD: ``tau``; SGD with momentum rho: ``[tau - rho(1 - rho^tau)/(1 - rho)]/(1 - rho)``.

  Adam has no such closed form; we use ``tau`` for it (each Adam step moves a weight by about
  the learning rate whatever the gradient scale, so the update grows linearly in ``tau``).
  """
  tau = jnp.asarray(num_steps, jnp.float32)
  if optimizer == "sgd" and momentum:
    rho = momentum
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
  return tau


def scaffold_control_update(control: Variables, server_control: Variables, delta_params: Variables,
                            num_steps: jax.Array, learning_rate: float) -> Variables:
  """SCAFFOLD's option II (Karimireddy et al. 2020, Alg. 1 line 12):
  ``c_i+ = c_i - c + (x - y_i) / (K eta)`` with ``x - y_i = -delta``, K the client's local steps."""
  scale = 1.0 / (jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0) * learning_rate)
  return jax.tree.map(lambda ci, c, d: ci - c - scale * d, control, server_control, delta_params)


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
  generator: nn.Module | None = None  # FedGen's feature generator (`fedgen.Generator`), frozen on the client

  def __post_init__(self):
    if self.config.fedgen_batch_size and self.generator is None:
      raise ValueError("fedgen_batch_size > 0 needs the FedGen generator module (LocalTrainer.generator)")

  @property
  def tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.config)

  @property
  def contrastive(self) -> bool:
    return bool(self.config.moon_mu)

  @property
  def context_keys(self) -> set[str]:
    """What `init_state` puts in ``LocalState.context`` for this configuration."""
    c = self.config
    return ({"start"} if c.prox_mu or self.contrastive else set()) | ({"correction"} if c.scaffold else set()) | (
        {"previous"} if self.contrastive else set()) | (
        {"key", "generator", "fedgen_coefficients", "label_probs"} if c.fedgen_batch_size else set())

  def init_memory(self, variables: Variables) -> dict[str, Any]:
    """A client's persistent state before its first round (empty for stateless methods)."""
    memory = {}
    if self.config.scaffold:
      memory["control"] = jax.tree.map(jnp.zeros_like, variables["params"])  # c_i = 0 (SCAFFOLD Alg. 1)
    if self.contrastive:
      memory["previous"] = variables  # MOON's previous local model; the initial model before round 1
    return memory

  def init_state(self, start: Variables, memory: dict[str, Any] | None = None,
                 server: dict[str, Any] | None = None, key: jax.Array | None = None) -> LocalState:
    """A client's state at the start of a round, from the server's ``start`` variables, the
    client's ``memory`` (`init_memory`), the group's share of server state (SCAFFOLD's c; FedGen's
    "generator" variables, "fedgen_coefficients" [alpha, beta] and "label_probs") and the client's
    round ``key`` (FedGen draws its generated batches from it; shape-only uses may leave it out)."""
    c = self.config
    memory, server = memory or {}, server or {}
    context = {}
    if c.prox_mu or self.contrastive:
      context["start"] = start  # FedProx's anchor w^t; MOON's global model
    if c.scaffold:
      context["correction"] = tree_sub(server["control"], memory["control"])  # c - c_i
    if self.contrastive:
      context["previous"] = memory["previous"]
    if c.fedgen_batch_size:
      for name in ("generator", "fedgen_coefficients", "label_probs"):
        context[name] = server[name]
      if key is not None:
        context["key"] = key
    zero = jnp.zeros((), jnp.float32)
    return LocalState(start, self.tx.init(start["params"]), zero, zero, zero, context)

  def _forward(self, variables: Variables, x: jax.Array, train: bool, mask: jax.Array | None):
    """``((logits, z or None), batch_stats updates)``; z is MOON's projection."""
    kwargs = {"mutable": ["batch_stats"]} if train and "batch_stats" in variables else {}
    if self.contrastive:
      out = self.model.apply(variables, x, train=train, mask=mask, method="logits_and_projection", **kwargs)
    else:
      out = self.model.apply(variables, x, train=train, mask=mask, **kwargs)
    outputs, updates = out if kwargs else (out, {})
    return (outputs if self.contrastive else (outputs, None)), updates

  def train_step(self, state: LocalState, images: jax.Array, labels: jax.Array, mask: jax.Array) -> LocalState:
    """One masked step on the mean cross-entropy of the real rows, plus the configured client terms:
    FedProx's ``mu/2 ||w - w^t||^2``, MOON's ``mu * l_con``, SCAFFOLD's gradient correction ``c - c_i``,
    FedGen's generative regularizer (Zhu et al. 2021, `fedgen.client_regularizer`)."""
    c, ctx = self.config, state.context
    missing = self.context_keys - set(ctx)
    if missing:
      raise ValueError(f"the client objective needs {sorted(missing)} in LocalState.context; build the state "
                       "with init_state")
    x = normalize(images, self.mean, self.std)
    maskf = mask.astype(jnp.float32)
    if self.contrastive:  # representations of the frozen global and previous models (eval mode)
      z_global = jax.lax.stop_gradient(self._forward(ctx["start"], x, False, None)[0][1])
      z_previous = jax.lax.stop_gradient(self._forward(ctx["previous"], x, False, None)[0][1])
    if c.fedgen_batch_size:
      # Counting real steps only, so padded steps (vmap cohorts) do not shift the key sequence.
      step_key = jax.random.fold_in(ctx["key"], state.num_steps.astype(jnp.uint32))

    def loss_fn(params):
      (logits, z), updates = self._forward({**state.variables, "params": params}, x, True, mask)
      loss, total = masked_cross_entropy(logits, labels, maskf)
      # Python-level branches: a method without a term traces exactly the plain program.
      if c.prox_mu:
        loss = loss + proximal_term(params, ctx["start"]["params"], c.prox_mu)
      if self.contrastive:
        loss = loss + c.moon_mu * model_contrastive_loss(z, z_global, z_previous, c.moon_temperature, maskf)
      if c.fedgen_batch_size:
        alpha, beta = ctx["fedgen_coefficients"][0], ctx["fedgen_coefficients"][1]
        loss = loss + fedgen.client_regularizer(
            fedgen.feature_head(self.model), {**state.variables, "params": params}, self.generator, ctx["generator"],
            logits, labels, ctx["label_probs"], step_key, alpha=alpha, beta=beta,
            gen_batch_size=c.fedgen_batch_size, mask=maskf, gen_ratio=c.fedgen_batch_size / c.batch_size)[0]
      return loss, (updates, total)

    (_, (model_updates, total)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.variables["params"])
    if c.scaffold:
      grads = jax.tree.map(jnp.add, grads, ctx["correction"])
    updates, opt_state = self.tx.update(grads, state.opt_state, state.variables["params"])
    variables = {**state.variables, **model_updates, "params": optax.apply_updates(state.variables["params"], updates)}
    active = maskf.sum() > 0
    stepped = LocalState(variables, opt_state, state.loss_sum + total, state.num_examples + maskf.sum(),
                         state.num_steps + 1.0, ctx)
    return jax.tree.map(lambda new, old: jnp.where(active, new, old), stepped, state)

  def finish(self, state: LocalState, start: Variables, memory: dict[str, Any] | None = None,
             server: dict[str, Any] | None = None) -> ClientOutput:
    """The client's upload and its memory for the next round it is sampled in."""
    c = self.config
    memory, server = memory or {}, server or {}
    delta = tree_sub(state.variables, start)
    extras, new_memory = {}, {}
    if c.scaffold:
      control = scaffold_control_update(memory["control"], server["control"], delta["params"], state.num_steps,
                                        c.learning_rate)
      extras["control_delta"] = tree_sub(control, memory["control"])
      new_memory["control"] = control
    if self.contrastive:
      new_memory["previous"] = state.variables
    if c.normalize_delta:
      a = nova_normalizer(state.num_steps, c.optimizer, c.momentum)
      safe = jnp.where(a > 0, a, 1.0)  # a client without steps (vmap padding) has a zero delta
      delta = jax.tree.map(lambda d: d / safe, delta)
      extras["nova_a"] = a
    return ClientOutput(delta, extras, new_memory)

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

