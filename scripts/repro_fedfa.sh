#!/usr/bin/env bash
# FedFA's robustness experiment at CPU size (docs/reproduction.md, "FedFA") with --preset fedfa-cpu. On the seeds in
# SEEDS (default "0 1"): FlexiFed and FedFA, clean and with 20% malicious clients at lambda 1, every attacker on the
# largest architecture (ResNet26, --malicious-group largest: the paper's Sec. 3.1 premise). Then, on the seeds in
# ABLATION_SEEDS (default "0 1"; empty: none): the attack at lambda 20 and at lambda 1 with the attackers drawn from
# every client (the latter on ANY_CLIENT_SEEDS if set); FedFA's two parts alone under it; lambda 20 on the largest architecture and FedFA's two parts alone,
# clean and under lambda 1 there; last, why lambda 20 breaks FedFA there: its two parts alone at lambda 20, alpha
# taken to the cohort's median norm instead of its mean (--fedfa-center median), lambda 5 between, and lambda 20 on
# the kernels alone or on the other parameters alone (--backdoor-leaves). Each run resumes if interrupted; finished
# runs are skipped.
# An attacked run is expected to fall towards chance, so the divergence guard is off for those.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/fedfa}
ATTACK=(--malicious-fraction 0.2 --on-divergence off)
source scripts/resumable_run.sh
run() { resumable_run fedfa-cpu "$OUT" "$@"; }
for seed in ${SEEDS:-0 1}; do
  for method in FlexiFed FedFA; do
    run "${method}_clean_s$seed" --method "$method" --seed "$seed"
    run "${method}_largest1_s$seed" --method "$method" --seed "$seed" "${ATTACK[@]}" --malicious-group largest \
        --backdoor-scale 1
  done
done
for seed in ${ABLATION_SEEDS-0 1}; do
  for method in FlexiFed FedFA; do
    run "${method}_attack_s$seed" --method "$method" --seed "$seed" "${ATTACK[@]}" --backdoor-scale 20
  done
done
for seed in ${ANY_CLIENT_SEEDS-${ABLATION_SEEDS-0 1}}; do
  for method in FlexiFed FedFA; do
    run "${method}_attack1_s$seed" --method "$method" --seed "$seed" "${ATTACK[@]}" --backdoor-scale 1
  done
done
for seed in ${ABLATION_SEEDS-0 1}; do
  run "FedFA-graftonly_attack1_s$seed" --method FedFA --no-fedfa-scale --seed "$seed" "${ATTACK[@]}" --backdoor-scale 1
  run "FedFA-scaleonly_attack1_s$seed" --method FedFA --no-fedfa-graft --seed "$seed" "${ATTACK[@]}" --backdoor-scale 1
done
for seed in ${ABLATION_SEEDS-0 1}; do
  for method in FlexiFed FedFA; do
    run "${method}_largest_s$seed" --method "$method" --seed "$seed" "${ATTACK[@]}" --malicious-group largest \
        --backdoor-scale 20
  done
done
for seed in ${ABLATION_SEEDS-0 1}; do
  for part in graft scale; do  # (each part alone, clean and under the lambda-1 attack on the largest architecture)
    no=$([ $part = graft ] && echo --no-fedfa-scale || echo --no-fedfa-graft)
    run "FedFA-${part}only_clean_s$seed" --method FedFA "$no" --seed "$seed"
    run "FedFA-${part}only_largest1_s$seed" --method FedFA "$no" --seed "$seed" "${ATTACK[@]}" \
        --malicious-group largest --backdoor-scale 1
  done
done
for seed in ${ABLATION_SEEDS-0 1}; do
  LARGEST=(--seed "$seed" "${ATTACK[@]}" --malicious-group largest)
  run "FedFA-graftonly_largest_s$seed" --method FedFA --no-fedfa-scale "${LARGEST[@]}" --backdoor-scale 20
  run "FedFA-scaleonly_largest_s$seed" --method FedFA --no-fedfa-graft "${LARGEST[@]}" --backdoor-scale 20
  run "FedFA-median_clean_s$seed" --method FedFA --fedfa-center median --seed "$seed"
  for scale in 20 1 5; do
    name=$([ $scale = 20 ] && echo largest || echo largest$scale)
    run "FedFA-median_${name}_s$seed" --method FedFA --fedfa-center median "${LARGEST[@]}" --backdoor-scale $scale
  done
  for method in FlexiFed FedFA; do
    run "${method}_largest5_s$seed" --method "$method" "${LARGEST[@]}" --backdoor-scale 5
  done
done
for seed in ${ABLATION_SEEDS-0 1}; do  # (where lambda 20 does its damage: lambda on the kernels alone, on the rest)
  for method in FlexiFed FedFA; do
    for leaves in kernels others; do
      run "${method}_largest-${leaves}_s$seed" --method "$method" --seed "$seed" "${ATTACK[@]}" \
          --malicious-group largest --backdoor-scale 20 --backdoor-leaves "$leaves"
    done
  done
done
