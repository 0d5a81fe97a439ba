#!/usr/bin/env bash
# InCo Aggregation's Fashion-MNIST experiment at CPU size (docs/reproduction.md, "InCo Aggregation"): HeteroAvg and
# InCoAvg paired on each seed in SEEDS (default "0 1 2"), then FedAvg per group on the seeds in FEDAVG_SEEDS (default:
# SEEDS), --preset inco-cpu for ROUNDS rounds (default 120). Each run resumes if interrupted; finished runs are
# skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/inco}
source scripts/resumable_run.sh
for seed in ${SEEDS:-0 1 2}; do
  for method in HeteroAvg InCoAvg; do
    resumable_run inco-cpu "$OUT" "${method}_s$seed" --method "$method" --seed "$seed" --rounds "${ROUNDS:-120}"
  done
done
for seed in ${FEDAVG_SEEDS-${SEEDS:-0 1 2}}; do
  resumable_run inco-cpu "$OUT" "FedAvg_s$seed" --method FedAvg --seed "$seed" --rounds "${ROUNDS:-120}"
done
