#!/usr/bin/env bash
# Tests against the lowest versions pyproject.toml supports (its lower bounds, which are
# integration/compat.py's SUPPORTED; tests/test_compat.py checks the pins below match them)
# and the lowest test extras (trl, peft), in a throwaway virtualenv that reuses this
# environment's torch and every other package (--system-site-packages; --no-deps, so pip
# never fetches torch). Result and date: CONTRIBUTING.md, "Supported versions".
#
# Without arguments: the tests that exercise DeepSpeed, Accelerate, transformers, TRL and PEFT
# most, that is the integration layer's unit tests and every launched script of
# integration_tests/ (Accelerate, the HF Trainer and its clients, TRL's SFTTrainer and
# `trl sft`, PEFT LoRA, the ZeRO-3 configs, the main job). Arguments go to pytest; test paths
# first replace that selection (`bash scripts/test_lowest.sh tests integration_tests` runs
# everything), options alone are added to it (`bash scripts/test_lowest.sh -k trainer`).
#
# Pins beyond the bounds, each what the lowest versions need (pip's resolver is off):
# - tokenizers 0.22.1, huggingface-hub 0.36.0: transformers 4.56 wants <=0.23.0 and <1.0;
# - datasets 4.7.0, TRL 1.0's lowest (newer ones import huggingface-hub>=1.0 names), with
#   its dill<0.4.1, multiprocess<0.70.19, fsspec<=2026.2.0 and httpx.
# TRL 1.0 itself declares accelerate>=1.4 and transformers>=4.56.2: run below that, it is
# tested as far as these clients use it, not supported by TRL.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRAIN_LOWEST_VENV:-/tmp/megatrain-lowest}
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps deepspeed==0.19.8 accelerate==1.10.0 transformers==4.56.0 \
    tokenizers==0.22.1 huggingface-hub==0.36.0 trl==1.0.0 peft==0.17.0 \
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 fsspec==2026.2.0 httpx==0.28.1 httpcore==1.0.9
# This checkout's code; DeepSpeed's ops built for these versions, apart from the shared cache.
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
case "${1:-}" in
    "" | -*) # no test paths given: the default selection, options (-k, -x) added to it
        set -- tests/test_compat.py tests/test_deepspeed_*.py tests/test_fp16.py tests/test_load_from.py \
            tests/test_lora.py tests/test_layer_checkpointing.py integration_tests "$@" ;;
esac
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${MEGATRAIN_TEST_WORKERS:-2}" --dist worksteal \
    --durations=15 "$@"
