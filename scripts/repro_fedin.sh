#!/usr/bin/env bash
# FedIN's Fashion-MNIST experiment at CPU size (docs/reproduction.md, "FedIN"): HeteroAvg, HeteroProx and FedIN
# x the seeds in SEEDS (default "0 1") with --preset fedin-cpu, then InclusiveFL (seeds 0 and 1), then FedIN's
# ablations (Table VII: HeteroProx is "w/o IN"; the plain sum of gradients; the Eq. 13 projection; then the history
# bank), on the seeds in ABLATION_SEEDS (default "0 1"). Each run resumes if interrupted; finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/fedin}
source scripts/resumable_run.sh
run() { resumable_run fedin-cpu "$OUT" "$@"; }
for seed in ${SEEDS:-0 1}; do
  for method in HeteroAvg HeteroProx FedIN; do
    run "${method}_s$seed" --method "$method" --seed "$seed"
  done
done
for seed in 0 1; do
  run "InclusiveFL_s$seed" --method InclusiveFL --seed "$seed"
done
ABLATION=(--on-divergence off)  # (the Eq. 13 projection leaves groups at chance: the guard would stop it)
for seed in ${ABLATION_SEEDS:-0 1}; do
  run "FedIN-sum_s$seed" --method FedIN --fedin-rule sum --seed "$seed" "${ABLATION[@]}"
  run "FedIN-project_s$seed" --method FedIN --fedin-rule project --seed "$seed" "${ABLATION[@]}"
done
for seed in ${ABLATION_SEEDS:-0 1}; do
  run "FedIN-history_s$seed" --method FedIN --fedin-bank history --seed "$seed" "${ABLATION[@]}"
done
