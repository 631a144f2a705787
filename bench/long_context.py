"""Long context on the CPU: peak host memory and step time of one training step, by length.

The model of issue 23: a 117M-parameter Llama (hidden 1024, FFN 2816, 4 blocks, 8 heads,
vocab 32000, SDPA attention), fp32, AdamW with gradient clipping, one sequence per step.
Four systems, each run in a fresh process per length:

- ``engine``: megatrain with its defaults -- the chunked loss (``model/chunked_loss.py``)
  and the tiled MLP (``streaming/tiled_mlp.py``) at their ``"auto"`` sizes;
- ``engine_loss_only``: megatrain with the chunked loss and the MLP whole
  (``"mlp_tile_tokens": 0``), to attribute memory and time to each feature;
- ``engine_off``: megatrain with both off (``"loss_chunk_tokens": 0,
  "mlp_tile_tokens": 0``): the engine before issue 23, for the step-time comparison;
- ``plain``: plain PyTorch with Hugging Face gradient checkpointing,
  ``torch.optim.AdamW`` and ``clip_grad_norm_``.

Each run reports the process's peak RSS (``ru_maxrss``: the whole process, interpreter
included), its RSS before the model was built, and the step's time. A thread samples RSS
every 2 ms with the phase of the step the main thread is in (blocks forward, head
forward, head backward, blocks backward, optimizer step), so the engine's peak is broken
down into the persistent state (``engine.host_bytes()``), the block-boundary checkpoints
(``blocks x T x hidden`` fp32, parked on the host) and the transients of the phase the
peak falls in (one block's recompute, or the head), with each phase's own peak beside it.

The longest sequence each system trains in this machine's memory: peak RSS is linear in
the sequence length for all three (SDPA attention holds no ``T x T`` matrix), so it is
fitted (least squares) over the measured lengths and solved for the machine's total
memory; the fit's largest residual is reported with it. A step at that length is not
run: attention's cost grows with ``T^2`` and one step at 64k tokens takes about half an
hour on this CPU. ``megatrain plan``'s prediction for the same model is printed beside it.

    python bench/long_context.py --runs engine:16384 engine_off:16384 plain:16384 \
        --json bench/results/long_context_cpu.json

Runs are merged into ``--json`` (a run of the same system and length again adds its step
time to ``step_seconds_repeats``; the step-time ratio compares the best of each), so the
measurements can be taken in several sittings (each under the heavy-run lock) and in
alternating order; the summary is recomputed from every run in the file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
HIDDEN, FFN, BLOCKS, HEADS, VOCAB = 1024, 2816, 4, 8, 32000
SYSTEMS = ("engine", "engine_off", "engine_loss_only", "plain")
OPTIONS = {
    "engine": {},
    "engine_off": {"loss_chunk_tokens": 0, "mlp_tile_tokens": 0},
    "engine_loss_only": {"mlp_tile_tokens": 0},
}
TARGET_PEAK_GIB = 4.0  # issue 23, at 16,384 tokens (from 8.62 GiB)
TARGET_LENGTH_RATIO = 4.0
TARGET_STEP_SLOWDOWN = 1.10


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PhaseSampler:
    """RSS every ``interval`` seconds, the highest per phase the main thread names."""

    def __init__(self, interval: float = 0.002) -> None:
        self.phase = "build"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            phase, rss = self.phase, _rss_bytes()
            if rss > self.peaks.get(phase, 0):
                self.peaks[phase] = rss

    def __enter__(self) -> _PhaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=BLOCKS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=1 << 20,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _wrap(owner: object, name: str, before) -> None:
    """Call ``before()`` ahead of ``owner.name`` (phase labels only; the bench's own business)."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def run(system: str, length: int) -> dict:
    """One training step of ``system`` at ``length`` tokens (in the child process)."""
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29571",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "DS_ACCELERATOR": "cpu",
    }.items():
        os.environ.setdefault(key, value)
    import torch

    torch.manual_seed(0)
    baseline = _rss_bytes()
    sampler = _PhaseSampler()
    result: dict = {"system": system, "seq_len": length, "baseline_rss_bytes": baseline}
    set_phase = lambda phase: lambda: setattr(sampler, "phase", phase)  # noqa: E731
    with sampler:
        model = _model()
        result["params"] = sum(p.numel() for p in model.parameters())
        layers = model.model.layers
        layers[0].register_forward_pre_hook(lambda *a: set_phase("blocks forward")())
        layers[-1].register_forward_hook(lambda *a: set_phase("head forward")())
        if system == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        else:
            from megatrain_ds import MegatrainEngine, parse_engine_config

            engine = MegatrainEngine(
                model,
                parse_engine_config(
                    {
                        "train_micro_batch_size_per_gpu": 1,
                        "gradient_clipping": 1.0,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
                        "megatrain": OPTIONS[system],
                    }
                ),
            )
            engine.train()
            _wrap(engine.blocks, "_recompute", set_phase("blocks backward"))
            result["state_bytes"] = sum(engine.host_bytes().values())
            result["loss_chunk_tokens"] = engine.causal_loss.chunk_tokens if engine.causal_loss else 0
            result["mlp_tile_tokens"] = engine.mlp_tile_tokens
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
        started, cpu_started = time.perf_counter(), time.process_time()
        if system == "plain":
            loss = model(input_ids=ids, labels=ids).loss
            forward_done = time.perf_counter()
            set_phase("head backward")()
            loss.backward()
            set_phase("optimizer step")()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            loss = engine(input_ids=ids, labels=ids).loss
            forward_done = time.perf_counter()
            set_phase("head backward")()
            engine.backward(loss)
            set_phase("optimizer step")()
            engine.step()
        finished, cpu_finished = time.perf_counter(), time.process_time()
    result.update(
        cpu_seconds=cpu_finished - cpu_started,
        loss=float(loss),
        step_seconds=finished - started,
        forward_seconds=forward_done - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_rss_by_phase=sampler.peaks,
        load_average=os.getloadavg()[0],
    )
    if system != "plain":
        engine.destroy()
    return result


def _fit(points: list[tuple[int, int]]) -> dict | None:
    """Least-squares ``peak = a + b * T`` over ``(T, peak)``; ``None`` with fewer than 2 lengths."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = sum((t - mean_t) * (p - mean_p) for t, p in points) / sum((t - mean_t) ** 2 for t, _ in points)
    intercept = mean_p - slope * mean_t
    residual = max(abs(p - intercept - slope * t) / p for t, p in points)
    return {"bytes_at_zero": intercept, "bytes_per_token": slope, "largest_relative_residual": residual}


def _machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _planner_prediction(memory: int) -> dict:
    """``megatrain plan``'s longest sequence for this model on the CPU (planning/long_context.py)."""
    from megatrain_ds.planning.planner import Hardware, ModelShape, RunSettings, max_sequence_length, plan

    shape = ModelShape(
        num_blocks=BLOCKS,
        block_params=4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN,
        total_block_params=BLOCKS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN),
        resident_params=2 * VOCAB * HIDDEN + HIDDEN,
        hidden=HIDDEN,
        vocab=VOCAB,
        intermediate=FFN,
    )
    hardware = Hardware("cpu", 1e11, 1e10, 1e10, 1e10, memory, shares_host_memory=True)
    settings = RunSettings(seq_len=16384, bf16=False)
    at_16k = plan(shape, settings, hardware, memory)
    return {
        "max_sequence_length": max_sequence_length(shape, settings, hardware, memory),
        "bytes_per_token": at_16k.bytes_per_token,
        "peak_bytes_at_16k": at_16k.predicted_peak_host_bytes,
    }


def summarize(runs: list[dict]) -> dict:
    memory = _machine_memory()
    summary: dict = {"machine_memory_bytes": memory}
    by = {(r["system"], r["seq_len"]): r for r in runs}
    fits = {}
    for system in SYSTEMS:
        fit = _fit([(r["seq_len"], r["peak_rss_bytes"]) for r in runs if r["system"] == system])
        if fit is not None:
            fit["longest_sequence_in_machine_memory"] = int((memory - fit["bytes_at_zero"]) / fit["bytes_per_token"])
            fits[system] = fit
    summary["fits"] = fits
    if "engine" in fits and "plain" in fits:
        ratio = (
            fits["engine"]["longest_sequence_in_machine_memory"] / fits["plain"]["longest_sequence_in_machine_memory"]
        )
        summary["longest_sequence_ratio_engine_vs_plain"] = ratio
        summary["longest_sequence_target_met"] = ratio >= TARGET_LENGTH_RATIO
    engine16, off16 = by.get(("engine", 16384)), by.get(("engine_off", 16384))
    if engine16 is not None:
        summary["engine_peak_rss_gib_at_16k"] = engine16["peak_rss_bytes"] / GIB
        summary["peak_target_met"] = engine16["peak_rss_bytes"] <= TARGET_PEAK_GIB * GIB
        summary["engine_peak_breakdown_at_16k"] = _breakdown(engine16)
    if engine16 is not None and off16 is not None:
        best = lambda r: min(r.get("step_seconds_repeats", [r["step_seconds"]]))  # noqa: E731
        summary["step_seconds_at_16k"] = {"engine": best(engine16), "engine_off": best(off16)}
        summary["step_time_ratio_engine_vs_off_at_16k"] = best(engine16) / best(off16)
        summary["step_time_target_met"] = summary["step_time_ratio_engine_vs_off_at_16k"] <= TARGET_STEP_SLOWDOWN
        cpu = lambda r: r.get("cpu_seconds_repeats") or ([r["cpu_seconds"]] if "cpu_seconds" in r else [])  # noqa: E731
        if cpu(engine16) and cpu(off16):
            # CPU seconds of the step (all threads): less sensitive than wall time to other
            # work on a shared machine, which the load average shows.
            summary["cpu_seconds_at_16k"] = {"engine": min(cpu(engine16)), "engine_off": min(cpu(off16))}
            summary["cpu_time_ratio_engine_vs_off_at_16k"] = min(cpu(engine16)) / min(cpu(off16))
        summary["engine_off_peak_rss_gib_at_16k"] = off16["peak_rss_bytes"] / GIB
    # Every length both engine systems ran at: best wall time and best CPU time of each.
    ratios = {}
    for (system, length), result in sorted(by.items()):
        off = by.get(("engine_off", length))
        if system != "engine" or off is None:
            continue
        wall = lambda r: min(r.get("step_seconds_repeats", [r["step_seconds"]]))  # noqa: E731
        cpus = lambda r: r.get("cpu_seconds_repeats") or ([r["cpu_seconds"]] if "cpu_seconds" in r else [])  # noqa: E731
        ratios[str(length)] = {
            "wall": wall(result) / wall(off),
            "cpu": min(cpus(result)) / min(cpus(off)) if cpus(result) and cpus(off) else None,
            "load_average": {"engine": result["load_average"], "engine_off": off["load_average"]},
        }
    summary["step_time_ratio_engine_vs_off_by_length"] = ratios
    plain16 = by.get(("plain", 16384))
    if plain16 is not None:
        summary["plain_peak_rss_gib_at_16k"] = plain16["peak_rss_bytes"] / GIB
    summary["planner"] = _planner_prediction(memory)
    return summary


def _breakdown(run_result: dict) -> dict:
    """Where the engine's peak RSS goes (bytes): see the module docstring."""
    checkpoints = BLOCKS * run_result["seq_len"] * HIDDEN * 4
    fixed = run_result["baseline_rss_bytes"] + run_result["state_bytes"]
    phases = run_result["peak_rss_by_phase"]
    peak_phase = max(phases, key=phases.get)
    return {
        "interpreter_and_libraries": run_result["baseline_rss_bytes"],
        "state": run_result["state_bytes"],
        "checkpoints": checkpoints,
        "transients_at_peak": phases[peak_phase] - fixed - checkpoints,
        "peak_phase": peak_phase,
        "transients_by_phase": {
            phase: rss - fixed - (checkpoints if phase != "optimizer step" else 0)
            for phase, rss in phases.items()
            if phase != "build"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", default=[], help="SYSTEM:LENGTH, e.g. engine:16384")
    parser.add_argument("--json", help="merge the runs into this file and write the summary there")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child[0], int(args.child[1]))))
        return
    existing = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    runs = existing.get("runs", [])
    for spec in args.runs:
        system, length = spec.split(":")
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        output = subprocess.run(
            [sys.executable, __file__, "--child", system, length], check=True, capture_output=True, text=True
        ).stdout
        result = json.loads(output.strip().splitlines()[-1])
        print(
            f"{system:>10} T={int(length):>6}: peak RSS {result['peak_rss_bytes'] / GIB:.2f} GiB, "
            f"step {result['step_seconds']:.1f} s (load {result['load_average']:.1f})",
            flush=True,
        )
        # A repeat keeps every step time (the summary compares the best of each) and the
        # latest memory figures (the same every time: the allocations do not depend on timing).
        earlier = [r for r in runs if (r["system"], r["seq_len"]) == (system, int(length))]
        result["step_seconds_repeats"] = [
            t for r in earlier for t in r.get("step_seconds_repeats", [r["step_seconds"]])
        ]
        result["step_seconds_repeats"].append(result["step_seconds"])
        result["cpu_seconds_repeats"] = [
            t
            for r in earlier
            for t in r.get("cpu_seconds_repeats", []) or ([r["cpu_seconds"]] if "cpu_seconds" in r else [])
        ]
        result["cpu_seconds_repeats"].append(result["cpu_seconds"])
        runs = [r for r in runs if (r["system"], r["seq_len"]) != (system, int(length))] + [result]
        _write(args.json, runs)  # after every run: a sitting cut short keeps what it measured
    print(json.dumps(_write(args.json, runs)["summary"], indent=2))


def _write(path: str | None, runs: list[dict]) -> dict:
    report = {
        "benchmark": "long_context",
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "model": {"hidden": HIDDEN, "ffn": FFN, "blocks": BLOCKS, "heads": HEADS, "vocab": VOCAB, "dtype": "fp32"},
        "allocator_environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MALLOC_", "MKL_"))},
        "runs": sorted(runs, key=lambda r: (r["system"], r["seq_len"])),
        "summary": summarize(runs),
    }
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
