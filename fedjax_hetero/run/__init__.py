"""The run: a `RunConfig` turned into a results folder (`runner.run_experiment`), built (`build`) and checked
(`preflight`), with its checkpoints, history, divergence guard, stop requests and progress; jobs of many runs
(`jobs`). See docs/running.md."""

from fedjax_hetero.run.build import build_simulation, run_method
from fedjax_hetero.run.continuation import saved_config
from fedjax_hetero.run.jobs import run_jobs
from fedjax_hetero.run.runner import run_experiment

__all__ = ["build_simulation", "run_experiment", "run_jobs", "run_method", "saved_config"]
