"""Seeds and sweeps as one job: the runs of ``--seeds`` and ``--sweep``, advanced together where they can share a
device program (`rounds.many.ManyRuns`), else one after another.

`runs_of` turns a config, seeds and sweeps into the job's runs (the product of the swept values, each seed of
each), each into a folder of its own: ``<output-dir>_<setting>=<value>..._s<seed>``; `parse_sweep` says which
settings a sweep takes (`sweep_refusal`: every number; a count or a choice changes a program's shapes or code).
`run_jobs` makes and checks every run's method (`build.run_method`) before any run trains, then runs them
together (`run_together`) or apart. Together, every run holds its folder's lock, writes its metrics, summary and
checkpoints and resumes on ``--resume`` as it would alone; only the device program is shared. A call advances the
runs that are at the earliest round (after a resume or a rollback the runs may stand at different rounds: the ones
behind catch up first). A run that rolls back (``--on-divergence rollback``) goes on in the job with its lower
learning rate, which is then a traced value of its own.

What differs between runs of one program: the settings each run's own simulation computes on the host
(`HOST_SETTINGS`: the seeds, the partition's alpha, the malicious fraction, the divergence guard's), and the
numbers a program takes per run as traced values (`traced`: the client's, the method's, differential privacy's and
the server optimizer's, the backdoor's scale), with which each run's method is made in the program (`swept`).
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import time
from typing import Any, Callable, Iterator, Sequence

import jax

from fedjax_hetero import distributed
from fedjax_hetero import data as fdata
from fedjax_hetero.config import RunConfig, declare
from fedjax_hetero.config.declare import Number, substituted, value_at
from fedjax_hetero.config.run import FLAGS_BY_PATH
from fedjax_hetero.garbage import deferred_full_collections
from fedjax_hetero.methods import Method, build_method, get_entry
from fedjax_hetero.rounds.many import ManyRuns, NotBatchable
from fedjax_hetero.rounds.simulation import host_loop_reason, runs_in_program
from fedjax_hetero.rounds.spec import RoundSpec
from fedjax_hetero.run import continuation, preflight, results_folder, runner
from fedjax_hetero.run.build import (check_downloadable, partitioned_dataset, run_method, training_parts,
                                     with_run_settings)
from fedjax_hetero.run.guard import DivergenceError
from fedjax_hetero.run.interruption import Interrupted, StopRequests

Log = Callable[[str], None]
# Settings whose every value each run's own simulation computes with, on the host: its partition, its cohorts, its
# malicious clients, its divergence guard.
HOST_SETTINGS = ("federation.seed", "federation.sample_seed", "data.alpha", "federation.malicious_fraction")
# What every run of a job has in common: one dataset is loaded, and a call evaluates the same rounds of each.
SHARED = {"--dataset": lambda c: c.data.dataset, "--data-dir": lambda c: c.data.data_dir,
          "--rounds": lambda c: c.rounds, "--eval-every": lambda c: c.eval_every}


def sweep_refusal(leaf: declare.Leaf) -> str | None:
  """Why ``--sweep`` does not take the setting ``leaf`` (None: it does): every number sweeps, and the host's seeds."""
  if leaf.path == "federation.seed":
    return "the seed goes by --seeds"
  on_the_host = leaf.path in HOST_SETTINGS or leaf.path.startswith("divergence.")  # (counts of the host's loop)
  if isinstance(leaf.setting.check, Number) or (on_the_host and isinstance(leaf.setting.check, declare.Integer)):
    return None
  if isinstance(leaf.setting.check, declare.Integer):
    return "it is a count: the shapes and loops of the runs' program follow it"
  return "it is a choice: it selects what the runs' program computes"


def traced(path: str) -> bool:
  """Whether a program of many runs takes the swept setting ``path`` as a traced value of each run's."""
  return path.startswith(("client.", "method.", "privacy.", "server.")) or path == "federation.backdoor_scale"


def parse_sweep(text: str, config: RunConfig) -> tuple[str, tuple[float, ...]]:
  """``client.learning_rate=1e-3,3e-3`` -> the setting's path and its values; ValueError naming what is wrong."""
  name, _, values = text.partition("=")
  name = name.strip()
  leaves = {leaf.path: leaf for leaf in declare.leaves(config)}
  if name not in leaves:
    raise ValueError(f"--sweep {name!r}: no such setting; a setting is named by its config.json path, e.g. "
                     "client.learning_rate or method.prox.mu (docs/many-runs.md)")
  why = sweep_refusal(leaves[name])
  if why:
    raise ValueError(f"--sweep {name}: {why}; every numeric setting sweeps (and the seed, by --seeds)")
  integer = isinstance(leaves[name].setting.check, declare.Integer)
  try:
    parsed = tuple((int if integer else float)(v) for v in values.split(",") if v.strip())
  except ValueError:
    raise ValueError(f"--sweep {text!r}: expected {name}=V1,V2,... with {'integers' if integer else 'numbers'}"
                     ) from None
  if not parsed:
    raise ValueError(f"--sweep {text!r}: expected {name}=V1,V2,... (the values to run it at)")
  if len(set(parsed)) != len(parsed):
    raise ValueError(f"--sweep {text!r}: expected distinct values")
  turns_off = (traced(name) and not name.startswith("server.")) or name == "federation.malicious_fraction"
  if turns_off and len({v == 0 for v in parsed}) > 1:  # (a server optimizer's beta of 0 turns nothing off)
    raise ValueError(f"--sweep {name}: zero and non-zero values make different programs (a zero turns its part "
                     "off); sweep the zero in a job of its own")
  return name, parsed


def sweep_names(sweeps: Sequence[tuple[str, Sequence[float]]]) -> dict[str, str]:
  """How messages name the swept settings (`declare.named_from`): ``client.learning_rate (from --sweep)``."""
  return {FLAGS_BY_PATH[name].cli: f"{name} (from --sweep)" for name, _ in sweeps}


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
  why = host_loop_reason(method, config.backend)
  if why is None and not runs_in_program(config.round_program, method, config.backend):
    why = f"the rounds run as a host loop (--round-program {config.round_program} on {jax.default_backend()})"
  return why


def check_shared(configs: Sequence[RunConfig]) -> None:
  """ValueError naming the settings in `SHARED` that differ between ``configs``."""
  values = {flag: {get(c) for c in configs} for flag, get in SHARED.items()}
  differ = [f"{flag} ({', '.join(sorted(map(str, seen)))})" for flag, seen in values.items() if len(seen) > 1]
  if differ:
    raise ValueError(f"the runs of one job must share {', '.join(differ)}: run them as separate jobs")


def swept(configs: Sequence[RunConfig], methods: Sequence[Method], given: Method | None
          ) -> tuple[list[dict[str, float]], Callable[[RoundSpec, dict[str, Any]], RoundSpec]]:
  """Every run's traced settings (the numbers that differ between ``configs`` and that a program takes per run),
  and how a program makes a run's spec from the first run's with them; `NotBatchable` for settings that differ and
  no program takes (or a method declared by value, ``given``, that cannot be made again with them)."""
  flat = [{leaf.path: leaf.default for leaf in declare.leaves(c)} for c in configs]
  differ = [path for path in flat[0] if any(f[path] != flat[0][path] for f in flat[1:])]
  untaken = [p for p in differ if not traced(p) and p not in HOST_SETTINGS and not p.startswith(("output.",
                                                                                                  "divergence."))]
  if untaken:
    raise NotBatchable(f"{', '.join(untaken)} cannot differ between runs of one program (it takes per run only "
                       "the numbers of the client, the method, privacy and the server optimizer, the backdoor scale "
                       "and the host's settings); pass --round-program host to run them one after another, or run "
                       "them as separate jobs")
  paths = [p for p in differ if traced(p)]
  read = dict(methods[0].local_settings)
  if given is not None and get_entry(given.name, missing_ok=True) is None and any(
      p.startswith("method.") or p.removeprefix("client.") in read for p in paths):
    raise NotBatchable(f"{given.name} is a method declared by value, made once: it cannot be made again with each "
                       f"run's {', '.join(paths)}; register it (register_method) to sweep them")
  template = configs[0]

  def specialize(spec: RoundSpec, values: dict[str, Any]) -> RoundSpec:
    config = substituted(template, values)
    method = given if given is not None and not any(p.startswith("method.") or p.removeprefix("client.") in read
                                                    for p in values) else \
        build_method(config.method.name, config.method, config.client, checked=False)
    return spec.with_values(local=config.client, method=with_run_settings(config, method), federation=config.federation)

  return [{p: float(value_at(c, p)) for p in paths} for c in configs], specialize


@contextlib.contextmanager
def naming_the_run(config: RunConfig, many: bool) -> Iterator[None]:
  """Within it, an error about one run of a job of ``many`` runs starts with that run's folder (its seed and swept
  values are in the name)."""
  try:
    yield
  except (ValueError, FloatingPointError) as e:
    if many and e.args and isinstance(e.args[0], str) and not e.args[0].startswith(config.output.dir):
      e.args = (f"{config.output.dir}: {e.args[0]}", *e.args[1:])
    raise


def starting_the_unbegun(configs: Sequence[RunConfig], log: Log) -> list[RunConfig]:
  """``configs`` on a --resume of a job, its runs that never began (no folder, or an empty one) to start: --resume
  continues the job, as a signal in one of its runs advises, once any of its runs has begun (none has: the folders
  are wrong, and each run's resume says so)."""
  configs = list(configs)
  if len(configs) < 2 or not configs[0].output.resume:
    return configs
  unbegun = [not results_folder.folder_entries(config.output.dir) for config in configs]
  if all(unbegun) or not any(unbegun):
    return configs
  for i, config in enumerate(configs):
    if unbegun[i]:
      log(f"{config.output.dir}: this run of the job never began; starting it")
      configs[i] = config.replace(resume=False)
  return configs


def run_jobs(configs: Sequence[RunConfig], methods: Sequence[Method] | None = None, log: Log = print,
             max_runs_per_program: int | None = None, memory_budget: int | None = None) -> list[dict[str, Any]]:
  """Runs (or resumes) a job's runs, each run's method made and checked (`build.run_method`; ``methods``: made
  already) before any run trains: together in one program where they can share one (`batchable`), else one after
  another; their summaries."""
  for config in configs:
    preflight.check_settings(config)
    config.output.check_paths()
  configs = starting_the_unbegun(configs, log)
  methods = list(methods or [run_method(config) for config in configs])
  why_apart = batchable(configs[0], methods[0])
  if why_apart is None:
    return run_together(configs, methods=methods, log=log, max_runs_per_program=max_runs_per_program,
                        memory_budget=memory_budget)
  log(f"{len(configs)} runs one after another: {why_apart}")
  datasets: dict[tuple[str, str | None], Any] = {}  # loaded once per dataset; each run takes its own subset of it
  if distributed.is_main_process():
    for config in configs:  # every run's folder and data before the first run trains
      source = (config.data.dataset, config.data.data_dir)
      if source not in datasets:
        check_downloadable(config.data)
        datasets[source] = fdata.load_dataset(*source)
      with naming_the_run(config, len(configs) > 1):
        _check_can_start(config, datasets[source])
  summaries, stopped = [], []  # (the runs the divergence guard stopped: the job goes on, as runs together do)
  with StopRequests(log) as stop:  # a signal between two runs stops the job before the next one
    for i, (config, method) in enumerate(zip(configs, methods)):
      if stop.requested is not None:
        log(f"{signal.Signals(stop.requested).name}: the job stopped before {config.output.dir} "
            f"({i} of {len(configs)} runs ended); to train the rest, rerun the same command with "
            "--resume-or-start")
        raise Interrupted(stop.requested, 0)
      try:
        with naming_the_run(config, len(configs) > 1):
          summaries.append(runner.run_checked(config, method,
                                              datasets.get((config.data.dataset, config.data.data_dir)), log))
      except Interrupted:
        if i + 1 < len(configs):  # (--resume refuses the folders of runs that never started)
          log(f"the job's {len(configs) - i - 1} later run(s) have not started: the same command with "
              "--resume starts them")
        raise
      except DivergenceError as e:
        stopped.append((config, e))
        if i + 1 < len(configs):
          log(f"stopped by the divergence guard: {e}; the job goes on with its other runs")
  if stopped:  # the other runs ended: the first stop ends the job as it would end the run alone
    config, error = stopped[0]
    with naming_the_run(config, len(configs) > 1):
      raise error
  return summaries


def run_together(configs: Sequence[RunConfig], dataset: Any = None, log: Log = print, method: Method | None = None,
                 max_runs_per_program: int | None = None, memory_budget: int | None = None,
                 methods: Sequence[Method] | None = None) -> list[dict[str, Any]]:
  """Runs (or resumes) ``configs`` together and writes each one's results folder; their summaries. ``method``: a
  method declared by value that every run runs; ``methods``: every run's method as `build.run_method` made it."""
  for config in configs:
    preflight.check_settings(config)
    config.output.check_paths()
  check_shared(configs)
  methods = list(methods or [run_method(config, method) for config in configs])
  swept(configs, methods, method)  # settings no program takes, refused before the data loads
  main = distributed.is_main_process()
  with contextlib.ExitStack() as locks, deferred_full_collections():
    for config in configs:
      locks.enter_context(results_folder.lock(config.output.dir, enabled=main))
    if dataset is None:  # loaded once; each run takes its own subset and partition of it
      check_downloadable(configs[0].data)
      dataset = fdata.load_dataset(configs[0].data.dataset, configs[0].data.data_dir)
    # Every run checked and built, and the program's refusals made, before any run's folder is written.
    planned = []
    for i, (config, m) in enumerate(zip(configs, methods)):
      with naming_the_run(config, len(configs) > 1):
        planned.append(runner.plan(config, dataset, log if i == 0 else _quiet, m))
    settings, specialize = swept([p.config for p in planned], [p.method for p in planned], method)
    batch = ManyRuns([p.sim for p in planned], settings, specialize, memory_budget=memory_budget,
                     max_runs_per_program=max_runs_per_program, log=log)
    runs = [runner.open_run(p, log if i == 0 else _quiet) for i, p in enumerate(planned)]
    per_program = (f"{len(runs)} runs in one program" if batch.max_runs_per_program >= len(runs) else
                   f"{len(runs)} runs, at most {batch.max_runs_per_program} per program")
    log(per_program + (f", swept per run: {', '.join(settings[0])}" if settings[0] else "") +
        f", runs mapped by {batch.mapping}; the round lines below are the first run's ({configs[0].output.dir}), "
        "every run's are in its folder's metrics.jsonl")
    return _Together(runs, batch, log, method).train()


def _quiet(_: str) -> None:
  pass


def _check_can_start(config: RunConfig, dataset: fdata.ArrayDataset) -> None:
  """What `runner.prepare` would refuse in ``config``'s folder and data, checked without writing anything: a job
  runs it for every run before its first run trains. (A folder being repaired or continued unchecked is left to
  its turn: those change it.)"""
  output = config.output
  if not (output.repair_metrics or output.resume_unchecked):
    continuation.history(config, _quiet)
  subset, parts = partitioned_dataset(config, dataset)
  preflight.check_fit(config, subset, training_parts(config, parts)[0], _quiet)


class _Together:
  """The training loop of runs that share a program: each run's own loop (`runner._Run`) takes its calls' rows."""

  def __init__(self, runs: list, batch: ManyRuns, log: Log, given: Method | None):
    self.runs, self.batch, self.log, self.given = runs, batch, log, given
    self.stopped: dict[int, DivergenceError] = {}  # runs the divergence guard stopped (their summary written)
    self.alone: list[int] = []  # runs that left the program after a rollback, trained alone after the others

  def train(self) -> list[dict[str, Any]]:
    for run in self.runs:
      run.wall_start = time.perf_counter()
      run.static_costs.start()
    with StopRequests(self.log) as stop:  # also while the runs end: a signal then waits for their files
      try:
        signum, late = stop.agree([False] * len(self.runs))
        while signum is None and not any(late) and self._step(stop):
          signum, late = stop.agree([r.time_up() for r in self.runs])
        if signum is not None:
          self._interrupt(signum)
        for run, up in zip(self.runs, late):
          if up:
            run.stop_for_time()
      finally:
        for i, run in enumerate(self.runs):
          if i not in self.alone:
            run.reporter.close()
            run.manager.wait_until_finished()
      ended = {i: run.finish() for i, run in enumerate(self.runs) if i not in self.stopped and i not in self.alone}
      for i in ended:
        self.runs[i].said_ended(stop.requested)
      ended.update({i: self.runs[i].train() for i in self.alone if i not in self.stopped})  # (a signal stops them)
    summaries = [ended[i] for i in sorted(ended)]
    if self.stopped:  # the other runs finished: the first stop ends the job as it would end the run alone
      i, stop = next(iter(self.stopped.items()))
      with naming_the_run(self.runs[i].config, len(self.runs) > 1):
        raise stop
    return summaries

  def _step(self, signals: StopRequests) -> bool:
    """One call of the runs at the earliest round (the rounds a signal waits for); False when every run is done."""
    active = [i for i, r in enumerate(self.runs)
              if r.state.round < r.config.rounds and i not in self.stopped and i not in self.alone]
    if not active:
      return False
    done = min(self.runs[i].state.round for i in active)
    chosen = [i for i in active if self.runs[i].state.round == done]
    every = [self.runs[i].config.output.checkpoint_every for i in chosen]
    stop = min(min(self.runs[i].config.rounds, (done // e + 1) * e) for i, e in zip(chosen, every))
    count = self.batch.call_length(chosen, done, stop)
    config = self.runs[chosen[0]].config
    evaluate = {r for r in range(done + 1, done + count + 1) if r % config.eval_every == 0 or r == config.rounds}
    results = self.batch.run(chosen, [self.runs[i].state for i in chosen], count, evaluate,
                             signals.calling(range(done + 1, done + count + 1)))
    for i, (state, rows) in zip(chosen, results):
      run = self.runs[i]
      error = run.diverged(rows) if isinstance(rows, Exception) else run.accept(state, rows) if rows else None
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
      settings, specialize = swept([r.config for r in self.runs], [r.method for r in self.runs], self.given)
      self.batch.replace(i, run.sim, settings, specialize)
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


__all__ = ["NotBatchable", "batchable", "parse_sweep", "run_jobs", "run_together", "runs_of", "sweep_refusal"]
