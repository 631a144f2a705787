"""Peak host memory of loading a pretrained model under a ZeRO-3 offload config: engine vs DeepSpeed.

The user's habit this measures: a ZeRO-3 offload JSON, transformers' ``HfDeepSpeedConfig``
kept alive (what the HF Trainer, TRL and Accelerate's ``zero3_init_flag`` do), then
``from_pretrained`` and ``deepspeed.initialize``, then training. With ``"engine":
"megatrain"`` added, the config is read as stage 0 and the model is loaded whole, then
moved into the engine's host state one parameter at a time ([Note: ZeRO-3 configs] in
``megatrain_ds/integration/deepspeed_hook.py``); without it (``MEGATRAIN_DISABLE_HOOK=1``)
DeepSpeed builds the model under ``deepspeed.zero.Init``, loads the shards and builds its
ZeRO-3 offload engine (CPU Adam). Each system runs in a fresh process on the same
safetensors directory (a random-init Llama, fp32) and one optimizer step, and reports:

- ``peak_rss_bytes``: the process's peak resident set (``VmHWM``), load, initialize and one
  step included, and the same after each phase;
- for the engine, ``engine_host_bytes`` (its persistent host state, ``engine.host_bytes()``,
  the steady state) and ``largest_block_bytes`` (one block's fp32 master, m and v and
  gradient): the target is ``peak <= baseline + steady state + about one block``.

    python bench/stage3_load.py --layers 20 --json bench/results/stage3_load_cpu.json   # 1.01B parameters
    python bench/stage3_load.py --layers 8 --json bench/results/stage3_load_cpu.json    # 0.49B
    python bench/stage3_load.py --layers 20 --systems megatrain                         # the engine alone

On a 24 GiB machine DeepSpeed's ZeRO-3 offload (fp32, about 27 bytes per parameter at its
peak here) cannot hold a 1B model: at 20 layers the kernel kills it for memory, and the JSON
records that with the resident set sampled from here until then; the side-by-side with both
finishing runs at 8 layers. The JSON keeps one entry per size (``<layers>_layers``).

The model directory is written once to ``--model-dir`` (kept for later runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000  # TinyLlama-1.1B's shape
SEQ_LEN = 64


def zero3_offload_config(engine: bool) -> dict[str, Any]:
    """The shipped ``configs/ds_zero3_offload_megatrain.json`` with the Trainer's "auto" values
    filled in as ``deepspeed.initialize`` needs them (one sequence per step, clipping 1.0)."""
    path = Path(__file__).resolve().parents[1] / "configs" / "ds_zero3_offload_megatrain.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if not engine:
        del config["engine"]
    del config["scheduler"]
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=1, gradient_accumulation_steps=1)
    config.update(gradient_clipping=1.0, bf16={"enabled": False}, fp16={"enabled": False})
    config["optimizer"]["params"] = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    zero = config["zero_optimization"]
    zero.update(reduce_bucket_size=HIDDEN * HIDDEN, stage3_prefetch_bucket_size=int(0.9 * HIDDEN * HIDDEN))
    zero["stage3_param_persistence_threshold"] = 10 * HIDDEN
    return config


def make_model(directory: Path, layers: int) -> int:
    """A random-init fp32 Llama saved with ``save_pretrained`` (safetensors); its parameter count."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_system(model_dir: Path, engine: bool) -> dict[str, Any]:
    """One system in this (fresh) process: load, initialize, one step; memory after each."""
    import deepspeed
    import torch
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = zero3_offload_config(engine)
    phases: dict[str, dict[str, float]] = {}
    start = time.perf_counter()

    def mark(name: str) -> None:
        phases[name] = {
            "rss_bytes": _status_bytes("VmRSS"),
            "peak_rss_bytes": _status_bytes("VmHWM"),
            "seconds": time.perf_counter() - start,
        }

    mark("baseline")
    kept = HfDeepSpeedConfig(config)  # transformers' ZeRO-3 detection, as the Trainer sets it up
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mark("from_pretrained")
    num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    model_engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    mark("initialize")
    batch = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))  # same on both
    loss = model_engine(input_ids=batch, labels=batch).loss
    model_engine.backward(loss)
    model_engine.step()
    mark("one_step")
    result: dict[str, Any] = {
        "engine": type(model_engine).__qualname__,
        "num_params": num_params,
        "built_partitioned": partitioned,
        "loss": float(loss),
        "phases": phases,
        "peak_rss_bytes": phases["one_step"]["peak_rss_bytes"],
    }
    if engine:
        host = model_engine.host_bytes()
        result["engine_host_bytes"] = sum(host.values())
        result["engine_host_bytes_by_kind"] = host
        block = model_engine.module.model.layers[0]
        result["largest_block_bytes"] = sum(p.numel() for p in block.parameters()) * 16  # master, m, v, grad
    del kept
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _peak_rss_of(pid: int) -> int:
    """``VmHWM`` of a running process (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            return next((int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def run_child(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One system's result; for a child that dies (the kernel's OOM killer: a system that
    cannot load the model in this machine's memory), how and at what peak RSS, sampled here."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
        peak = 0
        while child.poll() is None:
            peak = max(peak, _peak_rss_of(child.pid))
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        if child.returncode == 0:
            return json.loads(out.read().strip().splitlines()[-1])
        killed = child.returncode == -signal.SIGKILL
        return {
            "failed": "killed by SIGKILL (out of memory)" if killed else f"exit status {child.returncode}",
            "returncode": child.returncode,
            "peak_rss_bytes_sampled": peak,
            "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "stderr_tail": err.read()[-2000:],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20, help="20: 1.01B parameters")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/stage3_load_<layers>L")
    parser.add_argument("--systems", default="megatrain,deepspeed")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=("megatrain", "deepspeed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = args.model_dir or Path(f"/tmp/stage3_load_{args.layers}L")
    if args.child:
        print(json.dumps(run_system(model_dir, engine=args.child == "megatrain")))
        return
    if not (model_dir / "config.json").is_file():
        print(f"writing the model to {model_dir}: {make_model(model_dir, args.layers) / 1e9:.3f}B parameters")
    results: dict[str, Any] = {}
    for system in args.systems.split(","):
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        # One process of its own: zero.Init and deepspeed.initialize join a one-rank group.
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.pop("MEGATRAIN_DISABLE_HOOK", None)
        if system == "deepspeed":
            env["MEGATRAIN_DISABLE_HOOK"] = "1"
        command = [sys.executable, __file__, "--layers", str(args.layers), "--model-dir", str(model_dir)]
        results[system] = run_child([*command, "--child", system], env)
        if "failed" in results[system]:
            print(f"{system}: {results[system]['failed']}", flush=True)
            continue
        gib = results[system]["peak_rss_bytes"] / 2**30
        print(f"{system}: peak RSS {gib:.2f} GiB", flush=True)
    summary: dict[str, Any] = {
        "model": {"layers": args.layers, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "vocab": VOCAB},
        "seq_len": SEQ_LEN,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "load_average": os.getloadavg(),
        "allocator_environment": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "MKL_"))},
        "results": results,
    }
    if "megatrain" in results and "failed" not in results["megatrain"]:
        ours = results["megatrain"]
        baseline = ours["phases"]["baseline"]["rss_bytes"]
        allowed = baseline + ours["engine_host_bytes"] + ours["largest_block_bytes"]
        summary["megatrain_peak_minus_baseline_and_steady_state_bytes"] = (
            ours["peak_rss_bytes"] - baseline - ours["engine_host_bytes"]
        )
        summary["megatrain_within_steady_state_plus_one_block"] = ours["peak_rss_bytes"] <= allowed
    if "deepspeed" in results and "megatrain" in results and "failed" not in results["deepspeed"]:
        summary["peak_ratio_deepspeed_over_megatrain"] = (
            results["deepspeed"]["peak_rss_bytes"] / results["megatrain"]["peak_rss_bytes"]
        )
    print(json.dumps(summary, indent=1))
    if args.json:  # one entry per model size, kept across runs of other sizes
        args.json.parent.mkdir(parents=True, exist_ok=True)
        runs = json.loads(args.json.read_text(encoding="utf-8")) if args.json.is_file() else {}
        runs[f"{args.layers}_layers"] = summary
        args.json.write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
