"""How fast the gradient worker takes gradient chunks on this machine, and what slows it.

On one H200 (``bench/results/gpu_H200``) backward waited at every block for the gradient
worker, which handled 1.9 G elements/s whatever it computed: widening the chunks to fp32
first (4x faster kernels on warm buffers) changed nothing. This measures the worker alone,
through the engine's own :class:`~megatrain_ds.gradients.sink.GradientSink` (device-to-host
copies into pinned staging on a GPU, the worker thread, its back-pressure), with what the
worker does for a bf16 step without accumulation (``engine._consume_gradient``: the chunk
summed into the held gradients, ``LossScaling.unscale_into_``; its squared norm,
``OptimizerStepper.consume_final``). Cases:

- ``alone``: nothing else runs;
- ``python_busy``: a thread runs Python meanwhile, as backward's autograd thread does with
  the blocks' recompute (the GIL: the worker needs it between its kernels);
- ``one_thread``: torch's intra-op threads set to 1 before the worker starts;
- ``ops_on_main``: the same kernels on the main thread, no sink: the kernels' own rate;
- ``direct``: a design to compare, not the engine's: each chunk copied straight into the
  held gradients on the d2h stream and its norm computed on the device, so the host has
  nothing to do per chunk (the copies' rate is then the ceiling).

    python bench/gradient_worker.py [--elements N] [--out PATH]

Prints a table; writes ``bench/results/gradient_worker_<device>.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain_ds.gradients.sink import GradientSink
from megatrain_ds.runtime.device_runtime import DeviceRuntime

CHUNK = 1 << 22
"""The engine's STAGING_CHUNK_ELEMENTS: the worker takes chunks of this many elements."""
NUM_STAGING = 4
"""The engine's default ``num_staging_buffers``."""


def consume_into(held: torch.Tensor, sums: list[float]) -> Callable[[int, int, torch.Tensor, bool], None]:
    """The worker's work for a bf16 step without accumulation, as the engine does it."""

    def consume(_state: int, offset: int, chunk: torch.Tensor, _final: bool) -> None:
        accumulated = held[offset : offset + chunk.numel()]
        accumulated.add_(chunk)
        sums.append(float(torch.linalg.vector_norm(accumulated, dtype=torch.float32)) ** 2)

    return consume


def through_sink(runtime: DeviceRuntime, grads: torch.Tensor, held: torch.Tensor) -> float:
    """Elements per second from the first push to the drain, through a fresh sink."""
    sums: list[float] = []
    sink = GradientSink(runtime, CHUNK, grads.dtype, NUM_STAGING, consume_into(held, sums))
    try:
        runtime.synchronize()
        started = time.perf_counter()
        for offset in range(0, grads.numel(), CHUNK):
            sink.push(0, offset, grads[offset : offset + CHUNK], True)
        sink.drain()
        return grads.numel() / (time.perf_counter() - started)
    finally:
        sink.close()


def ops_on_main(grads: torch.Tensor, held: torch.Tensor) -> float:
    """The same kernels on host chunks, on the calling thread."""
    host = grads[:CHUNK].cpu()
    consume = consume_into(held, [])
    started = time.perf_counter()
    for offset in range(0, held.numel(), CHUNK):
        consume(0, offset, host, True)
    return held.numel() / (time.perf_counter() - started)


def direct_into_held(runtime: DeviceRuntime, grads: torch.Tensor, held: torch.Tensor) -> float:
    """Elements per second when chunks go straight into ``held`` and their norms are
    computed where the gradient is, read once at the end."""
    norms = []
    runtime.synchronize()
    started = time.perf_counter()
    for offset in range(0, grads.numel(), CHUNK):
        piece = grads[offset : offset + CHUNK]
        produced = runtime.event()
        produced.record(runtime.compute_stream())
        with runtime.on(runtime.d2h_stream):
            runtime.d2h_stream.wait_event(produced)  # the gradient is finished before it is read
            held[offset : offset + piece.numel()].copy_(piece, non_blocking=True)
        norms.append(torch.linalg.vector_norm(piece, dtype=torch.float32))
    float(torch.stack(norms).square().sum())
    runtime.synchronize()  # every copy has landed
    return grads.numel() / (time.perf_counter() - started)


def with_python_busy(measure: Callable[[], float]) -> float:
    """``measure()`` while another thread runs Python the whole time."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        return measure()
    finally:
        stop.set()
        spinner.join()


def run(elements: int) -> dict:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    runtime = DeviceRuntime.create(device)
    grads = torch.randn(elements, device=device).to(torch.bfloat16)
    held = runtime.host_zeros(elements, torch.bfloat16)
    threads = torch.get_num_threads()
    rates: dict[str, float] = {}
    through_sink(runtime, grads, held)  # warm-up: staging pinned, kernels loaded
    rates["alone"] = through_sink(runtime, grads, held)
    rates["python_busy"] = with_python_busy(lambda: through_sink(runtime, grads, held))
    torch.set_num_threads(1)
    try:
        rates["one_thread"] = through_sink(runtime, grads, held)
    finally:
        torch.set_num_threads(threads)
    rates["ops_on_main"] = ops_on_main(grads, held)
    rates["direct"] = direct_into_held(runtime, grads, held)
    return {
        "device": runtime.device_name,
        "elements": elements,
        "chunk_elements": CHUNK,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "elements_per_s": rates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 28, help="gradient elements per pass (bf16)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.elements)
    print(f"{result['device']}: {args.elements / 1e6:.0f}M bf16 gradient elements, {CHUNK >> 20}M-element chunks")
    for case, rate in result["elements_per_s"].items():
        print(f"  {case:12s} {rate / 1e9:6.2f} G elements/s")
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["device"]).strip("_")
    out = args.out or Path(__file__).resolve().parent / "results" / f"gradient_worker_{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
