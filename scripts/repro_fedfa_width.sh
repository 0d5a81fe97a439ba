#!/usr/bin/env bash
# FedFA's width and width+depth variants at CPU size, clean (docs/reproduction.md, "FedFA"), with --preset fedfa-cpu, on
# the seeds in SEEDS (default "0 1"): width groups ResNet18 @0.125 and @0.0625 (FedFA against HeteroFL, its width
# baseline) and width+depth groups ResNet26 @0.125 and ResNet18 @0.0625 (FedFA against NeFL); FedFA with and without the
# static BatchNorm its paper trains with. Then, on the seeds in ABLATION_SEEDS (default "0 1"; empty: none), the
# ablations: FedFA's kernel norm per element (--fedfa-norm rms), FedFA without its scaling, HeteroFL without its static
# BatchNorm; last, the width groups under 20% attackers at lambda 1, all on the widest group (--malicious-group
# largest). Each run resumes if interrupted; finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/repro/fedfa}
WIDTH=(--groups resnet18@0.125,resnet18@0.0625)
WIDTH_DEPTH=(--groups resnet26@0.125,resnet18@0.0625)
# HeteroFL's Scaler divides by a group's rate of the global model; in these ResNets a BatchNorm follows every
# scaled convolution, so in training it changes only BatchNorm's epsilon term.
NO_SCALER=(--no-heterofl-scaler)
source scripts/resumable_run.sh
run() { resumable_run fedfa-cpu "$OUT" "$@"; }
for seed in ${SEEDS:-0 1}; do
  run "HeteroFL_width_s$seed" --method HeteroFL --seed "$seed" "${WIDTH[@]}" "${NO_SCALER[@]}"
  run "FedFA_width_s$seed" --method FedFA --seed "$seed" "${WIDTH[@]}"
  run "FedFA-sbn_width_s$seed" --method FedFA --fedfa-static-bn --seed "$seed" "${WIDTH[@]}"
  run "NeFL_widthdepth_s$seed" --method NeFL --seed "$seed" "${WIDTH_DEPTH[@]}"
  run "FedFA_widthdepth_s$seed" --method FedFA --seed "$seed" "${WIDTH_DEPTH[@]}"
  run "FedFA-sbn_widthdepth_s$seed" --method FedFA --fedfa-static-bn --seed "$seed" "${WIDTH_DEPTH[@]}"
done
ABLATION=(--on-divergence off)  # (some of them leave a group at chance: the guard would stop them)
for seed in ${ABLATION_SEEDS-0 1}; do
  run "FedFA-rms_width_s$seed" --method FedFA --fedfa-norm rms --seed "$seed" "${WIDTH[@]}" "${ABLATION[@]}"
  run "FedFA-rms_widthdepth_s$seed" --method FedFA --fedfa-norm rms --seed "$seed" "${WIDTH_DEPTH[@]}" "${ABLATION[@]}"
  run "FedFA-noscale_width_s$seed" --method FedFA --no-fedfa-scale --seed "$seed" "${WIDTH[@]}" "${ABLATION[@]}"
  run "HeteroFL-nosbn_width_s$seed" --method HeteroFL --no-heterofl-static-bn --seed "$seed" "${WIDTH[@]}" \
      "${NO_SCALER[@]}" "${ABLATION[@]}"
done
ATTACK=(--malicious-fraction 0.2 --on-divergence off --malicious-group largest --backdoor-scale 1)
for seed in ${ABLATION_SEEDS-0 1}; do
  run "HeteroFL_width_largest1_s$seed" --method HeteroFL --seed "$seed" "${WIDTH[@]}" "${NO_SCALER[@]}" "${ATTACK[@]}"
  run "FedFA-sbn_width_largest1_s$seed" --method FedFA --fedfa-static-bn --seed "$seed" "${WIDTH[@]}" "${ATTACK[@]}"
done
