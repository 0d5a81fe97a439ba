#!/usr/bin/env bash
# The FedImpro Fashion-MNIST experiment at CPU scale (docs/reproduction.md): the fedimpro-cpu preset for
# FedAvg, FedProx, FedImpro (then Scaffold and FedNova) over seeds, resumable; then the comparison table and plots.
# Usage: bash scripts/repro_fedimpro.sh [SEEDS] [METHODS]   e.g. bash scripts/repro_fedimpro.sh "0 1" "FedAvg FedImpro"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${1:-0 1}"
METHODS="${2:-FedAvg FedProx FedImpro Scaffold FedNova}"
OUT=runs/repro/fedimpro
for seed in $SEEDS; do
  for method in $METHODS; do
    dir="$OUT/${method}_s${seed}"
    if [ -f "$dir/summary.json" ] && ! grep -q '"interrupted": {' "$dir/summary.json"; then continue; fi
    .venv/bin/python -m experiments.fmnist --preset fedimpro-cpu --method "$method" --seed "$seed" \
      --output-dir "$dir" --no-progress --resume-or-start
  done
done
