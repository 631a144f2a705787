#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: torch first, pinned to the tested 2.13.0 (where
# torch is already installed, e.g. a GPU image or a CPU build installed by hand, it is
# kept), then this package (editable, from this checkout) with its pinned dependencies.
# Pinning does not make torch a CPU build: on Linux PyPI's torch 2.13.0 is a 527 MB wheel
# that requires CUDA 13's libraries (cuDNN, cuBLAS, NCCL, ...), GPU or not. pip takes a CPU
# build only where its configuration offers one (a local wheel or an extra index, as on
# this project's machines), so the message says how to get one before the download starts.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: no torch here; installing torch==2.13.0 (from PyPI on Linux a CUDA build, several GB with" \
        "its CUDA libraries; on a machine without a GPU install the CPU build first and set-up keeps it:" \
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet --constraint constraints.txt --editable ".[test]"
# libaio for DeepSpeed's async I/O op (the NVMe tier, megatrain_ds/state/swap_io.py); without
# it the tier falls back to O_DIRECT reads and writes on a thread pool.
if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libaio-dev >/dev/null || echo "setup: could not install libaio-dev (the NVMe tier will use its thread fallback)"
fi
# The C++ ops, compiled once into torch's extension cache (TORCH_EXTENSIONS_DIR, else
# ~/.cache/torch_extensions) and a second or two to load after:
# - the engine's own builds, from DeepSpeed's sources with its flags, under names that say
#   what they depend on (megatrain_ds/runtime/built_ops.py), so a new virtualenv reuses them:
#   the binding of DeepSpeed's CPU Adam kernel with the fused gradient accumulation
#   (megatrain_ds/optimizer/cpu_binding.py, ~40 s), and DeepSpeed's async I/O op with its
#   pinned-memory op where libaio is there (the NVMe tier, megatrain_ds/state/swap_io.py, ~150 s);
# - DeepSpeed's own, which it rebuilds in each new virtualenv: its CPU Adam op (the tests'
#   reference, and DeepSpeed's engine with offload_optimizer, ~40 s) and, on a machine without
#   CUDA, its CPU accelerator's shared-memory op (its collectives, even for one process:
#   otherwise the main job's first run compiles it, ~25 s).
# Times are for two cores. tests/test_cpu_adam_fused.py checks the binding against DeepSpeed's
# op bit for bit and fails, not skips, where a compiler should have built it. Quiet unless a
# build fails; the test then shows the full error.
ops_log=$(mktemp)
if ! DS_ACCELERATOR=cpu "$PYTHON" -c "
from deepspeed.ops.op_builder import CPUAdamBuilder
from megatrain_ds.optimizer.cpu_binding import load_deepspeed_op
from megatrain_ds.state.swap_io import deepspeed_aio_op
CPUAdamBuilder().load(verbose=False)
load_deepspeed_op()
try:
    deepspeed_aio_op()
except RuntimeError as error:
    print(f'setup: {error} (the NVMe tier will use its thread fallback)')
import torch
from deepspeed.ops.op_builder import ShareMemCommBuilder
if not torch.cuda.is_available() and ShareMemCommBuilder().is_compatible(verbose=False):
    ShareMemCommBuilder().load(verbose=False)
" >"$ops_log" 2>&1; then
    echo "setup: could not build DeepSpeed's CPU Adam, async I/O or shared-memory op (tests/test_cpu_adam_fused.py will fail):"
    tail -n 20 "$ops_log"
fi
grep "^setup: " "$ops_log" || true
rm -f "$ops_log"
