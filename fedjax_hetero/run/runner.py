"""An experiment from config to results folder: data, partition, rounds, checkpoints, plots.

``run_experiment(RunConfig(...))`` is what ``python -m experiments.<dataset>`` and the notebooks call; with
``method=`` it runs a method declared by value (`fedjax_hetero.methods.Method`) the same way. The results
folder holds ``metrics.jsonl`` (one JSON object per round), ``config.json`` (the settings and the run's history,
`fedjax_hetero.run.history`), ``summary.json``, ``accuracy.png``, the partition report and plot, and orbax checkpoints
under ``checkpoints/``. Under the backdoor attack (``--malicious-fraction``) the malicious clients' ids are in
``summary.json`` (``malicious_clients``), at the end of ``partition.txt`` (by architecture group) and in the log.

In a multi-process run (`fedjax_hetero.distributed`) every process runs the experiment the same way, and
process 0 alone writes the folder's files, logs and shows progress; every process saves and restores the
checkpoints (orbax's multi-process checkpointing), so the folder must be on a file system all of them see.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from typing import Any, Callable

import jax

from fedjax_hetero import data as fdata, distributed, garbage
from fedjax_hetero.config import RunConfig, as_dict
from fedjax_hetero.methods import Method, build_method
from fedjax_hetero.rounds import ServerState, Simulation, costs
from fedjax_hetero.rounds.client_eval import final_summary
from fedjax_hetero.rounds.rows import NonFiniteLossError
from fedjax_hetero.run import checkpoints, continuation, metrics_log, preflight, privacy_accounting, results_folder
from fedjax_hetero.run import history as run_history
from fedjax_hetero.run.build import Planned, build_simulation, run_method, with_run_settings, write_partition
from fedjax_hetero.run.guard import (DivergenceError, DivergenceWatch, diverged_round, in_restored_model, ranked,
                                     repeated, rollback_reason, rollback_record, rolled_back, stop_advice)
from fedjax_hetero.run.interruption import Interrupted, StopRequests
from fedjax_hetero.run.plot import plot_accuracy
from fedjax_hetero.run.reporting import Reporter

__all__ = ["advance", "run_experiment"]

Log = Callable[[str], None]


def advance(sim: Simulation, state: ServerState, config: RunConfig, while_compiling: Callable[[], Any] | None = None,
            stop: StopRequests | None = None) -> tuple[ServerState, list[dict[str, Any]]]:
  """The training loop's one step: ``state`` (consumed: a rollback restores) advanced by one call of the simulation,
  which ends at the next checkpoint round or the last round (the unit of checkpoints, of the divergence stop and of
  a stop request; one round on the host loop), and its rounds' metrics rows (with the test accuracy on evaluation
  rounds and after the last). A signal to the run's ``stop`` names the call's rounds; in a single-process run (the
  processes stop at the same call) one that comes while the call's program compiles beside the setup ends it early
  with no round."""
  every = config.output.checkpoint_every
  count = sim.call_length(state.round, min(config.rounds, (state.round // every + 1) * every))
  rounds = range(state.round + 1, state.round + count + 1)
  return sim.run_call(state, count, {r for r in rounds if r % config.eval_every == 0 or r == config.rounds},
                      while_compiling, stop and stop.calling(rounds))


def _quiet(_: str) -> None:
  pass


def run_experiment(config: RunConfig, dataset: fdata.ArrayDataset | None = None, log: Log = print,
                   method: Method | None = None) -> dict[str, Any]:
  """Runs (or resumes) an experiment and writes its results folder; returns the summary.

  ``method``: a method declared by value, run instead of the catalog's (``config.method.name`` must be its
  name). Raises `guard.DivergenceError` when the run diverges and ``config.divergence`` says stop (after
  writing the summary; the best checkpoint is kept). In a multi-process run every process calls it, with the
  same config; only process 0 writes files and logs. The run holds its folder's lock throughout
  (`results_folder.lock`): a second run on the folder fails at once, naming the holder."""
  preflight.check_settings(config)  # settings that would do nothing
  config.output.check_paths()
  return run_checked(config, run_method(config, method), dataset, log)


def run_checked(config: RunConfig, method: Method, dataset: fdata.ArrayDataset | None = None,
                log: Log = print) -> dict[str, Any]:
  """`run_experiment` of a config whose settings were checked and whose method `run_method` made."""
  main = distributed.is_main_process()
  with results_folder.lock(config.output.dir, enabled=main), garbage.deferred_full_collections():
    return prepare(config, dataset, log, method).train()


def method_for(config: RunConfig, method: Method) -> Method:
  """``method`` (as `run_method` made it) for ``config``'s local training: made again where its build read a
  learning rate that ``config`` changed (SCAFFOLD's correction, after a rollback)."""
  built_with = dict(method.local_settings).get("learning_rate")
  if built_with is None or built_with == config.client.learning_rate:
    return method
  return build_method(config.method.name, config.method, config.client)


def prepare(config: RunConfig, dataset: fdata.ArrayDataset | None, log: Log, method: Method) -> "_Run":
  """A run of ``method`` (`run_method`'s) ready to train: folder prepared, state restored on --resume, a fresh run's
  first call compiling (`Simulation.compile_first_call_beside`); the caller holds the lock, ran the preflight."""
  return open_run(plan(config, dataset, log, method), log, first_call_beside=True)


def plan(config: RunConfig, dataset: fdata.ArrayDataset | None, log: Log, method: Method) -> Planned:
  """`prepare`'s checks and simulation, before anything is written: a job plans all its runs first."""
  log = log if distributed.is_main_process() else _quiet
  config.data.check_paths()
  config, history, changed = continuation.history(config.replace(method=method.name), log)  # ("FedAvg" recorded)
  method = method_for(config, method)  # (a resume goes on with the learning rate a rollback left)
  sim, parts = build_simulation(config, dataset, log, method, compile_init=True)  # (before the folder is made)
  data = results_folder.check_data(config, sim.spec, log)  # a resume trains on the data it started on
  return Planned(config, history, changed, method, sim, parts, data)


def open_run(planned: Planned, log: Log, first_call_beside: bool = False) -> "_Run":
  """The planned run's folder prepared, its state restored on --resume (``first_call_beside``: `prepare`'s)."""
  main = distributed.is_main_process()
  log, config = log if main else _quiet, planned.config
  distributed.barrier("fedjax_hetero.run.runner: settings read")  # before process 0 changes the folder
  if main:
    continuation.prepare_folder(config)
    results_folder.record_data(config, planned.data)
  partition = write_partition(planned.sim, planned.parts, config.output.dir, main, config.output.resume)
  run = _Run(config, log, planned.method, planned.sim, planned.history, main, partition)
  if first_call_beside and not config.output.resume and config.rounds:
    planned.sim.compile_first_call_beside(run.static_costs.start)
  run.begin(planned.sim.init_state(), planned.changed)
  return run


class _Run:
  """The training loop's state: the config (the learning rates change on a rollback), the simulation, the
  rows so far, the history, the checkpoints and the divergence guard."""

  def __init__(self, config: RunConfig, log: Log, method: Method, sim: Simulation, history: run_history.History,
               main: bool, partition: concurrent.futures.Future):
    self.config, self.log, self.method, self.sim = config, log, method, sim  # (the method before `with_run_settings`)
    self.history, self.main, self.out, self.partition = history, main, config.output.dir, partition  # (being written)
    self.metrics_path, self.wall_start = os.path.join(self.out, "metrics.jsonl"), 0.0
    self.rows: list[dict[str, Any]] = []
    self.state: ServerState | None = None
    self.stopped_after: dict[str, Any] | None = None  # where --stop-after ended this process's training
    self.kept_summary: dict[str, Any] | None = None  # a finished run's summary, kept by a resume that adds nothing
    self.reporter = Reporter(config, sim.spec.method.name, log, main)
    self.static_costs = costs.InBackground(sim.spec)  # (per client and group: a rollback's learning rate keeps them)

  def begin(self, state: ServerState, changed: str | None) -> None:
    """Restores the latest intact checkpoint on --resume, and writes config.json and the metrics kept."""
    if self.config.output.resume:
      restored = checkpoints.restore_latest_intact(self.out, state, self.log)
      if restored is not None:
        state = self.sim.place(restored)
        self.log(f"resumed from round {state.round}")
      self.rows = metrics_log.read_for_resume(self.metrics_path, state.round, self.log)
    # Every process has read the folder (and process 0 set damaged checkpoints aside) before it is rewritten.
    distributed.barrier("fedjax_hetero.run.runner: folder read")
    self.manager = checkpoints.manager(self.out, self.config.output.checkpoint_every,
                                       self.config.output.keep_checkpoints)
    reason = ("start" if state.round == 0 else f"resumed with changed local training: {changed}" if changed
              else "resumed (the folder kept no earlier segments)")
    if state.round < self.config.rounds:
      self.history.next_segment(self.config, state.round + 1, reason)
    elif state.round:
      self.kept_summary = self._nothing_to_train(state)
    self.state = state
    self._rewrite()

  def _nothing_to_train(self, state: ServerState) -> dict[str, Any] | None:
    """A resume with no round left: its last round, now the final one, evaluated if --eval-every left it out (a
    run stopped early, resumed with --rounds as done); returns the folder's summary when it has nothing to add."""
    last, rounds = self.rows[-1], f"{state.round} round{'s' if state.round != 1 else ''}"
    if last["test_accuracy"] is None:
      self.rows[-1] = {**last, "test_accuracy": self.sim.evaluate(state), **self.sim.client_accuracy(state)}
      self.log(f"{self.out}: the run has its {rounds} already; nothing to train: evaluated its last round, which "
               "--eval-every had left out (a larger --rounds continues it)")
      return None
    self.log(f"{self.out}: the run has its {rounds} already; nothing to train (a larger --rounds continues it)")
    return continuation.finished_summary(self.out, last)

  def _rewrite(self) -> None:
    """config.json and metrics.jsonl as they stand, and the guard and best accuracy rebuilt from the rows."""
    self.reporter.restart(self.rows)
    if self.main:
      run_history.write(self.config, self.history)
      with open(self.metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in self.rows)
    self.watch = DivergenceWatch(self.config.divergence, self.sim.spec.store.num_classes)
    self.watch.replay(self.rows)
    self.best = max((r["test_accuracy"]["mean"] for r in self.rows if r.get("test_accuracy")), default=-1.0)

  def train(self) -> dict[str, Any]:
    """Trains the remaining rounds; returns the summary (written with the plot). On SIGINT or SIGTERM it stops
    after the round in progress, writes what it has and raises `Interrupted`."""
    self.wall_start = time.perf_counter()
    with StopRequests(self.log) as stop:  # also while the run ends: a signal then waits for its files
      try:
        try:
          signum, (late,) = stop.agree([False])
          while self.state.round < self.config.rounds and signum is None and not late:
            error = self._round(stop)
            if error is not None:
              self._recover(error)
            signum, (late,) = stop.agree([self.time_up()])
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the handlers: the round in progress is lost
          self._interrupt(signal.SIGINT, clean=False)
        if signum is not None and self.state.round < self.config.rounds:
          self._interrupt(signum, clean=True)
        elif late:
          self.stop_for_time()
      finally:
        self.reporter.close()
        self.manager.wait_until_finished()
      summary = self.finish()
      self.said_ended(stop.requested)
    return summary

  def said_ended(self, signum: int | None) -> None:
    """Says that a signal that came as the run ended (in its last call, or as it wrote its results) found it done."""
    if signum is not None:
      done = self.state.round
      ended = (f"finished its {done} rounds" if done >= self.config.rounds else
               f"stopped after round {done} (--stop-after: rerun with --resume to continue)")
      self.log(f"{signal.Signals(signum).name} came as the run ended: it {ended}; its results are in {self.out}")

  def time_up(self) -> bool:
    """Whether --stop-after's seconds have passed with rounds left (checked at the end of a call)."""
    limit = self.config.stop_after
    return (limit is not None and self.state.round < self.config.rounds
            and time.perf_counter() - self.wall_start >= limit)

  def _save_now(self, save: bool = True) -> int:
    """Waits for a pending checkpoint and (with ``save``) saves the state of the last completed round if no
    checkpoint holds it yet; returns that round."""
    self.manager.wait_until_finished()
    done = self.state.round
    if save and done and self.manager.latest_step() != done and checkpoints.save(self.manager, self.state,
                                                                                force=True):
      self.manager.wait_until_finished()
    return done

  def stop_for_time(self) -> None:
    """Ends a run at --stop-after: its state saved, a resume hint; the summary says where it stopped."""
    done = self._save_now()
    self.stopped_after = {"seconds": self.config.stop_after, "completed_round": done}
    self.log(f"--stop-after {self.config.stop_after:g} s: stopped after round {done} of {self.config.rounds}, "
             f"checkpoint saved; to continue, rerun the same command with --resume (results so far in {self.out})")

  def _interrupt(self, signum: int, clean: bool) -> None:
    """Ends a stopped run: its state saved (after a completed round), summary and plot written, a resume hint."""
    done = self._save_now(clean)
    self.finish(interrupted={"signal": signal.Signals(signum).name, "completed_round": done})
    self.log(f"interrupted after round {done} of {self.config.rounds} ({signal.Signals(signum).name}); "
             f"to continue, rerun the same command with --resume (results so far in {self.out})")
    raise Interrupted(signum, done)

  def _round(self, stop: StopRequests) -> DivergenceError | None:
    """One call of rounds (`advance`) trained, logged and checkpointed; the divergence it shows, if any (the
    state then stays where it was, and the call's rows after the diverged round are dropped)."""
    try:
      state, rows = advance(self.sim, self.state, self.config, self.static_costs.start, stop)
    except NonFiniteLossError as e:
      return self.diverged(e)
    return self.accept(state, rows) if rows else None  # (none: stopped before the call)

  def diverged(self, error: NonFiniteLossError) -> DivergenceError:
    """A non-finite loss or model of the next call as the divergence it shows. With the guard off the run stops
    here: its summary and plot are written, and the error is raised, naming where they are."""
    round_ = diverged_round(error, self.state.round + 1)
    if self.config.divergence.action != "off":
      # (clients whose losses rose that far blew the weights up themselves: lower rates mend that, not the server)
      rises = (self.watch.loss_rise(round_, g, loss) for g, loss in getattr(error, "losses", {}).items())
      return next((e for e in rises if e is not None), None) or DivergenceError.of_non_finite(error, round_)
    self.manager.wait_until_finished()
    self.finish({"round": round_, "group": getattr(error, "group", None), "reason": str(error),
                 "best_checkpoint": checkpoints.best_step(self.manager)})
    done = self.state.round
    where = f"results of rounds 1-{done} in {self.out}" if done else f"no round completed; summary in {self.out}"
    raise type(error)(f"{error} ({where})", round_, getattr(error, "group", None)) from None

  def accept(self, state: ServerState, rows: list[dict[str, Any]]) -> DivergenceError | None:
    """A call's new state and rows logged and checkpointed (see `_round`)."""
    best_before = self.best
    for row in rows:
      row = costs.costed_row(row, self.static_costs, self.rows[-1] if self.rows else None)
      row = privacy_accounting.private_row(row, self.config, self.history.rollbacks)
      self.rows.append(row)
      if self.main:
        with open(self.metrics_path, "a") as f:
          f.write(json.dumps(row) + "\n")
      self.reporter.add(self.rows)
      error = self.watch.check(row) if self.config.divergence.action != "off" else None
      if error is not None:
        return error
      if row["test_accuracy"]:
        self.best = max(self.best, row["test_accuracy"]["mean"])
    self.state = state
    accuracy = rows[-1]["test_accuracy"]["mean"] if rows[-1]["test_accuracy"] else None
    accuracy = accuracy if ranked(accuracy, self.watch.num_classes) else None  # (a model at chance is no best)
    new_best = accuracy is not None and accuracy > best_before and accuracy >= self.best  # (at the call's end)
    final = state.round == self.config.rounds
    if checkpoints.save(self.manager, state, force=final or new_best, accuracy=accuracy) and \
        jax.tree.leaves(state.memory):
      self.manager.wait_until_finished()  # the next round writes the memory in place: the save must have read it
    return None

  def _recover(self, error: DivergenceError) -> None:
    """A diverged round: stop (raising), or roll back to the best checkpoint (none above chance, or one whose model
    holds the divergence: to the initial model, round 0) with lower learning rates (`guard.rolled_back`)."""
    self.manager.wait_until_finished()
    best, again = checkpoints.best_step(self.manager), repeated(error, self.history.rollbacks)
    restart = again is not None and in_restored_model(again, error)  # (then the rates stay: `guard`)
    if (self.config.divergence.action == "stop" or len(self.history.rollbacks) >= self.config.divergence.max_rollbacks
        or error.in_server_step or (again and not restart)):  # (lower rates mend neither: `guard`)
      self._stop(error, best, None if restart else again)
    best = 0 if restart else best or 0
    self.config, changes = rolled_back(self.config, lower=not restart)
    reason = rollback_reason(error, best, changes, again if restart else None)
    self.log(f"diverged: {reason}")
    checkpoints.drop_after(self.manager, best)
    # The rounds go on with the lower rates: the method may read the clients' (SCAFFOLD's correction).
    self.method = method_for(self.config, self.method)
    self.sim = self.sim.with_values(local=self.config.client, method=with_run_settings(self.config, self.method))
    self.state = self.sim.place(checkpoints.restore(self.manager, best, self.sim.spec.state_shapes) if best else
                                self.sim.init_state())
    self.history.rollbacks.append(rollback_record(error, best, changes))
    self.history.next_segment(self.config, best + 1, reason)
    self.rows = [r for r in self.rows if r["round"] <= best]
    self._rewrite()

  def _stop(self, error: DivergenceError, best: int | None, again: dict[str, Any] | None = None) -> None:
    """Ends a diverged run: the summary says where and why, and the error names the best checkpoint."""
    self.finish({"round": error.round, "group": error.group, "reason": str(error), "best_checkpoint": best})
    advice = stop_advice(self.config, len(self.history.rollbacks), best, self.manager.directory, error, again)
    raise DivergenceError(f"{error}; {advice}", error.round, error.group) from None

  def finish(self, stopped: dict | None = None, interrupted: dict | None = None) -> dict[str, Any]:
    """Writes summary.json and accuracy.png (process 0); returns the summary (a finished run's, as it was, when
    a resume had nothing to add: `_nothing_to_train`)."""
    self.partition.result()
    if self.kept_summary is not None and stopped is None and interrupted is None:
      self._plot(only_if_missing=True)
      return self.kept_summary
    summary = {**self.summary(stopped, waits=interrupted is None or bool(self.rows)), "interrupted": interrupted,
               "stopped_after": self.stopped_after}
    if self.main:
      with open(os.path.join(self.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    self._plot()
    return summary

  def _plot(self, only_if_missing: bool = False) -> None:
    """accuracy.png (process 0); ``only_if_missing``: a kept summary's run killed before its plot gets it now."""
    path = os.path.join(self.out, "accuracy.png")
    if self.main and not (only_if_missing and os.path.exists(path)):
      if only_if_missing:
        self.log(f"{self.out}: accuracy.png was missing (the run stopped before it was drawn); drew it")
      plot_accuracy(self.rows, path, f"{self.sim.spec.method.name} on {self.config.data.dataset} "
                    f"({self.config.data.partition})")

  def summary(self, stopped: dict[str, Any] | None, waits: bool = True) -> dict[str, Any]:
    """summary.json's fields (``costs`` None unless ``waits``: a run stopped before a round does not wait for them)."""
    rows, spec = self.rows, self.sim.spec
    evaluated = [r for r in rows if r.get("test_accuracy")]
    best = max(evaluated, key=lambda r: (r["test_accuracy"]["mean"], r["round"])) if evaluated else None
    train_seconds, final_round = sum(r["round_seconds"] for r in rows), (rows[-1]["round"] if rows else 0)
    return {
        "method": spec.method.name,
        "final_round": final_round,
        "final_accuracy": evaluated[-1]["test_accuracy"] if evaluated else None,
        "final_accuracy_round": evaluated[-1]["round"] if evaluated else None,  # final_round's, if it was evaluated
        "best_mean_accuracy": best["test_accuracy"]["mean"] if best else None,
        "best_round": best["round"] if best else None,
        "wall_seconds_this_run": time.perf_counter() - self.wall_start,
        "train_seconds_all_rounds": train_seconds,
        "mean_samples_per_s": sum(r["examples"] for r in rows) / max(train_seconds, 1e-9),
        "backend": self.sim.cohorts.name,
        "client_terms": [t.name for t in spec.method.terms], "server_steps": [s.name for s in spec.method.server],
        "platform": jax.default_backend(), "processes": jax.process_count(), "devices": jax.device_count(),
        "parameters_per_group": {g.name: m.num_owned() for g, m in zip(spec.groups, spec.maps)},
        "costs": costs.summary_costs(self.static_costs, rows) if waits else None,
        **({"privacy": privacy_accounting.summary_privacy(self.config, rows)} if self.config.privacy.on else {}),
        "segments": self.history.spans(final_round), "rollbacks": list(self.history.rollbacks),
        "stopped_by_divergence": stopped,
        "config": as_dict(self.config),
        # The backdoor attack's malicious client ids (`fedjax_hetero.client.attack`), only when it is on.
        **({"malicious_clients": [int(c) for c in spec.malicious_clients]} if len(spec.malicious_clients) else {}),
        # Under per-client evaluation: the last evaluation's mean, worst 10% and spread per group, and of all clients.
        **({"final_client_accuracy": final_summary(rows)} if spec.client_eval is not None else {}),
        # Under client availability: how many sampled clients did not answer, over all rounds and per group.
        **({"clients_dropped": sum(len(r["dropped"]) for r in rows),
            "clients_dropped_per_group": {g.name: sum(r["dropped_per_group"][g.name] for r in rows)
                                          for g in spec.groups}} if spec.availability.on else {}),
    }
