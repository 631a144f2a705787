#!/usr/bin/env bash
# Set up (idempotent), then run the main job: train a small Llama-shaped model on the
# corpus shipped in data/, on the GPU if there is one (bf16 compute), else the CPU (fp32).
# It is a plain Accelerate script launched with the shipped Accelerate config, whose
# DeepSpeed JSON says "engine": "megatrain". Extra arguments go to examples/train_clm.py
# (e.g. --steps 500, --model DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    precision=bf16
else
    precision=no
    export DS_ACCELERATOR=cpu  # DeepSpeed's accelerator: it would guess, with a warning
fi
exec "$PYTHON" -m accelerate.commands.launch --config_file configs/accelerate_megatrain.yaml \
    --mixed_precision "$precision" examples/train_clm.py "$@"
