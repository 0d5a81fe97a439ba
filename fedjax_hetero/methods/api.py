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

A piece with a client half and a server half is linked by value, not by name:
a server step (or the sampler) holds its client terms in ``reads``, reads their
uploads (``inputs.uploads(term)``) and broadcasts to those that take a
``share``. A `Method` checks at construction that every upload is read, every
share written, and every term a step reads is among its terms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, NamedTuple

import flax.linen as nn
import jax

from fedjax_hetero.client.local import GradientRule
from fedjax_hetero.client.terms import ClientTerm, check_term
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
    for term in self.terms:
      check_term(term)
    for kind, names in (("client term", [t.name for t in self.terms]), ("server step", [s.name for s in self.server])):
      if len(set(names)) != len(names):
        raise ValueError(f"{self.name}: {kind} names must be unique, got {names}")
    readers = [(f"server step {s.name!r}", s.reads, s.broadcast) for s in self.server]
    readers.append((f"sampler {self.sampler.name!r}", (self.sampler.reads,) if self.sampler.reads else (), None))
    for reader, reads, broadcast in readers:
      for term in reads:
        if not any(term is t for t in self.terms):
          raise ValueError(f"{self.name}: the {reader} reads client term {term.name!r}, which is not among the "
                           f"method's terms ({', '.join(t.name for t in self.terms) or 'none'})")
      if broadcast is not None and not any(t.share for t in reads):
        raise ValueError(f"{self.name}: the {reader} broadcasts a share, but none of the client terms it reads "
                         "takes one (share=True)")
    for term in self.terms:
      read_by = [(reader, broadcast) for reader, reads, broadcast in readers if any(term is t for t in reads)]
      if term.upload is not None and not read_by:
        raise ValueError(f"{self.name}: client term {term.name!r} uploads ({term.upload.reduce}), but no server step or "
                         "sampler reads it (list the term in a step's reads)")
      if term.share and not any(broadcast is not None for _, broadcast in read_by):
        raise ValueError(f"{self.name}: client term {term.name!r} takes a share, but no server step that reads "
                         "it broadcasts one")

  def term_index(self, term: ClientTerm) -> int:
    """The position of ``term`` (by identity) in ``terms``: where its upload is in a result's uploads."""
    return next(i for i, t in enumerate(self.terms) if t is term)

  @property
  def share_writers(self) -> tuple[int | None, ...]:
    """Per client term, the index of the server step whose broadcast it takes (None: it takes none)."""
    return tuple(next((i for i, s in enumerate(self.server) if s.broadcast and any(term is t for t in s.reads)),
                      None) if term.share else None for term in self.terms)

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

