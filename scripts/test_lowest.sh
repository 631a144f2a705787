#!/usr/bin/env bash
# Tests against the lowest versions pyproject.toml supports (its lower bounds, which are
# integration/compat.py's SUPPORTED; tests/test_compat.py checks the pins below match them)
# and the lowest test extras (trl, peft), in a throwaway virtualenv that reuses this
# environment's torch and every other package (--system-site-packages; --no-deps, so pip
# never fetches torch). Result and date: CONTRIBUTING.md, "Supported versions".
#
# Without arguments: the README's whole suite (tests/ and integration_tests/, pyproject's
# testpaths). Arguments go to pytest: test paths narrow it
# (`bash scripts/test_lowest.sh integration_tests`), options are added (`-k trainer`, `-x`).
#
# DeepSpeed's ops build into "$VENV/torch_extensions". A build that is interrupted (a run
# stopped with Ctrl-C) leaves a `lock` file in its op's directory there, without the op's .so,
# and every later run waits on it without end (a launched script then times out after 600 s);
# delete that directory, or the virtualenv, after stopping a run.
#
# Pins beyond the bounds, each what the lowest versions need (pip's resolver is off):
# - tokenizers 0.22.1, huggingface-hub 1.3.0: transformers 5.2 wants >=0.22.0,<=0.23.0 and
#   >=1.3.0,<2.0 (the hub's own hf-xet, httpx and shellingham come from this environment);
# - datasets 4.7.0, TRL 1.0's lowest, with its dill<0.4.1, multiprocess<0.70.19,
#   fsspec<=2026.2.0 and httpx.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRAIN_LOWEST_VENV:-/tmp/megatrain-lowest}
# --without-pip: this environment's pip installs into it, and no setuptools of the venv module's
# own (65 on Python 3.11, below pyproject's build requirement) shadows this environment's when
# tests/test_deepspeed_hook.py builds the wheels.
python3 -m venv --system-site-packages --without-pip "$VENV"
# Run from a virtualenv, --system-site-packages reaches the base interpreter's packages, not
# this environment's (its torch included): a .pth file adds them, after the venv's own, with
# their .pth files processed as the base's are. This package is then installed into the venv
# itself (editable, as set-up installs it), so that its start-up hook's .pth is in one of the
# venv's site directories, where a user's install puts it and tests/test_deepspeed_hook.py
# looks for it.
nested=$(python3 -c "import sys; print(int(sys.prefix != sys.base_prefix))")
if [ "$nested" = 1 ]; then
    purelib=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    python3 -c "import site; print(*(f'import site; site.addsitedir({p!r})' for p in site.getsitepackages()), sep='\n')" \
        >"$purelib/megatrain_this_environment.pth"
fi
"$VENV/bin/python" -m pip install -q --no-deps deepspeed==0.19.8 accelerate==1.10.0 transformers==5.2.0 \
    tokenizers==0.22.1 huggingface-hub==1.3.0 trl==1.0.0 peft==0.18.0 \
    datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 fsspec==2026.2.0 httpx==0.28.1 httpcore==1.0.9
if [ "$nested" = 1 ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation --editable .
fi
# This checkout's code; DeepSpeed's ops built for these versions, apart from the shared cache.
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${MEGATRAIN_TEST_WORKERS:-2}" --dist worksteal \
    --durations=15 "$@"
