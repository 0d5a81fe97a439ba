"""HeteroFL's three parts beyond the layer-wise mean (Diao, Ding, Tarokh, ICLR 2021, Sec. 3).

Width groups train leading-channel slices of the global model, averaged over
the holders of each element (the default sub-model map and the mean step).
Each part below is a switch of its own, for ablations:

* `scaler`: the Scaler module, a hidden layer's output divided by the group's
  width rate in training (the models' ``scaler`` attribute; `models.common.scaler`);
* `static_batch_norm` + `static_batch_norm_evaluation`: static BatchNorm (sBN),
  no running statistics kept or averaged in training, re-estimated on the server's
  models from training data before evaluation;
* `absent_class_logits`: in local training, the logits of the classes absent
  from the client's data are zeroed before the cross-entropy (non-IID masking).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_hetero.client.terms import ClientFinal, ClientTerm, StepContext
from fedjax_hetero.config.methods import BN_SAMPLES
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import Variables
from fedjax_hetero.models.common import without_scaler
from fedjax_hetero.models.evaluation import EVAL_BATCH, batch_norm_statistics

# Training samples the server re-estimates BatchNorm statistics on before each evaluation (BN_SAMPLES). HeteroFL
# passes over the whole training set; a fixed subset bounds the cost of an evaluation.


def _with_scaler(model: nn.Module) -> nn.Module:
  if not {"scaler", "scaler_of"} <= {f.name for f in dataclasses.fields(model)}:
    raise ValueError(f"HeteroFL's Scaler needs a model with `scaler` and `scaler_of` attributes (MLP, CNN, "
                     f"ResNet); {type(model).__name__} has not both (--no-heterofl-scaler)")
  return model.clone(scaler=True)


def scaler() -> ClientTerm:
  """HeteroFL's Scaler (Sec. 3): every group's model divides its hidden layers' outputs by its rate in training,
  its width over the global model's (``width / scaler_of``; `RoundSpec.build` sets ``scaler_of``, so the global
  model's rate is 1), and is unchanged at evaluation."""
  return ClientTerm("scaler", wrap_model=_with_scaler)


def _without_batch_stats(state, final: ClientFinal, memory, share) -> Variables:
  if "batch_stats" not in final.delta:
    return final.delta
  return {**final.delta, "batch_stats": jax.tree.map(jnp.zeros_like, final.delta["batch_stats"])}


def static_batch_norm() -> ClientTerm:
  """sBN's client side (Sec. 3): training uses batch statistics only, and the running statistics a
  client's BatchNorm layers track are dropped from its update, so the server never averages them."""
  return ClientTerm("static_bn", delta=_without_batch_stats)


def static_batch_norm_evaluation(num_samples: int = BN_SAMPLES, seed: int = 0,
                                 batch_size: int = EVAL_BATCH
                                 ) -> Callable[[nn.Module, Variables, FederatedStore], Variables]:
  """sBN's server side (Sec. 3): before a model is evaluated, its BatchNorm statistics are the
  cumulative average of the batch statistics of a training pass over ``num_samples`` training samples
  (a fixed draw, ``seed``; HeteroFL uses all of them), with the Scaler off so that they match the
  evaluation's activations. For `Method.evaluation_variables`."""
  if num_samples < 1:
    raise ValueError(f"static BN needs at least one training sample, got {num_samples}")

  def evaluation_variables(model: nn.Module, variables: Variables, store: FederatedStore) -> Variables:
    if "batch_stats" not in variables:
      return variables
    n = int(store.images.shape[0])
    ids = np.sort(np.random.default_rng(seed).permutation(n)[:min(num_samples, n)])
    return batch_norm_statistics(without_scaler(model), variables, store.images[jnp.asarray(ids)], store.mean,
                                 store.std, batch_size)

  return evaluation_variables


def _zero_absent(logits: jax.Array, ctx: StepContext) -> jax.Array:
  classes = jnp.arange(logits.shape[-1])
  present = (ctx.client_labels[:, None] == classes[None, :]).any(axis=0)
  return jnp.where(present, logits, 0.0)


def absent_class_logits() -> ClientTerm:
  """HeteroFL's non-IID masking (its experiments; FedFA Sec. 4 reuses it): in local training the logits of
  classes that no sample of the client's round schedule has are set to zero before the cross-entropy (as
  the authors' code does), so those classes' logits get no gradient. Evaluation uses all logits."""
  return ClientTerm("label_mask", logits=_zero_absent)
