#!/usr/bin/env bash
# Set up (idempotent), then run every test: unit tests in tests/, end-to-end runs in
# integration_tests/ (all but the race checker's mutation test, CI's second stage: .ci/run).
# Extra arguments go to pytest (e.g. -k parity, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Both cores (pytest-xdist; MEGATRAIN_TEST_WORKERS=0 runs in one process), work stolen by an
# idle worker so the long tests do not leave one waiting at the end; the slowest 15 printed.
exec "${PYTHON:-python3}" -m pytest -q -n "${MEGATRAIN_TEST_WORKERS:-2}" --dist worksteal --durations=15 "$@"
