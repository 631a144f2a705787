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
