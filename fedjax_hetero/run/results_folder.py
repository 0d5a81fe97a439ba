"""The results folder a run owns: one run at a time, what ``--overwrite`` may delete, and what a resume reads.

* `lock`: a run (or a resume) holds an exclusive ``fcntl.flock`` on ``<folder>/.lock`` while it runs. The
  kernel drops the lock with the process, so a run killed with SIGKILL leaves no stale lock; a second process
  on the folder fails at once, naming the holder's pid (written into the file). The lock file goes when the
  run ends (and the folder, if the run made it and wrote nothing).
* `never_started`: a run killed before it wrote ``config.json`` (in its first compilation) leaves only
  `BEFORE_SETTINGS`; such a folder holds no run, and a start, ``--resume-or-start`` or ``--resume`` starts it.
* `check_fresh`, `clear_for_overwrite`: ``--overwrite`` deletes only a folder that holds a run (its
  ``config.json``, ``metrics.jsonl``, ``checkpoints/`` or ``partition.txt``); anything else is refused,
  naming what is there.
* `check_resume`: before a resume reads anything, ``config.json`` and ``summary.json`` must parse as a run's
  settings (errors name the file) and ``metrics.jsonl`` must be one row per round (`fedjax_hetero.run.metrics_log`).
  A folder holding checkpoints or metrics but no readable settings is refused: nothing could check that the
  command continues the same run. ``--resume-unchecked`` continues it anyway (the unreadable file is set
  aside as ``*.unreadable``, a summary.json beside it as ``*.set-aside``), ``--repair-metrics`` rebuilds the
  metrics it can.
* `check_data`, `record_data`: the data a run trains and evaluates on are fingerprinted into ``data_fingerprint.json``
  (`fedjax_hetero.data.fingerprint`); a resume on other data (another ``--data-dir``, swapped files) is refused
  (`data_changes` says what differs; ``analyze`` warns with `data_warning`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import os
import shutil
from typing import Any, Callable, Iterator

import numpy as np

from fedjax_hetero import distributed
from fedjax_hetero.config import cli_flag
from fedjax_hetero.data import fingerprint
from fedjax_hetero.os_errors import describe
from fedjax_hetero.run import metrics_log
from fedjax_hetero.validation import first_line

LOCK_FILE = ".lock"
# A folder holding one of these is a run's (partition.txt: a run killed before it wrote config.json; the others
# are written beside config.json, but any of them marks the folder as one this library wrote).
RUN_ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", "partition.txt", "summary.json", "data_fingerprint.json",
               "damaged_checkpoints", metrics_log.DROPPED_CHECKPOINTS)
SETTINGS_FILES = ("config.json", "summary.json")
FINGERPRINT_FILE = "data_fingerprint.json"
TRACE = "availability_trace"  # the fingerprint's entry of the absences a trace file lists
# What a run writes before config.json (`fedjax_hetero.run.runner.prepare`).
BEFORE_SETTINGS = ("partition.txt", "partition.png", FINGERPRINT_FILE)
UNREADABLE = ".unreadable"
SET_ASIDE = ".set-aside"  # (the summary.json beside a config.json set aside as unreadable; not read)


class FolderInUseError(ValueError):
  """Another process holds the results folder's lock."""


def _folder_flag(output_dir: str) -> str:
  return f"{cli_flag('output.dir')} {output_dir!r}"


def _make_folder(output_dir: str) -> bool:
  """Creates the folder (and its parents) if needed; returns whether it did. One-line errors for the paths the
  OS refuses (a dangling symlink, a name too long, /proc, a read-only file system)."""
  if os.path.islink(output_dir) and not os.path.exists(output_dir):
    raise ValueError(f"{_folder_flag(output_dir)} is a symbolic link to {os.readlink(output_dir)!r}, which does "
                     "not exist; create its target or choose another folder")
  if os.path.isdir(output_dir):
    return False
  try:
    os.makedirs(output_dir)
  except OSError as e:
    if isinstance(e, FileExistsError) and os.path.isdir(output_dir):  # (another run made it since: the lock decides)
      return False
    raise ValueError(f"{_folder_flag(output_dir)} cannot be created: {describe(e)}") from None
  return True


def _holder(fd: int) -> str:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 64).decode(errors="replace").strip()
  return f"pid {text}" if text.isdigit() else "a process that is starting"


def _acquire(output_dir: str) -> int:
  """An open descriptor of the folder's lock file, locked; FolderInUseError if another process holds it."""
  path = os.path.join(output_dir, LOCK_FILE)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise ValueError(f"{_folder_flag(output_dir)} cannot be used: {describe(e)}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
      os.close(fd)
      if holder is None:
        raise ValueError(f"{_folder_flag(output_dir)} cannot be locked: {describe(e)}") from None
      raise FolderInUseError(f"{_folder_flag(output_dir)} is in use by another run ({holder}, which holds {path}); "
                             "wait for it to end, or choose another folder") from None
    if _same_file(fd, path):
      break
    os.close(fd)  # the holder removed the file as it ended, after this process opened it: lock the new one
  os.ftruncate(fd, 0)
  os.write(fd, str(os.getpid()).encode())
  return fd


def _same_file(fd: int, path: str) -> bool:
  try:
    return os.path.samestat(os.fstat(fd), os.stat(path))
  except FileNotFoundError:
    return False


def _release(fd: int, output_dir: str, made_folder: bool) -> None:
  """Unlocks, removing the lock file while still holding it (`_acquire` retries on a removed file), and the
  folder if this run made it and left nothing in it."""
  try:
    os.remove(os.path.join(output_dir, LOCK_FILE))
    if made_folder and not os.listdir(output_dir):
      os.rmdir(output_dir)
  except OSError:
    pass  # (the folder went away under the run: nothing to tidy)
  finally:
    os.close(fd)


_MADE_HERE: set[str] = set()  # the folders this process's `lock` created, while it holds them


@contextlib.contextmanager
def lock(output_dir: str, enabled: bool = True) -> Iterator[None]:
  """Holds the results folder's lock for the block (see the module docstring); creates the folder if needed.
  ``enabled`` False (the other processes of a multi-process run, which process 0 speaks for) does nothing."""
  if not enabled:
    yield
    return
  made_folder = _make_folder(output_dir)
  try:
    fd = _acquire(output_dir)
  except BaseException:
    if made_folder:
      with contextlib.suppress(OSError):
        os.rmdir(output_dir)
    raise
  if made_folder:
    _MADE_HERE.add(os.path.abspath(output_dir))
  try:
    yield
  finally:
    _MADE_HERE.discard(os.path.abspath(output_dir))
    concurrent.futures.wait(_WRITING.pop(os.path.abspath(output_dir), ()))
    _release(fd, output_dir, made_folder)


_WRITING: dict[str, list[concurrent.futures.Future]] = {}  # `write_beside`'s, by folder
_writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedjax_hetero-folder")


def write_beside(output_dir: str, write: Callable[[], None]) -> concurrent.futures.Future:
  """``write`` (of files into the locked folder ``output_dir``) run on a thread of its own while the caller goes on;
  `lock` holds the folder until it has ended. The future's result raises what it raised."""
  future = _writer.submit(write)
  _WRITING.setdefault(os.path.abspath(output_dir), []).append(future)
  return future


def left_empty(output_dir: str) -> bool:
  """Whether the folder was there before this command and holds nothing besides its lock (a run stopped while
  its command started up); a folder the command just made is not."""
  return (os.path.isdir(output_dir) and os.path.abspath(output_dir) not in _MADE_HERE
          and not folder_entries(output_dir))


def folder_entries(output_dir: str) -> list[str]:
  """What the folder holds besides its lock file (sorted; none if it is no folder)."""
  return sorted(set(os.listdir(output_dir)) - {LOCK_FILE}) if os.path.isdir(output_dir) else []


def _listing(names: list[str], limit: int = 6) -> str:
  shown = ", ".join(names[:limit])
  return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def never_started(output_dir: str) -> bool:
  """Whether the folder holds only what a run writes before its settings (see the module docstring)."""
  entries = folder_entries(output_dir)
  return bool(entries) and set(entries) <= set(BEFORE_SETTINGS)


def check_fresh(output_dir: str, overwrite: bool) -> None:
  """A new run's folder is empty (or `never_started`: the start rewrites those files), or ``overwrite`` and it
  holds a run; else ValueError saying what is there."""
  entries = folder_entries(output_dir)
  if not entries or never_started(output_dir):
    return
  if overwrite and not set(entries) & set(RUN_ENTRIES):
    raise ValueError(f"{cli_flag('output.overwrite')} deletes only a results folder, and {output_dir!r} holds no run "
                     f"(no {', '.join(RUN_ENTRIES[:3])}/) but {_listing(entries)}; move those away or choose "
                     "another folder")
  check_no_foreign_files(output_dir)
  if not overwrite:
    raise ValueError(f"output directory {output_dir!r} is not empty; pass --resume to continue it or --overwrite "
                     "to start over")


def check_no_foreign_files(output_dir: str) -> None:
  """ValueError if the folder holds files but no run (nor a run's first files): no run can start or go on in it,
  and none deletes them."""
  entries = folder_entries(output_dir)
  if entries and not set(entries) & set(RUN_ENTRIES) and not never_started(output_dir):
    raise ValueError(f"output directory {output_dir!r} holds no run (no {', '.join(RUN_ENTRIES[:3])}/) but "
                     f"{_listing(entries)}; a run starts only in an empty folder: move those away or choose another "
                     "--output-dir")


def clear_for_overwrite(output_dir: str) -> None:
  """Deletes everything in the (locked) folder but its lock file."""
  for name in folder_entries(output_dir):
    path = os.path.join(output_dir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    else:
      os.remove(path)


def read_json_object(path: str) -> dict[str, Any] | None:
  """The JSON object in ``path`` (None if there is no such file); ValueError naming the file otherwise."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    text = f.read()
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    what = "is empty" if not text.strip() else f"is not valid JSON ({e}; half-written?)"
    raise ValueError(f"{path} {what}") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path} holds {type(value).__name__} {json.dumps(value)[:40]}, not a JSON object")
  return value


def check_history(path: str, saved: dict[str, Any]) -> None:
  """config.json's records beside the settings (a summary.json's too): segments and rollbacks (lists of objects),
  processes; ValueError naming ``path`` otherwise."""
  for key in ("segments", "rollbacks"):
    entries = saved.get(key, [])
    if not (isinstance(entries, list) and all(isinstance(e, dict) for e in entries)):
      raise ValueError(f"{path}: {key!r} is not a list of objects")
  if any(not isinstance(seg.get("from_round"), int) or not isinstance(seg.get("settings"), dict)
         for seg in saved.get("segments", [])):
    raise ValueError(f"{path}: a segment lacks its from_round or settings")
  if any(not (isinstance(r.get("learning_rate"), list) and len(r["learning_rate"]) == 2)
         for r in saved.get("rollbacks", [])):
    raise ValueError(f"{path}: a rollback lacks its learning_rate [before, after]")
  processes = saved.get("processes", 1)
  if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
    raise ValueError(f"{path}: 'processes' is {processes!r}, not a process count")


def _settings_problem(output_dir: str, read_saved: Callable[..., Any]) -> tuple[str | None, Any]:
  """(why the folder's saved settings cannot be read, None if they can; the saved config, None if none)."""
  try:
    saved = read_json_object(os.path.join(output_dir, "config.json"))
    if saved is not None:
      check_history(os.path.join(output_dir, "config.json"), saved)
    else:
      read_json_object(os.path.join(output_dir, "summary.json"))
  except ValueError as e:
    return str(e), None
  name = "config.json" if saved is not None else "summary.json"
  try:
    return None, read_saved(output_dir, lambda _: None)
  except (ValueError, TypeError, AttributeError, KeyError) as e:
    return f"{os.path.join(output_dir, name)} does not hold a run's settings ({first_line(e, 200)})", None


def _has_state(output_dir: str) -> bool:
  root = os.path.join(output_dir, "checkpoints")
  steps = os.path.isdir(root) and any(name.isdigit() for name in os.listdir(root))
  metrics = os.path.join(output_dir, "metrics.jsonl")
  return steps or (os.path.exists(metrics) and os.path.getsize(metrics) > 0)


def _set_aside(output_dir: str, log: Callable[[str], None]) -> None:
  """The settings files moved away: the one whose problem was reported (config.json where it exists) as
  unreadable, and a summary.json beside it, not read, as set aside (so that nothing reads the old settings back)."""
  reported = "config.json" if os.path.exists(os.path.join(output_dir, "config.json")) else "summary.json"
  for name in SETTINGS_FILES:
    path = os.path.join(output_dir, name)
    if os.path.exists(path):
      target = path + (UNREADABLE if name == reported else SET_ASIDE)
      os.replace(path, target)
      log(f"warning: --resume-unchecked: moved {path} to {target}; this command's settings are used unchecked")


def _check_settings(output_dir: str, unchecked: bool, read_saved: Callable[..., Any],
                    log: Callable[[str], None]) -> None:
  problem, saved = _settings_problem(output_dir, read_saved)
  if problem is None and (saved is not None or not _has_state(output_dir)):
    return
  why = problem or (f"{output_dir!r} holds checkpoints or metrics but no config.json (or summary.json) with the "
                    "settings they were trained with")
  if not unchecked:
    raise ValueError(f"cannot resume: {why}; nothing can check that this command continues the same run. Restore "
                     f"the file, or pass {cli_flag('output.resume_unchecked')} to continue with this command's "
                     "settings unchecked")
  log(f"warning: {cli_flag('output.resume_unchecked')}: {why}")
  _set_aside(output_dir, log)


def check_resume(config: Any, read_saved: Callable[..., Any], log: Callable[[str], None]) -> None:
  """Before a resume reads the folder (see the module docstring); ``read_saved(output_dir, log)`` reads its
  saved config (`fedjax_hetero.run.continuation.saved_config`). Process 0 checks (and repairs, as asked); the others
  wait for it."""
  out = config.output.dir
  if distributed.is_main_process():
    _check_settings(out, config.output.resume_unchecked, read_saved, log)
    if config.output.repair_metrics:
      metrics_log.repair(out, log)
    else:
      metrics_log.check(os.path.join(out, "metrics.jsonl"))
  distributed.barrier("fedjax_hetero.run.results_folder: resume checked")


def check_data(config: Any, spec: Any, log: Callable[[str], None]) -> dict | None:
  """The fingerprint of the data ``spec`` trains and evaluates on, compared with the recorded one on a resume;
  ValueError on other data, unless ``--resume-unchecked`` (then a warning). `record_data` writes it (a new run's,
  and an older folder's without a record) once the folder is prepared. None on processes other than 0."""
  if not distributed.is_main_process():
    return None
  now = data_fingerprint(spec)
  try:
    changed = data_changes(config.output.dir, now) if config.output.resume else []
  except ValueError as e:
    changed = [f"the record cannot be read: {e}"]
  if changed:
    path = os.path.join(config.output.dir, FINGERPRINT_FILE)
    source = ("federation.availability_trace" if all(c.startswith(TRACE) for c in changed) else
              "data.partition_file" if config.data.partition_file is not None and all(
                  c.startswith("client_index_table") for c in changed) else "data.data_dir")
    message = (f"the data differ from those the run in {config.output.dir!r} trained on ({'; '.join(changed)}; "
               f"recorded in {path}); was {cli_flag(source)} pointed at other files?")
    advice = "Point it at the run's data, or pass --overwrite instead of --resume to start over"
    if all(c.startswith("test_") for c in changed) and config.data.max_test_samples and not \
        config.data.max_train_samples:  # (the subset's draw changed: datasets.ArrayDataset.subset)
      message = (f"the run in {config.output.dir!r} evaluated on another {cli_flag('data.max_test_samples')} "
                 "subset: a run without --max-train-samples now draws the one every run of its seed draws (it drew "
                 "another before); its rows so far used the old one.")
      advice = "Pass --overwrite instead of --resume to start over, or --resume-unchecked to go on with the new one"
    if not config.output.resume_unchecked:
      raise ValueError(f"cannot resume: {message} {advice}")
    log(f"warning: {cli_flag('output.resume_unchecked')}: {message}")
  return now


def data_fingerprint(spec: Any) -> dict:
  """`fingerprint.of_data` of what ``spec`` trains and evaluates on (with its availability trace, if any)."""
  now = fingerprint.of_data(spec.store, spec.test_images, spec.test_labels)
  if spec.availability.absent:  # (a trace is data too: another one would change the rounds)
    now.update(fingerprint.of_arrays({TRACE: np.asarray(sorted(spec.availability.absent), np.int64)}))
  return now


def data_changes(run_dir: str, now: dict) -> list[str]:
  """How the fingerprint ``now`` differs from the one recorded in ``run_dir`` (nothing without a record); ValueError
  naming the record if it cannot be read."""
  recorded = read_json_object(os.path.join(run_dir, FINGERPRINT_FILE))
  return fingerprint.differences(recorded, now) if recorded is not None else []


def data_warning(run_dir: str, spec: Any) -> str | None:
  """A warning that the data ``spec`` holds are not those recorded in ``run_dir`` (or cannot be checked), if so:
  what an analysis of the run says before its results."""
  try:
    changed = data_changes(run_dir, data_fingerprint(spec))
  except ValueError as e:
    return f"warning: {run_dir}: the data cannot be checked against the run's ({e})"
  return (f"warning: {run_dir}: the data differ from those its run trained and evaluated on ({'; '.join(changed)})"
          if changed else None)


def record_data(config: Any, now: dict | None) -> None:
  """Writes `check_data`'s fingerprint into the run's folder (nothing on processes other than 0)."""
  if now is not None:
    with open(os.path.join(config.output.dir, FINGERPRINT_FILE), "w") as f:
      json.dump(now, f)
