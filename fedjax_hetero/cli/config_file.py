"""``--config FILE``: a whole `RunConfig` from JSON or YAML, e.g. a finished run's ``config.json``.

The file holds the config tree in the layout of ``config.json`` (``{"client": {"learning_rate": 0.01}, ...}``,
whose history is ignored); a file of flag names alone (``{"learning_rate": 0.01}``, the layout older versions
saved) reads too. Settings not in it keep the dataset's defaults (those ``python -m experiments.<dataset>``
starts from), and older layouts are upgraded as ``--resume``
upgrades them (`fedjax_hetero.run.history.upgrade`). The file is read strictly: an unknown key, a key given
twice, or a flag name beside the nested layout is an error naming the key and its line. What a file says about
resuming or overwriting is dropped: those say what one command does, not what the run is; so is a hand-written
file's history (``segments``, ``rollbacks``, ``processes``). `file_notes` says what was dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
from typing import Any

from fedjax_hetero.config import RunConfig, declare, flatten
from fedjax_hetero.config.run import FLAGS, FLAGS_BY_PATH
from fedjax_hetero.run import history


@functools.cache
def _loader() -> type:
  """YAML's safe loader that also reads ``1e-3`` as a number (YAML 1.1, PyYAML's, wants ``1.0e-3``)."""
  import yaml

  class Loader(yaml.SafeLoader):
    pass

  Loader.add_implicit_resolver(
      "tag:yaml.org,2002:float",
      re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$|"
                 r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|"
                 r"^\.(?:nan|NaN|NAN)$"),
      list("-+0123456789."))
  return Loader


def _yaml_tree(text: str) -> tuple[Any, dict[str, int]]:
  """The YAML document and the line of each mapping key (dotted path); ValueError on a key given twice."""
  import yaml

  lines: dict[str, int] = {}
  columns: dict[str, int] = {}
  words: dict[str, str] = {}  # dotted path -> an unquoted word YAML 1.1 reads as true or false (on, off, yes, no)

  def walk(node: Any, prefix: str) -> None:
    if not isinstance(node, yaml.MappingNode):
      return
    for key, value in node.value:
      path, line, column = f"{prefix}{key.value}", key.start_mark.line + 1, key.start_mark.column + 1
      if path in lines:
        raise ValueError(_given_twice(path, (lines[path], columns[path]), (line, column)))
      lines[path], columns[path] = line, column
      if isinstance(value, yaml.ScalarNode) and value.tag.endswith(":bool") and value.style is None:
        words[path] = value.value
      walk(value, path + ".")

  try:
    walk(yaml.compose(text, Loader=_loader()), "")
    return _choices_as_written(yaml.load(text, Loader=_loader()), words), lines
  except yaml.MarkedYAMLError as e:
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    raise ValueError(f"not valid YAML ({where}{e.problem or e.context})") from None
  except yaml.YAMLError as e:
    raise ValueError(f"not valid YAML ({str(e).splitlines()[0]})") from None


def _choices_as_written(tree: Any, words: dict[str, str]) -> Any:
  """``tree`` with an unquoted on/off/yes/no, which YAML 1.1 reads as true or false, read as the word where its
  setting is a choice (``divergence: {action: off}``; a word that is not one of them is refused as written)."""
  for path, word in words.items():
    leaf = FLAGS_BY_PATH.get(path) or FLAGS.get(path)
    choices = getattr(leaf.setting.check, "choices", ()) if leaf is not None else ()
    if choices:
      *sections, key = path.split(".")
      functools.reduce(lambda node, name: node[name], sections, tree)[key] = (
          word.lower() if word.lower() in choices else word)
  return tree


def _given_twice(path: str, first: tuple[int, int], second: tuple[int, int]) -> str:
  """The error for the key ``path`` written at (line, column) ``first`` and again at ``second``."""
  where = (f"line {first[0]}, columns {first[1]} and {second[1]}" if first[0] == second[0] else
           f"lines {first[0]} and {second[0]}")
  return f"{path!r} is given twice ({where})"


class _Pairs(list):
  """A JSON object's (key, value) pairs as written, a key given twice included (to find it by its path)."""


def _json_tree(text: str) -> tuple[Any, dict[str, int]]:
  """The JSON document and the line of each key (found in the text); ValueError on a key given twice."""
  positions: dict[str, list[tuple[int, int]]] = {}  # key name -> (line, column) of each place it is written, in order
  for match in re.finditer(r'"((?:[^"\\]|\\.)*)"\s*:', text):
    line_start = text.rfind("\n", 0, match.start()) + 1
    positions.setdefault(match.group(1), []).append((text.count("\n", 0, match.start()) + 1,
                                                     match.start() - line_start + 1))
  try:
    pairs = json.loads(text, object_pairs_hook=_Pairs)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
  lines, unread = {}, {key: iter(found) for key, found in positions.items()}

  # In the text's order, so each key takes its own next position; a list's objects are values: no lines.
  def walk(node: Any, prefix: str, settings: bool = True) -> Any:
    if isinstance(node, list) and not isinstance(node, _Pairs):
      return [walk(item, prefix, settings=False) for item in node]
    if not isinstance(node, _Pairs):
      return node
    tree: dict[str, Any] = {}
    places: dict[str, tuple[int, int]] = {}
    for key, value in node:
      path, place = f"{prefix}{key}", next(unread.get(key, iter(())), (0, 0))
      if key in tree:
        raise ValueError(_given_twice(path, places[key], place) if place[0] and places[key][0] else
                         f"{path!r} is given twice")
      places[key] = place
      if settings:
        lines[path] = place[0]
      tree[key] = walk(value, f"{path}.", settings)
    return tree

  return walk(pairs, ""), lines


def _check_sections(tree: dict[str, Any], owner: type, prefix: str, lines: dict[str, int]) -> None:
  """Every key of ``tree`` that names a section of settings (``method``, ``method.prox``) holds an object of them;
  ValueError naming the key, its line and the form it takes."""
  for f in dataclasses.fields(owner):
    value, section = tree.get(f.name), f.default
    if f.name not in tree or not dataclasses.is_dataclass(section):
      continue
    if isinstance(value, dict):
      _check_sections(value, type(section), f"{prefix}{f.name}.", lines)
      continue
    example = ("name: ..." if f.name == "method" else
               ", ".join(f"{g.name}: ..." for g in dataclasses.fields(section))[:60])
    raise ValueError(f"{prefix}{f.name}{_at(lines, prefix + f.name)} must be an object of settings, "
                     f"{{{example}}}, got {value!r}")


def _at(lines: dict[str, int], path: str) -> str:
  return f" (line {lines[path]})" if lines.get(path) else ""


# A command-line spelling without its dashes (``lr``, ``prox-mu``) -> the key a file writes for it.
_KEYS_OF_SPELLINGS = {leaf.cli.lstrip("-"): leaf.flag for leaf in FLAGS.values()}


def _initials(name: str) -> str:
  return "".join(part[0] for part in name.split("_") if part)


def _close_in_nested_layout(name: str) -> list[str]:
  """The full paths an unknown key of a nested file may have meant: in its own section a key it abbreviates or
  spells out (``server.learning_rate``: ``server.lr``), else the same name in another section
  (``client.clients_per_round``: ``federation.clients_per_round``), else the closest paths by spelling."""
  section, _, leaf = name.rpartition(".")
  own = [path for path in FLAGS_BY_PATH if path.rpartition(".")[0] == section]
  short = [p for p in own if _initials(leaf) == p.rpartition(".")[2] or leaf == _initials(p.rpartition(".")[2])]
  elsewhere = [path for path in FLAGS_BY_PATH if path.rpartition(".")[2] == leaf]
  spelled = [f"{section}.{key}" if section else key
             for key in difflib.get_close_matches(leaf, [p.rpartition(".")[2] for p in own], n=1)]
  return short or elsewhere or spelled or difflib.get_close_matches(name, list(FLAGS_BY_PATH), n=1)


def _close_to(name: str, nested: bool = False) -> str:
  if name in _KEYS_OF_SPELLINGS and nested:
    return f" (did you mean {FLAGS[_KEYS_OF_SPELLINGS[name]].path!r}? --{name} is its command-line flag)"
  if name in _KEYS_OF_SPELLINGS:
    return f" (did you mean {_KEYS_OF_SPELLINGS[name]!r}? --{name} is its command-line flag)"
  if nested and name not in FLAGS_BY_PATH:  # (a nested file's keys are paths: a flag name there is refused)
    close = _close_in_nested_layout(name)
    return f" (did you mean {' or '.join(repr(path) for path in close)}?)" if close else ""
  if name in FLAGS_BY_PATH:  # a dotted path as one key: the file's layouts nest it, or name the flag
    nested = functools.reduce(lambda inner, key: f"{key}: {{{inner}}}", reversed(name.split(".")[:-1]),
                              f"{name.split('.')[-1]}: ...")
    return f" (a dotted path is not a key: nest it as {nested}, or use its flag name {FLAGS_BY_PATH[name].flag!r})"
  known = set(FLAGS) | {leaf.path for leaf in FLAGS.values()}
  close = difflib.get_close_matches(name, known, n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_layout(tree: dict[str, Any], lines: dict[str, int]) -> None:
  """A nested file (a section given as an object) holds no flag names beside its sections."""
  fields = {f.name: f for f in dataclasses.fields(RunConfig)}
  sections = {name for name, f in fields.items() if dataclasses.is_dataclass(f.default)}
  nested = [name for name, value in tree.items() if name in sections and isinstance(value, dict)]
  if not nested:
    return
  flags = [name for name in tree if name not in fields and name in FLAGS]
  if flags:
    where = "; ".join(f"{name!r}{_at(lines, name)} belongs at {FLAGS[name].path}" for name in flags)
    raise ValueError(f"mixes flag names with the nested layout of config.json (it has a {nested[0]!r} block): "
                     f"{where}. Write them under their sections, or write the whole file as flag names")


def _read(path: str) -> tuple[Any, dict[str, int]]:
  flag = f"--config {path!r}"
  if not os.path.isfile(path):
    raise ValueError(f"{flag} is not a file")
  yaml_file = path.lower().endswith((".yaml", ".yml"))
  try:
    with open(path) as f:
      text = f.read()
    tree, lines = (_yaml_tree if yaml_file else _json_tree)(text)
  except (OSError, ValueError) as e:
    read_as = "" if yaml_file or path.lower().endswith(".json") else " (read as JSON: a YAML file's name ends in .yaml)"
    raise ValueError(f"{flag}: {e}{read_as}") from None
  if not isinstance(tree, dict):
    raise ValueError(f"{flag} must hold a mapping of settings, got {type(tree).__name__}")
  return tree, lines


def known_lines(path: str | None) -> dict[str, int]:
  """The line of each setting of the config file ``path`` (by dotted path), for the messages that name it; empty
  without a file or for one that cannot be read (`read_config` has said why)."""
  if path is None:
    return {}
  try:
    _, lines = _read(path)
  except ValueError:
    return {}
  return {(FLAGS[key].path if key in FLAGS else key): line for key, line in lines.items()}


def named_dataset(path: str) -> str | None:
  """The dataset a config file names (``data.dataset``, or ``dataset`` in a flat file), None if none or if the
  file cannot be read (`read_config` says why)."""
  try:
    tree, _ = _read(path)
  except ValueError:
    return None
  data = tree.get("data")
  named = data.get("dataset") if isinstance(data, dict) else tree.get("dataset")
  return named if isinstance(named, str) else None


_ACTIONS = ("resume", "resume_or_start", "overwrite", "resume_unchecked", "repair_metrics")
_HISTORY = (history.SEGMENTS, history.ROLLBACKS, history.PROCESSES)


def file_notes(path: str | None, config: RunConfig) -> list[str]:
  """The ``note:`` lines for what `read_config` drops of the file ``path`` while the run ``config`` goes on: a
  folder action it sets (the command's flags say what to do with the folder) and a hand-written file's history
  keys (a results folder's own). A results folder's ``config.json`` (it has all of them) has its history and
  actions, so they pass in silence; but if its local training changed from a round on (a resume with another
  ``--lr``, a rollback), a new run from it trains every round with the latest values, and a note says so."""
  if path is None:
    return []
  try:
    tree, lines = _read(path)
  except ValueError:
    return []
  flag = f"--config {path}"
  if all(key in tree for key in _HISTORY):
    return _segment_notes(flag, tree.get(history.SEGMENTS), config, path)
  output = tree.get("output") if isinstance(tree.get("output"), dict) else {}
  actions = [f"output.{key}" for key in _ACTIONS if output.get(key)] + [key for key in _ACTIONS if tree.get(key)]
  past = [key for key in (history.SEGMENTS, history.ROLLBACKS) if key in tree]
  named = lambda keys: ", ".join(key + _at(lines, key) for key in keys)
  parts = []
  if actions:
    parts.append(f"drops {named(actions)}: the command's flags say what to do with the folder (" +
                 ", ".join("--" + key.rpartition(".")[2].replace("_", "-") for key in actions) + ")")
  if history.PROCESSES in tree:
    parts.append(f"drops {named([history.PROCESSES])}: the command's flags say how many processes run it "
                 "(--num-processes)")
  if past:
    parts.append(f"drops {named(past)}: a run's history, which its results folder's config.json records (to change "
                 "a local-training setting from a round on, --resume the run with the new value)")
  return [f"note: {flag} " + "; ".join(parts)] if parts else []


def _segment_notes(flag: str, segments: Any, config: RunConfig, path: str) -> list[str]:
  output = config.output
  if (output.resume or output.resume_or_start) and os.path.realpath(output.dir) == os.path.realpath(
      os.path.dirname(path) or "."):
    return []  # (the run itself, continued: its history goes on)
  if not isinstance(segments, list) or len(segments) < 2:
    return []
  settings = [(seg.get("from_round"), seg.get("settings") or {}) for seg in segments if isinstance(seg, dict)]
  changed = sorted({key for _, values in settings for key in values
                    if len({repr(v.get(key)) for _, v in settings}) > 1})
  if not changed:
    return []
  now = flatten(config)
  history_text = "; ".join(f"{key} " + ", ".join(f"{values.get(key)!r} from round {start}" for start, values in
                                                 settings) for key in changed)
  used = ", ".join(f"{key} {now.get(key)!r}" for key in changed)
  return [f"note: {flag} records a run whose local training changed partway ({history_text}); this run trains "
          f"every round with {used}"]


def read_config(path: str, base: RunConfig | None = None) -> RunConfig:
  """The `RunConfig` of a JSON (``.json``) or YAML (``.yaml``/``.yml``) file, every setting it leaves out as in
  ``base`` (the command's dataset defaults; the library's if None); ValueError naming the file. A method option
  the file's method does not read stays in it, for the build step to refuse."""
  flag = f"--config {path!r}"
  tree, lines = _read(path)
  for key in _HISTORY:  # (what is dropped is told by `file_notes`)
    tree.pop(key, None)
  output = tree.get("output")
  if isinstance(output, dict):  # what to do with the folder is the command's, never the file's (docs/running.md)
    tree["output"] = {k: v for k, v in output.items() if k not in _ACTIONS}
  for key in _ACTIONS:  # (the flat layout's names)
    tree.pop(key, None)
  ignored: list[str] = []
  names = {leaf.cli: f"{key} (line {lines[key]})" for key, leaf in
           ((key, FLAGS.get(key) or FLAGS_BY_PATH.get(key)) for key in lines) if leaf is not None and lines[key]}
  try:
    _check_layout(tree, lines)
    if any(isinstance(value, dict) for value in tree.values()):  # (a flat file names the method as a flag)
      _check_sections(tree, RunConfig, "", lines)
    with declare.named_from(names):
      config = history.upgrade(tree, ignored, own_options_only=False, base=base)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{flag}: {e}") from None
  if ignored:
    nested = any(isinstance(value, dict) for value in tree.values())
    unknown = ", ".join(f"{name!r}{_at(lines, name)}{_close_to(name, nested)}" for name in sorted(ignored))
    raise ValueError(f"{flag}: unknown setting(s) {unknown}; `python -m experiments.fmnist --help` and docs/cli.md "
                     "list the settings (config.json keys and flag names)")
  action = dict.fromkeys(_ACTIONS, False)
  # A path in a file starting with ~ means the home folder, as it would on the command line (no shell expands it).
  home = lambda p: os.path.expanduser(p) if isinstance(p, str) else p
  data = dataclasses.replace(config.data, data_dir=home(config.data.data_dir),
                             partition_file=home(config.data.partition_file))
  federation = dataclasses.replace(config.federation, availability_trace=home(config.federation.availability_trace))
  return dataclasses.replace(config, data=data, federation=federation,
                             output=dataclasses.replace(config.output, dir=home(config.output.dir), **action))
