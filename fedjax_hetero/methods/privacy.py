"""Differential privacy at the client, DP-FedAvg style (McMahan et al., ICLR 2018, "Learning Differentially Private
Recurrent Language Models"), for any method whose clients upload their update alone.

Each client clips its whole update (every variable of its model, as one vector) to L2 norm C:

    Delta_c <- Delta_c * min(1, C / ||Delta_c||)

and the server replaces the method's averaging step ("mean") by a noised one: per element e of the federation's
model, Gaussian noise of standard deviation z C goes on the sum of the clipped updates of the round's clients that
hold e, and the sum is divided by a public number, the expected count of those clients,

    delta_e = (sum_{c holds e} Delta_{c,e} + N(0, z^2 C^2)) / E_e,     E_e = m * P(a client holds e),

m being the clients per round and P the chance that a client holds e and answers (the share of the clients in a
group that holds e, or its --group-draw probability, times 1 - its --client-dropout). With one architecture group
whose clients all answer, E_e = m: the number of clients that answered. A fixed divisor keeps the released update
a function of the noised sum alone (the count of a round's holders would tell which groups took part, which the
accountant does not model), and the mean unbiased. Every
element some group holds gets noise every round, held this round or not. The noise's key comes from the
federation's server key of the round: seeded, the same after a resume, bit for bit.

The privacy spent is counted on the host (`fedjax_hetero.run.privacy_accounting`). What is refused, with the reason
(`with_privacy`): client terms that upload anything (their uploads would leave the client unclipped and un-noised),
a stacked federation and a server without a "mean" step (there is no sum of updates to noise), a sampler other than
the uniform draw the accountant assumes, and aggregation weights other than 1 (`config.privacy.check_privacy`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero import aggregators
from fedjax_hetero.client.terms import ClientTerm
from fedjax_hetero.compilation import shared_by_value
from fedjax_hetero.config.declare import cli_name, is_off
from fedjax_hetero.config.federation import FederationConfig
from fedjax_hetero.config.privacy import PrivacyConfig
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.methods.api import Method
from fedjax_hetero.server.steps import ServerStep
from fedjax_hetero.validation import check_number

NOISE_STREAM = 0xD9  # folded into the federation's server key: the noise's own stream, apart from the other steps'


def global_norm(tree: Variables) -> jax.Array:
  """The L2 norm of every leaf of ``tree`` together, in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def check_clip(clip: Any) -> None:
  """A concrete ``clip`` is a finite number > 0 (a traced one, a swept setting, was checked as the config's)."""
  if not isinstance(clip, (jax.Array, np.ndarray)):
    check_number("clip", clip, above=0)


def clipped(delta: Variables, clip: Any) -> Variables:
  """``delta * min(1, clip / ||delta||)``, every leaf in its dtype (a zero update stays zero)."""
  check_clip(clip)
  norm = global_norm(delta)
  scale = jnp.where(norm > clip, clip / jnp.where(norm > 0, norm, 1.0), 1.0)
  return jax.tree.map(lambda x: (x * scale).astype(x.dtype), delta)


def clip_term(clip: Any) -> ClientTerm:
  """The client's half: its update clipped to ``clip`` after every other term changed it (the last ``delta``).
  One term per bound, so that trainers carrying it stay equal and share their programs (a traced bound, in a job's
  program, makes its own)."""
  check_clip(clip)
  return _clip_term(clip)


@shared_by_value(16)
def _clip_term(clip: float) -> ClientTerm:
  return ClientTerm("dp_clip", delta=lambda state, final, memory, share: clipped(final.delta, clip))


def gaussian_noise(key: jax.Array, like: Variables, std: Any) -> Variables:
  """Independent N(0, std^2) per element of ``like`` (float32), one key per leaf split from ``key``."""
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(key, max(len(leaves), 1))
  return treedef.unflatten([std * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def expected_holders(federation, clients_per_round: int, group_draw: Sequence[float],
                     dropout: Sequence[float] = ()) -> list[float]:
  """Per member group of ``federation``, the expected count of its clients that answer among a round's
  ``clients_per_round``: its share of all clients, or its ``group_draw`` probability when groups are drawn every
  round, times the chance its clients answer (``dropout``: one probability for every group, or one per group;
  `sampling.availability`)."""
  total = federation.store.num_clients
  answers = lambda g: 1.0 - (dropout[g] if len(dropout) > 1 else dropout[0] if dropout else 0.0)
  return [clients_per_round * (group_draw[g] if group_draw else len(clients) / total) * answers(g)
          for g, clients in zip(federation.members, federation.clients)]


def private_mean(clip: Any, noise_multiplier: Any, clients_per_round: int, group_draw: Sequence[float] = (),
                 dropout: Sequence[float] = ()) -> ServerStep:
  """The noised mean of the clipped updates (see the module docstring): ``delta`` the noised sum over the
  expected holders ``E``, ``coverage`` E (> 0 wherever the noise went)."""

  def update(carry, state, inputs, plan):
    federation = inputs.federation
    total, _ = aggregators.heterogeneous_sums([r.delta_sum for r in inputs.results], inputs.weights,
                                              federation.maps, carry.model, inputs.offset)
    counts = [jnp.float32(e) for e in expected_holders(federation, clients_per_round, group_draw, dropout)]
    expected = aggregators.weighted_coverage(counts, federation.maps, carry.model, inputs.offset)
    if not is_off(noise_multiplier):
      noise = gaussian_noise(jax.random.fold_in(inputs.key, NOISE_STREAM), carry.model, noise_multiplier * clip)
      total = jax.tree.map(lambda s, n, e: s + jnp.where(e > 0, n, 0.0).astype(s.dtype), total, noise, expected)
    zeros = jax.tree.map(jnp.zeros_like, carry.model)
    return carry._replace(delta=aggregators.masked_mean(total, expected, zeros), coverage=expected), state

  return ServerStep("mean", update)


def refusal(method: Method) -> str | None:
  """Why ``method`` cannot be made private this way (None: it can)."""
  uploads = [f"{t.name!r} ({t.upload.reduce})" for t in method.terms if t.upload is not None]
  if uploads:
    return (f"its clients upload more than their update: client term{'s' if len(uploads) > 1 else ''} "
            f"{', '.join(uploads)}, which would leave the client neither clipped nor noised")
  if method.sharing.stacked:
    return "every client trains a model of its own slot (stacked sharing): there is no sum of updates to noise"
  names = [s.name for s in method.server]
  if "mean" not in names:
    return (f"its server steps ({', '.join(names)}) have no 'mean' step averaging the clients' updates, which the "
            "noised sum replaces")
  if next(s for s in method.server if s.name == "mean").init is not None:
    return "its 'mean' step keeps state of its own, which the noised sum that replaces it would drop"
  sampler = method.sampler
  if sampler.name != "uniform" or sampler.observe is not None or sampler.reads is not None:
    return (f"its sampler ({sampler.name}) does not draw a uniform cohort of --clients-per-round clients every "
            "round, which the privacy accountant assumes")
  return None


def with_privacy(method: Method, privacy: PrivacyConfig, federation: FederationConfig) -> Method:
  """``method`` with its clients' updates clipped (`clip_term`, last) and its "mean" step noised (`private_mean`);
  unchanged when ``privacy`` is off. ValueError naming the flag when the method cannot be (`refusal`)."""
  if not privacy.on:
    return method
  why = refusal(method)
  if why is not None:
    raise ValueError(f"{cli_name(privacy, 'clip')}: {method.name} cannot be made differentially private by "
                     f"clipping and noising its clients' updates: {why} (docs/privacy.md)")
  noised = private_mean(privacy.clip, privacy.noise_multiplier, federation.clients_per_round, federation.group_draw,
                        federation.client_dropout)
  return dataclasses.replace(method, terms=method.terms + (clip_term(privacy.clip),),
                             server=tuple(noised if s.name == "mean" else s for s in method.server))
