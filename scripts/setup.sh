#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: torch first and pinned (an unpinned torch from
# PyPI is a multi-GB CUDA build; where torch is already installed, e.g. a GPU image, it is
# kept), then this package (editable, from this checkout) with its pinned dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet --constraint constraints.txt --editable ".[test]"
# libaio for DeepSpeed's async I/O op (the NVMe tier, megatrain_ds/state/swap_io.py); without
# it the tier falls back to O_DIRECT reads and writes on a thread pool.
if [ ! -e /usr/include/libaio.h ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libaio-dev >/dev/null || echo "setup: could not install libaio-dev (the NVMe tier will use its thread fallback)"
fi
