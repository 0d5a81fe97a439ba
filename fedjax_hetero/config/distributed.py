"""How one process joins a multi-process run: `DistributedConfig` (`fedjax_hetero.distributed` acts on it)."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from fedjax_hetero.config.declare import Custom, Integer, OneOf, Settings, cli_name, setting, validate
from fedjax_hetero.validation import show

MODES = ("off", "auto")  # off: one process unless the coordinator flags are given; auto: jax detects the cluster
ENV = {"coordinator": "FEDJAX_HETERO_COORDINATOR", "num_processes": "FEDJAX_HETERO_NUM_PROCESSES",
       "process_id": "FEDJAX_HETERO_PROCESS_ID"}
EXPLICIT = ("coordinator", "num_processes", "process_id")


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Settings):
  """How this process joins a multi-process run.

  ``mode`` "off" with no coordinator settings is a single-process run. With ``coordinator``,
  ``num_processes`` and ``process_id`` (all three) this process joins the run they describe. ``mode``
  "auto" lets `jax.distributed.initialize` detect the cluster (Cloud TPU VM or pod slice, SLURM, Open
  MPI); any of the three given overrides what it detects.

  ``timeout``: seconds every process waits for all to join (jax's ``initialization_timeout``) and, at
  the end, for all to finish (``shutdown_timeout_seconds``). ``heartbeat_timeout``: seconds after which a
  silent process counts as dead and the others stop with jax's error.
  """

  TITLE = "multi-process runs (jax.distributed; needs --backend sharded or auto)"
  DESCRIPTION = ("Every process runs the same command; process 0 writes the results folder, which must be on a "
                 "file\nsystem all processes see. python -m experiments.launch starts such a run on this machine's "
                 "CPUs.")

  mode: str = setting(
      "off", "auto: let jax.distributed.initialize detect the processes (Cloud TPU VM or pod slice, SLURM, Open "
      "MPI); off: one process, unless --coordinator, --num-processes and --process-id are given", OneOf(MODES),
      flag="distributed")
  coordinator: str | None = setting(None, f"process 0's address and a free port (default: ${ENV['coordinator']})",
                                    Custom(lambda name, value: _check_address(value), str), metavar="HOST:PORT")
  num_processes: int | None = setting(None, f"processes in the run (default: ${ENV['num_processes']})", Integer(1),
                                      metavar="N")
  process_id: int | None = setting(None, f"this process's index, 0 to N-1 (default: ${ENV['process_id']})",
                                   Integer(0), metavar="I")
  timeout: int = setting(60, "how long processes wait for each other to join, and at the end to finish",
                         Integer(1), flag="distributed_timeout", metavar="SECONDS")
  heartbeat_timeout: int = setting(20, "a process silent this long counts as dead: the others stop with an error",
                                   Integer(1), metavar="SECONDS")

  def __post_init__(self):
    validate(self)
    given = [name for name in EXPLICIT if getattr(self, name) is not None]
    if self.mode == "off" and given and len(given) < len(EXPLICIT):
      missing = [cli_name(DistributedConfig, name) for name in EXPLICIT if name not in given]
      raise ValueError(f"{', '.join(cli_name(DistributedConfig, n) for n in given)} given without "
                       f"{', '.join(missing)}: a multi-process run needs all three (or "
                       f"{cli_name(DistributedConfig, 'mode')} auto on a Cloud TPU VM, SLURM or Open MPI)")
    if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
      raise ValueError(f"{cli_name(DistributedConfig, 'process_id')} must be in [0, {self.num_processes - 1}] for "
                       f"{cli_name(DistributedConfig, 'num_processes')} {self.num_processes}, got {self.process_id}")

  @property
  def enabled(self) -> bool:
    """Whether this process calls `jax.distributed.initialize`."""
    return self.mode == "auto" or self.coordinator is not None

  @property
  def multi_process(self) -> bool | None:
    """Whether the run has several processes; None where only jax's detection will tell (mode auto)."""
    if not self.enabled:
      return False
    return None if self.num_processes is None else self.num_processes > 1

  def check_backend(self, backend: str) -> None:
    """Raises ValueError if the run has several processes and ``backend`` runs on one process's devices."""
    if self.multi_process and backend not in ("sharded", "auto"):
      raise ValueError(f"{'--backend'} {backend} trains on this process's devices only; a run of "
                       f"{self.num_processes} processes needs {'--backend'} sharded (auto picks it)")


def _check_address(address: object) -> None:
  flag = cli_name(DistributedConfig, 'coordinator')
  host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
  if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
    raise ValueError(f"{flag} must be HOST:PORT (process 0's address and a free port, e.g. 10.0.0.1:1234), "
                     f"got {show(address)}")


def from_flags(mode: str = "off", coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: int = 60, heartbeat_timeout: int = 20,
               environ: Mapping[str, str] | None = None) -> DistributedConfig:
  """The config from the command line's values, the coordinator settings not given there read from
  ``$FEDJAX_HETERO_COORDINATOR``, ``$FEDJAX_HETERO_NUM_PROCESSES`` and ``$FEDJAX_HETERO_PROCESS_ID``
  (a launcher sets them per process); raises ValueError naming the flag or variable."""
  environ = os.environ if environ is None else environ
  values = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
  for name, variable in ENV.items():
    text = environ.get(variable, "").strip()
    if values[name] is not None or not text:
      continue
    if name == "coordinator":
      values[name] = text
      continue
    try:
      values[name] = int(text)
    except ValueError:
      raise ValueError(f"${variable} must be an integer ({cli_name(DistributedConfig, name)}), "
                       f"got {text!r}") from None
  return DistributedConfig(mode, timeout=timeout, heartbeat_timeout=heartbeat_timeout, **values)
