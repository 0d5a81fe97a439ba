"""What a run shows and writes as it trains, besides metrics.jsonl: the progress display, and the metric
writers chosen with ``--log`` (CSV, TensorBoard through tensorboardX, Weights & Biases).

Every writer gets the same scalars as metrics.jsonl, by slash-separated name (`scalars`): ``train_loss``,
``train_loss_per_group/cnn@1``, ``test_accuracy/mean``, ``dissimilarity/cnn@1/high``, ``samples_per_s``, ...
A terminal shows a progress bar; anything else (a log file, a notebook, ``--no-progress``) gets one plain line
per evaluation, with no carriage returns; so does standard output sent to a file while the bar shows on the
terminal's standard error (``... > run.log``).
"""

from __future__ import annotations

import contextlib
import csv
import numbers
import os
import re
import struct
import sys
from typing import Any, Callable, Mapping, Sequence

from fedjax_hetero.config import RunConfig, as_dict
Row = Mapping[str, Any]


def scalars(row: Row, prefix: str = "") -> dict[str, float]:
  """A metrics row's numbers by slash-separated name (lists, such as the sampled clients, and None left out)."""
  out: dict[str, float] = {}
  for key, value in row.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(scalars(value, name + "/"))
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and key != "round":
      out[name] = float(value)
  return out


class CsvWriter:
  """``metrics.csv``: one row per round, a column per scalar (rewritten when a new column appears)."""

  def __init__(self, out: str, config: RunConfig):
    self.path, self.columns = os.path.join(out, "metrics.csv"), []

  def write(self, rows: Sequence[Row]) -> None:
    table = [{"round": r["round"], **scalars(r)} for r in rows]
    self.columns = list(dict.fromkeys(["round", *(key for line in table for key in line)]))
    with open(self.path, "w", newline="") as f:
      writer = csv.DictWriter(f, self.columns)
      writer.writeheader()
      writer.writerows(table)

  def add(self, rows: Sequence[Row]) -> None:
    line = {"round": rows[-1]["round"], **scalars(rows[-1])}
    if not set(line) <= set(self.columns):
      self.write(rows)
      return
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, self.columns).writerow(line)

  def close(self) -> None:
    pass


# The package each --log writer needs (an extra: pip install 'fedjax_hetero[logging]').
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def check_writers(names: Sequence[str]) -> None:
  """ValueError for a ``--log`` writer whose package is not installed, before the run loads anything."""
  import importlib.util

  for name in names:
    if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
      raise _missing(name)


def _missing(name: str) -> ValueError:
  return ValueError(f"--log {name} needs {PACKAGES[name]}: pip install 'fedjax_hetero[logging]'")


TAG_CHARACTERS = re.compile(r"[^-/\w.]")  # what tensorboardX replaces in a scalar's name to make its tag


class TensorBoardWriter:
  """TensorBoard event files under ``tensorboard/``, one scalar per name, stepped by round (TensorBoard's tags
  allow no ``@``: tensorboardX writes ``test_accuracy/cnn@0.5`` as ``test_accuracy/cnn_0.5``)."""

  def __init__(self, out: str, config: RunConfig):
    try:
      from tensorboardX import SummaryWriter
    except ImportError:  # (found by `check_writers` but broken)
      raise _missing("tensorboard") from None
    self.folder = os.path.join(out, "tensorboard")
    self.writer, self.logged = SummaryWriter(self.folder), None

  def write(self, rows: Sequence[Row]) -> None:
    """The kept rows' scalars the event files lack (a resume that adds ``--log tensorboard`` or follows a segment run
    without it, a final round evaluated on a resume); those written before stay as they are."""
    if self.logged is None:
      self.logged = logged_scalars(self.folder)
    for row in rows:
      self._log(row, missing_only=True)
    self.writer.flush()

  def add(self, rows: Sequence[Row]) -> None:
    self._log(rows[-1], missing_only=False)
    self.writer.flush()

  def _log(self, row: Row, missing_only: bool) -> None:
    for name, value in scalars(row).items():
      tagged = (TAG_CHARACTERS.sub("_", name).lstrip("/"), row["round"])  # (the tag tensorboardX writes)
      if not (missing_only and tagged in self.logged):
        self.writer.add_scalar(name, value, row["round"])
        if self.logged is not None:
          self.logged.add(tagged)

  def close(self) -> None:
    self.writer.close()


def logged_scalars(folder: str) -> set[tuple[str, int]]:
  """The (tag, step) of every scalar in a folder's TensorBoard event files (TFRecord framing, tensorboardX's Event
  proto); a file's reading ends at a record a kill cut short or that does not parse."""
  from google.protobuf.message import DecodeError
  from tensorboardX.proto import event_pb2

  names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
  logged: set[tuple[str, int]] = set()
  for path in (os.path.join(folder, n) for n in names if "tfevents" in n):
    if not os.path.isfile(path):
      continue
    with open(path, "rb") as f:
      data = f.read()
    position = 0
    while position + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[position:position + 8])
      record = data[position + 12:position + 12 + length]
      try:
        event = event_pb2.Event.FromString(record) if len(record) == length else None
      except DecodeError:
        event = None
      if event is None:
        break
      logged.update((value.tag, event.step) for value in event.summary.value)
      position += 16 + length
  return logged


class WandbWriter:
  """A Weights & Biases run named after the results folder (``WANDB_MODE=offline`` keeps it on disk). Its x-axis is
  the logged ``round``, not W&B's own step, which must grow: W&B drops a row at a lower step, so the rounds a
  rollback trains again would be lost (and the round they replace overwritten)."""

  def __init__(self, out: str, config: RunConfig):
    try:
      import wandb
    except ImportError:
      raise _missing("wandb") from None
    self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fedjax_hetero"), dir=out,
                          name=os.path.basename(os.path.abspath(out)), config=as_dict(config), reinit=True)
    self.run.define_metric("round")
    self.run.define_metric("*", step_metric="round")

  def write(self, rows: Sequence[Row]) -> None:
    pass  # (each process's W&B run holds the rounds it trains: a resume's, those after it)

  def add(self, rows: Sequence[Row]) -> None:
    self.run.log({"round": rows[-1]["round"], **scalars(rows[-1])})

  def close(self) -> None:
    self.run.finish()


WRITERS = {"csv": CsvWriter, "tensorboard": TensorBoardWriter, "wandb": WandbWriter}


def evaluation_line(row: Row, rounds: int) -> str:
  """``round 10/100: loss 0.5120, 1,234 samples/s, mean accuracy 84.10% (cnn@1 86.00, ...)``."""
  accuracy = row["test_accuracy"]
  groups = ", ".join(f"{name} {100 * value:.2f}" for name, value in accuracy.items() if name != "mean")
  return (f"round {row['round']}/{rounds}: {_training(row, '.4f', ',.0f')}, mean accuracy "
          f"{100 * accuracy['mean']:.2f}% ({groups})")


def _training(row: Row, loss: str, speed: str) -> str:
  """The round's loss and speed; a round in which no client took a step has neither (its 0 is no measurement)."""
  if not row.get("examples"):
    answered_none = row.get("dropped") and len(row["dropped"]) == len(set(row["clients"]))
    return "no sampled client answered" if answered_none else "no local step taken"
  return f"loss {row['train_loss']:{loss}}, {row['samples_per_s']:{speed}} samples/s"


def _terminal_columns() -> int:
  try:
    return os.get_terminal_size(sys.stderr.fileno()).columns
  except (OSError, ValueError):
    return 0


class Reporter:
  """The progress display and the ``--log`` writers of one run (process 0's; the others' is silent)."""

  def __init__(self, config: RunConfig, title: str, log: Callable[[str], None], main: bool):
    self.rounds, self.log, self.bar = config.rounds, log, None
    self.writers = [WRITERS[name](config.output.dir, config) for name in config.output.log] if main else []
    if main and config.output.progress and sys.stderr.isatty():
      from tqdm import tqdm
      width = dict(dynamic_ncols=True) if _terminal_columns() else dict(ncols=100, nrows=24)  # (of no size)
      self.bar = tqdm(total=config.rounds, desc=title, unit="round", **width)
    self.lines = self.bar is None or not sys.stdout.isatty()

  def restart(self, rows: Sequence[Row]) -> None:
    """The rows kept from before (a resume, a rollback): the writers that rewrite whole files rewrite them."""
    for writer in self.writers:
      writer.write(rows)
    if self.bar is not None:
      self.bar.n = rows[-1]["round"] if rows else 0
      self.bar.refresh()

  def add(self, rows: Sequence[Row]) -> None:
    """A new round, the last of ``rows``."""
    for writer in self.writers:
      writer.add(rows)
    row = rows[-1]
    if self.bar is not None:
      evaluated = next((r["test_accuracy"] for r in reversed(rows) if r.get("test_accuracy")), None)
      postfix = ({"loss": f"{row['train_loss']:.3f}", "samples/s": f"{row['samples_per_s']:.0f}"}
                 if row.get("examples") else {"training": _training(row, "", "")})
      self.bar.set_postfix({**postfix, **({"acc": f"{100 * evaluated['mean']:.2f}%"} if evaluated else {})},
                           refresh=False)
      self.bar.n = row["round"]
      self.bar.refresh()
    if self.lines and row.get("test_accuracy"):
      # (`... | tee run.log`: the line and the bar share the terminal, so the bar steps aside for it)
      with contextlib.nullcontext() if self.bar is None else self.bar.external_write_mode():
        self.log(evaluation_line(row, self.rounds))

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    for writer in self.writers:
      writer.close()
