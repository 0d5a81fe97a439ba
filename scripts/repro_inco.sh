#!/usr/bin/env bash
# InCo Aggregation's Fashion-MNIST experiment at CPU size (docs/reproduction.md, "InCo Aggregation"): HeteroAvg and
# InCoAvg paired on each seed in SEEDS (default "0 1 2"), then FedAvg per group on the seeds in FEDAVG_SEEDS (default:
# SEEDS), --preset inco-cpu for ROUNDS rounds (default 120); then the two checks, each a HeteroAvg/InCoAvg pair on
# every seed in CHECK_SEEDS (default: none): label-IID clients (iid_imbalanced, 120 rounds) and width x0.25 (60
# rounds). Each run resumes if interrupted; finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/inco}
source scripts/resumable_run.sh
run() { resumable_run inco-cpu "$OUT" "${1}_s$2" --method "$1" --seed "$2" --rounds "${ROUNDS:-120}"; }
for seed in ${SEEDS:-0 1 2}; do
  run HeteroAvg "$seed"
  run InCoAvg "$seed"
done
for seed in ${FEDAVG_SEEDS-${SEEDS:-0 1 2}}; do
  run FedAvg "$seed"
done
WIDTH_025=resnet10@0.25,resnet14@0.25,resnet18@0.25,resnet22@0.25,resnet26@0.25
for seed in ${CHECK_SEEDS:-}; do
  for method in HeteroAvg InCoAvg; do
    resumable_run inco-cpu "$OUT" "iid_${method}_s$seed" --method "$method" --seed "$seed" --rounds 120 \
        --partition iid_imbalanced
  done
done
for seed in ${CHECK_SEEDS:-}; do
  for method in HeteroAvg InCoAvg; do
    resumable_run inco-cpu "$OUT" "w025_${method}_s$seed" --method "$method" --seed "$seed" --rounds 60 \
        --groups "$WIDTH_025"
  done
done
