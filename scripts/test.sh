#!/usr/bin/env bash
# Set up (idempotent), then run every test: unit tests in tests/, end-to-end runs in
# integration_tests/. Extra arguments go to pytest (e.g. -k parity, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
