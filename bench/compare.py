"""Side by side: this engine vs DeepSpeed ZeRO-3 CPU offload vs plain PyTorch.

Same Llama-shaped model (random init, seed 0), same batches, same machine. Each system
runs in a fresh process (so peak RSS is its own), the systems alternate for
``--repeats`` rounds, and each keeps its best round. Prints a table and writes one JSON
under ``bench/results/``.

    python bench/compare.py --hidden 1536 --layers 16 --seq-len 128 --micro-batch 2
    python bench/compare.py --hidden 512 --layers 4 --systems megatrain torch --steps 3

Counted FLOPs are 6*P*T (the recompute's extra 2*P*T for blocks is reported separately).
On a CPU-only machine everything is fp32; with CUDA the engine and ZeRO-3 compute in bf16
and plain PyTorch uses bf16 autocast.
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
from pathlib import Path

SYSTEMS = ("megatrain", "zero3_offload", "torch")
RESULT_KEY = {"megatrain": "megatrain", "zero3_offload": "deepspeed_zero3_offload", "torch": "torch"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ds_config(system: str, args: argparse.Namespace, cuda: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "bf16": {"enabled": cuda},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    }
    if system == "megatrain":
        config["engine"] = "megatrain"
    else:
        config["zero_optimization"] = {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": cuda},
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
        }
    return config


def run_child(system: str, args: argparse.Namespace) -> dict:
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers

    import megatrain_ds  # noqa: F401  (routes "engine": "megatrain")

    device = torch.device("cuda" if cuda else "cpu")
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128), attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    baseline = _rss_bytes()
    started = time.perf_counter()
    if system == "zero3_offload":
        ds_config = _ds_config(system, args, cuda)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = transformers.LlamaForCausalLM(config)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
        params = sum(p.ds_numel for p in model.parameters())
    else:
        model = transformers.LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        if system == "megatrain":
            engine, *_ = deepspeed.initialize(model=model, config=_ds_config(system, args, cuda))
        else:
            engine = model.to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
    init_seconds = time.perf_counter() - started
    generator = torch.Generator().manual_seed(1)
    phases: list[dict[str, float]] = []
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator).to(device)
        times = {}
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and system == "torch"):
            loss = engine(input_ids=ids, labels=ids).loss
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if system == "torch":
            loss.backward()
        else:
            engine.backward(loss)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if system == "torch":
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, step=t3 - t0)
        phases.append(times)
        losses.append(float(loss))
    measured = phases[1:] if len(phases) > 1 else phases  # first step warms up
    best = min(measured, key=lambda t: t["step"])
    tokens = args.micro_batch * args.seq_len
    result = {
        "params": params,
        "step_seconds": best["step"],
        "forward_seconds": best["forward"],
        "backward_seconds": best["backward"],
        "optimizer_seconds": best["optimizer"],
        "all_step_seconds": [t["step"] for t in phases],
        "tokens_per_s": tokens / best["step"],
        "tflops_6pt": 6 * params * tokens / best["step"] / 1e12,
        "recompute_tflops": (2 * params * tokens / best["step"] / 1e12) if system == "megatrain" else 0.0,
        "init_seconds": init_seconds,
        "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "losses": losses,
    }
    result["bytes_per_param"] = result["peak_host_bytes"] / params
    return result


def _versions() -> dict:
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in ("torch", "deepspeed", "transformers", "megatrain_ds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/compare_<device>_<params>.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)))
        return

    passthrough = [arg for arg in sys.argv[1:]]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for system in args.systems:
            completed = subprocess.run([sys.executable, __file__, *passthrough, "--child", system],
                                       capture_output=True, text=True)
            lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
            if completed.returncode != 0 or not lines:
                print(f"{system}: failed (exit {completed.returncode}): {completed.stderr[-2000:]}")
                continue
            result = json.loads(lines[-1][len("RESULT "):])
            if system not in best or result["step_seconds"] < best[system]["step_seconds"]:
                best[system] = result
    print(f"{'system':24s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'step s':>8s} {'fwd':>6s} {'bwd':>6s} "
          f"{'opt':>6s} {'host B/param':>12s} {'GPU GiB':>8s}")
    for system, r in best.items():
        print(f"{RESULT_KEY[system]:24s} {r['tokens_per_s']:10.1f} {r['tflops_6pt']:8.4f} {r['step_seconds']:8.2f} "
              f"{r['forward_seconds']:6.2f} {r['backward_seconds']:6.2f} {r['optimizer_seconds']:6.2f} "
              f"{r['bytes_per_param']:12.2f} {r['peak_gpu_bytes'] / 2**30:8.2f}")
    if "megatrain" in best:
        for other in ("zero3_offload", "torch"):
            if other in best:
                print(f"megatrain step time / {RESULT_KEY[other]}: "
                      f"{best['megatrain']['step_seconds'] / best[other]['step_seconds']:.2f}")
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    params = next(iter(best.values()))["params"] if best else 0
    out = Path(args.out or f"bench/results/compare_{device.split()[0].lower()}_{params // 10**6}M.json")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.write_text(json.dumps({
        "device": device, "git_rev": rev, "versions": _versions(),
        "model": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                  "vocab": args.vocab, "params": params},
        "batch": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "gradient_clipping": args.clip},
        "results": {RESULT_KEY[s]: r for s, r in best.items()},
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
