"""Orbax checkpoints of a run's whole `ServerState`: models, server steps' state, sampler, client memory.

The state's typed parts (NamedTuples such as an optax state or FedCross's
`CrossState`) are stored as flax state dicts and rebuilt against a template
state, so any method's state round-trips without knowing its types.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import serialization

from fedjax_hetero.engine import ServerState


BEST_METRIC = "mean_accuracy"


def manager(output_dir: str, every: int = 1, keep: int = 2) -> ocp.CheckpointManager:
  """The results folder's checkpoint manager (``checkpoints/``), saving every ``every`` rounds.

  It keeps the ``keep`` latest checkpoints and, besides them, the one with the best mean test accuracy
  (`save` with ``accuracy``), so that a run which diverges still has its best state.
  """
  best = ocp.checkpoint_managers.BestN(get_metric_fn=lambda metrics: metrics[BEST_METRIC], n=1,
                                       keep_checkpoints_without_metrics=False)
  policy = ocp.checkpoint_managers.AnyPreservationPolicy([ocp.checkpoint_managers.LatestN(keep), best])
  options = ocp.CheckpointManagerOptions(save_interval_steps=every, preservation_policy=policy)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(output_dir, "checkpoints")), options=options)


def state_tree(state: ServerState) -> dict[str, Any]:
  """Everything a resumed run needs, as nested dicts of arrays (the round is the checkpoint's step)."""
  return serialization.to_state_dict({"models": state.models, "steps": state.steps, "sampler": state.sampler,
                                      "memory": state.memory})


def save(checkpoints: ocp.CheckpointManager, state: ServerState, force: bool = False,
         accuracy: float | None = None) -> None:
  """Saves at ``state.round`` if the manager's interval (or ``force``) says so; ``accuracy`` (the round's mean
  test accuracy) ranks it for keeping the best."""
  metrics = None if accuracy is None else {BEST_METRIC: float(accuracy)}
  checkpoints.save(state.round, args=ocp.args.StandardSave(state_tree(state)), force=force, metrics=metrics)


def best_step(checkpoints: ocp.CheckpointManager) -> int | None:
  """The kept checkpoint with the best mean test accuracy, if any was saved with one."""
  return checkpoints.best_step()


def restore(checkpoints: ocp.CheckpointManager, step: int, template: ServerState) -> ServerState:
  """The checkpoint of round ``step``, shaped and typed like ``template`` (e.g. the simulation's initial state)."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  restored = checkpoints.restore(step, args=ocp.args.StandardRestore(abstract))
  parts = {"models": template.models, "steps": template.steps, "sampler": template.sampler,
           "memory": template.memory}
  parts = serialization.from_state_dict(parts, restored)
  return ServerState(int(step), parts["models"], parts["steps"], parts["sampler"], parts["memory"])


def restore_latest(checkpoints: ocp.CheckpointManager, template: ServerState) -> ServerState:
  """The latest checkpoint, shaped and typed like ``template``; raises ValueError if there is none."""
  step = checkpoints.latest_step()
  if step is None:
    raise ValueError(f"no checkpoint in {checkpoints.directory}")
  return restore(checkpoints, step, template)


def restore_latest_intact(checkpoints: ocp.CheckpointManager, template: ServerState,
                          warn: Callable[[str], None]) -> ServerState | None:
  """The newest checkpoint that restores. Each newer damaged one is named in a warning and moved out of the
  way, to ``damaged_checkpoints/`` beside ``checkpoints/`` (kept for inspection; the rounds it held are
  trained again). None if no checkpoint restores."""
  for step in sorted(checkpoints.all_steps(), reverse=True):
    try:
      return restore(checkpoints, step, template)
    except Exception as e:  # orbax raises many kinds (ValueError, OSError, tensorstore's, msgpack's)
      reason = (str(e).strip().splitlines() or [""])[0][:300]
      source = os.path.join(str(checkpoints.directory), str(step))
      target = os.path.join(os.path.dirname(str(checkpoints.directory)), "damaged_checkpoints", str(step))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.rmtree(target, ignore_errors=True)
      shutil.move(source, target)
      checkpoints.reload()
      warn(f"warning: checkpoint {source} cannot be restored ({type(e).__name__}: {reason}); moved it to "
           f"{target} and skipped it")
  return None


def drop_after(checkpoints: ocp.CheckpointManager, step: int) -> None:
  """Deletes the checkpoints of rounds after ``step`` (a rolled-back trajectory), so the rounds can be saved again."""
  checkpoints.wait_until_finished()
  for later in [s for s in checkpoints.all_steps() if s > step]:
    checkpoints.delete(later)
