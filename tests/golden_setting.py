"""The golden setting built with the library's API (see `tests.golden`)."""

from __future__ import annotations

import jax.numpy as jnp

from fedjax_hetero.config import FedGenConfig, FederationConfig, LocalConfig, MethodConfig
from fedjax_hetero.methods import build_method
from fedjax_hetero.rounds import ArchGroup, RoundSpec, Simulation, assign_groups, make_backend, make_simulation
from tests.golden import ONE_GROUP, group_models
from tests.helpers import tiny_federation

TINY_FEDGEN = FedGenConfig(noise_dim=4, hidden_dim=16, batch_size=16, ensemble_epochs=2, n_teacher_iters=1,
                           gen_batch_size=8)


def eval_variables(sim: Simulation, state) -> dict:
  """Every group's variables after ``state``'s round, by group name (the record's model fingerprints)."""
  return {g.name: sim.spec.group_variables(state, i) for i, g in enumerate(sim.spec.groups)}


def golden_spec(method: str, family: str, steps_per_call: int = 1) -> RoundSpec:
  ds, store = tiny_federation()
  models = group_models(ds.num_classes, family)
  if method in ONE_GROUP:
    models = models[1:]
  groups = [ArchGroup(name, model, clients)
            for (name, model), clients in zip(models, assign_groups(store.num_clients, len(models)))]
  local = LocalConfig(epochs=2, batch_size=8, optimizer="adam", learning_rate=1e-2, steps_per_call=steps_per_call)
  built = build_method(method, MethodConfig(fedgen=TINY_FEDGEN) if method == "FedGen" else MethodConfig(), local)
  return RoundSpec.build(groups, store, local, built, FederationConfig(clients_per_round=3, seed=0),
                         jnp.asarray(ds.test_images), jnp.asarray(ds.test_labels))


def golden_simulation(method: str, backend: str, family: str, round_program: str = "host",
                      rounds_per_call: int | None = None, steps_per_call: int = 1) -> Simulation:
  """The golden entry's simulation: on the host loop of ``backend``, or as a device program (``round_program``
  "fused") whose cohorts are mapped as ``backend`` maps them; the host loop runs ``steps_per_call`` local steps
  per jitted call."""
  return make_simulation(golden_spec(method, family, steps_per_call), make_backend(backend), round_program,
                         rounds_per_call)
