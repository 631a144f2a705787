"""The largest model this machine can train: the engine vs ZeRO-3 CPU offload vs plain PyTorch.

Scaling rule: the model of ``bench/compare.py`` (Llama, hidden 1536, intermediate 4096,
12 heads, vocab 32000, untied head) made deeper: ``P(L) = 98.4M + 28.3M * L`` for ``L``
blocks. Batch 2 x 128 tokens, fp32, gradient clipping 1.0, AdamW, as in compare.py.
"Can train" means two optimizer steps whose peak resident set (initialisation included,
the interpreter and libraries too) stays within the budget: ``MemTotal`` less
``--reserve`` (the kernel, page cache and other processes keep at least that much).

1. Predict. For every system, peak RSS is measured in two small fresh runs
   (``--calibration-layers``) and extrapolated linearly in ``P``; for the engine the
   planner (``megatrain plan --gpu cpu``: its state, compute-side buffers and transient
   gradients, plus the interpreter baseline measured in the small runs) predicts it too.
   The largest ``L`` whose predicted peak fits the budget is the answer (for the engine,
   the larger of the two predictions is used, so both must fit).
2. Verify with a real run of two steps at that ``L``, in a fresh process (compare.py's
   child). The machine is shared, so the run starts only once ``MemAvailable`` exceeds its
   predicted peak plus ``--margin``, and a watchdog kills it should ``MemAvailable`` fall
   under ``--min-free`` -- no run may push the machine into the OOM killer.
3. One size step above (``L + 1``) is not run: it is predicted not to fit (by the
   extrapolation, and for the engine by the planner; the engine's own preflight check,
   which counts only persistent state, is reported beside it).

4. With ``--nvme-path``: the NVMe tier. A model whose host-memory-only state does not
   fit this machine (``--nvme-shape``, default Llama hidden 2048, FFN 5632, 37 blocks:
   2.03B parameters, fp32, clipping, 2 x 128 tokens) is trained for two steps with a
   plain ZeRO-Infinity JSON (``offload_optimizer.device: "nvme"``, ``nvme_path``, an
   ``"aio"`` block) plus ``"engine": "megatrain"``; the engine's preflight verdict without
   the tier is reported beside it, and the peak RSS against ``--nvme-rss-limit``. With
   ``--nvme-bf16`` it computes in bf16 and the tier holds the fp32 masters as well as m
   and v (12 of the 16 bytes per parameter): the 4.14B model of the second command below.

    python bench/largest_model.py                  # all three systems, ~10 minutes
    python bench/largest_model.py --systems megatrain --json /tmp/largest.json
    python bench/largest_model.py --systems --nvme-path /work/nvme_swap --json bench/results/largest_model_nvme_cpu.json
    python bench/largest_model.py --systems --nvme-path /work/nvme_swap --nvme-bf16 --nvme-shape 2048 5632 78 \
        --nvme-buffer-count 2 --json bench/results/largest_model_nvme_bf16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's megatrain_ds, wherever pip points
from compare import run_guarded  # noqa: E402  (bench/, the script's own folder)

SYSTEMS = ("megatrain", "zero3_offload", "torch")
MODEL = {"hidden": 1536, "intermediate": 4096, "vocab": 32000, "seq_len": 128, "micro_batch": 2, "clip": 1.0}
GIB = 1 << 30


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def meta_llama(layers: int, model: dict = MODEL):  # -> transformers.LlamaForCausalLM
    """The benchmark's model at depth ``layers``, on the meta device (shapes only)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=model["vocab"],
        hidden_size=model["hidden"],
        intermediate_size=model["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=model["hidden"] // 128,
        num_key_value_heads=model["hidden"] // 128,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def params_of(layers: int, model: dict = MODEL) -> int:
    h, i, v = model["hidden"], model["intermediate"], model["vocab"]
    return layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def run(
    system: str,
    layers: int,
    min_free: int,
    steps: int = 2,
    model: dict = MODEL,
    nvme_path: str | None = None,
    extra: Sequence[str] = (),
) -> dict:
    """compare.py's child for ``system`` at depth ``layers``, under a MemAvailable watchdog."""
    command = [
        sys.executable,
        str(HERE / "compare.py"),
        "--child",
        system,
        "--layers",
        str(layers),
        "--hidden",
        str(model["hidden"]),
        "--intermediate",
        str(model["intermediate"]),
        "--vocab",
        str(model["vocab"]),
        "--seq-len",
        str(model["seq_len"]),
        "--micro-batch",
        str(model["micro_batch"]),
        "--clip",
        str(model["clip"]),
        "--steps",
        str(steps),
    ]
    if nvme_path:
        command += ["--nvme-path", nvme_path]
    command += list(extra)
    started = time.perf_counter()
    completed, lowest = run_guarded(command, min_free)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    outcome = {
        "system": system,
        "layers": layers,
        "params": params_of(layers, model),
        "exit": completed.returncode,
        "seconds": time.perf_counter() - started,
        "lowest_mem_available": lowest,
    }
    if "killed: MemAvailable fell under" in completed.stderr:
        outcome["killed_by_watchdog"] = True
    if completed.returncode != 0 or not lines:
        outcome["error"] = completed.stderr[-1500:]
        return outcome
    result = json.loads(lines[-1][len("RESULT ") :])
    outcome.update(
        peak_rss=result["baseline_rss_bytes"] + result["peak_host_bytes"],
        baseline_rss=result["baseline_rss_bytes"],
        bytes_per_param=result["bytes_per_param"],
        step_seconds=result["all_step_seconds"],
        losses=result["losses"],
    )
    for key in ("nvme", "trace_split", "init_seconds"):
        if key in result:
            outcome[key] = result[key]
    return outcome


def fit(points: list[dict]) -> tuple[float, float]:
    """Peak RSS = a + b * P through the two calibration runs."""
    (p1, r1), (p2, r2) = [(run["params"], run["peak_rss"]) for run in points]
    slope = (r2 - r1) / (p2 - p1)
    return r1 - slope * p1, slope


def largest(predict, budget: int, limit: int = 4096) -> int:
    """Largest depth (from 2: blocks are a repeated list) whose predicted peak fits ``budget``;
    0 if not even two blocks fit."""
    if predict(2) > budget:
        return 0
    layers = 2
    while layers < limit and predict(layers + 1) <= budget:
        layers += 1
    return layers


def planner_peak(layers: int, baseline: int) -> tuple[int, dict]:
    """The planner's peak host bytes for depth ``layers`` (cached CPU profile) plus the
    interpreter baseline, and its plan."""
    from megatrain_ds.planning.planner import RunSettings

    settings = RunSettings(seq_len=MODEL["seq_len"], micro_batch=MODEL["micro_batch"], bf16=False, clipping=True)
    return planner_peak_of(meta_llama(layers), settings, baseline)


def planner_peak_of(model, settings, baseline: int) -> tuple[int, dict]:
    """The planner's peak host bytes for ``model`` (a Llama, on meta is fine; a peft model
    too: its frozen parameters count as the planner counts them) at ``settings`` (a
    ``RunSettings``), on this machine's cached CPU profile, plus ``baseline``; and its plan."""
    from megatrain_ds.cli import cpu_profile, shape_of
    from megatrain_ds.planning.planner import plan

    hardware = cpu_profile(model.config, "model.layers", settings)
    result = plan(shape_of(model), settings, hardware, host_memory_bytes=meminfo("MemTotal"))
    return baseline + result.predicted_peak_host_bytes, result.to_json()


def preflight_verdict(layers: int, budget: int, model_shape: dict = MODEL, bf16: bool = False) -> str:
    """The engine's own preflight check (persistent state only) for depth ``layers``."""
    return preflight_verdict_of(meta_llama(layers, model_shape), budget, bf16)


def preflight_verdict_of(model, budget: int, bf16: bool) -> str:
    """The engine's own preflight check (persistent state only) for ``model`` (on meta is
    fine), trained by AdamW with clipping on the host within ``budget`` bytes."""
    import torch

    from megatrain_ds import parse_engine_config
    from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
    from megatrain_ds.optimizer.facade import build_optimizer
    from megatrain_ds.planning.preflight import AvailableMemory, InsufficientMemoryError, PreflightInputs, preflight

    engine_config = parse_engine_config(
        {
            "train_micro_batch_size_per_gpu": MODEL["micro_batch"],
            "gradient_clipping": MODEL["clip"],
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        }
    )
    optimizer = build_optimizer(model, None, engine_config.optimizer, None)
    try:
        run = PreflightInputs(model, engine_config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
        need = preflight(run, available=AvailableMemory(host=budget))
    except InsufficientMemoryError:
        return "does not fit"
    return f"fits (persistent state {need.host_total / GIB:.2f} GiB)"


def nvme_run(args: argparse.Namespace, budget: int, min_free: int) -> dict:
    """Step 4 of the module docstring."""
    hidden, ffn, layers = args.nvme_shape
    shape = {**MODEL, "hidden": hidden, "intermediate": ffn}
    params = params_of(layers, shape)
    entry: dict = {
        "model": {**shape, "layers": layers, "params": params},
        "rss_limit_bytes": int(args.nvme_rss_limit * GIB),
        "preflight_without_tier": preflight_verdict(layers, budget, shape, args.nvme_bf16),
    }
    print(
        f"nvme tier: {params / 1e9:.3f}B params; without the tier, preflight: {entry['preflight_without_tier']}",
        flush=True,
    )
    extra = ["--nvme-buffer-count", str(args.nvme_buffer_count)] + (["--bf16"] if args.nvme_bf16 else [])
    entry["model"].update(bf16=args.nvme_bf16, buffer_count=args.nvme_buffer_count)
    outcome = run("megatrain", layers, min_free, model=shape, nvme_path=args.nvme_path, extra=extra)
    entry["run"] = outcome
    if "peak_rss" in outcome:
        entry["within_rss_limit"] = outcome["peak_rss"] <= entry["rss_limit_bytes"]
        print(
            f"nvme tier: trained {params / 1e9:.3f}B params, peak RSS {outcome['peak_rss'] / GIB:.2f} GiB "
            f"(limit {args.nvme_rss_limit} GiB), steps {[round(x, 1) for x in outcome['step_seconds']]} s, "
            f"losses {outcome['losses']}",
            flush=True,
        )
    else:
        print(f"nvme tier: failed: {outcome.get('error', '')[-500:]}", flush=True)
    return entry


def wait_for_memory(needed: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while meminfo("MemAvailable") < needed:
        if time.monotonic() > deadline:
            return False
        time.sleep(5)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument(
        "--nvme-path", default=None, help="also train the NVMe tier's model (step 4) with swap files here"
    )
    parser.add_argument(
        "--nvme-shape", type=int, nargs=3, default=[2048, 5632, 37], metavar=("HIDDEN", "FFN", "LAYERS")
    )
    parser.add_argument(
        "--nvme-bf16",
        action="store_true",
        help="the NVMe run computes in bf16: the tier then holds the fp32 masters too",
    )
    parser.add_argument(
        "--nvme-buffer-count",
        type=int,
        default=4,
        help="offload_optimizer.buffer_count of the NVMe run (its window, in blocks)",
    )
    parser.add_argument("--nvme-rss-limit", type=float, default=20.0, help="GiB; the NVMe run's peak RSS target")
    parser.add_argument("--reserve", type=float, default=2.0, help="GiB of MemTotal left to the rest of the machine")
    parser.add_argument("--calibration-layers", type=int, nargs=2, default=[2, 8])
    parser.add_argument(
        "--margin", type=float, default=0.5, help="GiB of MemAvailable beyond a run's predicted peak before it starts"
    )
    parser.add_argument("--min-free", type=float, default=0.5, help="GiB; the watchdog kills a run below it")
    parser.add_argument("--wait", type=float, default=900, help="seconds to wait for memory before skipping a run")
    parser.add_argument("--json", default=str(HERE / "results" / "largest_model_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    budget = meminfo("MemTotal") - int(args.reserve * GIB)
    min_free = int(args.min_free * GIB)
    print(f"budget: {budget / GIB:.2f} GiB (MemTotal {meminfo('MemTotal') / GIB:.2f} GiB less {args.reserve} GiB)")
    report: dict = {
        "model": {**MODEL, "params_per_block": params_of(1) - params_of(0), "params_outside_blocks": params_of(0)},
        "budget_bytes": budget,
        "mem_total": meminfo("MemTotal"),
        "reserve_gib": args.reserve,
        "systems": {},
    }
    for system in args.systems:
        entry: dict = {"calibration": []}
        for layers in args.calibration_layers:
            outcome = run(system, layers, min_free)
            entry["calibration"].append(outcome)
            print(
                f"{system:14s} L={layers:3d} P={outcome['params'] / 1e6:7.0f}M peak "
                f"{outcome.get('peak_rss', 0) / GIB:6.2f} GiB ({outcome.get('bytes_per_param', 0):.2f} B/param "
                "above baseline)",
                flush=True,
            )
        if any("peak_rss" not in run_ for run_ in entry["calibration"]):
            entry["error"] = "a calibration run failed"
            report["systems"][system] = entry
            continue
        intercept, slope = fit(entry["calibration"])
        extrapolated = lambda layers: intercept + slope * params_of(layers)  # noqa: E731
        entry["extrapolation"] = {"intercept_bytes": intercept, "bytes_per_param": slope}
        found = largest(extrapolated, budget)
        if system == "megatrain":
            baseline = max(run_["baseline_rss"] for run_ in entry["calibration"])
            by_planner = largest(lambda layers: planner_peak(layers, baseline)[0], budget)
            entry["largest_by_planner"] = by_planner
            entry["largest_by_extrapolation"] = found
            found = min(found, by_planner)
        for _attempt in range(3):  # a verified peak over the budget: one block fewer, verified again
            entry.update(
                largest_layers=found, largest_params=params_of(found), predicted_peak_at_found=extrapolated(found)
            )
            one_above = {
                "layers": found + 1,
                "params": params_of(found + 1),
                "run": False,
                "predicted_peak_by_extrapolation": extrapolated(found + 1),
            }
            if system == "megatrain":
                entry["planner_peak_at_found"] = planner_peak(found, baseline)[0]
                one_above["predicted_peak_by_planner"] = planner_peak(found + 1, baseline)[0]
                entry["preflight_at_found"] = preflight_verdict(found, budget)
                one_above["preflight"] = preflight_verdict(found + 1, budget)
            one_above["why_not_run"] = (
                "predicted (or, one block less, measured) over the budget; a run "
                "past the budget could drive the shared machine into the OOM killer"
            )
            entry["one_above"] = one_above
            needed = int(max(extrapolated(found), entry.get("planner_peak_at_found", 0)) + args.margin * GIB)
            print(
                f"{system:14s} largest L={found} ({params_of(found) / 1e9:.3f}B params), predicted peak "
                f"{entry['predicted_peak_at_found'] / GIB:.2f} GiB; L+1 predicted "
                f"{one_above['predicted_peak_by_extrapolation'] / GIB:.2f} GiB",
                flush=True,
            )
            if not wait_for_memory(needed, args.wait):
                entry["verification"] = {
                    "skipped": f"MemAvailable stayed under {needed / GIB:.2f} GiB for {args.wait} s (other processes)"
                }
                print(f"{system:14s} verification skipped: not enough free memory", flush=True)
                break
            verified = run(system, found, min_free)
            entry.setdefault("verifications", []).append(verified)
            entry["verification"] = verified
            if "peak_rss" not in verified:
                print(f"{system:14s} verification failed: {verified.get('error', '')[-300:]}", flush=True)
                break
            verified["fits_budget"] = verified["peak_rss"] <= budget
            verified["measured_over_predicted"] = verified["peak_rss"] / extrapolated(found)
            if "planner_peak_at_found" in entry:
                verified["measured_over_planner"] = verified["peak_rss"] / entry["planner_peak_at_found"]
            print(
                f"{system:14s} verified L={found}: peak {verified['peak_rss'] / GIB:.2f} GiB "
                f"(budget {budget / GIB:.2f}), steps {[round(x, 1) for x in verified['step_seconds']]} s",
                flush=True,
            )
            if verified["fits_budget"]:
                break
            found -= 1
        entry["verified_within_budget"] = bool(entry.get("verification", {}).get("fits_budget"))
        report["systems"][system] = entry
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.nvme_path:
        report["nvme_tier"] = nvme_run(args, budget, min_free)
        Path(args.json).write_text(json.dumps(report, indent=2))
    summary = {s: e.get("largest_params") for s, e in report["systems"].items()}
    report["summary_largest_params"] = summary
    if summary.get("megatrain") and summary.get("zero3_offload"):
        report["summary_engine_over_zero3"] = summary["megatrain"] / summary["zero3_offload"]
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(json.dumps(summary), f"wrote {args.json}")


if __name__ == "__main__":
    main()
