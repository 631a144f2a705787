"""Whether a micro-batch is large enough to hide its weight transfers; warned once per engine.

Every block's weights cross host->device twice per micro-batch (forward, and backward with
its recompute) whatever the batch, while block compute grows with the tokens of a weight
pass. The planner's cost model (``planning/planner.py``) puts the break-even at
``T = w * F / (4 * B)`` tokens (:func:`~megatrain_ds.planning.planner.min_tokens_to_hide_transfer`;
``w`` bytes per streamed weight, ``F`` the device's FLOP/s, ``B`` its host->device bytes/s).
A run under :data:`EXPOSED_FRACTION` of that leaves the device waiting for copies most of
the step, so the engine says so once, at its first training forward, with the numbers and
what to change. Gradient accumulation does not help: each micro-batch streams every block
again.

The machine's figures: the planner's table for an H100, H200 or GH200 (another GPU is
taken as H100-class on PCIe Gen5, and the warning says so); on the CPU, where the "device"
is the host, the planner's CPU profile: this machine's matmul and memory copy rates, as
``megatrain plan --gpu cpu`` measures them but with smaller buffers and shorter runs
(tens of ms and 32 MB, once per process).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from megatrain_ds.planning.planner import GPU_HARDWARE, Hardware, min_tokens_to_hide_transfer
from megatrain_ds.runtime.device_runtime import DeviceRuntime

logger = logging.getLogger(__name__)

EXPOSED_FRACTION = 0.25
"""Warn below this fraction of the tokens that hide the transfers."""

_GPU_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100"))  # most specific first


def tokens_per_pass(args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(sequences, tokens)`` of a batch: the shape of ``input_ids`` (or ``inputs_embeds``
    without its hidden dimension); ``None`` for a batch of neither."""
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if tokens is None and args and isinstance(args[0], torch.Tensor):
        tokens = args[0]  # Hugging Face models take input_ids first
    if not isinstance(tokens, torch.Tensor) or tokens.dim() == 0:
        return None
    if tokens.is_floating_point():  # embeddings: [batch, seq, hidden]
        if tokens.dim() < 2:
            return None
        shape = tokens.shape[:-1]
    else:
        shape = tokens.shape
    return (int(shape[0]) if len(shape) > 1 else 1), int(shape.numel())


def hardware_of(runtime: DeviceRuntime) -> tuple[Hardware, str]:
    """The planner's figures for ``runtime``'s device, and a note on where they come from."""
    name = runtime.device_name
    if runtime.is_cuda:
        for marker, key in _GPU_NAMES:
            if marker in name.upper():
                return GPU_HARDWARE[key], f"the planner's {key} figures"
        return GPU_HARDWARE["h100"], f"assumed H100-class figures (the planner has none for {name})"
    return measure_cpu(), "this CPU, measured"


@functools.lru_cache(maxsize=1)
def measure_cpu(seconds: float = 0.02) -> Hardware:
    """This machine as the compute device (fp32 matmul rate, memory copy rate); cached.

    The planner's CPU profile (``cli.measure_cpu``) with 16 MB buffers instead of 128 MB,
    so that an engine's first step does not add to its peak host memory.
    """
    size = 256
    # Constant operands: timing needs no random values, and drawing them would move the
    # user's RNG stream (a resumed run would then differ from an uninterrupted one).
    a, b = torch.full((size, size), 0.5), torch.full((size, size), 0.25)
    flops = 2 * size**3 * _rate(lambda: a @ b, seconds)
    source = torch.empty(4 << 20)
    target = torch.empty_like(source)
    copy_rate = source.numel() * 4 * _rate(lambda: target.copy_(source), seconds)
    return Hardware("cpu", flops, copy_rate, copy_rate, 2 * copy_rate, 0, shares_host_memory=True)


def _rate(work: Any, seconds: float) -> float:
    work()  # warm up
    count, started = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - started < seconds:
        work()
        count += 1
    return count / (time.perf_counter() - started)


def transfer_advice(
    sequences: int, tokens: int, hardware: Hardware, source: str, bf16: bool, accumulation: int
) -> str | None:
    """The warning for a micro-batch of ``tokens``, or ``None`` when it is not far too small."""
    needed = min_tokens_to_hide_transfer(hardware, bf16)
    if tokens >= EXPOSED_FRACTION * needed:
        return None
    length = max(tokens // max(sequences, 1), 1)
    wanted_micro = -(-needed // length)
    accumulation_note = (
        f" (this run accumulates over {accumulation} micro-batches, and each streams every block again)"
        if accumulation > 1
        else ""
    )
    return (
        f"megatrain: a micro-batch of {tokens} tokens ({sequences} x {length}) is far too small to hide the "
        f"weight transfers on {hardware.name}: block compute covers the host-to-device copies from about "
        f"{needed} tokens per weight pass (planner: T >= w*F/(4*B) with w={2 if bf16 else 4} bytes, "
        f"F={hardware.flops / 1e12:.3g} TFLOP/s, B={hardware.h2d_bytes_per_s / 1e9:.3g} GB/s; {source}), "
        f"so the device waits for copies for most of the step. Raise train_micro_batch_size_per_gpu "
        f"(about {wanted_micro} at this sequence length) or the sequence length; gradient accumulation "
        f"does not help{accumulation_note}."
    )


def warn_if_transfers_exposed(
    runtime: DeviceRuntime, args: tuple, kwargs: Mapping[str, Any], *, bf16: bool, accumulation: int
) -> str | None:
    """Log :func:`transfer_advice` for this batch (the engine calls it once); returns it."""
    counted = tokens_per_pass(args, kwargs)
    if counted is None:
        return None
    hardware, source = hardware_of(runtime)
    message = transfer_advice(*counted, hardware, source, bf16, accumulation)
    if message is not None:
        logger.warning(message)
    return message
