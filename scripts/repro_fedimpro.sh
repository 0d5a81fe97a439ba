#!/usr/bin/env bash
# The FedImpro Fashion-MNIST experiment at CPU scale (docs/reproduction.md, "FedImpro"): the fedimpro-cpu preset for
# FedAvg, FedProx, FedImpro (then Scaffold and FedNova) over seeds, into OUT (default runs/repro/fedimpro). Each run
# resumes if interrupted; finished runs are skipped.
# Usage: bash scripts/repro_fedimpro.sh [SEEDS] [METHODS] [OUT]
#   e.g. bash scripts/repro_fedimpro.sh "0 1" "FedAvg FedImpro"
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS="${1:-0 1}"
METHODS="${2:-FedAvg FedProx FedImpro Scaffold FedNova}"
OUT=${3:-runs/repro/fedimpro}
source scripts/resumable_run.sh
for seed in $SEEDS; do
  for method in $METHODS; do
    resumable_run fedimpro-cpu "$OUT" "${method}_s${seed}" --method "$method" --seed "$seed"
  done
done
