#!/usr/bin/env bash
# Set up (idempotent), then run the main job: train a small Llama-shaped model on the
# corpus shipped in data/, on the GPU if there is one, else the CPU. Extra arguments go to
# examples/train_clm.py (e.g. --steps 500, --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/train_clm.py "$@"
