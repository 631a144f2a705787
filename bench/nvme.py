"""The NVMe tier: achieved swap bandwidth vs the disk's own, and step time with the tier vs without.

All in one run, on the disk under ``--nvme-path``:

1. The disk's own sequential O_DIRECT bandwidth (``measure_disk_bandwidth``: one thread,
   16 MiB transfers over a fresh preallocated file), write then read.
2. The tier's achieved bandwidth, through its own machinery (``NvmeTier``: swap files,
   slots, I/O threads, the chosen engine), over ``--blocks`` synthetic blocks of
   ``--block-mib`` MiB of m and v each:
   - write: every block's file written by the tier's engine, 2 in flight (as write-behind);
   - read (after the writes: a preallocated file never written reads as zeros without
     touching the device): every block acquired read-only in order, prefetch ``window - 1`` deep;
   - update pass: every block acquired for writing, in order (the optimizer's pattern:
     read ahead, write behind on the same disk), against the disk's time for the same
     bytes, ``read_bytes / disk_read + written_bytes / disk_write``.
   Ratios >= 0.70 are the target.
3. Step time of the engine (``bench/compare.py``'s child, fresh processes) on the same
   Llama with a plain ZeRO-Infinity JSON (``offload_optimizer.device: "nvme"``), with the
   weights on NVMe too (``offload_param.device: "nvme"`` as well: ``"nvme_offload": "all"``)
   and without either (host memory only), and the split of each tiered step from its
   trace: compute, waiting for the disk, AdamW, and the I/O threads' read and write time.

    python bench/nvme.py --nvme-path /work/nvme_swap
    python bench/nvme.py --nvme-path /mnt/nvme --blocks 16 --block-mib 512 --layers 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's megatrain_ds, wherever pip points


def tier_bandwidth(nvme_path: str, blocks: int, block_mib: int, window: int, engine: str) -> dict:
    from dataclasses import replace

    import torch

    from megatrain_ds.config import AioSettings, MegatrainOptions
    from megatrain_ds.runtime.device_runtime import DeviceRuntime
    from megatrain_ds.state.flat_layout import build_flat_layout
    from megatrain_ds.state.host_store import HostFlatState, absent_on_host
    from megatrain_ds.state.nvme_tier import MOMENTS, NvmeTier
    from megatrain_ds.state.nvme_window import IO_THREADS
    from megatrain_ds.state.state_placement import Buffer, Where, whole_in_host_memory

    numel = block_mib * (1 << 20) // 8  # m and v: 8 bytes per element
    states = []
    for _ in range(blocks):
        layout = build_flat_layout([("w", torch.Size([numel]), 0)])
        on_tier = Buffer(Where.TIER, layout.numel, 4)  # the moments, as "optimizer" places them (fp32 compute)
        states.append(
            HostFlatState(
                layout=layout,
                master=torch.empty(0),
                shadow=None,
                exp_avg=absent_on_host(layout.numel),
                exp_avg_sq=absent_on_host(layout.numel),
                placement=replace(whole_in_host_memory(layout.numel, 4), exp_avg=on_tier, exp_avg_sq=on_tier),
            )
        )
    options = MegatrainOptions(
        nvme_offload="optimizer", nvme_path=nvme_path, nvme_window_blocks=window, nvme_aio=AioSettings(engine=engine)
    )
    tier = NvmeTier(
        [state.layout.numel for state in states],
        MOMENTS,
        DeviceRuntime.create(torch.device("cpu"), pin_memory=False),
        options,
    )
    for state in states:
        tier.adopt(state)
    try:
        file_bytes = tier.directory.nbytes // blocks
        result = {"engine": tier.engine_name, "blocks": blocks, "file_bytes": file_bytes, "window": window}

        # Writes alone: the tier's engine and files, IO_THREADS buffers in flight as its write-behind has.
        buffers = [tier.io.buffer(file_bytes // 4).fill_(1.0) for _ in range(IO_THREADS)]  # not zero pages
        paths = sorted(tier.directory.files.values())
        began = time.perf_counter()
        with ThreadPoolExecutor(IO_THREADS) as pool:
            list(pool.map(lambda i: tier.io.write(buffers[i % IO_THREADS], paths[i], 0), range(blocks)))
        result["write_seconds"] = time.perf_counter() - began
        result["write_bytes_per_s"] = blocks * file_bytes / result["write_seconds"]

        began = time.perf_counter()
        tier.expect(states)
        for state in states:
            tier.acquire(state, write=False)
        result["read_seconds"] = time.perf_counter() - began
        result["read_bytes_per_s"] = tier.bytes_read / result["read_seconds"]

        tier.flush()  # nothing changed: nothing written; the window is empty
        read, written = tier.bytes_read, tier.bytes_written
        began = time.perf_counter()
        tier.expect(states)
        for state in states:
            tier.acquire(state)
            state.exp_avg[:1] += 1  # an update's write (the whole slot goes back)
        tier.flush()
        result["update_seconds"] = time.perf_counter() - began
        result["update_read_bytes"] = tier.bytes_read - read
        result["update_written_bytes"] = tier.bytes_written - written
        return result
    finally:
        tier.close()


def engine_step(args: argparse.Namespace, nvme_path: str | None, weights: bool = False) -> dict:
    command = [
        sys.executable,
        str(HERE / "compare.py"),
        "--child",
        "megatrain",
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--vocab",
        "32000",
        "--seq-len",
        "128",
        "--micro-batch",
        "2",
        "--clip",
        "1.0",
        "--steps",
        str(args.steps),
    ]
    if nvme_path:
        command += ["--nvme-path", nvme_path, *(["--nvme-weights"] if weights else [])]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=HERE)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"engine run failed ({nvme_path=}):\n{completed.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--block-mib", type=int, default=256, help="MiB of m and v per synthetic block")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--disk-gib", type=float, default=2.0, help="size of the raw-disk measurement file")
    parser.add_argument("--rounds", type=int, default=2, help="bandwidth measurements, best of")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=str(HERE / "results" / "nvme_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)

    from megatrain_ds.state.swap_io import DiskBandwidth, measure_disk_bandwidth

    # Best of --rounds each, the disk and the tier alike: other work only slows a run down.
    disks = [measure_disk_bandwidth(args.nvme_path, int(args.disk_gib * (1 << 30))) for _ in range(args.rounds)]
    disk = DiskBandwidth(read=max(d.read for d in disks), write=max(d.write for d in disks))
    print(f"disk (O_DIRECT sequential): read {disk.read / 1e9:.2f} GB/s, write {disk.write / 1e9:.2f} GB/s", flush=True)
    report: dict = {
        "nvme_path": args.nvme_path,
        "load_average": os.getloadavg(),
        "disk": {
            "read_bytes_per_s": disk.read,
            "write_bytes_per_s": disk.write,
            "rounds": [{"read": d.read, "write": d.write} for d in disks],
        },
        "tier": {},
    }
    for engine in ("aio", "threads"):
        rounds = [
            tier_bandwidth(args.nvme_path, args.blocks, args.block_mib, args.window, engine) for _ in range(args.rounds)
        ]
        tier = dict(
            rounds[0],
            read_bytes_per_s=max(r["read_bytes_per_s"] for r in rounds),
            write_bytes_per_s=max(r["write_bytes_per_s"] for r in rounds),
            update_seconds=min(r["update_seconds"] for r in rounds),
            rounds=rounds,
        )
        disk_time = tier["update_read_bytes"] / disk.read + tier["update_written_bytes"] / disk.write
        tier.update(
            read_over_disk=tier["read_bytes_per_s"] / disk.read,
            write_over_disk=tier["write_bytes_per_s"] / disk.write,
            update_over_disk=disk_time / tier["update_seconds"],
        )
        report["tier"][engine] = tier
        print(
            f"tier [{tier['engine']}]: read {tier['read_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({tier['read_over_disk']:.0%} of the disk), write {tier['write_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({tier['write_over_disk']:.0%}), update pass {tier['update_over_disk']:.0%} of the disk's time",
            flush=True,
        )

    ram = engine_step(args, None)
    tiered = engine_step(args, os.path.join(args.nvme_path, "engine"))
    everything = engine_step(args, os.path.join(args.nvme_path, "engine"), weights=True)
    report["model"] = {
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "params": ram["params"],
        "seq_len": 128,
        "micro_batch": 2,
        "clip": 1.0,
        "fp32": True,
    }
    report["engine"] = {
        "ram_only": ram,
        "nvme_tier": tiered,
        "nvme_tier_with_weights": everything,
        "step_seconds_tier_over_ram": tiered["step_seconds"] / ram["step_seconds"],
        "peak_host_bytes_tier_over_ram": tiered["peak_host_bytes"] / ram["peak_host_bytes"],
        "step_seconds_weights_on_tier_over_ram": everything["step_seconds"] / ram["step_seconds"],
        "peak_host_bytes_weights_on_tier_over_ram": everything["peak_host_bytes"] / ram["peak_host_bytes"],
    }
    for name, run in (("the NVMe tier", tiered), ("the weights on it too", everything)):
        print(
            f"engine, {ram['params'] / 1e6:.0f}M params: step {ram['step_seconds']:.2f} s in host memory, "
            f"{run['step_seconds']:.2f} s with {name} ({run['step_seconds'] / ram['step_seconds']:.2f}x); "
            f"peak host {ram['peak_host_bytes'] / 2**30:.2f} -> {run['peak_host_bytes'] / 2**30:.2f} GiB; "
            "step split: " + ", ".join(f"{k} {v:.2f} s" for k, v in run.get("trace_split", {}).items()),
            flush=True,
        )
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
