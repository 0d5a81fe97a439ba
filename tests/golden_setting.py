"""The golden setting built with the engine's API (see `tests.golden`)."""

from __future__ import annotations

import jax.numpy as jnp

from fedjax_hetero.config import FedGenConfig, MethodConfig
from fedjax_hetero.backends import make_backend
from fedjax_hetero.client.local import LocalConfig
from fedjax_hetero.engine import ArchGroup, FederationConfig, Simulation, assign_groups
from fedjax_hetero.methods import build_method
from tests.golden import ONE_GROUP, group_models
from tests.helpers import tiny_federation

TINY_FEDGEN = FedGenConfig(noise_dim=4, hidden_dim=16, batch_size=16, ensemble_epochs=2, n_teacher_iters=1,
                           gen_batch_size=8)


class GoldenSimulation(Simulation):
  def eval_variables(self, state):
    return {g.name: self.group_variables(state, i) for i, g in enumerate(self.groups)}


def golden_simulation(method: str, backend: str, family: str) -> GoldenSimulation:
  ds, store = tiny_federation()
  models = group_models(ds.num_classes, family)
  if method in ONE_GROUP:
    models = models[1:]
  groups = [ArchGroup(name, model, clients)
            for (name, model), clients in zip(models, assign_groups(store.num_clients, len(models)))]
  local = LocalConfig(epochs=2, batch_size=8, optimizer="adam", learning_rate=1e-2, steps_per_call=2)
  built = build_method(method, MethodConfig(fedgen=TINY_FEDGEN) if method == "FedGen" else MethodConfig(), local)
  return GoldenSimulation(groups, store, local, built, FederationConfig(clients_per_round=3, seed=0),
                          make_backend(backend), jnp.asarray(ds.test_images), jnp.asarray(ds.test_labels))
