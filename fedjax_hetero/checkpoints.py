"""Orbax checkpoints of a run's whole `ServerState`: models, server steps' state, sampler, client memory.

The state's typed parts (NamedTuples such as an optax state or FedCross's
`CrossState`) are stored as flax state dicts and rebuilt against a template
state, so any method's state round-trips without knowing its types.

In a multi-process run every process calls `save` and the restores, with the same arguments: orbax writes
the replicated arrays once (process 0 is its primary host) and restores them into the template's shardings,
replicated global arrays (a restore needs a template holding real arrays, such as the initial state).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import serialization

from fedjax_hetero.engine import ServerState
from fedjax_hetero.validation import first_line


BEST_METRIC = "mean_accuracy"


class _QuietUnrankedSaves(logging.Filter):
  """Orbax logs a warning for each save without metrics when checkpoints are ranked; rounds without an
  evaluation are saved that way on purpose."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietUnrankedSaves())


def manager(output_dir: str, every: int = 1, keep: int = 2) -> ocp.CheckpointManager:
  """The results folder's checkpoint manager (``checkpoints/``), saving every ``every`` rounds.

  It keeps the ``keep`` latest checkpoints and, besides them, the one with the best mean test accuracy
  (`save` with ``accuracy``), so that a run which diverges still has its best state. Opening it reads every
  checkpoint's metadata, and fails on a damaged one: a resumed run calls `restore_latest_intact` first.
  """
  best = ocp.checkpoint_managers.BestN(get_metric_fn=lambda metrics: metrics[BEST_METRIC], n=1,
                                       keep_checkpoints_without_metrics=False)
  policy = ocp.checkpoint_managers.AnyPreservationPolicy([ocp.checkpoint_managers.LatestN(keep), best])
  # best_fn too: without it orbax's best_step() is the latest step and the metrics are not written to disk, so a
  # manager that reopens the folder (a resumed run) would see no best at all.
  options = ocp.CheckpointManagerOptions(save_interval_steps=every, preservation_policy=policy,
                                         best_fn=lambda metrics: metrics[BEST_METRIC], best_mode="max")
  return ocp.CheckpointManager(_root(output_dir), options=options)


def _root(output_dir: str) -> str:
  return os.path.abspath(os.path.join(output_dir, "checkpoints"))


def state_tree(state: ServerState) -> dict[str, Any]:
  """Everything a resumed run needs, as nested dicts of arrays (the round is the checkpoint's step)."""
  return serialization.to_state_dict({"models": state.models, "steps": state.steps, "sampler": state.sampler,
                                      "memory": state.memory})


def save(checkpoints: ocp.CheckpointManager, state: ServerState, force: bool = False,
         accuracy: float | None = None) -> bool:
  """Saves at ``state.round`` if the manager's interval (or ``force``) says so; ``accuracy`` (the round's mean
  test accuracy) ranks it for keeping the best. Returns whether it saved; the save finishes in the background
  (``checkpoints.wait_until_finished()``)."""
  metrics = None if accuracy is None else {BEST_METRIC: float(accuracy)}
  return checkpoints.save(state.round, args=ocp.args.StandardSave(state_tree(state)), force=force, metrics=metrics)


def best_step(checkpoints: ocp.CheckpointManager) -> int | None:
  """The kept checkpoint with the best mean test accuracy, if any was saved with one."""
  return checkpoints.best_step()


def restore(checkpoints: ocp.CheckpointManager, step: int, template: ServerState) -> ServerState:
  """The checkpoint of round ``step``, shaped and typed like ``template`` (e.g. the simulation's initial state)."""
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  return _from_tree(step, checkpoints.restore(step, args=ocp.args.StandardRestore(abstract)), template)


def _from_tree(step: int, restored: Any, template: ServerState) -> ServerState:
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


# The JSON files a manager reads when it opens a folder (the step's metadata and its metrics).
_OPENED_FILES = ("_CHECKPOINT_METADATA", os.path.join("metrics", "metrics"))


def restore_latest_intact(output_dir: str, template: ServerState,
                          warn: Callable[[str], None]) -> ServerState | None:
  """The newest checkpoint of a results folder that restores, read without a manager (which would fail to open
  on a damaged one). Each newer one that does not restore is named in a warning and moved to
  ``damaged_checkpoints/`` beside ``checkpoints/`` (kept for inspection; its rounds are trained again). None if
  there is no checkpoint; if none restores, raises ValueError and moves nothing (a failure shared by all of
  them is not damage)."""
  root = _root(output_dir)
  steps = sorted((int(name) for name in os.listdir(root) if name.isdigit()), reverse=True) \
      if os.path.isdir(root) else []
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  failures: list[tuple[int, Exception]] = []
  for step in steps:
    try:
      for name in _OPENED_FILES:
        if os.path.exists(os.path.join(root, str(step), name)):
          with open(os.path.join(root, str(step), name)) as f:
            json.load(f)
      restored = ocp.StandardCheckpointer().restore(os.path.join(root, str(step), "default"), abstract)
    except Exception as e:  # orbax raises many kinds (ValueError, OSError, tensorstore's, msgpack's)
      failures.append((step, e))
      continue
    for damaged, error in failures:
      source = os.path.join(root, str(damaged))
      target = os.path.join(os.path.dirname(root), "damaged_checkpoints", str(damaged))
      if jax.process_index() == 0:  # every process of a multi-process run finds the same damage; one moves it
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(source, target)
      warn(f"warning: checkpoint {source} cannot be restored ({first_line(error, 300)}); moved it to {target} and "
           f"resumed from round {step}")
    return _from_tree(step, restored, template)
  if failures:
    raise ValueError(f"no checkpoint in {root} can be restored (rounds {', '.join(map(str, steps))}; the newest: "
                     f"{first_line(failures[0][1], 300)}); nothing was moved")
  return None


def drop_after(checkpoints: ocp.CheckpointManager, step: int) -> None:
  """Deletes the checkpoints of rounds after ``step`` (a rolled-back trajectory), so the rounds can be saved again."""
  checkpoints.wait_until_finished()
  for later in [s for s in checkpoints.all_steps() if s > step]:
    checkpoints.delete(later)
