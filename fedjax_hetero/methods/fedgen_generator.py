"""FedGen's pieces as pure functions (Zhu, Hong and Zhou, "Data-Free Knowledge
Distillation for Heterogeneous Federated Learning", ICML 2021).

The classifier is split at its "features" cut point into a feature extractor
and a head, ``head_apply(vars, feats) = model.apply(vars, feats,
start="features", stop="logits")``. Each round (the paper's Algorithm 1) the
server learns a conditional generator ``G(eps, y)`` of *features*: the
label-count-weighted ensemble of the round's client heads must classify
``G(eps, y)`` as ``y`` (teacher loss) while a diversity term keeps different
noises apart. Clients then regularize local training with it: their head must
classify generated features of sampled labels, and their predictions on real
inputs are pulled towards what their head predicts on ``G(y)`` of the same
labels. The per-client label-weighted teacher loss and the latent KL term
follow the released code, as the FedCross spec describes it (the FedCross
authors re-used that code); the paper's equations state the objectives in a
simpler form (e.g. an ensemble of averaged client logits).

Hyperparameters follow the FedCross spec's FedGen summary (itself the config
of the FedCross authors' framework) where it gives them; the rest, marked
"FedGen code", follow the released FedGen implementation:
  * generator: noise 100 + one-hot label -> Dense 512 -> BN -> ReLU -> Dense
    latent; noise ~ U[0, 1) (FedGen code: ``torch.rand``);
  * server: Adam (coupled L2 weight decay 1e-2), 10 x 5 = 50 steps of batch
    128 per round, teacher weight 1, diversity weight 1, learning rate
    3e-4 (CIFAR-10) decayed by 0.98 per round (FedGen code: ExponentialLR);
  * clients: ``alpha_gen = beta_gen = 0.2`` (CIFAR-10), decayed as
    ``max(1e-4, c * 0.98**round)`` and off in round 0 (FedGen code); 32
    generated samples per local step (FedGen code: ``gen_batch_size``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_hetero.config.options import FedGenConfig
from fedjax_hetero.hetero.maps import Variables

HeadApply = Callable[[Variables, jax.Array], jax.Array]


def decayed_coefficient(initial: float, round_index: int, decay: float = 0.98, floor: float = 1e-4) -> float:
  """``max(floor, initial * decay**round)``, FedGen's client schedule; a zero ``initial`` stays zero."""
  return max(min(floor, initial), initial * decay ** round_index)


def client_coefficients(config: FedGenConfig, round_index: int | jax.Array
                        ) -> tuple[float, float] | tuple[jax.Array, jax.Array]:
  """(alpha, beta) of the client regularizer in round ``round_index`` (0-based); (0, 0) in round 0. A traced
  round (the round program's) gives them in float32, computed on the device."""
  if not isinstance(round_index, (int, np.integer)):
    r = jnp.asarray(round_index, jnp.float32)
    decayed = lambda initial: jnp.where(r <= 0, 0.0, jnp.maximum(jnp.minimum(config.coefficient_floor, initial),
                                                                 initial * config.coefficient_decay ** r))
    return decayed(config.generative_alpha), decayed(config.generative_beta)
  if round_index <= 0:
    return 0.0, 0.0
  return (decayed_coefficient(config.generative_alpha, round_index, config.coefficient_decay,
                              config.coefficient_floor),
          decayed_coefficient(config.generative_beta, round_index, config.coefficient_decay, config.coefficient_floor))


# ---------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------


class Generator(nn.Module):
  """Conditional feature generator ``G(eps, y)``: [eps, onehot(y)] -> Dense -> BN -> ReLU -> Dense.

  The output is a feature vector of the classifier's penultimate width
  ``latent_dim`` (no activation, as in FedGen). With ``embedding`` the label
  enters as a learned embedding of width ``noise_dim`` instead of one-hot.
  """

  num_classes: int
  latent_dim: int
  noise_dim: int = 100
  hidden_dim: int = 512
  embedding: bool = False

  @nn.compact
  def __call__(self, labels: jax.Array, noise: jax.Array, train: bool = False) -> jax.Array:
    if self.embedding:
      y = nn.Embed(self.num_classes, self.noise_dim, name="label_embedding")(labels)
    else:
      y = jax.nn.one_hot(labels, self.num_classes, dtype=noise.dtype)
    h = nn.Dense(self.hidden_dim, name="fc")(jnp.concatenate([noise, y], axis=-1))
    # PyTorch BatchNorm1d defaults: running average keeps 0.9 of the old value.
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name="bn")(h)
    return nn.Dense(self.latent_dim, name="latent")(nn.relu(h))


def sample_noise(key: jax.Array, batch_size: int, noise_dim: int) -> jax.Array:
  """FedGen's generator noise, U[0, 1) (the released code uses ``torch.rand``)."""
  return jax.random.uniform(key, (batch_size, noise_dim))


def generate(generator: Generator, variables: Variables, labels: jax.Array, key: jax.Array,
             train: bool = False) -> tuple[jax.Array, jax.Array, Variables]:
  """``G(eps, labels)`` with fresh noise: (features [B, latent], noise [B, noise_dim], new batch_stats).

  ``train`` normalizes with the batch's statistics and returns updated running
  ones; otherwise the running statistics are used and returned unchanged.
  """
  noise = sample_noise(key, labels.shape[0], generator.noise_dim)
  if train:
    feats, updates = generator.apply(variables, labels, noise, train=True, mutable=["batch_stats"])
    return feats, noise, updates["batch_stats"]
  return generator.apply(variables, labels, noise), noise, variables["batch_stats"]


class GeneratorState(NamedTuple):
  params: Variables
  batch_stats: Variables
  opt_state: Any

  @property
  def variables(self) -> Variables:
    return {"params": self.params, "batch_stats": self.batch_stats}


def generator_optimizer(weight_decay: float = 1e-2) -> optax.GradientTransformation:
  """Adam with PyTorch-style (coupled) L2 weight decay, *without* the learning-rate scaling.

  `train_generator` multiplies by ``-learning_rate`` itself, so the per-round
  decay of the rate changes an argument, not the compiled program.
  """
  return optax.chain(optax.add_decayed_weights(weight_decay), optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8))


def init_generator(generator: Generator, key: jax.Array, weight_decay: float = 1e-2) -> GeneratorState:
  labels = jnp.zeros((2,), jnp.int32)
  variables = generator.init(key, labels, jnp.zeros((2, generator.noise_dim)))
  params = variables["params"]
  return GeneratorState(params, variables["batch_stats"], generator_optimizer(weight_decay).init(params))


# ---------------------------------------------------------------------------
# Label statistics
# ---------------------------------------------------------------------------


def ensemble_label_weights(label_counts: jax.Array, pseudo_count: float = 1.0,
                           valid: jax.Array | None = None) -> jax.Array:
  """FedGen's ensemble weights ``w[k, c] = count_k(c) / sum_j count_j(c)`` over the K clients [K, C].

  ``pseudo_count`` is added to every (valid) client's counts first, as FedGen's
  code starts its counters at 1. Padded client slots (``valid`` False) get
  weight 0. A label nobody has gets weight 0 everywhere.
  """
  counts = jnp.asarray(label_counts, jnp.float32)
  keep = jnp.ones(counts.shape[0], jnp.float32) if valid is None else jnp.asarray(valid, jnp.float32)
  counts = (counts + pseudo_count) * keep[:, None]
  totals = counts.sum(axis=0, keepdims=True)
  return jnp.where(totals > 0, counts / jnp.where(totals > 0, totals, 1.0), 0.0)


def present_label_probs(label_counts: jax.Array) -> jax.Array:
  """Uniform over the labels with at least one sample (counts summed over leading axes) [C].

  FedGen samples generator labels uniformly from the labels some selected
  client holds (server) or that the federation holds (clients). Uniform over
  all labels when none is present.
  """
  counts = jnp.asarray(label_counts, jnp.float32)
  present = (counts.reshape(-1, counts.shape[-1]).sum(axis=0) > 0).astype(jnp.float32)
  present = jnp.where(present.sum() > 0, present, jnp.ones_like(present))
  return present / present.sum()


# ---------------------------------------------------------------------------
# Server: generator objective and training
# ---------------------------------------------------------------------------


def ensemble_teacher_loss(logits: jax.Array, labels: jax.Array, label_weights: jax.Array) -> jax.Array:
  """``mean_b sum_k w[k, y_b] * CE(logits[k, b], y_b)`` for client logits [K, B, C] (FedGen's teacher loss)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels[None, :])  # [K, B]
  weights = label_weights[:, labels]  # [K, B]
  return jnp.mean(jnp.sum(weights * ce, axis=0))


def diversity_loss(noise: jax.Array, features: jax.Array) -> jax.Array:
  """FedGen's diversity term ``exp(-mean_ij d_noise(i, j) * d_feat(i, j))``.

  ``d_noise`` is the mean squared difference of two noise vectors and
  ``d_feat`` the mean absolute difference of their generated features, so
  minimizing it pushes samples with distant noise to distant features.
  """
  feats = features.reshape(features.shape[0], -1)
  noise_dist = jnp.mean(jnp.square(noise[:, None, :] - noise[None, :, :]), axis=-1)
  feat_dist = jnp.mean(jnp.abs(feats[:, None, :] - feats[None, :, :]), axis=-1)
  return jnp.exp(-jnp.mean(noise_dist * feat_dist))


def stacked_head_logits(head_apply: HeadApply, client_head_vars: Variables, feats: jax.Array) -> jax.Array:
  """Every client head (variables stacked on a leading K axis) on the same features: [K, B, C]."""
  return jax.vmap(head_apply, in_axes=(0, None))(client_head_vars, feats)


def generator_loss(gen_params: Variables, generator: Generator, head_apply: HeadApply, client_head_vars: Variables,
                   label_weights: jax.Array, labels: jax.Array, key: jax.Array, *, batch_stats: Variables,
                   teacher_weight: float = 1.0, diversity_weight: float = 1.0
                   ) -> tuple[jax.Array, tuple[Variables, dict[str, jax.Array]]]:
  """The server's generator objective for one batch of ``labels``.

  ``teacher_weight * ensemble_teacher_loss + diversity_weight * diversity_loss``
  on ``G(eps, labels)`` in training mode (batch statistics), with the K fixed
  client heads ``client_head_vars`` stacked on a leading axis and
  ``label_weights`` [K, C] from `ensemble_label_weights`. FedGen's adversarial
  student term is left out: its weight (ensemble beta) is 0 in the spec.
  Returns ``(loss, (new_batch_stats, {"teacher", "diversity"}))``.
  """
  variables = {"params": gen_params, "batch_stats": batch_stats}
  feats, noise, new_stats = generate(generator, variables, labels, key, train=True)
  logits = stacked_head_logits(head_apply, client_head_vars, feats)
  teacher = ensemble_teacher_loss(logits, labels, label_weights)
  diversity = diversity_loss(noise, feats)
  loss = teacher_weight * teacher + diversity_weight * diversity
  return loss, (new_stats, {"teacher": teacher, "diversity": diversity})


@functools.partial(jax.jit, static_argnames=("generator", "head_apply", "num_steps", "batch_size"))
def train_generator(state: GeneratorState, generator: Generator, head_apply: HeadApply, client_head_vars: Variables,
                    label_weights: jax.Array, label_probs: jax.Array, key: jax.Array, learning_rate: jax.Array, *,
                    num_steps: int = 50, batch_size: int = 128, weight_decay: float = 1e-2,
                    teacher_weight: float = 1.0, diversity_weight: float = 1.0
                    ) -> tuple[GeneratorState, dict[str, jax.Array]]:
  """The server's generator update of one round: ``num_steps`` Adam steps, one jitted scan.

  Each step draws ``batch_size`` labels from ``label_probs`` [C] (see
  `present_label_probs`) and fresh noise. The client heads stay fixed.
  ``head_apply`` is a static argument: pass the same callable every round
  (e.g. one `feature_head` per model) to reuse the compiled program. The
  optimizer state carries over between rounds, as FedGen keeps one Adam.
  Returns the new state and per-step "loss", "teacher", "diversity" [num_steps].
  """
  tx = generator_optimizer(weight_decay)
  grad_fn = jax.value_and_grad(generator_loss, has_aux=True)
  num_classes = label_probs.shape[0]

  def step(carry: GeneratorState, step_key: jax.Array):
    label_key, noise_key = jax.random.split(step_key)
    labels = jax.random.choice(label_key, num_classes, (batch_size,), p=label_probs)
    (loss, (stats, parts)), grads = grad_fn(carry.params, generator, head_apply, client_head_vars, label_weights,
                                            labels, noise_key, batch_stats=carry.batch_stats,
                                            teacher_weight=teacher_weight, diversity_weight=diversity_weight)
    updates, opt_state = tx.update(grads, carry.opt_state, carry.params)
    params = jax.tree.map(lambda p, u: p - learning_rate * u, carry.params, updates)
    return GeneratorState(params, stats, opt_state), {"loss": loss, **parts}

  return jax.lax.scan(step, state, jax.random.split(key, num_steps))


def train_generator_round(state: GeneratorState, config: FedGenConfig, generator: Generator, head_apply: HeadApply,
                          client_head_vars: Variables, label_counts: jax.Array, learning_rate: jax.Array,
                          key: jax.Array, valid: jax.Array | None = None
                          ) -> tuple[GeneratorState, dict[str, jax.Array]]:
  """`train_generator` with everything else derived from ``config`` and the K clients' label counts [K, C]
  (``valid`` False: a padding slot); ``learning_rate`` is the round's (`FedGenConfig.generator_learning_rate`)."""
  return train_generator(state, generator, head_apply, client_head_vars,
                         ensemble_label_weights(label_counts, config.label_pseudo_count, valid),
                         present_label_probs(label_counts if valid is None
                                             else jnp.asarray(label_counts) * jnp.asarray(valid)[:, None]),
                         key, learning_rate, num_steps=config.generator_steps, batch_size=config.batch_size,
                         weight_decay=config.weight_decay, teacher_weight=config.ensemble_alpha,
                         diversity_weight=config.ensemble_eta)


# ---------------------------------------------------------------------------
# Clients: generative regularization
# ---------------------------------------------------------------------------


def client_regularizer(head_apply: HeadApply, head_vars: Variables, generator: Generator, gen_vars: Variables,
                       real_logits: jax.Array, real_labels: jax.Array, label_probs: jax.Array, key: jax.Array, *,
                       alpha: jax.Array | float, beta: jax.Array | float, gen_batch_size: int,
                       mask: jax.Array | None = None, gen_ratio: float = 1.0
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """FedGen's client-side regularizer, added to the cross-entropy on the real batch.

  * teacher: ``CE(head(G(y_hat)), y_hat)`` for ``gen_batch_size`` labels
    ``y_hat ~ label_probs``, weighted ``alpha * gen_ratio`` (FedGen code's
    ``gen_batch_size / batch_size``);
  * latent: ``KL(softmax(head(G(y))) || softmax(real_logits))`` with ``y`` the
    real batch's labels and the target held fixed, mean over the real rows
    (``mask``), weighted ``beta``.

  The generator runs in inference mode (running BN statistics) and gets no
  gradient; gradients reach the head through the teacher term and the whole
  model through ``real_logits``. Returns ``(loss, {"teacher", "latent"})``
  with the unweighted terms.
  """
  gen_vars = jax.lax.stop_gradient(gen_vars)
  num_classes = label_probs.shape[0]
  key_labels, key_teacher, key_latent = jax.random.split(key, 3)

  sampled = jax.random.choice(key_labels, num_classes, (gen_batch_size,), p=label_probs)
  feats, _, _ = generate(generator, gen_vars, sampled, key_teacher)
  teacher = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(head_apply(head_vars, feats), sampled))

  feats_real, _, _ = generate(generator, gen_vars, real_labels, key_latent)
  target_logp = jax.lax.stop_gradient(jax.nn.log_softmax(head_apply(head_vars, feats_real)))
  kl = jnp.sum(jnp.exp(target_logp) * (target_logp - jax.nn.log_softmax(real_logits)), axis=-1)
  maskf = jnp.ones(kl.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
  latent = jnp.sum(kl * maskf) / jnp.maximum(maskf.sum(), 1.0)

  loss = alpha * gen_ratio * teacher + beta * latent
  return loss, {"teacher": teacher, "latent": latent}


# ---------------------------------------------------------------------------
# Model helpers
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureHead:
  """``model.apply(vars, feats, start=cut, stop="logits")`` as a hashable callable (a stable jit key)."""

  model: nn.Module
  cut: str = "features"

  def __call__(self, variables: Variables, feats: jax.Array) -> jax.Array:
    return self.model.apply(variables, feats, start=self.cut, stop="logits")


def feature_head(model: nn.Module, cut: str = "features") -> FeatureHead:
  return FeatureHead(model, cut)


def feature_width(model: nn.Module, sample_input: jax.Array, cut: str = "features") -> int:
  """Width of ``model``'s activation at ``cut`` (the generator's ``latent_dim``), from shapes only."""

  def features(x):
    variables = model.init(jax.random.key(0), x)
    return model.apply(variables, x, stop=cut)

  return int(np.prod(jax.eval_shape(features, sample_input).shape[1:]))
