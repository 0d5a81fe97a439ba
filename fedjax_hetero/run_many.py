"""Seeds and sweeps as one job: ``--seeds`` and ``--sweep`` runs advanced together (`many_runs.ManyRuns`).

`runs_of` turns a config, seeds and sweeps into the job's runs (the product of the swept values, each seed of
each), each into a folder of its own: ``<output-dir>_<setting>=<value>..._s<seed>``. `run_together` runs them
the way `runner.run_experiment` runs one: every run holds its folder's lock, writes its metrics, summary and
checkpoints and resumes on ``--resume``, as it would alone; only the device program is shared. A call advances
the runs that are at the earliest round (after a resume or a rollback the runs may stand at different rounds:
the ones behind catch up first). A run that rolls back (``--on-divergence rollback``) is rebuilt with its lower
learning rate and stays in the job: its learning rate is then traced per run.

Which runs can share a program is `many_runs.check_batchable`'s to say; `batchable` says it for a config before
any data is loaded: the round program must be fused (not the host loop, not CluSamp, not a multi-process or
sharded run). Where it is not, the CLI runs them one after another (`cli.run`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable, Sequence

import jax

from fedjax_hetero import data as fdata
from fedjax_hetero import distributed, preflight, results_folder, runner
from fedjax_hetero.build import check_downloadable
from fedjax_hetero.config import RunConfig, declare
from fedjax_hetero.guard import DivergenceError
from fedjax_hetero.interruption import Interrupted, StopRequests
from fedjax_hetero.many_runs import ManyRuns
from fedjax_hetero.sweeps import NotBatchable, sweepable
from fedjax_hetero.methods import Method

Log = Callable[[str], None]


def sweep_settings(config: RunConfig) -> tuple[str, ...]:
  """The settings ``--sweep`` takes (the seed goes by ``--seeds``)."""
  return tuple(s for s in sweepable(config.method) if not s.startswith("federation."))


def parse_sweep(text: str, config: RunConfig) -> tuple[str, tuple[float, ...]]:
  """``client.learning_rate=1e-3,3e-3`` -> the setting's path and its values; ValueError naming what is wrong."""
  name, _, values = text.partition("=")
  name = name.strip()
  allowed = sweep_settings(config)
  if name not in allowed:
    raise ValueError(f"--sweep {name!r}: only settings that change no shape and no program structure can be swept "
                     f"in one program (not the architectures, the method, sizes or counts); sweepable: "
                     f"{', '.join(allowed)} (and the seed, by --seeds)")
  try:
    parsed = tuple(float(v) for v in values.split(",") if v.strip())
  except ValueError:
    raise ValueError(f"--sweep {text!r}: expected {name}=V1,V2,... with numbers") from None
  if not parsed or len(set(parsed)) != len(parsed):
    raise ValueError(f"--sweep {text!r}: expected distinct values")
  return name, parsed


def runs_of(config: RunConfig, seeds: Sequence[int] | None, sweeps: Sequence[tuple[str, Sequence[float]]] = ()
            ) -> list[RunConfig]:
  """Every combination of the swept values and seeds, each run's folder named after what it sets; ValueError
  for a setting swept twice or two runs that would share a folder."""
  leaves = {leaf.path: leaf for leaf in declare.leaves(config)}
  names = [name for name, _ in sweeps]
  if len(set(names)) != len(names):
    raise ValueError(f"--sweep {sorted({n for n in names if names.count(n) > 1})[0]} is given twice: give its "
                     "values once, comma-separated")
  runs = []
  for values in itertools.product(*[[(name, v) for v in vs] for name, vs in sweeps]):
    for seed in (seeds or [None]):
      flags = {leaves[name].flag: value for name, value in values}
      suffix = "".join(f"_{name}={value:g}" for name, value in values) + ("" if seed is None else f"_s{seed}")
      if seed is not None:
        flags["seed"] = seed
      runs.append(config.replace(**flags, output_dir=config.output.dir.rstrip("/") + suffix))
  folders = [r.output.dir for r in runs]
  if len(set(folders)) != len(folders):
    raise ValueError(f"two runs of the job would share the folder {next(f for f in folders if folders.count(f) > 1)!r} "
                     "(its name keeps 6 significant digits of a swept value): sweep values that differ there")
  return runs


def batchable(config: RunConfig, method: Method) -> str | None:
  """Why the runs of ``config`` cannot share one program (None: they can), before any data is loaded."""
  if config.round_program == "host" or (config.round_program == "auto" and jax.default_backend() == "cpu"):
    return f"the rounds run as a host loop (--round-program {config.round_program} on {jax.default_backend()})"
  if method.sampler.observe is not None:
    return f"{method.name}'s sampler keeps host-side state from every round's uploads"
  if jax.process_count() > 1 or config.backend == "sharded":
    return "a sharded or multi-process run splits each cohort over devices"
  return None


def run_together(configs: Sequence[RunConfig], dataset: Any = None, log: Log = print, method: Method | None = None,
                 max_runs_per_program: int | None = None, memory_budget: int | None = None) -> list[dict[str, Any]]:
  """Runs (or resumes) ``configs`` together and writes each one's results folder; their summaries."""
  for config in configs:
    preflight.check_settings(config)
    config.output.check_paths()
  check_shared(configs)
  main = distributed.is_main_process()
  with contextlib.ExitStack() as locks:
    for config in configs:
      locks.enter_context(results_folder.lock(config.output.dir, enabled=main))
    if dataset is None:  # loaded once; each run takes its own subset and partition of it
      check_downloadable(configs[0].data)
      dataset = fdata.load_dataset(configs[0].data.dataset, configs[0].data.data_dir)
    runs = []
    for i, config in enumerate(configs):
      runs.append(runner.prepare(config, dataset, log if i == 0 else _quiet, method))
    batch = ManyRuns([r.sim for r in runs], None if method else [r.config.method for r in runs],
                     memory_budget=memory_budget, max_runs_per_program=max_runs_per_program, log=log)
    per_program = (f"{len(runs)} runs in one program" if batch.max_runs_per_program >= len(runs) else
                   f"{len(runs)} runs, at most {batch.max_runs_per_program} per program")
    log(per_program + (f", swept per run: {', '.join(batch.swept)}" if batch.swept else ""))
    return _Together(runs, batch, log).train()


# What every run of a job has in common: one dataset is loaded, and a call evaluates the same rounds of each.
SHARED = {"--dataset": lambda c: c.data.dataset, "--data-dir": lambda c: c.data.data_dir,
          "--rounds": lambda c: c.rounds, "--eval-every": lambda c: c.eval_every}


def check_shared(configs: Sequence[RunConfig]) -> None:
  """ValueError naming the settings in `SHARED` that differ between ``configs``."""
  values = {flag: {get(c) for c in configs} for flag, get in SHARED.items()}
  differ = [f"{flag} ({', '.join(sorted(map(str, seen)))})" for flag, seen in values.items() if len(seen) > 1]
  if differ:
    raise ValueError(f"the runs of one job must share {', '.join(differ)}: run them as separate jobs")


def _quiet(_: str) -> None:
  pass


class _Together:
  """The training loop of runs that share a program: each run's own loop (`runner._Run`) takes its calls' rows."""

  def __init__(self, runs: list, batch: ManyRuns, log: Log):
    self.runs, self.batch, self.log = runs, batch, log
    self.stopped: dict[int, DivergenceError] = {}  # runs the divergence guard stopped (their summary written)
    self.alone: list[int] = []  # runs that left the program after a rollback, trained alone after the others

  def train(self) -> list[dict[str, Any]]:
    for run in self.runs:
      run.wall_start = time.perf_counter()
    try:
      with StopRequests(jax.process_count() == 1, self.log) as stop:
        while stop.requested is None and self._step():
          pass
      if stop.requested is not None:
        self._interrupt(stop.requested)
    finally:
      for i, run in enumerate(self.runs):
        if i not in self.alone:
          run.reporter.close()
          run.manager.wait_until_finished()
    summaries = [self.runs[i].train() if i in self.alone else run.finish()
                 for i, run in enumerate(self.runs) if i not in self.stopped]
    if self.stopped:  # the other runs finished: the first stop ends the job as it would end the run alone
      raise next(iter(self.stopped.values()))
    return summaries

  def _step(self) -> bool:
    """One call of the runs at the earliest round; False when every run is done."""
    active = [i for i, r in enumerate(self.runs)
              if r.state.round < r.config.rounds and i not in self.stopped and i not in self.alone]
    if not active:
      return False
    done = min(self.runs[i].state.round for i in active)
    chosen = [i for i in active if self.runs[i].state.round == done]
    count = self.batch.call_length(chosen, done, min(runner.call_length(self.runs[i].config, self.runs[i].sim, done)
                                                     for i in chosen))
    config = self.runs[chosen[0]].config
    evaluate = {r for r in range(done + 1, done + count + 1) if r % config.eval_every == 0 or r == config.rounds}
    results = self.batch.run(chosen, [self.runs[i].state for i in chosen], count, evaluate)
    for i, (state, rows) in zip(chosen, results):
      run = self.runs[i]
      error = run.diverged(rows) if isinstance(rows, Exception) else run.accept(state, rows)
      if error is not None:
        self._recover(i, error)
    return True

  def _recover(self, i: int, error: DivergenceError) -> None:
    run = self.runs[i]
    try:
      run._recover(error)  # raises when the run stops; else it is rebuilt with a lower learning rate
    except DivergenceError as stop:
      self.stopped[i] = stop
      return
    try:
      self.batch.replace(i, run.sim, run.config.method)
    except NotBatchable as e:  # (e.g. a learning rate the method reads as a number): it goes on alone, after
      self.log(f"{run.out}: continues alone after the other runs: {e}")
      self.alone.append(i)

  def _interrupt(self, signum: int) -> None:
    stopped = None
    for run in self.runs:
      try:
        run._interrupt(signum, clean=True)
      except Interrupted as e:
        stopped = e
    if stopped is not None:
      raise stopped


__all__ = ["NotBatchable", "batchable", "parse_sweep", "run_together", "runs_of", "sweep_settings"]
