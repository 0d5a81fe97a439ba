#!/usr/bin/env bash
# The accelerator suite (benchmarks/gpu_suite.py): about 8 minutes on one GPU, one table at the end.
# Usage: bash benchmarks/gpu_suite.sh [OUT_DIR]   (default: runs/gpu_suite; pass --smoke after it to try it on a CPU)
# Needs jax with CUDA, torch with CUDA, and Fashion-MNIST (apt-get install dataset-fashion-mnist, or
# FEDJAX_HETERO_DATA_DIR=DIR holding DIR/fashion-mnist).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu_suite}"
shift || true
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
# A fresh persistent compilation cache: first rounds are honest compilations, and later steps may reuse them.
export FEDJAX_HETERO_CACHE_DIR="${FEDJAX_HETERO_CACHE_DIR:-$(mktemp -d)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PYTHON" -c "import jax; print('jax', jax.__version__, jax.devices())"
PYTHONPATH=. exec "$PYTHON" -m benchmarks.gpu_suite "$OUT" "$@"
