#!/usr/bin/env bash
# docs/privacy.png: FedAvg on a Fashion-MNIST subset (10,000 training images, 500 IID clients, 100 per round, an MLP
# with 16 hidden units, 4 local SGD steps), without privacy and with the updates clipped to 1 and noised at z = 0,
# 1, 2 and 4, 30 rounds each; then the accuracy per round with epsilon. About 3 minutes on 2 CPU cores. Usage:
#   bash scripts/privacy_figure.sh [OUT_DIR]   (default runs/privacy)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/privacy}
python=${PYTHON:-.venv/bin/python}
common=(--method FedAvg --groups mlp@0.25 --num-clients 500 --clients-per-round 100 --partition iid
        --max-train-samples 10000 --max-test-samples 2000 --optimizer sgd --lr 0.1 --batch-size 10 --epochs 2
        --rounds 30 --eval-every 2 --no-dissimilarity
        --no-progress --overwrite)
"$python" -m experiments.fmnist "${common[@]}" --output-dir "$out/off"
for z in 0 1 2 4; do
  "$python" -m experiments.fmnist "${common[@]}" --dp-clip 1 --dp-noise-multiplier "$z" --output-dir "$out/z$z"
done
"$python" scripts/plot_privacy.py docs/privacy.png "$out/off" "$out/z0" "$out/z1" "$out/z2" "$out/z4"
