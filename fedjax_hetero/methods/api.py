"""A federated method is a declaration: client terms, server steps, how groups share models, a sampler.

`Method` composes the pieces the round loop (`fedjax_hetero.engine`) runs
without knowing any method:

* ``terms``: `ClientTerm`s added to every client's data loss and upload
  (`fedjax_hetero.client.terms`), with ``combine`` for terms in several gradients;
* ``server``: the `ServerStep` pipeline of each federation (`fedjax_hetero.server`);
* ``sharing``: how architecture groups form federations (`PER_GROUP`: every
  group alone, the InCo paper's baselines; `SHARED`: one global model averaged
  layer-wise; `STACKED`: FedCross's K middleware models, one per client slot);
* ``sampler``: who takes part (`fedjax_hetero.sampling.samplers`);
* ``submodel``: how a group's model sits in the shared model (`hetero.maps`:
  leading slices, FedRolex's rolling windows);
* ``own_leaves``: the leaves every group of a shared federation keeps a copy of
  its own, averaged over that group's clients only (`hetero.maps.separate`;
  NeFL's inconsistent parameters).

Client terms, server steps and the sampler are linked by name only: a step's
broadcast goes to the client term of its name, and a term's upload to the step
or sampler of its name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, NamedTuple

import flax.linen as nn
import jax

from fedjax_hetero.client.local import GradientRule
from fedjax_hetero.client.terms import ClientTerm
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.hetero.maps import Path, SubmodelMap, Variables, build_group_map
from fedjax_hetero.sampling.samplers import Sampler, uniform
from fedjax_hetero.server.steps import ServerStep, apply_delta, insert_before, mean_delta


class Sharing(NamedTuple):
  """How architecture groups share server models."""

  name: str
  shared: bool  # one federation for all groups (else one per group)
  stacked: bool = False  # the federation keeps one model per cohort slot; client i trains slot i


PER_GROUP = Sharing("per_group", shared=False)
SHARED = Sharing("shared", shared=True)
STACKED = Sharing("stacked", shared=False, stacked=True)


@dataclasses.dataclass(frozen=True)
class Method:
  """A federated method (see the module docstring)."""

  name: str
  paper: str  # where it comes from, for grouping in --help
  summary: str  # one line
  terms: tuple[ClientTerm, ...] = ()
  server: tuple[ServerStep, ...] = (mean_delta(), apply_delta())
  sharing: Sharing = SHARED
  sampler: Sampler = uniform()
  combine: GradientRule | None = None
  one_group: str | None = None  # why the method trains a single architecture group, if it must
  # (global shapes, group shapes, group name) -> the group's map into the shared model
  submodel: Callable[[Variables, Variables, str], SubmodelMap] = build_group_map
  # (group's model, its variables, the training store) -> the variables it is evaluated with (HeteroFL's
  # static BN re-estimates BatchNorm statistics); None: the server's variables as they are
  evaluation_variables: Callable[[nn.Module, Variables, FederatedStore], Variables] | None = None
  # (group's model as the clients train it, a sample input) -> the paths of its variable leaves that each group
  # of a shared federation keeps its own copy of (NeFL's inconsistent parameters); None: every leaf is shared
  own_leaves: Callable[[nn.Module, jax.Array], Collection[Path]] | None = None
  # The LocalConfig settings the method's build read, as (name, value) pairs (SCAFFOLD's learning rate,
  # FedNova's optimizer): a Simulation training with other values is refused (`simulation_checks`).
  local_settings: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    for kind, names in (("client term", [t.name for t in self.terms]), ("server step", [s.name for s in self.server])):
      if len(set(names)) != len(names):
        raise ValueError(f"{self.name}: {kind} names must be unique, got {names}")

  def wrap_model(self, model: nn.Module) -> nn.Module:
    """The model the clients train: ``model`` with what the terms add (e.g. MOON's projection head)."""
    for term in self.terms:
      if term.wrap_model is not None:
        model = term.wrap_model(model)
    return model

  def with_terms(self, *terms: ClientTerm) -> "Method":
    return dataclasses.replace(self, terms=self.terms + tuple(terms))

  def with_step_before(self, name: str, step: ServerStep) -> "Method":
    return dataclasses.replace(self, server=insert_before(self.server, name, step))

