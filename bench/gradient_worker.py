"""How fast the gradient path takes gradient chunks on this machine, and what slows it.

On one H200 (``bench/results/gpu_H200``) backward waited at every block for the gradient
worker, which handled 1.9 G elements/s whatever it computed: widening the chunks to fp32
first (4x faster kernels on warm buffers) changed nothing. Since then a step without
accumulation (held dtype == compute dtype) takes the *direct* path: each chunk is copied
straight into the held gradients on the d2h stream and its squared norm summed on the
device, read once at the step (``gradients/sink.py``, ``gradients/squared_norm.py``); the
worker still takes the chunks that need a host pass (accumulation, fp16). Both run through
the engine's own :class:`~megatrain_ds.gradients.sink.GradientSink`. Cases:

- ``alone``: the staged path (pinned staging, the worker thread, its back-pressure), with
  what the worker does for a staged final chunk (``engine._consume_gradient``: the chunk
  added into the held gradients, ``LossScaling.unscale_into_``; its squared norm,
  ``SquaredNorm.add_on_host``), nothing else running;
- ``python_busy``: the same while a thread runs Python, as backward's autograd thread does
  with the blocks' recompute (the GIL: the worker needs it between its kernels);
- ``one_thread``: torch's intra-op threads set to 1 before the worker starts;
- ``ops_on_main``: the same kernels on the main thread, no sink: the kernels' own rate;
- ``direct``: the engine's direct path (``land`` returns the held view): on a GPU the
  copies' rate is the ceiling; on the CPU the copy and norm run on the pushing thread;
- ``direct_python_busy``: the direct path beside a thread running Python.

``--accumulation`` measures instead what a later micro-batch's chunk costs the worker with
gradient accumulation (bf16 chunks added into fp32 held gradients, the final micro-batch's
squared norm; ``engine._consume_gradient``), through the staged path, ``--repeats`` times,
the cases interleaved so that each repeat sees the same load:

- ``torch_ops``: ``LossScaling.unscale_into_`` (``add_``) then ``SquaredNorm.add_on_host``
  (``vector_norm`` and ``float()``), as before the fused pass (and where it cannot run);
- ``fused``: ``HostAccumulation.accumulate_``, one GIL-free call of the engine's C++ binding
  (``optimizer/gradient_accumulation.py``); each alone and ``*_python_busy``.

    python bench/gradient_worker.py [--elements N] [--out PATH]
    python bench/gradient_worker.py --accumulation [--repeats R] [--elements N] [--out PATH]

Prints a table; writes ``bench/results/gradient_worker_<device>.json`` (with
``--accumulation``: ``gradient_worker_accumulation_<device>.json``) unless ``--out``.
"""

from __future__ import annotations

import argparse
import functools
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

from megatrain_ds.gradients.sink import GradientSink, Landing
from megatrain_ds.gradients.squared_norm import SquaredNorm
from megatrain_ds.optimizer.cpu_binding import load_deepspeed_op
from megatrain_ds.optimizer.gradient_accumulation import HostAccumulation
from megatrain_ds.optimizer.loss_scaling import LossScaling
from megatrain_ds.runtime.device_runtime import DeviceRuntime

CHUNK = 1 << 22
"""The engine's STAGING_CHUNK_ELEMENTS: the worker takes chunks of this many elements."""
NUM_STAGING = 4
"""The engine's default ``num_staging_buffers``."""


def consume_into(held: torch.Tensor, norm: SquaredNorm) -> Callable[[int, int, torch.Tensor, bool, Landing], None]:
    """The worker's work for a staged final chunk (an added micro-batch), as the engine does it."""

    def consume(_state: int, offset: int, chunk: torch.Tensor, _final: bool, _landing: Landing) -> None:
        accumulated = held[offset : offset + chunk.numel()]
        accumulated.add_(chunk)
        norm.add_on_host(accumulated)

    return consume


def through_sink(runtime: DeviceRuntime, grads: torch.Tensor, held: torch.Tensor) -> float:
    """Elements per second from the first push to the drain, through a fresh sink."""
    sink = GradientSink(runtime, CHUNK, grads.dtype, NUM_STAGING, consume_into(held, SquaredNorm(runtime.device)))
    try:
        return _push_all(runtime, sink, grads)
    finally:
        sink.close()


def _push_all(runtime: DeviceRuntime, sink: GradientSink, grads: torch.Tensor, after=lambda: None) -> float:
    """Elements per second of pushing ``grads`` chunk by chunk, up to the drain (and ``after``)."""
    runtime.synchronize()
    started = time.perf_counter()
    for offset in range(0, grads.numel(), CHUNK):
        sink.push(0, offset, grads[offset : offset + CHUNK], True)
    sink.drain()
    after()
    return grads.numel() / (time.perf_counter() - started)


def ops_on_main(grads: torch.Tensor, held: torch.Tensor) -> float:
    """The same kernels on host chunks, on the calling thread."""
    host = grads[:CHUNK].cpu()
    consume = consume_into(held, SquaredNorm(torch.device("cpu")))
    started = time.perf_counter()
    for offset in range(0, held.numel(), CHUNK):
        consume(0, offset, host, True, Landing())
    return held.numel() / (time.perf_counter() - started)


def direct_into_held(runtime: DeviceRuntime, grads: torch.Tensor, held: torch.Tensor) -> float:
    """Elements per second of the engine's direct path: every chunk lands in ``held`` by
    the copy, its norm summed where the gradient is, read once after the drain."""
    norm = SquaredNorm(runtime.device)

    def land(_state: int, offset: int, numel: int, _final: bool) -> Landing:
        return Landing(held=held[offset : offset + numel], fresh=True, notify=False)

    def consume(*_chunk: object) -> None:
        raise AssertionError("a direct chunk reached the worker")

    sink = GradientSink(runtime, CHUNK, grads.dtype, NUM_STAGING, consume, land=land, norm=norm)
    try:
        return _push_all(runtime, sink, grads, norm.take)
    finally:
        sink.close()


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
    rates["direct_python_busy"] = with_python_busy(lambda: direct_into_held(runtime, grads, held))
    return {
        "device": runtime.device_name,
        "elements": elements,
        "chunk_elements": CHUNK,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "elements_per_s": rates,
    }


def accumulating_consume(
    held: torch.Tensor, norm: SquaredNorm, accumulation: HostAccumulation
) -> Callable[[int, int, torch.Tensor, bool, Landing], None]:
    """The worker's work for a later micro-batch's staged chunk, as ``engine._consume_gradient``
    does it: added into the fp32 held gradients, and on the final micro-batch its squares
    summed (fused, or by the torch ops' ``SquaredNorm.add_on_host``)."""
    scaling = LossScaling(None)

    def consume(_state: int, offset: int, chunk: torch.Tensor, final: bool, _landing: Landing) -> None:
        accumulated = held[offset : offset + chunk.numel()]
        squares = accumulation.accumulate_(accumulated, chunk, scaling, overwrite=False, squares=final)
        if final:
            if squares is None:
                norm.add_on_host(accumulated)
            else:
                norm.add_squares_on_host(squares)

    return consume


def accumulating(runtime: DeviceRuntime, grads: torch.Tensor, held: torch.Tensor, op: object | None) -> float:
    """Elements per second of a final micro-batch's chunks added into ``held`` through a fresh sink."""
    norm = SquaredNorm(runtime.device)
    sink = GradientSink(
        runtime, CHUNK, grads.dtype, NUM_STAGING, accumulating_consume(held, norm, HostAccumulation(op))
    )
    try:
        return _push_all(runtime, sink, grads, norm.take)
    finally:
        sink.close()


def run_accumulation(elements: int, repeats: int) -> dict:
    """The accumulation cases, ``repeats`` rounds, interleaved (every round runs each case once)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    runtime = DeviceRuntime.create(device)
    grads = torch.randn(elements, device=device).to(torch.bfloat16)
    held = runtime.host_empty(elements, torch.float32)
    held.normal_()
    op = load_deepspeed_op()
    cases: dict[str, Callable[[], float]] = {
        "torch_ops": lambda: accumulating(runtime, grads, held, None),
        "fused": lambda: accumulating(runtime, grads, held, op),
    }
    cases.update(
        {f"{name}_python_busy": functools.partial(with_python_busy, measure) for name, measure in list(cases.items())}
    )
    for measure in cases.values():
        measure()  # warm-up: staging pinned, the binding loaded, pages touched
    rates: dict[str, list[float]] = {name: [] for name in cases}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name, measure in cases.items():
            rates[name].append(measure())
    return {
        "device": runtime.device_name,
        "mode": "accumulation: bf16 chunks added into fp32 held gradients, final micro-batch (squared norm)",
        "git_rev": _git_rev(),
        "elements": elements,
        "chunk_elements": CHUNK,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average_before_after": [load_before, os.getloadavg()],
        "repeats": repeats,
        "elements_per_s_median": {name: statistics.median(values) for name, values in rates.items()},
        "elements_per_s_min_max": {name: [min(values), max(values)] for name, values in rates.items()},
        "elements_per_s_all": rates,
    }


def _git_rev() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 28, help="gradient elements per pass (bf16)")
    parser.add_argument("--accumulation", action="store_true", help="the accumulation cases (torch ops vs fused)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the accumulation cases")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run_accumulation(args.elements, args.repeats) if args.accumulation else run(args.elements)
    print(f"{result['device']}: {args.elements / 1e6:.0f}M bf16 gradient elements, {CHUNK >> 20}M-element chunks")
    for case, rate in result.get("elements_per_s", result.get("elements_per_s_median", {})).items():
        spread = result.get("elements_per_s_min_max", {}).get(case)
        extra = f"  (min {spread[0] / 1e9:.2f}, max {spread[1] / 1e9:.2f})" if spread else ""
        print(f"  {case:24s} {rate / 1e9:6.2f} G elements/s{extra}")
    name = re.sub(r"[^A-Za-z0-9]+", "_", result["device"]).strip("_")
    kind = "gradient_worker_accumulation" if args.accumulation else "gradient_worker"
    out = args.out or Path(__file__).resolve().parent / "results" / f"{kind}_{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
