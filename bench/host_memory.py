"""Peak host memory per parameter of the engine, initialisation included.

Each configuration runs in a fresh process: build a Llama-shaped model in fp32 (random
init), hand it to the engine, train a few steps, and report the process's peak resident
set size above its size right before the model was built, divided by the parameter
count. On a CPU-only machine the "device" is the host too, so the weight buffers,
gradient staging and activations are included in the figure.

    python bench/host_memory.py --hidden 1536 --layers 16     # ~500M parameters
    python bench/host_memory.py --hidden 512 --layers 8 --json bench/results/host_memory_cpu.json

Targets (issue: engine core): at most 16.5 bytes/param with bf16 compute and gradient
clipping, at most 12.5 with fp32 compute and no clipping, plus a few blocks of staging.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

CASES = {
    "bf16_clip": {"bf16": {"enabled": True}, "gradient_clipping": 1.0},
    "fp32_clip": {"bf16": {"enabled": False}, "gradient_clipping": 1.0},
    "fp32_noclip": {"bf16": {"enabled": False}, "gradient_clipping": 0.0},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(case: str, hidden: int, layers: int, steps: int, seq_len: int) -> dict:
    """Runs in the child process."""
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    import torch
    import transformers

    from megatrain_ds import MegatrainEngine, parse_engine_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
        attn_implementation="sdpa",
    )
    baseline = _rss_bytes()
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    engine = MegatrainEngine(model, parse_engine_config({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        **CASES[case],
    }))
    init_seconds = time.perf_counter() - started
    after_init = _rss_bytes()
    batch = {"input_ids": torch.randint(0, 32000, (2, seq_len))}
    batch["labels"] = batch["input_ids"]
    step_seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        step_seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine.destroy()
    return {
        "case": case, "params": params,
        "peak_bytes_per_param": (peak - baseline) / params,
        "after_init_bytes_per_param": (after_init - baseline) / params,
        "state_bytes_per_param": sum(engine.host_bytes().values()) / params,
        "init_seconds": init_seconds, "step_seconds": step_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, args.hidden, args.layers, args.steps, args.seq_len)))
        return
    results = []
    for case in args.cases:
        output = subprocess.run(
            [sys.executable, __file__, "--child", case, "--hidden", str(args.hidden),
             "--layers", str(args.layers), "--steps", str(args.steps), "--seq-len", str(args.seq_len)],
            check=True, capture_output=True, text=True,
        ).stdout
        result = json.loads(output.strip().splitlines()[-1])
        results.append(result)
        print(f"{case:12s} params={result['params'] / 1e6:.0f}M  peak={result['peak_bytes_per_param']:.2f} B/param"
              f"  after-init={result['after_init_bytes_per_param']:.2f}  state={result['state_bytes_per_param']:.2f}"
              f"  init={result['init_seconds']:.1f}s  step={min(result['step_seconds']):.2f}s", flush=True)
    if args.json:
        import torch

        with open(args.json, "w") as handle:
            json.dump({"device": "cpu: " + (platform.processor() or platform.machine()),
                       "torch": torch.__version__, "hidden": args.hidden, "layers": args.layers,
                       "seq_len": args.seq_len, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
