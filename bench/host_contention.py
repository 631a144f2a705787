"""What the host's AdamW pass and the link's copies cost each other: the numbers that decide
where the optimizer runs (issue 42, item 2).

The engine's optimizer finish runs the CPU AdamW kernel over every state while the GPU's
copies (weights host-to-device, gradients device-to-host) run too; both read and write the
same DRAM. ``optimizer/placement.py`` calibrates each alone. This bench measures:

- ``adam``: the engine's CPU AdamW kernel (``make_cpu_kernel("auto")``) at several thread
  counts, G elements/s and GB/s of DRAM traffic (28 B/element: fp32 p, g, m, v read, p, m,
  v written), alone and while a thread keeps pinned copies running both ways (on a GPU: two
  streams, host-to-device and device-to-host; on the CPU: one host-to-host copy, the same
  DRAM traffic per byte moved each way);
- ``copies``: the copies' GB/s each way, alone and beside the kernel at each thread count;
- ``norm`` (GPU only): the device-side squared norm of a gradient stream in the sink's
  4M-element chunks (``gradients/squared_norm.py``), against the device-to-host copy of the
  same chunks, each on one stream.

    python bench/host_contention.py [--elements N] [--threads 8 14 16] [--out PATH]

Prints a table; writes ``bench/results/host_contention_<device>.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain_ds.gradients.squared_norm import SquaredNorm
from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.optimizer.cpu_adam import make_cpu_kernel

ADAM_BYTES_PER_ELEMENT = 28
COPY_BYTES = 256 << 20
CHUNK = 1 << 22
"""The engine's STAGING_CHUNK_ELEMENTS: the sink's chunks."""
HYPER = AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.01, True)


class CopyLoad:
    """A thread that keeps copies running until stopped, counting the bytes each way."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.host = [torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        device = "cuda" if cuda else "cpu"
        self.device = [torch.empty(COPY_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        self.moved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if not self.cuda:
            while not self._stop.is_set():
                self.device[0].copy_(self.host[0])  # a host copy: one read, one write of DRAM
                self.moved += COPY_BYTES
            return
        h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
        while not self._stop.is_set():
            with torch.cuda.stream(h2d):
                self.device[0].copy_(self.host[0], non_blocking=True)
            with torch.cuda.stream(d2h):
                self.host[1].copy_(self.device[1], non_blocking=True)
            # Wait for both before counting: the bytes are moved once the streams are done.
            h2d.synchronize()
            d2h.synchronize()
            self.moved += COPY_BYTES

    def __enter__(self) -> CopyLoad:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._started

    def gb_per_s_each_way(self) -> float:
        return self.moved / self.seconds / 1e9


def adam_elements_per_s(elements: int, rounds: int) -> float:
    """The median rate of ``rounds`` full passes of the engine's CPU kernel."""
    kernel = make_cpu_kernel("auto")
    p, g, m, v = (torch.rand(elements) for _ in range(4))
    kernel.step_(p, g, m, v, None, step=1, hyper=HYPER)  # warm: pages touched, threads up
    seconds = []
    for step in range(2, rounds + 2):
        started = time.perf_counter()
        kernel.step_(p, g, m, v, None, step=step, hyper=HYPER)
        seconds.append(time.perf_counter() - started)
    return elements / statistics.median(seconds)


def copies_alone(cuda: bool, seconds: float = 1.0) -> float:
    with CopyLoad(cuda) as load:
        time.sleep(seconds)
    return load.gb_per_s_each_way()


def norm_against_copy(elements: int) -> dict:
    """Seconds per G elements of the device-side norm and of the d2h copy, sink-sized chunks."""
    grads = torch.randn(elements, device="cuda").to(torch.bfloat16)
    held = torch.empty(elements, dtype=torch.bfloat16, pin_memory=True)
    norm = SquaredNorm(grads.device)
    stream = torch.cuda.Stream()

    def over_chunks(work: Callable[[int, int], object]) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.cuda.stream(stream):
                for offset in range(0, elements, CHUNK):
                    work(offset, min(CHUNK, elements - offset))
            stream.synchronize()
            best = min(best, time.perf_counter() - started)
        return best / elements * 1e9

    copy = over_chunks(lambda o, n: held[o : o + n].copy_(grads[o : o + n], non_blocking=True))
    squared = over_chunks(lambda o, n: norm.add_on_device(grads[o : o + n]))
    return {"copy_s_per_g_elements": copy, "norm_s_per_g_elements": squared, "norm_over_copy": squared / copy}


def run(elements: int, thread_counts: list[int], rounds: int) -> dict:
    cuda = torch.cuda.is_available()
    rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        alone = adam_elements_per_s(elements, rounds)
        with CopyLoad(cuda) as load:
            loaded = adam_elements_per_s(elements, rounds)
        rows.append(
            {
                "threads": threads,
                "adam_g_elements_per_s": alone / 1e9,
                "adam_gb_per_s": alone * ADAM_BYTES_PER_ELEMENT / 1e9,
                "adam_g_elements_per_s_beside_copies": loaded / 1e9,
                "adam_slowdown_beside_copies": alone / loaded,
                "copies_gb_per_s_each_way_beside_adam": load.gb_per_s_each_way(),
            }
        )
    result = {"threads": rows, "copies_gb_per_s_each_way_alone": copies_alone(cuda)}
    if cuda:
        result["norm"] = norm_against_copy(min(elements, 1 << 28))
    return result


def device_label() -> str:
    if torch.cuda.is_available():
        return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").removeprefix("NVIDIA_")
    return "cpu"


def git_rev() -> str:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def print_table(result: dict) -> None:
    print(f"copies alone: {result['copies_gb_per_s_each_way_alone']:.1f} GB/s each way")
    print(f"{'threads':>7} {'adam G el/s':>11} {'adam GB/s':>9} {'+copies':>8} {'slowdown':>8} {'copies GB/s':>11}")
    for row in result["threads"]:
        print(
            f"{row['threads']:7d} {row['adam_g_elements_per_s']:11.2f} {row['adam_gb_per_s']:9.1f} "
            f"{row['adam_g_elements_per_s_beside_copies']:8.2f} {row['adam_slowdown_beside_copies']:8.2f} "
            f"{row['copies_gb_per_s_each_way_beside_adam']:11.1f}"
        )
    if "norm" in result:
        norm = result["norm"]
        print(f"device norm {norm['norm_s_per_g_elements']:.4f} s/G el vs d2h copy {norm['copy_s_per_g_elements']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=100_000_000, help="fp32 elements per AdamW pass")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: 8, 14, all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    threads = args.threads or sorted({min(n, cores) for n in (8, 14, cores)})
    result = {"device": device_label(), "git_rev": git_rev(), "cores": cores, "elements": args.elements}
    result.update(run(args.elements, threads, args.rounds))
    print_table(result)
    out = Path(args.out or f"bench/results/host_contention_{result['device']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
