"""How each client trains in a round: `LocalConfig` (the local optimizer is rebuilt every round)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_hetero.config.declare import Flag, Integer, Number, OneOf, Settings, cli_name, setting, validate

OPTIMIZERS = ("sgd", "adam")
# XLA:CPU flushes subnormal floats to zero, so a float32 learning rate below this is 0 in training.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class LocalConfig(Settings):
  """How each client trains in a round (a fresh optimizer every round)."""

  TITLE = "local training"

  epochs: int = setting(1, "local epochs per round", Integer(minimum=1))
  batch_size: int = setting(64, "local batch size", Integer(minimum=1))
  optimizer: str = setting("adam", "client optimizer, created fresh every round", OneOf(OPTIMIZERS))
  learning_rate: float = setting(1e-3, "client learning rate", Number(above=0), spelling="--lr")
  momentum: float = setting(0.0, "SGD momentum", Number(minimum=0, below=1))
  weight_decay: float = setting(0.0, "L2 weight decay added to the gradient before the optimizer (PyTorch's "
                                "weight_decay; with Adam, not AdamW's decoupled decay)", Number(minimum=0))
  drop_last: bool = setting(False, "drop each epoch's partial last batch (InCo's code) instead of masking it", Flag())
  steps_per_call: int = setting(
      1, "local steps unrolled in one jitted call: 1 compiles fastest and is as fast for ResNets; 4 trains a "
      "full-width CNN ~6% faster on XLA:CPU (docs/performance.md)", Integer(minimum=1))

  def __post_init__(self):
    validate(self)
    if self.learning_rate < FLOAT32_TINY:
      raise ValueError(f"{cli_name(self, 'learning_rate')} {self.learning_rate:g} is 0 in float32 training arithmetic "
                       f"(below {FLOAT32_TINY:.3g}, the smallest normal float32; XLA flushes smaller values to 0), so "
                       "the weights would never change")

  def steps_per_epoch(self, num_examples: int) -> int:
    if self.drop_last:
      return num_examples // self.batch_size
    return -(-num_examples // self.batch_size)

  def num_steps(self, num_examples: int) -> int:
    return self.epochs * self.steps_per_epoch(num_examples)

  def chunk_sizes(self, num_steps: int) -> list[int]:
    """Unrolled chunk lengths covering ``num_steps`` exactly: full chunks, then single steps."""
    full, rest = divmod(num_steps, self.steps_per_call)
    return [self.steps_per_call] * full + [1] * rest

  def chunk_lengths(self, max_steps: int) -> tuple[int, ...]:
    """Every chunk length a schedule of at most ``max_steps`` steps can use (one compiled program each)."""
    return tuple(sorted({n for n in (self.steps_per_call, 1) if n <= max(max_steps, 1)}, reverse=True))
