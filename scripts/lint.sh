#!/usr/bin/env bash
# The static checks CI runs (.ci/run): ruff's lint and format check over the tree, and
# pyright over megatrain_ds/ and triton_kernels/ (configs in pyproject.toml). Zero findings.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# --project: the config here, never a pyrightconfig.json of a folder above. A run that
# checked no files (a config that matched nothing) is no pass.
report=$("$PYTHON" -m pyright --project pyproject.toml --stats) || { echo "$report"; exit 1; }
echo "$report" | grep -E "Total files checked|errors?, "
checked=$(echo "$report" | sed -n 's/^Total files checked: \([0-9]*\)$/\1/p')
if [ "${checked:-0}" -lt 50 ]; then
    echo "lint: pyright checked ${checked:-no} files; expected the package and its kernels" >&2
    exit 1
fi
