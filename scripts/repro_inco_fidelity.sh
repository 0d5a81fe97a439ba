#!/usr/bin/env bash
# InCo fidelity (docs/reproduction.md, "The InCo authors' protocol"): HeteroAvg/InCoAvg pairs
# with the same seed. First the acceptance pairs, the authors' whole protocol (--preset inco-authors-cpu with their
# client split) for 80 rounds on seeds 0 and 1; then the same protocol on seed 0 with other cohorts only
# (--sample-seed 1: same split, initialization and shuffling), 40 rounds; two more seeds of the authors' protocol
# (2 and 3, 80 rounds) to pool four pairs; then our protocol (--preset inco-cpu,
# evaluated every round) on seed 0 for 80 rounds, and the two ablations that each change one thing of it towards
# theirs: their image pipeline (32x32, unnormalized, first 9,728 test images), their split.
# SPLIT is their hetero-fix-100-0.5.npy converted by scripts/convert_inco_split.py (see docs/reproduction.md).
# Each run resumes if interrupted; finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/inco_fidelity}
SPLIT=${SPLIT:-inco_split.npz}
[ -f "$SPLIT" ] || { echo "no client split at $SPLIT: convert the authors' file first (docs/reproduction.md)" >&2; exit 1; }
source scripts/resumable_run.sh
pair() {
  local preset=$1 name=$2; shift 2
  for method in HeteroAvg InCoAvg; do
    # (--steps-per-call 2: the setting these runs were recorded with, docs/reproduction.md)
    resumable_run "$preset" "$OUT" "${method}_$name" --method "$method" --steps-per-call 2 "$@"
  done
}
pair inco-authors-cpu authors_s0 --partition-file "$SPLIT" --seed 0 --rounds 80
pair inco-authors-cpu authors_s1 --partition-file "$SPLIT" --seed 1 --rounds 80
pair inco-authors-cpu authors_s0_c1 --partition-file "$SPLIT" --seed 0 --sample-seed 1 --rounds 40
pair inco-authors-cpu authors_s2 --partition-file "$SPLIT" --seed 2 --rounds 80
pair inco-authors-cpu authors_s3 --partition-file "$SPLIT" --seed 3 --rounds 80
for seed in ${FACTOR_SEEDS:-0}; do  # (FACTOR_SEEDS="0 1": the one-factor pairs on more seeds)
  pair inco-cpu ours_s$seed --seed "$seed" --rounds 80 --eval-every 1
  pair inco-cpu pipeline_s$seed --seed "$seed" --rounds 80 --eval-every 1 --image-size 32 --normalize none \
      --test-first 9728
  pair inco-cpu split_s$seed --seed "$seed" --rounds 80 --eval-every 1 --partition-file "$SPLIT"
done
