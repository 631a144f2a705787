#!/usr/bin/env bash
# The tests that touch DeepSpeed, Accelerate and transformers, run against the lowest versions
# pyproject.toml supports (its lower bounds; integration/compat.py's SUPPORTED), in a throwaway
# virtualenv that reuses this environment's torch and every other package
# (--system-site-packages; --no-deps, so pip never fetches torch). Extra arguments go to pytest.
# transformers 4.56 needs tokenizers<=0.23.0 and huggingface-hub<1.0: pinned here too.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRAIN_LOWEST_VENV:-/tmp/megatrain-lowest}
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps deepspeed==0.19.8 accelerate==1.0.0 transformers==4.56.0 \
    tokenizers==0.22.1 huggingface-hub==0.36.0
# This checkout's code; DeepSpeed's ops built for these versions, apart from the shared cache.
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 0 \
    tests/test_compat.py tests/test_deepspeed_adapter.py tests/test_deepspeed_entry.py tests/test_fp16.py "$@"
