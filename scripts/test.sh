#!/usr/bin/env bash
# README command 2 (and CI): set up, then run the whole test suite in two pytest-xdist workers (XLA compiles
# on one core at a time, so two workers keep both cores busy; tests/conftest.py shares one compilation cache).
# loadgroup spreads the tests one by one, except a module marked xdist_group, which stays on one worker.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
.venv/bin/python -m pytest -q -ra --durations=15 -n 2 --dist loadgroup tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
