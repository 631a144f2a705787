"""Checkpoint save/load time and peak extra host memory, and loading a meta-device model.

Two fresh processes, one after the other, on a Llama-shaped model (default hidden 1536,
16 layers, vocab 32000: ~550M parameters; fp32 compute, no clipping, so the host state
is 12 bytes/param: master, Adam m, Adam v):

1. ``save-load``: build the model (random init), hand it to the engine, then
   ``save_checkpoint`` and ``load_checkpoint`` (into the same engine), each timed, with
   the peak resident set above its level before the call.
2. ``meta-load``: build the model under ``accelerate.init_empty_weights()`` and create the
   engine with ``"load_from"`` = the tag directory just saved (it is a Hugging Face model
   directory); timed, with the peak resident set above the engine's final level.

"Extra" memory is measured three ways: the kernel's high-water mark of the resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` before each call), and a 2 ms sampler
of anonymous memory (``RssAnon``, what the process itself allocated) and of mapped file
pages (``RssFile``: the safetensors memory maps of the meta-device load, which the
high-water mark cannot separate from the state being allocated at the same time). Both are
compared with the size of one block: its fp32 master
(the issue's target: under 3 blocks). Save and load go through the page cache; nothing
here drops caches (the machine is shared), so the load reads what the save just wrote if
it is still cached: the JSON records the machine's load and free memory.

    python bench/checkpoint.py                                       # ~550M, ~7 GB of files
    python bench/checkpoint.py --hidden 512 --layers 4 --json bench/results/checkpoint_cpu_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time


def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
    return values


class PeakMeter:
    """Peak RSS (kernel high-water mark) and peak RssAnon (sampled) above the start."""

    def __enter__(self) -> PeakMeter:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # reset VmHWM to the current RSS
        self.start = _status()
        self.peak_anon = self.start["RssAnon"]
        self.peak_file = self.start["RssFile"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.began = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            status = _status()
            self.peak_anon = max(self.peak_anon, status["RssAnon"])
            self.peak_file = max(self.peak_file, status["RssFile"])

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.began
        self._stop.set()
        self._thread.join()
        self.end = _status()
        self.peak_anon = max(self.peak_anon, self.end["RssAnon"])

    def report(self, baseline: dict[str, int] | None = None) -> dict[str, float]:
        """Peaks above ``baseline`` (default: the state when the meter started)."""
        base = baseline or self.start
        return {
            "seconds": self.seconds,
            "peak_extra_rss_bytes": self.end["VmHWM"] - base["VmRSS"],
            "peak_extra_anon_bytes": self.peak_anon - base["RssAnon"],
            "peak_mapped_file_bytes": self.peak_file - self.start["RssFile"],
        }


def _model_config(hidden: int, layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        attn_implementation="sdpa",
    )


ENGINE_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}


def _block_bytes(engine) -> dict[str, int]:
    state = engine.states[0]
    return {
        "block_master_bytes": state.master.numel() * state.master.element_size(),
        "block_state_bytes": sum(state.nbytes_by_kind().values()),
    }


def run_save_load(hidden: int, layers: int, directory: str) -> dict:
    import torch
    import transformers

    from megatrain_ds import MegatrainEngine, parse_engine_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_model_config(hidden, layers))
    params = sum(p.numel() for p in model.parameters())
    engine = MegatrainEngine(model, parse_engine_config(ENGINE_CONFIG))
    for state in engine.states:  # make m and v non-trivial (a trained run's are)
        state.exp_avg.copy_(state.master).mul_(1e-3)
        state.exp_avg_sq.copy_(state.master).square_()
    with PeakMeter() as save:
        engine.save_checkpoint(directory, tag="bench")
    files = sum(
        os.path.getsize(os.path.join(directory, "bench", f)) for f in os.listdir(os.path.join(directory, "bench"))
    )
    reference = [state.master[:4096].clone() for state in engine.states]
    for state in engine.states:
        state.master.zero_()
    with PeakMeter() as load:
        engine.load_checkpoint(directory)
    assert all(torch.equal(ref, state.master[:4096]) for ref, state in zip(reference, engine.states))
    result = {
        "params": params,
        "state_bytes": sum(engine.host_bytes().values()),
        "checkpoint_bytes": files,
        **_block_bytes(engine),
        "save": save.report(),
        "load": load.report(),
    }
    engine.destroy()
    return result


def run_meta_load(hidden: int, layers: int, directory: str) -> dict:
    import accelerate
    import transformers

    from megatrain_ds import MegatrainEngine, parse_engine_config
    from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
    from megatrain_ds.optimizer.facade import build_optimizer
    from megatrain_ds.planning import preflight

    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(_model_config(hidden, layers))
    config = parse_engine_config({**ENGINE_CONFIG, "megatrain": {"load_from": os.path.join(directory, "bench")}})
    shapes = preflight._shapes(model, config, build_optimizer(model, None, config.optimizer, None))
    estimate = preflight.estimate_from_shapes(shapes, config, "cpu", STAGING_CHUNK_ELEMENTS).host_total
    with PeakMeter() as meter:
        engine = MegatrainEngine(model, config)
    after = meter.end
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        **_block_bytes(engine),
        "seconds": meter.seconds,
        "rss_growth_bytes": after["VmRSS"] - meter.start["VmRSS"],
        "preflight_estimate_bytes": estimate,
        # the transient above the engine's final state: what loading itself cost
        "peak_extra_rss_bytes": after["VmHWM"] - after["VmRSS"],
        "peak_extra_anon_bytes": meter.peak_anon - after["RssAnon"],
        # file pages of the safetensors memory maps (page cache mapped, not a copy)
        "peak_mapped_file_bytes": meter.peak_file - meter.start["RssFile"],
    }
    engine.destroy()
    return result


def _machine() -> dict:
    with open("/proc/meminfo") as handle:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle}
    return {
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "mem_total_bytes": info["MemTotal"],
        "mem_available_bytes": info["MemAvailable"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory, removed)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=["save-load", "meta-load"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = run_save_load if args.child == "save-load" else run_meta_load
        print(json.dumps(run(args.hidden, args.layers, args.dir)))
        return
    directory = args.dir or tempfile.mkdtemp(prefix="megatrain_ckpt_bench_")
    results = {"machine_before": _machine()}
    try:
        for child in ("save-load", "meta-load"):
            output = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    child,
                    "--hidden",
                    str(args.hidden),
                    "--layers",
                    str(args.layers),
                    "--dir",
                    directory,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[child] = json.loads(output.strip().splitlines()[-1])
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    results["machine_after"] = _machine()
    mib, block = 1 << 20, results["save-load"]["block_master_bytes"]
    first = results["save-load"]
    print(
        f"model: {first['params'] / 1e6:.0f}M parameters, host state {first['state_bytes'] / 2**30:.2f} GiB, "
        f"checkpoint {first['checkpoint_bytes'] / 2**30:.2f} GiB, one block (fp32 master) {block / mib:.0f} MiB"
    )
    for name in ("save", "load"):
        row = first[name]
        print(
            f"{name:5s} {row['seconds']:6.1f} s  {first['checkpoint_bytes'] / row['seconds'] / 2**30:5.2f} GiB/s  "
            f"peak extra RSS {row['peak_extra_rss_bytes'] / mib:6.1f} MiB  "
            f"anon {row['peak_extra_anon_bytes'] / mib:6.1f} MiB"
            f"  ({row['peak_extra_rss_bytes'] / block:.2f} blocks)"
        )
    meta = results["meta-load"]
    print(
        f"meta-device model from safetensors: {meta['seconds']:.1f} s, peak extra RSS "
        f"{meta['peak_extra_rss_bytes'] / mib:.1f} MiB, anon {meta['peak_extra_anon_bytes'] / mib:.1f} MiB, "
        f"mapped file "
        f"pages {meta['peak_mapped_file_bytes'] / mib:.1f} MiB ({meta['peak_mapped_file_bytes'] / block:.2f} blocks); "
        f"RSS growth {meta['rss_growth_bytes'] / 2**30:.2f} GiB "
        f"vs preflight estimate {meta['preflight_estimate_bytes'] / 2**30:.2f} GiB"
    )
    if args.json:
        import torch

        results.update(
            {
                "device": "cpu: " + (platform.processor() or platform.machine()),
                "torch": torch.__version__,
                "hidden": args.hidden,
                "layers": args.layers,
                "notes": "shared machine (load averages above); the save's time includes fsync of every "
                "file; the load reads what the save just wrote, from the page cache",
            }
        )
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
