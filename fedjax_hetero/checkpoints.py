"""Orbax checkpoints of a run's whole `ServerState`: models, server steps' state, sampler, client memory.

The state's typed parts (NamedTuples such as an optax state or FedCross's
`CrossState`) are stored as flax state dicts and rebuilt against a template
state, so any method's state round-trips without knowing its types.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import serialization

from fedjax_hetero.engine import ServerState


def manager(output_dir: str, every: int = 1, keep: int = 2) -> ocp.CheckpointManager:
  """The results folder's checkpoint manager (``checkpoints/``), saving every ``every`` rounds."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(output_dir, "checkpoints")), options=options)


def state_tree(state: ServerState) -> dict[str, Any]:
  """Everything a resumed run needs, as nested dicts of arrays (the round is the checkpoint's step)."""
  return serialization.to_state_dict({"models": state.models, "steps": state.steps, "sampler": state.sampler,
                                      "memory": state.memory})


def save(checkpoints: ocp.CheckpointManager, state: ServerState, force: bool = False) -> None:
  checkpoints.save(state.round, args=ocp.args.StandardSave(state_tree(state)), force=force)


def restore_latest(checkpoints: ocp.CheckpointManager, template: ServerState) -> ServerState:
  """The latest checkpoint, shaped and typed like ``template`` (e.g. the simulation's initial state)."""
  step = checkpoints.latest_step()
  if step is None:
    raise ValueError(f"no checkpoint in {checkpoints.directory}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_tree(template))
  restored = checkpoints.restore(step, args=ocp.args.StandardRestore(abstract))
  parts = {"models": template.models, "steps": template.steps, "sampler": template.sampler,
           "memory": template.memory}
  parts = serialization.from_state_dict(parts, restored)
  return ServerState(int(step), parts["models"], parts["steps"], parts["sampler"], parts["memory"])
