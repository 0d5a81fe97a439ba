"""What a job of many runs may sweep (`many_runs`), and how a swept value reaches a method's build.

A swept setting is traced per run. The method is built inside the trace from a config holding a `SweptValue`
in the setting's place: arithmetic on it gives the run's traced value; its truth is the runs' common truth (so
``if mu:`` keeps a term on every run or none, and ``== 0`` asks the same); another comparison or a conversion to
a number, which would need the concrete value, is refused, naming the setting. Options a build reads that way are
declared ``traced=False`` and are not offered.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import jax

from fedjax_hetero.config.declare import Number, leaves

# The local training settings a program can take per run (the optimizer's scalars).
CLIENT_SWEEPABLE = ("learning_rate", "momentum", "weight_decay")
# Host-side settings that may differ freely: each run's own `Simulation` computes what they change.
HOST_ONLY = ("federation.seed", "federation.sample_seed", "data.alpha")


class NotBatchable(ValueError):
  """Runs that cannot share one program; the message names what differs and what may."""


def method_sweepable(method_config: Any) -> tuple[str, ...]:
  """The numeric options of a method config (``method.prox.mu``, ...) a build reads as traced values: the
  method's sweepable settings."""
  return tuple(f"method.{leaf.path}" for leaf in leaves(method_config)
               if isinstance(leaf.setting.check, Number) and isinstance(leaf.default, float) and leaf.setting.traced)


def sweepable(method_config: Any) -> tuple[str, ...]:
  return tuple(f"client.{name}" for name in CLIENT_SWEEPABLE) + method_sweepable(method_config) + HOST_ONLY


def differing(trees: Sequence[Any], prefix: str) -> list[str]:
  """The leaf paths (``prefix`` + path) whose values differ between the config trees ``trees``."""
  flat = [{leaf.path: leaf.default for leaf in leaves(t)} for t in trees]
  return [prefix + path for path in flat[0] if any(f[path] != flat[0][path] for f in flat[1:])]


class SweptValue(float):
  """A swept setting as a method's build reads it: arithmetic gives the run's traced value; truth is the runs'
  common truth (``if mu:`` keeps a term on every run or none, `check_batchable`), and so is ``== 0``. Anything
  else that would need the concrete value (another comparison, ``float()``) is refused, naming the setting; as a
  float it is NaN, so a conversion this class does not see (``jnp.asarray``) makes the run fail loudly rather
  than train wrongly."""

  def __new__(cls, path: str, traced: jax.Array, truth: bool):
    self = super().__new__(cls, float("nan"))
    self.path, self.traced, self.truth = path, traced, truth
    return self

  def __bool__(self) -> bool:
    return self.truth

  def _concrete(self, *_):
    raise NotBatchable(f"{self.path} is read as a concrete number when the method is built (a comparison or a "
                       "conversion), so it cannot be swept in one program; sweep it in runs one after another")

  def __eq__(self, other):
    if isinstance(other, (int, float)) and not isinstance(other, SweptValue) and other == 0:
      return not self.truth  # (is it off? every run agrees: `check_batchable`; optax asks for weight decay)
    return self._concrete()

  def __ne__(self, other):
    return not self.__eq__(other)

  __float__ = __int__ = __index__ = __lt__ = __le__ = __gt__ = __ge__ = _concrete
  __hash__ = float.__hash__


def _arithmetic(name: str):
  return lambda self, *others: getattr(self.traced, name)(*[o.traced if isinstance(o, SweptValue) else o
                                                            for o in others])


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "pow", "rpow", "neg", "pos",
              "abs"):
  setattr(SweptValue, f"__{_name}__", _arithmetic(f"__{_name}__"))


def substituted(config: Any, values: dict[str, Any]) -> Any:
  """A copy of the frozen config tree ``config`` with ``values`` (by dotted path) set, unchecked: a traced
  value cannot be validated, and each run's concrete value was validated when its config was built."""
  for path, value in values.items():
    config = _set(config, path.split("."), value)
  return config


def _set(node: Any, parts: list[str], value: Any) -> Any:
  new = copy.copy(node)
  object.__setattr__(new, parts[0], value if len(parts) == 1 else _set(getattr(node, parts[0]), parts[1:], value))
  return new


def catalog_method(name: str, method_config: Any, local: Any):
  """The catalog's method ``name`` from option families that may hold traced values (`methods.build_method`
  without its checks, which compare values: each run's concrete config passed them)."""
  from fedjax_hetero.config import LocalConfig
  from fedjax_hetero.methods import get_entry
  entry = get_entry(name)
  return entry.build(*[local if kind is LocalConfig else method_config.family(kind) for kind in entry.options])


def get(config: Any, path: str) -> Any:
  for part in path.split("."):
    config = getattr(config, part)
  return config
