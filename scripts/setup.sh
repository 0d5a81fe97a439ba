#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian/Ubuntu machine (idempotent):
# the Fashion-MNIST Debian package and a virtual environment in .venv.
# Usage: setup.sh [EXTRAS]   e.g. `setup.sh test` installs ".[test]".
set -euo pipefail
EXTRAS="${1:-}"
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${FEDJAX_HETERO_DATA_DIR:-}" ]; then
  echo "[setup] installing the Fashion-MNIST Debian package"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip >/dev/null
    "$PYTHON" -m venv .venv
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
