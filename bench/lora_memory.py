"""Peak host memory per parameter of LoRA training: this engine vs DeepSpeed ZeRO-3 offload.

A bf16 Llama (about 220M parameters by default) with peft's LoRA (r=16 on q_proj and v_proj,
the adapters fp32 as peft makes them, every base weight frozen in bf16) is trained a few
steps with AdamW and gradient clipping, by each system in a fresh process: the engine, and
DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU (on a CPU-only
machine with ``DS_ACCELERATOR=cpu``, as ``bench/compare.py`` runs it). The figure is the
process's peak resident set size above its size right before the model is built (the
interpreter and libraries: ``baseline_rss_bytes``), divided by the parameter count.

What it checks (issue 44): a frozen parameter costs its own bytes and nothing more, so
the engine's figure is about 2 B/param (its bf16 weight, once) plus 16 B per trained
parameter (0.4% of them here) plus activations and transients: target at most 2.3 B/param
and at most DeepSpeed's.

    python bench/lora_memory.py --json bench/results/lora_memory_cpu_220M.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import _git_rev, _rss_bytes, _versions, run_guarded  # bench/ is not a package

SYSTEMS = ("megatrain", "zero3_offload")


def _resident_by_kind() -> dict[str, int]:
    """The process's resident bytes, anonymous (heap, mappings: tensors, allocator caches) and
    file-backed (libraries' code and data pages faulted in on first use)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                fields[key] = int(rest.split()[0]) * 1024
    return {"anonymous": fields["Anonymous"], "file": fields["Rss"] - fields["Anonymous"]}


def _ds_config(system: str, args: argparse.Namespace) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    }
    if system == "megatrain":
        config["engine"] = "megatrain"
    else:  # bench/compare.py's ZeRO-3 offload (no pinning: no CUDA here)
        config["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "offload_param": {"device": "cpu", "pin_memory": False},
            "overlap_comm": True,
            "contiguous_gradients": True,
        }
    return config


def _build(system: str, args: argparse.Namespace):
    """The LoRA model handed to ``system``: built in bf16 (no fp32 copy ever exists; under
    ``zero.Init`` for ZeRO-3, partitioned as it is built), then peft's adapters."""
    import contextlib

    import deepspeed
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        attn_implementation="sdpa",
    )
    ds_config = _ds_config(system, args)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    init = deepspeed.zero.Init(config_dict_or_path=ds_config) if system == "zero3_offload" else contextlib.nullcontext()
    with init:
        model = transformers.LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    _same_initial_weights(model, gathered=system == "zero3_offload")
    torch.manual_seed(0)  # the adapters' initialisation, the same for both
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)  # adapters in fp32 (peft's autocast_adapter_dtype)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=trained)
    return engine, params, trainable


def _same_initial_weights(model, gathered: bool) -> None:
    """Give every base weight values that depend on its name alone: each system then trains
    the same model. (Built under ``zero.Init``, a model's parameters are partitioned before
    Hugging Face's ``_init_weights`` runs, which then initialises nothing: ZeRO-3's weights
    would keep ``nn.Linear``'s own initialisation, the engine's Hugging Face's.) With
    ``gathered`` each ZeRO-3 parameter is gathered whole while it is written, one at a time,
    as its construction under ``zero.Init`` held it."""
    import contextlib
    import zlib

    import deepspeed
    import torch

    for name, param in model.named_parameters():
        scope = deepspeed.zero.GatheredParameters([param], modifier_rank=0) if gathered else contextlib.nullcontext()
        with scope, torch.no_grad():
            if param.dim() == 1:  # the RMSNorms' scales
                param.fill_(1.0)
            else:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.normal_(0.0, 0.02, generator=generator)


def run_child(system: str, args: argparse.Namespace) -> dict:
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29543", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import megatrain_ds  # noqa: F401  (routes "engine": "megatrain")

    baseline, baseline_kinds = _rss_bytes(), _resident_by_kind()
    started = time.perf_counter()
    engine, params, trainable = _build(system, args)
    init_seconds = time.perf_counter() - started
    generator = torch.Generator().manual_seed(1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    losses, seconds = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=generator).to(device)
        begun = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - begun)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    # Where the bytes are once the steps are done: the state, and what the step left behind.
    after = {kind: value - baseline_kinds[kind] for kind, value in _resident_by_kind().items()}
    result = {
        "params": params,
        "trainable_params": trainable,
        "peak_host_bytes": peak,
        "bytes_per_param": peak / params,
        "baseline_rss_bytes": baseline,
        "resident_after_steps_above_baseline": after,
        "init_seconds": init_seconds,
        "step_seconds": seconds,
        "losses": losses,
    }
    if system == "megatrain":
        state = engine.host_bytes()
        result["state_bytes"] = state
        result["state_bytes_per_param"] = sum(state.values()) / params
        engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16, help="LoRA r")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--min-free", type=float, default=2.0, help="GiB of MemAvailable below which a run is killed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    results: dict[str, dict] = {}
    for system in args.systems.split(","):
        forwarded = [a for a in sys.argv[1:] if not a.startswith("--json") and a != str(args.json)]
        command = [sys.executable, __file__, *forwarded, "--child", system]
        run, lowest = run_guarded(command, int(args.min_free * 2**30))
        if run.returncode != 0:
            results[system] = {"error": run.stderr[-3000:], "lowest_mem_available": lowest}
            print(f"{system}: failed\n{run.stderr[-3000:]}", file=sys.stderr)
            continue
        results[system] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{system}: {results[system]['bytes_per_param']:.2f} B/param peak above baseline")
    document = {
        "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab", "rank")},
        "run": {k: getattr(args, k) for k in ("seq_len", "micro_batch", "steps")},
        "results": results,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "versions": _versions(),
        "commit": _git_rev(),
    }
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
