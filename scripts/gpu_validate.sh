#!/usr/bin/env bash
# One command that validates the engine on a GPU machine and keeps the evidence.
#
# Run from anywhere on a machine with CUDA (no network needed):
#   bash scripts/gpu_validate.sh [--out DIR] [--only STEP]... [--skip STEP]... [--limit STEP=SECONDS]... [--compare-args "ARGS"]
#   bash scripts/gpu_validate.sh --dry-run     # the plan, on any machine
#
# Steps, in order (each one's log and result files go to DIR, default bench/results/gpu_<device>/):
#   install       deepspeed and pydantic from .whl/ where missing (the GPU machines have no
#                 index; fill .whl/ beforehand with ../shared/gpu/prepare_wheels.sh)
#   ops           JIT-build DeepSpeed's CPU Adam op and the engine's build of its kernel, both
#                 at once, so that no timed step pays for a compile
#   host-contention bench/host_contention.py: the CPU AdamW kernel at 8/14/all threads, alone
#                 and beside pinned copies both ways; the device-side norm against the d2h copy
#   gpu-tests     tests/test_gpu.py, tests/test_gpu_flows.py, tests/test_optimizer_gpu.py,
#                 tests/test_triton_adamw.py (the Triton AdamW compiled for the device, checkpoint
#                 save/resume on CUDA; call orders first run on the CPU: step() twice, evaluation only,
#                 a forward before step(), state_dict() right after a pipelined step())
#   sanitizer     the CUDA parity and checkpoint cases and tests/test_gpu_flows.py again under PyTorch's
#                 CUDA sanitizer (TORCH_CUDA_SANITIZER=1: a missing stream synchronisation fails the test)
#   data-parallel 2+ ranks on NCCL (skipped with one GPU)
#   compare       bench/compare.py: torch, DeepSpeed ZeRO-3 and ZeRO-2 offload and megatrain side by side
#                 (megatrain with its defaults, the GPU tier's "device_state": "auto" among them; also
#                 with "recompute": "none", and with "device_state": "none": every optimizer state on the host)
#                 (--compare-args, default the 940M Llama of configs/models/llama_940m.json)
#   compare-optimizer-cpu the engine alone on the same model with every optimizer state on the host
#                 ("device_state": "none") and "optimizer_device": "cpu" (against compare's
#                 megatrain_host_state, "optimizer_device": "auto": does streaming state through the GPU pay?)
#   compare-3b    ~3B Llama (hidden 3072, 28 blocks), 8 x 2048 tokens: engine (and with "device_state":
#                 "none"), ZeRO-3 and ZeRO-2 offload
#   lora-3b       bench/lora_memory.py on the ~3B shape: peft LoRA r=16 on q/v over a frozen bf16 base,
#                 the engine vs ZeRO-3 offload, tokens/s and peak host bytes (needs peft: put its wheel
#                 in .whl/ with `pip download --no-deps -d .whl peft`)
#   compare-7b    Llama-2-7B's shape, 8 x 2048 tokens: the engine alone (ZeRO-3 offload's ~25 B/param
#                 does not fit a 128 GiB host: bench/zero3_estimate.py, DeepSpeed's own estimator)
#   gradient-worker bench/gradient_worker.py: the host's gradient worker alone, and beside a
#                 Python-busy thread (what set the H200's step: bench/results/gpu_H200)
#   triton-adamw  bench/triton_adamw.py: the kernel's bandwidth vs a device copy and fused AdamW
#   timeline      bench/timeline.py --record --device cuda: the traced step as a PNG
# Every step runs even when an earlier one fails, each under its own time limit (--limit: a
# lease is short, and one hung step must not cost the others); a summary table ends the run
# and is written to DIR/summary.json, with the checkout's git_rev. Exit status: 0 when no
# step failed, 1 otherwise, 2 for bad arguments or no CUDA device (without --dry-run).
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(install ops host-contention gpu-tests sanitizer data-parallel compare compare-optimizer-cpu gradient-worker
       triton-adamw timeline compare-3b lora-3b compare-7b)
# Seconds each step may take before it is stopped and recorded as FAIL(124).
declare -A LIMITS=([install]=120 [ops]=300 [host-contention]=120 [gpu-tests]=600 [sanitizer]=300
                   [data-parallel]=300 [compare]=900 [compare-optimizer-cpu]=300 [gradient-worker]=120
                   [triton-adamw]=120 [timeline]=120 [compare-3b]=900 [lora-3b]=600
                   [compare-7b]=600)
# configs/models/llama_940m.json's shape, 3 warm-up and 5 measured steps (compare.py's defaults) per system.
DEFAULT_COMPARE_ARGS="--hidden 2048 --intermediate 5504 --layers 16 --seq-len 1024 --micro-batch 4"
# The issue's ~3B target: hidden 3072, 28 blocks, 8 x 2048 tokens.
# Each of COMPARE_3B_ARGS and COMPARE_7B_ARGS may be set in the environment instead (a shorter list of systems).
COMPARE_3B_ARGS=${COMPARE_3B_ARGS:-"--hidden 3072 --intermediate 8192 --layers 28 --seq-len 2048 --micro-batch 8 --warmup 3 --steps 5 --no-planner --systems megatrain megatrain_host_state zero3_offload zero2_offload"}
# Llama-2-7B's shape (hidden 4096, FFN 11008, 32 blocks), 8 x 2048 tokens: does the engine train it, how fast.
COMPARE_7B_ARGS=${COMPARE_7B_ARGS:-"--hidden 4096 --intermediate 11008 --layers 32 --seq-len 2048 --micro-batch 8 --warmup 1 --steps 3 --no-planner --systems megatrain"}

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "Options:"
    echo "  --dry-run            print each step's command and the summary; run nothing"
    echo "  --out DIR            where logs and results go (default bench/results/gpu_<device>)"
    echo "  --only STEP          run only the steps named (repeatable; name install and ops too): a"
    echo "                       lease's call then runs what it names, whatever steps are added later"
    echo "  --skip STEP          leave a step out (repeatable): ${STEPS[*]}"
    echo "  --limit STEP=SECONDS stop a step after SECONDS (repeatable; defaults: $(for s in "${STEPS[@]}"; do printf '%s=%s ' "$s" "${LIMITS[$s]}"; done))"
    echo "  --compare-args ARGS  arguments for bench/compare.py (default: $DEFAULT_COMPARE_ARGS)"
    echo "  -h, --help           this text"
}

fail_usage() { echo "gpu_validate.sh: $1 (see --help)" >&2; exit 2; }

DRY_RUN=0
OUT_DIR=""
COMPARE_ARGS="$DEFAULT_COMPARE_ARGS"
declare -A SKIPPED=()  # step -> why it is left out
ONLY=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        --out) [ $# -ge 2 ] || fail_usage "--out needs a directory"; OUT_DIR="$2"; shift ;;
        --skip)
            [ $# -ge 2 ] || fail_usage "--skip needs a step name"
            [[ " ${STEPS[*]} " == *" $2 "* ]] || fail_usage "unknown step '$2'; steps: ${STEPS[*]}"
            SKIPPED[$2]="--skip"; shift ;;
        --only)
            [ $# -ge 2 ] || fail_usage "--only needs a step name"
            [[ " ${STEPS[*]} " == *" $2 "* ]] || fail_usage "unknown step '$2'; steps: ${STEPS[*]}"
            ONLY+=("$2"); shift ;;
        --limit)
            [[ $# -ge 2 && "$2" =~ ^([a-z0-9-]+)=([0-9]+)$ ]] || fail_usage "--limit needs STEP=SECONDS"
            [[ " ${STEPS[*]} " == *" ${BASH_REMATCH[1]} "* ]] || fail_usage "unknown step '${BASH_REMATCH[1]}'; steps: ${STEPS[*]}"
            LIMITS[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}; shift ;;
        --compare-args) [ $# -ge 2 ] || fail_usage "--compare-args needs a value"; COMPARE_ARGS="$2"; shift ;;
        *) fail_usage "unknown argument '$1'" ;;
    esac
    shift
done
if [ ${#ONLY[@]} -gt 0 ]; then
    for name in "${STEPS[@]}"; do
        [[ " ${ONLY[*]} " == *" $name "* ]] || SKIPPED[$name]=${SKIPPED[$name]:-"not in --only"}
    done
fi

PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD:$PWD/triton_kernels${PYTHONPATH:+:$PYTHONPATH}"
# The ops' builds inside the checkout (git ignores it): the device tool keeps ignored files of
# the working tree between calls on a warm machine; ~/.cache may not be kept (the third H200
# run's second call, on the same warm machine, was cut at 30 s in the ops step, which takes a
# few seconds when the first call's builds are found).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export PYTHONUNBUFFERED=1
# The device name (file-name safe) and the GPU count, or "none" without CUDA.
read -r DEVICE NUM_GPUS < <("$PYTHON" - <<'EOF' 2>/dev/null || echo "none 0"
import re
import torch
if torch.cuda.is_available():
    name = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_")
    print(name.removeprefix("NVIDIA_") or "cuda", torch.cuda.device_count())
else:
    print("none", 0)
EOF
)
if [ "$DEVICE" = "none" ] && [ "$DRY_RUN" = 0 ]; then
    echo "gpu_validate.sh: no CUDA device here: run it on a GPU machine, or with --dry-run to see the plan" >&2
    exit 2
fi
if [ -z "$OUT_DIR" ]; then
    # A dry run leaves the repository as it was.
    if [ "$DRY_RUN" = 1 ]; then OUT_DIR=$(mktemp -d); else OUT_DIR=bench/results/gpu_$DEVICE; fi
fi
mkdir -p "$OUT_DIR"

NAMES=(); STATUSES=(); SECONDS_TAKEN=(); NOTES=()
record() { NAMES+=("$1"); STATUSES+=("$2"); SECONDS_TAKEN+=("$3"); NOTES+=("$4"); }

# step NAME NOTE -- COMMAND...: run one step (or plan it) under its limit, its output in
# OUT_DIR/NAME.log. COMMAND may be a function of this script (exported below).
step() {
    local name=$1 note=$2
    shift 3
    if [ -n "${SKIPPED[$name]:-}" ]; then
        record "$name" skipped 0 "${SKIPPED[$name]}"; return
    fi
    if [ "$DRY_RUN" = 1 ]; then
        echo "[dry-run] $name: (at most ${LIMITS[$name]} s) $*"
        record "$name" planned 0 "$note"; return
    fi
    echo "== $name: $*"
    local started=$SECONDS
    timeout --kill-after=15 "${LIMITS[$name]}" bash -c '"$@"' "$name" "$@" > >(tee "$OUT_DIR/$name.log") 2>&1
    local status=$?
    record "$name" "$([ $status = 0 ] && echo pass || echo "FAIL($status)")" $((SECONDS - started)) "$note"
}

install_wheels() {
    if "$PYTHON" -c "import deepspeed" 2>/dev/null; then echo "deepspeed already importable"; return 0; fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "deepspeed is missing and .whl/ is empty: run ../shared/gpu/prepare_wheels.sh where pip works," \
             "carry .whl/ here; the ZeRO-3 rows of compare will fail without it" >&2
        return 1
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}
export -f install_wheels
export PYTHON OUT_DIR NUM_GPUS

step install "wheels from .whl/" -- install_wheels
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
build_ops() {
    "$PYTHON" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" &
    local deepspeed_op=$!
    "$PYTHON" -c "from megatrain_ds.optimizer.cpu_adam import DeepSpeedKernel; DeepSpeedKernel()" || return
    wait $deepspeed_op
}
export -f build_ops
step ops "JIT builds: DeepSpeed's CPU Adam op, the engine's kernel" -- build_ops
step host-contention "CPU AdamW at 8/14/all threads, alone and beside pinned copies; the device norm" -- \
    "$PYTHON" bench/host_contention.py --out "$OUT_DIR/host_contention.json"
step gpu-tests "parity, overlap, memory flat in depth, call orders, device optimizer, Triton, checkpoints" -- \
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_flows.py tests/test_optimizer_gpu.py \
    tests/test_triton_adamw.py \
    tests/test_checkpoint.py::test_save_and_load_on_cuda \
    tests/test_trace.py::test_cuda_trace_shows_weight_copies_overlapping_compute
# -k also matches the module's name: every test of tests/test_gpu_flows.py, test_gpu.py's parity and checkpoint ones.
step sanitizer "TORCH_CUDA_SANITIZER=1 over the CUDA parity, checkpoint and call-order cases" -- \
    env TORCH_CUDA_SANITIZER=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_flows.py \
    -k "parity or checkpoint or test_gpu_flows"
data_parallel_vs_one_process() {
    "$PYTHON" -m torch.distributed.run --nproc_per_node "$NUM_GPUS" tests/data_parallel_worker.py parity \
        --out "$OUT_DIR/data_parallel" --steps 5 --accumulation 2 || return
    # The ranks' weights against plain PyTorch in one process with every rank's rows
    # (tests/test_data_parallel.py's reference, computed here on the CPU: hence 1e-4, not 2e-6).
    "$PYTHON" - "$OUT_DIR/data_parallel" "$NUM_GPUS" <<'EOF'
import sys
import torch
sys.path.insert(0, "tests")
from test_data_parallel import reference_training, relative_error
out, world = sys.argv[1], int(sys.argv[2])
expected, norms = reference_training(5, 2, world_size=world)
for rank in range(world):
    got = torch.load(f"{out}/rank{rank}.pt")
    error = relative_error({k: v.cpu() for k, v in got["state_dict"].items()}, expected)
    print(f"rank {rank}: relative weight error {error:.2e} vs one process")
    assert error < 1e-4, f"rank {rank} differs from one process: {error}"
EOF
}
export -f data_parallel_vs_one_process

if [ "$NUM_GPUS" -gt 1 ]; then
    step data-parallel "$NUM_GPUS ranks on NCCL vs one process" -- data_parallel_vs_one_process
else
    record data-parallel skipped 0 "one GPU (NCCL needs two)"
fi
# shellcheck disable=SC2086  # COMPARE_ARGS is a list of arguments
step compare "torch / ZeRO-3 offload / megatrain: $COMPARE_ARGS" -- \
    "$PYTHON" bench/compare.py $COMPARE_ARGS --out "$OUT_DIR/compare.json"
step compare-optimizer-cpu "the engine, host state, optimizer_device cpu: $COMPARE_ARGS" -- \
    "$PYTHON" bench/compare.py $COMPARE_ARGS --systems megatrain_host_state --megatrain '{"optimizer_device": "cpu"}' \
    --out "$OUT_DIR/compare_optimizer_cpu.json"
step gradient-worker "the gradient worker's rate: alone, beside Python, one thread, the kernels alone" -- \
    "$PYTHON" bench/gradient_worker.py --out "$OUT_DIR/gradient_worker.json"
step triton-adamw "bandwidth vs device copy and torch fused AdamW" -- \
    "$PYTHON" bench/triton_adamw.py --output "$OUT_DIR/triton_adamw.json"
step timeline "a traced step of configs/models/llama_940m.json (compare's default model)" -- \
    "$PYTHON" bench/timeline.py "$OUT_DIR/timeline.json" --record --device cuda --model configs/models/llama_940m.json \
    --seq-len 1024 --micro-batch 4 --threads "$(nproc)"
# shellcheck disable=SC2086
step compare-3b "~3B Llama, 8 x 2048 tokens: $COMPARE_3B_ARGS" -- \
    "$PYTHON" bench/compare.py $COMPARE_3B_ARGS --out "$OUT_DIR/compare_3b.json"
step lora-3b "LoRA r=16 on q/v over a bf16 ~3B base, 8 x 2048 tokens: the engine vs ZeRO-3 offload" -- \
    "$PYTHON" bench/lora_memory.py --hidden 3072 --intermediate 8192 --layers 28 --seq-len 2048 --micro-batch 8 \
    --warmup 3 --steps 8 --json "$OUT_DIR/lora_3b.json"
# shellcheck disable=SC2086
step compare-7b "Llama-2-7B shape, 8 x 2048 tokens, the engine: $COMPARE_7B_ARGS" -- \
    "$PYTHON" bench/compare.py $COMPARE_7B_ARGS --out "$OUT_DIR/compare_7b.json"

echo
printf '%-16s %-10s %8s  %s\n' step result seconds note
failed=0
for i in "${!NAMES[@]}"; do
    printf '%-16s %-10s %8s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${SECONDS_TAKEN[$i]}" "${NOTES[$i]}"
    [[ "${STATUSES[$i]}" == FAIL* ]] && failed=1
done
# The code the steps ran (a step whose only result is its log, like gpu-tests, has no other record).
GIT_REV=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ "$GIT_REV" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    GIT_REV="$GIT_REV-dirty"
fi
"$PYTHON" - "$OUT_DIR/summary.json" "$DEVICE" "$DRY_RUN" "$GIT_REV" "${#NAMES[@]}" \
    "${NAMES[@]}" "${STATUSES[@]}" "${SECONDS_TAKEN[@]}" "${NOTES[@]}" <<'EOF'
import json, sys
path, device, dry_run, git_rev = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
count = int(sys.argv[5])
columns = [sys.argv[6 + i * count: 6 + (i + 1) * count] for i in range(4)]
steps = [{"step": n, "result": r, "seconds": int(s), "note": note} for n, r, s, note in zip(*columns)]
with open(path, "w") as handle:
    json.dump({"device": device, "dry_run": dry_run, "git_rev": git_rev, "steps": steps}, handle, indent=1)
    handle.write("\n")
EOF
echo "summary: $OUT_DIR/summary.json"
exit $failed
