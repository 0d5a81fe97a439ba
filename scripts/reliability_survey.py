"""The reliability survey: probes of what a careful user (or a failing machine) does to a run, classified.

    python scripts/reliability_survey.py                 # every family; ~15 minutes on 2 cores
    python scripts/reliability_survey.py --family no-op  # one family
    python scripts/reliability_survey.py --json out.json

Families: concurrency, failed writes, read-back corruption, OS errors, no-op, library misuse (the last in
`scripts/reliability_probes_library.py`). Batch 1 (90 probes) was written before the fixes of issue 35, batch 2
(`scripts/reliability_probes_batch2.py`, 37 probes of the same families) after them, to see whether a fix holds
for its family; the table counts both (``--batch 1`` or ``--batch 2`` runs one). Each probe names the right
answer, a clear error naming given facts or a run that ends with a correct results folder, and is counted as
one of: clear error, handled correctly, silent-wrong, traceback, unhelpful, hang. The command-line probes run
``python -m experiments.fmnist`` on a tiny Fashion-MNIST setting (needs the dataset-fashion-mnist package)
in subprocesses; immutable files and full disks need root (chattr, mount -t tmpfs), else those probes are
skipped and listed as such.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import reliability_probes_batch2 as batch2_probes  # noqa: E402
from scripts import reliability_probes_cli as cli_probes  # noqa: E402
from scripts import reliability_probes_input as input_probes  # noqa: E402
from scripts import reliability_probes_readback as readback_probes  # noqa: E402
from scripts import reliability_probes_library as library_probes  # noqa: E402
from scripts.survey_common import OUTCOMES, classify, cli, scratch  # noqa: E402


def prepare(cache: str) -> cli_probes.Env:
  """The shared material: a two-round results folder and prepared data folders."""
  root = scratch()
  base = os.path.join(root, "base")
  result = cli(base, cache=cache, timeout=300)
  if result.status != 0:
    raise SystemExit(f"the base run failed:\n{result.err[-3000:]}")
  return cli_probes.Env(root=root, base=base, cache=cache, data=cli_probes.data_folders(root))


def run_probes(probes, env, log) -> list[dict]:
  rows = []
  for probe in probes:
    started = time.perf_counter()
    result = probe.run(env.fresh(probe.name)) if isinstance(probe, cli_probes.CliProbe) else probe.run()
    if result is None:
      rows.append({"family": probe.family, "probe": probe.name, "outcome": "skipped"})
      log(f"  skipped   {probe.family:<22} {probe.name}")
      continue
    outcome = classify(result, probe.expect)
    said = (str(result.exception) if result.exception else (result.err.strip().splitlines() or [""])[-1])[:160]
    rows.append({"family": probe.family, "probe": probe.name, "outcome": outcome,
                 "seconds": round(time.perf_counter() - started, 1), "said": said})
    log(f"  {outcome:<17} {probe.family:<22} {probe.name}  [{rows[-1]['seconds']}s] {said}")
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", action="append", help="run only this family (repeatable)")
  parser.add_argument("--json", help="write the rows and counts here")
  parser.add_argument("--batch", type=int, choices=(1, 2), help="only batch 1 (written before the fixes) or 2")
  args = parser.parse_args(argv)
  first = [*cli_probes.PROBES, *readback_probes.PROBES, *input_probes.PROBES, *library_probes.PROBES]
  probes = {None: first + batch2_probes.PROBES, 1: first, 2: batch2_probes.PROBES}[args.batch]
  if args.family:
    probes = [p for p in probes if p.family in args.family]
  cache = scratch()
  env = prepare(cache) if any(isinstance(p, cli_probes.CliProbe) for p in probes) else None
  try:
    rows = run_probes(probes, env, lambda line: print(line, flush=True))
  finally:
    shutil.rmtree(cache, ignore_errors=True)
    if env is not None:
      shutil.rmtree(env.root, ignore_errors=True)
  second = {p.name for p in batch2_probes.PROBES}
  for row in rows:
    row["batch"] = 2 if row["probe"] in second else 1
  counts = collections.Counter(r["outcome"] for r in rows)
  by_batch = [collections.Counter(r["outcome"] for r in rows if r["batch"] == b) for b in (1, 2)]
  print("\noutcome            all  batch 1  batch 2")
  for outcome in (*OUTCOMES, "skipped"):
    print(f"{outcome:<18} {counts.get(outcome, 0):>3}  {by_batch[0].get(outcome, 0):>7}  {by_batch[1].get(outcome, 0):>7}")
  print(f"{'total':<18} {len(rows):>3}  {sum(by_batch[0].values()):>7}  {sum(by_batch[1].values()):>7}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"counts": dict(counts), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
