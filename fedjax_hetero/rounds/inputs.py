"""What the host works out ahead of a call of rounds: who trains, padded into the rows every mapping reads.

A *call* is K ≥ 1 rounds that run without the host in between: one round of the host loop, or the rounds of one
device program. `plan_call` draws every round's participants (the method's sampler), pads each architecture
group's cohort to the group's slots (as many as a mapping of the cohort holds), and gathers every server step's
plan, every client's memory row and local step count. Every mapping, on the host or in a program, reads these
rows and pads nothing itself. `call_length` is where a call ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, NamedTuple, Sequence

import jax
import numpy as np

from fedjax_hetero.config import LocalConfig
from fedjax_hetero.data.store import FederatedStore
from fedjax_hetero.rounds.state import ServerState
from fedjax_hetero.sampling.samplers import Participants
from fedjax_hetero.server.steps import Plan

if TYPE_CHECKING:
  from fedjax_hetero.rounds.spec import RoundSpec


class Cohort(NamedTuple):
  """One architecture group's cohort in each round of a call, padded to the group's ``C`` slots: ``[K, C]``."""

  clients: np.ndarray  # int32: client ids (padding: 0, with no sample, so every step of it is masked)
  sizes: np.ndarray  # int32: samples per client (padding: 0)
  weights: np.ndarray  # float32: aggregation weights (padding: 0)
  real: np.ndarray  # float32: 1 for a sampled client
  rows: np.ndarray  # int32: rows in the group's client memory (padding: past the last, dropped)
  slots: np.ndarray  # int32: stacked sharing: the model slot each client starts from (padding: 0)
  server_ids: np.ndarray  # int32: the ids the server steps see (padding: the number of clients)
  count: np.ndarray  # int32 [K]: sampled clients
  steps: np.ndarray  # int32 [K]: local steps of the group's longest client
  inputs: Any  # the cohort's per-client trainer inputs (`LocalTrainer.client_inputs`; often none)


class CallInputs(NamedTuple):
  """A call's rows, ``[K, ...]`` (rounds past the call's length repeat its last, and are not run)."""

  rounds: np.ndarray  # int32: 0-based round index
  steps: np.ndarray  # int32: local steps of the round's longest client (of every group)
  evaluate: np.ndarray  # bool: evaluate after the round
  cohorts: tuple[Cohort, ...]  # per group
  plans: tuple[Any, ...]  # every server step's plan inputs, stacked over the rounds


class RoundRows(NamedTuple):
  """One round of a call as the round's body reads it: on the host loop numpy rows and Python values, in a device
  program the round's slice of the call's traced rows."""

  index: Any  # 0-based round index
  steps: Any  # local steps of the round's longest client (of every group)
  evaluate: Any  # bool: evaluate after the round
  cohorts: tuple[Cohort, ...]  # per group, the round's rows: ``[C]`` (and ``count``, ``steps`` scalars)
  plans: tuple[Any, ...]  # every server step's plan inputs
  statics: tuple  # every server step's static plan (the call's)


class Call(NamedTuple):
  """A call as the host planned it: its rows, and what the host keeps of each round for its metrics row."""

  first: int  # the call's first round (0-based)
  count: int  # its rounds
  inputs: CallInputs
  # per round: `RoundSpec.participants` (the sampler's, the cohorts and weights per group, those that did not answer)
  drawn: list[tuple[Participants, list[np.ndarray], list[np.ndarray], np.ndarray]]
  plans: list[list[Plan]]  # per round: every server step's plan
  statics: tuple  # the steps' static plans, one for the whole call

  def round(self, i: int) -> RoundRows:
    """The call's round ``i`` as the host loop reads it (the plans' own values, not their stacked rows)."""
    return RoundRows(self.first + i, int(self.inputs.steps[i]), bool(self.inputs.evaluate[i]),
                     tuple(jax.tree.map(lambda a: a[i], c) for c in self.inputs.cohorts),
                     tuple(p.inputs for p in self.plans[i]), self.statics)

  def pieces(self, evaluate: Collection[int]) -> list[tuple[int, int]]:
    """The call's rounds ``[a, b)`` cut after every round in ``evaluate`` (1-based): what a device program runs
    before each evaluation."""
    ends = [i + 1 for i in range(self.count - 1) if self.first + i + 1 in evaluate] + [self.count]
    return list(zip([0] + ends[:-1], ends))

  def inputs_from(self, i: int) -> CallInputs:
    """The call's rows from its round ``i`` on, padded as `plan_call` pads them (the last row repeated)."""
    return self.inputs if i == 0 else jax.tree.map(
        lambda a: np.concatenate([a[i:], np.repeat(a[-1:], i, axis=0)]), self.inputs)

  def trained(self, i: int) -> list[bool]:
    """Per group, whether any of its clients trained in the call's round ``i``."""
    return [len(cohort) > 0 for cohort in self.drawn[i][1]]


def plans(spec: "RoundSpec", round_index: int) -> list[Plan]:
  """Every server step's plan of round ``round_index``."""
  return [s.plan(round_index) if s.plan else Plan() for s in spec.method.server]


def call_length(spec: "RoundSpec", first: int, stop: int, per_call: int) -> int:
  """The rounds of the call from round ``first`` (0-based): at most ``per_call``, none from ``stop`` on, and none
  past a change of a server step's static plan (FedCross's stages)."""
  statics = tuple(p.static for p in plans(spec, first))
  end = first + 1
  while end < min(stop, first + per_call) and tuple(p.static for p in plans(spec, end)) == statics:
    end += 1
  return end - first


def padded_inputs(inputs: Any, size: int) -> Any:
  """Per-client inputs (numpy rows) padded with zero rows to ``size`` rows."""
  return jax.tree.map(lambda x: np.concatenate([x, np.zeros((size - len(x),) + x.shape[1:], x.dtype)]), inputs)


def one_cohort(store: FederatedStore, local: LocalConfig, trainer: Any, clients: np.ndarray, weights: np.ndarray,
               slots: int, rows: np.ndarray | None = None, num_rows: int = 0) -> Cohort:
  """One round's cohort ``clients`` (with aggregation ``weights``, and ``rows`` in a client memory of ``num_rows``
  rows) of a group trained by ``trainer``, as `Cohort` rows of ``slots`` clients."""
  pad, rows = slots - len(clients), np.zeros(len(clients), np.int64) if rows is None else rows
  return Cohort(np.concatenate([clients, np.zeros(pad, np.int64)]).astype(np.int32),
                np.concatenate([store.sizes[clients], np.zeros(pad, np.int64)]).astype(np.int32),
                np.concatenate([weights, np.zeros(pad)]).astype(np.float32),
                (np.arange(slots) < len(clients)).astype(np.float32),
                np.concatenate([rows, np.full(pad, num_rows)]).astype(np.int32),
                np.concatenate([np.arange(len(clients)), np.zeros(pad, np.int64)]).astype(np.int32),
                np.concatenate([clients, np.full(pad, store.num_clients)]).astype(np.int32),
                np.int32(len(clients)), np.int32(max([local.num_steps(int(n)) for n in store.sizes[clients]] or [0])),
                padded_inputs(trainer.client_inputs(clients), slots))


def cohort_rows(spec: "RoundSpec", group: int, cohorts: Sequence[np.ndarray], weights: Sequence[np.ndarray],
                slots: int) -> Cohort:
  """Group ``group``'s cohorts (one per round) and their weights as `Cohort` rows of ``slots`` clients, stacked."""
  rounds = [one_cohort(spec.store, spec.local, spec.trainers[group], clients, w, slots, spec.row_of_client[clients],
                       len(spec.groups[group].clients)) for clients, w in zip(cohorts, weights)]
  return jax.tree.map(lambda *xs: np.stack(xs), *rounds)


def plan_call(spec: "RoundSpec", state: ServerState, count: int, evaluate: Collection[int], slots: Sequence[int],
              length: int | None = None) -> Call:
  """The call of ``count`` rounds from ``state`` (rounds in ``evaluate``, 1-based, are evaluated), its rows
  padded to ``slots`` clients per group and to ``length`` rounds (default ``count``)."""
  rounds = [state.round + i for i in range(count)]
  padded = rounds + [rounds[-1]] * ((length or count) - count)
  drawn = [spec.participants(state.sampler, r) for r in padded]
  round_plans = [plans(spec, r) for r in padded]
  cohorts = tuple(cohort_rows(spec, g, [d[1][g] for d in drawn], [d[2][g] for d in drawn], slots[g])
                  for g in range(len(spec.groups)))
  steps = np.max([c.steps for c in cohorts], axis=0)
  plan_inputs = tuple(jax.tree.map(lambda *xs: np.stack(xs), *(p[s].inputs for p in round_plans))
                      for s in range(len(spec.method.server)))
  inputs = CallInputs(np.asarray(padded, np.int32), np.asarray(steps, np.int32),
                      np.asarray([r + 1 in evaluate for r in padded]) & (np.arange(len(padded)) < count),
                      cohorts, plan_inputs)
  return Call(state.round, count, inputs, drawn[:count], round_plans[:count],
              tuple(p.static for p in round_plans[0]))
