#!/usr/bin/env bash
# README command 2 (and CI): set up, then run the whole test suite in one pytest process.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
.venv/bin/python -m pytest -q -ra --durations=15 tests "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
