#!/usr/bin/env bash
# README command 1: set up, then run the Fashion-MNIST demo (extra flags pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m experiments.fmnist "$@"
