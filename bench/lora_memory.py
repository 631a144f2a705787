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

Each system's ``tokens_per_s`` is the median of its steps after ``--warmup`` (1) of them; on
a GPU, where that is the figure of interest (issue 44's LoRA tokens/s at ~3B against ZeRO-3
offload with the same adapter, ``scripts/gpu_validate.sh``'s ``lora-3b`` step), each step is
timed to the device's end of it, and ``tokens_per_s_engine_over_zero3`` is their ratio.

``--largest``: the largest LoRA run this machine takes, by ``bench/largest_model.py``'s
method. A Llama of 7B-class width (``--hidden 4096 --intermediate 11008``, 32 heads, vocab
32000) is made deeper; for each system two calibration runs (``--calibration-layers``,
two steps each) give its peak RSS (interpreter included) linear in the parameters, the
engine's planner (``megatrain plan``'s accounting, frozen weights at their own bytes)
predicts it too, and the largest depth whose predicted peak fits ``MemTotal`` less
``--reserve`` is verified by a real two-step run -- started only once ``MemAvailable``
holds its predicted peak (the larger of the two; the extrapolated one with
``--gate-by-measurement``) plus ``--margin`` plus ``--min-free``, and killed by a watchdog
should ``MemAvailable`` fall under ``--min-free`` (the machine is shared: no run may bring
on the OOM killer). Should other processes hold that memory for ``--wait`` seconds, the
deepest model that fits the most they left free meanwhile is verified instead (waiting for
that room again), and the JSON says so (``verified_below_predicted``), as it does when
``--verify-layers`` names a smaller depth (0: none, or with ``--reuse`` the earlier
verification kept); ``--reuse`` takes the calibration and prediction from an
earlier JSON of the same model, run and budget. Every run builds its model without
initialisation and then writes each base weight from its name
(``_same_initial_weights``), so every system trains the same weights.

    python bench/lora_memory.py --largest --hidden 4096 --intermediate 11008 --seq-len 64 --steps 2 \
        --json bench/results/largest_lora_cpu.json
    # the committed verifications (a shared machine): 34 blocks, 7.15B, engine then ZeRO-3
    python bench/lora_memory.py --largest --hidden 4096 --intermediate 11008 --seq-len 64 --steps 2 \
        --reuse bench/results/largest_lora_cpu.json --verify-layers 34 0 --gate-by-measurement \
        --margin 1.0 --min-free 0.5 --json bench/results/largest_lora_cpu.json  # then --verify-layers 0 34
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare import _git_rev, _rss_bytes, _versions, run_guarded  # bench/ is not a package
from largest_model import GIB, fit, largest, meminfo, planner_peak_of, preflight_verdict_of

SYSTEMS = ("megatrain", "zero3_offload")
PREDICTION_KEYS = (  # what --largest's step 1 records, which --reuse takes from an earlier run
    "calibration",
    "params_per_block",
    "params_outside_blocks",
    "extrapolation",
    "largest_by_extrapolation",
    "largest_by_planner",
    "largest_layers",
    "largest_params",
)


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


def _ds_config(system: str, args: argparse.Namespace, cuda: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    }
    if system == "megatrain":
        config["engine"] = "megatrain"
    else:  # bench/compare.py's ZeRO-3 offload (pinned as DeepSpeed's docs advise where there is a GPU)
        config["zero_optimization"] = {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "offload_param": {"device": "cpu", "pin_memory": cuda},
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
    from transformers.initialization import no_init_weights

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        attn_implementation="sdpa",
    )
    ds_config = _ds_config(system, args, torch.cuda.is_available())
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    init = deepspeed.zero.Init(config_dict_or_path=ds_config) if system == "zero3_offload" else contextlib.nullcontext()
    # No initialisation at construction (neither torch's nor Hugging Face's): every base
    # weight is written once, by name, right below; at 7B initialising twice costs minutes.
    with init, no_init_weights():
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
        losses.append(float(loss))
        if device.type == "cuda":  # the step's device work (and any pipelined update) in its time
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begun)
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
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    }
    if args.steps > args.warmup:  # throughput: the median of the steps after the warm-up ones
        median = sorted(seconds[args.warmup :])[(args.steps - args.warmup) // 2]
        result.update(median_step_seconds=median, tokens_per_s=args.micro_batch * args.seq_len / median)
    if system == "megatrain":
        state = engine.host_bytes()
        result["state_bytes"] = state
        result["state_bytes_per_param"] = sum(state.values()) / params
        engine.destroy()
    return result


# --- --largest: the deepest model of this width each system trains (largest_model.py's method) ---


def _measure(system: str, layers: int, args: argparse.Namespace) -> dict:
    """Two steps of ``system`` at depth ``layers`` in a fresh child, under a MemAvailable
    watchdog (``--min-free``): its peak RSS (the interpreter included) and what it reported."""
    command = [sys.executable, __file__, "--child", system, "--layers", str(layers), "--steps", str(args.steps)]
    for key in ("hidden", "intermediate", "vocab", "rank", "seq_len", "micro_batch"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    started = time.perf_counter()
    run, lowest = run_guarded(command, int(args.min_free * GIB))
    outcome: dict = {"layers": layers, "exit": run.returncode, "seconds": time.perf_counter() - started}
    outcome["lowest_mem_available"] = lowest
    if run.returncode != 0:
        outcome["error"] = run.stderr[-1500:]
        return outcome
    result = json.loads(run.stdout.strip().splitlines()[-1])
    outcome.update(result, peak_rss=result["baseline_rss_bytes"] + result["peak_host_bytes"])
    outcome["losses_finite"] = all(math.isfinite(loss) for loss in result["losses"])
    return outcome


def _meta_lora_llama(args: argparse.Namespace, layers: int):
    """The bench's LoRA model at depth ``layers`` on the meta device (sizes and dtypes only)."""
    import peft
    import torch
    import transformers

    heads = max(1, args.hidden // 128)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    with torch.device("meta"):
        model = torch.nn.Module.to(transformers.LlamaForCausalLM(config), torch.bfloat16)
        lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(model, lora).base_model.model  # the Llama, adapters in place


def _engine_forecast(args: argparse.Namespace, layers: int, baseline: int, budget: int) -> dict:
    """The planner's predicted peak (plus ``baseline``) and the preflight verdict at ``layers``."""
    from megatrain_ds.planning.planner import RunSettings

    model = _meta_lora_llama(args, layers)
    settings = RunSettings(seq_len=args.seq_len, micro_batch=args.micro_batch, bf16=True, clipping=True)
    return {
        "planner_peak": planner_peak_of(model, settings, baseline)[0],
        "preflight": preflight_verdict_of(model, budget, bf16=True),
    }


def _planner_peak(args: argparse.Namespace, layers: int, baseline: int) -> int:
    from megatrain_ds.planning.planner import RunSettings

    settings = RunSettings(seq_len=args.seq_len, micro_batch=args.micro_batch, bf16=True, clipping=True)
    return planner_peak_of(_meta_lora_llama(args, layers), settings, baseline)[0]


def _predict(system: str, args: argparse.Namespace, budget: int) -> dict:
    """Steps 1 of ``--largest``: two calibration runs, the peak extrapolated linearly in the
    parameters, and (the engine) the planner; the largest depth whose peaks fit ``budget``."""
    entry: dict = {"calibration": [_measure(system, layers, args) for layers in args.calibration_layers]}
    for run in entry["calibration"]:
        print(f"{system:14s} L={run['layers']:3d} peak {run.get('peak_rss', 0) / GIB:6.2f} GiB", flush=True)
    if any("peak_rss" not in run for run in entry["calibration"]):
        entry["error"] = "a calibration run failed"
        return entry
    (l1, p1), (l2, p2) = [(run["layers"], run["params"]) for run in entry["calibration"]]
    per_block = (p2 - p1) // (l2 - l1)  # exact: the blocks are identical
    intercept, slope = fit(entry["calibration"])
    entry["params_per_block"], entry["params_outside_blocks"] = per_block, p1 - l1 * per_block
    entry["extrapolation"] = {"intercept_bytes": intercept, "bytes_per_param": slope}
    entry["largest_by_extrapolation"] = largest(
        lambda layers: intercept + slope * (p1 + (layers - l1) * per_block), budget
    )
    if system == "megatrain":
        baseline = max(run["baseline_rss_bytes"] for run in entry["calibration"])
        entry["largest_by_planner"] = largest(lambda layers: _planner_peak(args, layers, baseline), budget)
    entry["largest_layers"] = min(entry["largest_by_extrapolation"], entry.get("largest_by_planner", 1 << 30))
    entry["largest_params"] = entry["params_outside_blocks"] + entry["largest_layers"] * per_block
    return entry


def _wait_for_memory(needed: int, timeout: float) -> tuple[bool, int]:
    """Whether ``MemAvailable`` reached ``needed`` within ``timeout`` seconds, and the most
    it reached (the room other processes left, to size a smaller run by)."""
    deadline, most = time.monotonic() + timeout, 0
    while (available := meminfo("MemAvailable")) < needed:
        most = max(most, available)
        if time.monotonic() > deadline:
            return False, most
        time.sleep(2)
    return True, available


def _verify(system: str, entry: dict, args: argparse.Namespace, budget: int, layers: int) -> None:
    """Step 2 of ``--largest``: a real run at the predicted depth once MemAvailable holds its
    predicted peak plus ``--margin``; one block fewer (up to twice) should it exceed ``budget``.
    Should other processes hold the memory past ``--wait``, the deepest model whose predicted
    peak fits what is free then is run instead (``verified_below_predicted``)."""
    intercept, slope = entry["extrapolation"]["intercept_bytes"], entry["extrapolation"]["bytes_per_param"]
    params_at = lambda layers: entry["params_outside_blocks"] + layers * entry["params_per_block"]  # noqa: E731
    extrapolated = lambda layers: intercept + slope * params_at(layers)  # noqa: E731
    baseline = max(run["baseline_rss_bytes"] for run in entry["calibration"])
    headroom = int((args.margin + args.min_free) * GIB)
    if layers != entry["largest_layers"]:
        entry["verified_below_predicted"] = True
    for _attempt in range(3):
        forecast = {"layers": layers, "params": params_at(layers), "extrapolated_peak": extrapolated(layers)}
        if system == "megatrain":
            forecast.update(_engine_forecast(args, layers, baseline, budget))
        entry.setdefault("forecasts", []).append(forecast)
        # Room for the predicted peak and still --margin above the watchdog's floor.
        predicted = forecast["extrapolated_peak"] if args.gate_by_measurement else forecast.get("planner_peak", 0)
        needed = int(max(forecast["extrapolated_peak"], predicted) + headroom)
        print(f"{system:14s} L={layers} ({forecast['params'] / 1e9:.2f}B): wait for {needed / GIB:.2f} GiB", flush=True)
        ready, most_free = _wait_for_memory(needed, args.wait)
        if not ready:
            room = most_free - headroom
            entry.setdefault("skipped", []).append({"layers": layers, "needed": needed, "most_available": most_free})
            above = max(1.0, predicted / forecast["extrapolated_peak"])  # the planner's excess, if gated by it
            layers = largest(lambda depth: above * extrapolated(depth), room)
            entry["verified_below_predicted"] = True
            if layers < 2:
                return
            continue
        verified = _measure(system, layers, args)
        entry.setdefault("verifications", []).append(verified)
        if "peak_rss" not in verified:
            return
        verified["fits_budget"] = verified["peak_rss"] <= budget
        verified["measured_over_extrapolated"] = verified["peak_rss"] / forecast["extrapolated_peak"]
        print(
            f"{system:14s} verified L={layers}: peak {verified['peak_rss'] / GIB:.2f} GiB, "
            f"steps {verified['step_seconds']} s",
            flush=True,
        )
        if verified["fits_budget"]:
            entry["verified_layers"], entry["verified_params"] = layers, params_at(layers)
            return
        layers -= 1


def largest_main(args: argparse.Namespace) -> None:
    """``--largest``: for each system, the deepest model of the given width it trains within
    ``MemTotal`` less ``--reserve``, predicted then verified (the module docstring)."""
    budget = meminfo("MemTotal") - int(args.reserve * GIB)
    report: dict = {
        "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "vocab", "rank")},
        "run": {k: getattr(args, k) for k in ("seq_len", "micro_batch", "steps")},
        "budget_bytes": budget,
        "mem_total": meminfo("MemTotal"),
        "reserve_gib": args.reserve,
        "systems": {},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "versions": _versions(),
        "git_rev": _git_rev(),
    }
    earlier = json.loads(args.reuse.read_text()) if args.reuse else {}
    for system in args.systems.split(","):
        reused = earlier.get("systems", {}).get(system)
        depth = dict(zip(args.systems.split(","), args.verify_layers or [])).get(system)
        if reused and all(earlier[key] == report[key] for key in ("model", "run", "budget_bytes")):
            # Not verified again (0): the earlier verification is kept with the prediction.
            entry = {key: value for key, value in reused.items() if depth == 0 or key in PREDICTION_KEYS}
            entry.setdefault("prediction_reused_from", earlier["git_rev"])
        else:
            entry = _predict(system, args, budget)
        report["systems"][system] = entry
        if args.json:  # after each step: a later one may take long or be killed
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        depth = entry.get("largest_layers") if depth is None else depth
        if "error" not in entry and depth:
            _verify(system, entry, args, budget, depth)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    for kind in ("predicted", "verified"):
        key = "largest_params" if kind == "predicted" else "verified_params"
        found = {system: entry.get(key) for system, entry in report["systems"].items()}
        report[f"summary_{kind}_params"] = found
        if all(found.get(system) for system in SYSTEMS):
            report[f"summary_{kind}_engine_over_zero3"] = found["megatrain"] / found["zero3_offload"]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key.startswith("summary")}))


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
    parser.add_argument(
        "--warmup", type=int, default=1, help="steps before those whose median gives tokens_per_s (the --steps)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--min-free", type=float, default=2.0, help="GiB of MemAvailable below which a run is killed")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--largest", action="store_true", help="the deepest model each system trains (docstring)")
    parser.add_argument("--calibration-layers", type=int, nargs=2, default=[2, 6])
    parser.add_argument("--reserve", type=float, default=2.0, help="GiB of MemTotal left to the rest of the machine")
    parser.add_argument(
        "--margin", type=float, default=0.5, help="GiB of MemAvailable beyond a predicted peak to start"
    )
    parser.add_argument("--wait", type=float, default=900, help="seconds to wait for memory before skipping a run")
    parser.add_argument(
        "--verify-layers",
        type=int,
        nargs="+",
        help="--largest: the depth to verify, one per --systems entry (0: none); default the predicted largest",
    )
    parser.add_argument(
        "--gate-by-measurement",
        action="store_true",
        help="--largest: wait for the extrapolated peak alone, not the planner's (larger) one",
    )
    parser.add_argument("--reuse", type=Path, help="--largest: take step 1 (calibration, prediction) from this JSON")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    if args.largest:
        largest_main(args)
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
        speed = results[system].get("tokens_per_s")
        speed_note = f", {speed:.0f} tokens/s (median after {args.warmup} warm-up steps)" if speed else ""
        print(f"{system}: {results[system]['bytes_per_param']:.2f} B/param peak above baseline{speed_note}")
    document = {
        "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab", "rank")},
        "run": {k: getattr(args, k) for k in ("seq_len", "micro_batch", "steps", "warmup")},
        "results": results,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "versions": _versions(),
        "commit": _git_rev(),
    }
    speeds = [results.get(system, {}).get("tokens_per_s") for system in SYSTEMS]
    if all(speeds):
        document["tokens_per_s_engine_over_zero3"] = speeds[0] / speeds[1]
        print(f"engine / ZeRO-3 offload tokens/s: {speeds[0] / speeds[1]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
