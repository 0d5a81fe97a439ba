#!/usr/bin/env bash
# FedCross's Fashion-MNIST experiment at CPU size (docs/reproduction.md, "FedCross"): FedAvg and FedCross (the
# preset's alpha 0.99, lowest similarity) paired on each seed in SEEDS (default "0"), --preset fedcross-cpu for ROUNDS
# rounds (default 500), into OUT (default runs/repro/fedcross). Each run resumes if interrupted; finished runs are
# skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/fedcross}
source scripts/resumable_run.sh
for seed in ${SEEDS:-0}; do
  for method in FedAvg FedCross; do
    resumable_run fedcross-cpu "$OUT" "${method}_s$seed" --method "$method" --seed "$seed" --rounds "${ROUNDS:-500}"
  done
done
