"""``megatrain`` console script. ``megatrain plan`` prints the cost model of a run.

    megatrain plan --model DIR_OR_CONFIG_JSON --gpu h100|h200|gh200|cpu \\
        --host-memory 1536GB --seq-len 4096 --micro-batch 1 [--json]

The model is built on the meta device (no memory) from a Hugging Face model directory or
a ``config.json`` (with ``model_type``), so its blocks are found exactly as the engine
finds them. ``--gpu cpu`` measures this machine's matmul and copy throughput first.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from megatrain_ds.block_discovery import find_blocks
from megatrain_ds.planner import GIB, GPU_HARDWARE, Hardware, ModelShape, RunSettings, plan

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"1536GB"``, ``"24GiB"``, ``"512G"`` -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 1536GB)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


def shape_of(model: torch.nn.Module, block_path: str | None = None) -> ModelShape:
    """The planner's view of ``model`` (meta tensors are fine: only sizes are read)."""
    _, blocks = find_blocks(model, block_path)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    resident = sum(p.numel() for p in model.parameters() if id(p) not in block_ids)
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    return ModelShape(num_blocks=len(blocks), block_params=max(block_sizes),
                      total_block_params=sum(block_sizes), resident_params=resident,
                      hidden=int(hidden), vocab=int(getattr(config, "vocab_size")))


def load_meta_model(source: str) -> torch.nn.Module:
    """A causal LM with the architecture of ``source`` (directory or config JSON), on meta."""
    import transformers

    path = Path(source)
    if path.is_dir():
        config = transformers.AutoConfig.from_pretrained(path)
    elif path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"{source}: a config JSON needs a model_type key (e.g. \"llama\")")
        config = transformers.AutoConfig.for_model(**data)
    else:
        raise ValueError(f"--model {source!r} is neither a model directory nor a config JSON file")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def measure_cpu(seconds: float = 0.5) -> Hardware:
    """This machine as the compute device: fp32 matmul rate and memory copy rate."""
    import os

    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    flops = 2 * size**3 * count / (time.perf_counter() - started)
    source = torch.empty(32 << 20)
    target = torch.empty_like(source)
    target.copy_(source)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        target.copy_(source)
        count += 1
    copy_rate = source.numel() * 4 * count / (time.perf_counter() - started)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Copies move bytes once each way: read+write traffic is twice the copy rate.
    return Hardware("cpu", flops, copy_rate, copy_rate, 2 * copy_rate, memory, shares_host_memory=True)


def _format_bytes(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def _print_plan(result, hardware: Hardware, settings: RunSettings) -> None:
    print(f"parameters: {result.params / 1e9:.3f} B   device: {hardware.name}   "
          f"tokens per weight pass: {settings.tokens_per_pass}")
    print("host memory:")
    for kind, value in result.host_bytes.items():
        print(f"  {kind:18s} {_format_bytes(value)}")
    print(f"  {'total':18s} {_format_bytes(result.host_bytes_total)}")
    print("GPU memory:" if not hardware.shares_host_memory else "compute-side memory (host):")
    for kind, value in result.gpu_bytes.items():
        print(f"  {kind:18s} {_format_bytes(value)}")
    print(f"  {'total':18s} {_format_bytes(result.gpu_bytes_total)}")
    print(f"tokens per weight pass to hide transfers: {result.min_tokens_to_hide_transfer}")
    for bound, seconds in result.step_seconds_by_bound.items():
        print(f"  {bound:18s} {seconds:8.3f} s/step")
    print(f"predicted step: {result.predicted_step_seconds:.3f} s, "
          f"{result.predicted_tokens_per_second:,.0f} tokens/s")
    print(f"largest micro-batch that fits: {result.max_micro_batch}")
    print("recommended: " + json.dumps(result.recommended))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description="megatrain_ds tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="memory and speed of a run, before running it")
    p.add_argument("--model", required=True, help="Hugging Face model directory or config JSON")
    p.add_argument("--gpu", required=True, choices=[*GPU_HARDWARE, "cpu"])
    p.add_argument("--host-memory", type=parse_size, default=None,
                   help="host memory, e.g. 1536GB (default: this machine's)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--fp32", action="store_true", help="fp32 compute (default bf16; cpu implies fp32)")
    p.add_argument("--no-clipping", action="store_true")
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--keep-checkpoints-on-device", action="store_true")
    p.add_argument("--block-path", default=None)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    hardware = measure_cpu() if args.gpu == "cpu" else GPU_HARDWARE[args.gpu]
    host_memory = args.host_memory or measure_cpu(0.01).device_memory_bytes
    settings = RunSettings(
        seq_len=args.seq_len, micro_batch=args.micro_batch,
        accumulation=args.gradient_accumulation_steps, bf16=not (args.fp32 or args.gpu == "cpu"),
        clipping=not args.no_clipping, checkpoint_interval=args.checkpoint_interval,
        offload_checkpoints=not args.keep_checkpoints_on_device,
    )
    shape = shape_of(load_meta_model(args.model), args.block_path)
    result = plan(shape, settings, hardware, host_memory)
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        print()
    else:
        _print_plan(result, hardware, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
