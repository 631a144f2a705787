#!/usr/bin/env bash
# The static checks CI runs (.ci/run): ruff's lint and format check over the tree, and
# pyright over megatrain_ds/ and triton_kernels/ (configs in pyproject.toml). Zero findings.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
"$PYTHON" -m pyright
