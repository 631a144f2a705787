"""Where each flat state's AdamW runs (``"megatrain": {"optimizer_device": ...}``).

- ``"cpu"``: on the host, with the fastest CPU kernel that runs here (``optimizer/cpu_adam.py``).
- ``"gpu"``: on the compute device, state streamed in and out (``optimizer/device_adamw.py``).
- ``"auto"`` (default): from measured numbers. Without CUDA that is ``"cpu"``; with CUDA a
  short calibration (cached per machine) measures the CPU kernel, host memcpy,
  host<->device bandwidth and the device kernel, and the states are split:

  Per element, the CPU touches ``24 + g + s`` bytes (read p, g, m, v; write p, m, v and
  the shadow: ``4+g+4+4 + 4+4+4+s``, with ``g``/``s`` the gradient/shadow widths) at the
  measured CPU AdamW rate; the device moves
  ``12 + g`` bytes in and ``12 + s`` out, over links that run both directions at once, and
  the kernel is bound by device memory. Both placements run at the same time (the worker
  queues device work and goes on with CPU work), so with ``t_cpu`` and ``t_gpu`` the
  seconds per element, a fraction ``f = t_cpu / (t_cpu + t_gpu)`` of the elements on the
  device makes both finish together. ``f`` is rounded to whole states, interleaved in
  backward order so that both are busy all through backward; under 5% a side gets none.
  Not modelled: the state transfers share the host-to-device link with the weight
  stream (4 B/param/step in bf16) and the device-to-host link with gradients (2 B).

The decision and its numbers are logged (``megatrain_ds.optimizer.placement``).
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.optimizer.cpu_adam import CpuAdamKernel, make_cpu_kernel
from megatrain_ds.optimizer.host_adamw import HostAdamW
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.measurement_cache import cache_dir, cached_measurement
from megatrain_ds.state.host_store import HostFlatState

logger = logging.getLogger(__name__)

PLACEMENTS = ("auto", "cpu", "gpu")
MIN_SHARE = 0.05
"""A placement given less than this share of the elements gets none (not worth the split)."""
CALIBRATION_ELEMENTS = 1 << 22
"""Elements per calibration run (16 MiB per fp32 tensor: past the caches, ~0.1 s each)."""
_HYPER = AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)


@dataclass(frozen=True)
class Calibration:
    """Measured throughputs, bytes per second (``None``: not measured, no device)."""

    cpu_kernel: str
    cpu_adam: float
    """CPU AdamW, bytes of state touched per second (28 B per element, fp32 gradient)."""
    host_copy: float
    """Host memcpy, bytes read + written per second."""
    h2d: float | None = None
    d2h: float | None = None
    device_adam: float | None = None
    """The device kernel alone, bytes of state touched per second (28 B per element)."""
    device: str = "cpu"

    def seconds_per_element(self, grad_bytes: int, shadow_bytes: int) -> tuple[float, float]:
        """``(t_cpu, t_gpu)``: seconds per element on each placement (``inf`` without a device)."""
        t_cpu = (24 + grad_bytes + shadow_bytes) / self.cpu_adam  # see the module docstring
        if self.h2d is None or self.d2h is None or self.device_adam is None:
            return t_cpu, float("inf")
        t_gpu = max((12 + grad_bytes) / self.h2d, (12 + shadow_bytes) / self.d2h, 28 / self.device_adam)
        return t_cpu, t_gpu


def device_share(calibration: Calibration, grad_bytes: int, shadow_bytes: int) -> float:
    """The fraction of elements the device should update (see the module docstring)."""
    t_cpu, t_gpu = calibration.seconds_per_element(grad_bytes, shadow_bytes)
    if t_gpu == float("inf"):
        return 0.0
    share = t_cpu / (t_cpu + t_gpu)
    return 0.0 if share < MIN_SHARE else 1.0 if share > 1.0 - MIN_SHARE else share


def split(numels: Sequence[int], share: float) -> list[str]:
    """``"gpu"``/``"cpu"`` per state, ``numels`` given in backward order: a state goes to the
    device when that keeps the device's share of the elements so far nearest ``share``."""
    placed, on_device, seen = [], 0, 0
    for numel in numels:
        seen += numel
        if share > 0 and on_device + numel / 2 <= share * seen:
            placed.append("gpu")
            on_device += numel
        else:
            placed.append("cpu")
    return placed


# -- calibration --------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 3) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(runtime: DeviceRuntime, kernel: CpuAdamKernel, n: int = CALIBRATION_ELEMENTS) -> Calibration:
    """Measure the numbers :func:`device_share` needs (about a second in all)."""

    def nothing() -> None:
        pass

    p, g, m, v = (torch.rand(n) for _ in range(4))
    cpu = 28 * n / _median_seconds(lambda: kernel.step_(p, g, m, v, None, step=10, hyper=_HYPER), nothing)
    src, dst = torch.rand(n), torch.empty(n)
    copy = 8 * n / _median_seconds(lambda: dst.copy_(src), nothing)
    if not runtime.is_cuda:
        return Calibration(kernel.name, cpu, copy)
    from megatrain_triton import adamw_step_

    sync = runtime.synchronize
    pinned = torch.empty(n).pin_memory()  # not runtime.host_empty: its registrations live with the engine
    dev = runtime.device_empty(n, torch.float32)
    h2d = 4 * n / _median_seconds(lambda: dev.copy_(pinned, non_blocking=True), sync)
    d2h = 4 * n / _median_seconds(lambda: pinned.copy_(dev, non_blocking=True), sync)
    dp, dg, dm, dv = (runtime.device_empty(n, torch.float32).uniform_() for _ in range(4))
    device_adam = (
        28
        * n
        / _median_seconds(
            lambda: adamw_step_(dp, dg, dm, dv, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=10), sync
        )
    )
    return Calibration(kernel.name, cpu, copy, h2d, d2h, device_adam, runtime.device_name)


def cache_path() -> Path:
    return cache_dir() / "calibration.json"


def _machine_key(runtime: DeviceRuntime, kernel: CpuAdamKernel) -> str:
    device = runtime.device_name if runtime.is_cuda else "cpu"
    return "|".join(
        [
            socket.gethostname(),
            platform.processor() or platform.machine(),
            str(os.cpu_count()),
            str(torch.get_num_threads()),
            device,
            torch.__version__,
            kernel.name,
        ]
    )


def calibrate(runtime: DeviceRuntime, kernel: CpuAdamKernel, path: Path | None = None) -> Calibration:
    """The cached calibration of this machine, measured (and cached) the first time."""
    figures = cached_measurement(
        path or cache_path(), _machine_key(runtime, kernel), lambda: asdict(measure(runtime, kernel))
    )
    return Calibration(**figures)


# -- building the engine's optimizer ------------------------------------------------------


def _why_cpu_only(
    placement: str, runtime: DeviceRuntime, states: Sequence[HostFlatState], finish_pipelines: bool
) -> str | None:
    """Why every state stays on the CPU, or ``None`` when some may go to the device."""
    if placement == "cpu":
        return '"optimizer_device": "cpu"'
    if placement != "auto":
        return None
    if not runtime.is_cuda:
        return "no CUDA device"
    # The device kernel writes bf16 shadows only: with fp16 compute "auto" keeps to the CPU.
    if any(state.shadow is not None and state.shadow.dtype == torch.float16 for state in states):
        return "fp16 compute: the device kernel writes bf16 copies only"
    if finish_pipelines:
        return "auto: the update runs behind the next forward, which a device-placed state would stop"
    return None


def build_host_adamw(
    param_groups: Sequence[dict],
    decoupled: bool,
    states: Sequence[HostFlatState],
    runtime: DeviceRuntime,
    placement: str,
    cpu_kernel: str,
    grad_dtype: torch.dtype,
    finish_pipelines: bool = False,
) -> HostAdamW:
    """The engine's :class:`HostAdamW`, each state placed as ``placement`` says (logged).

    ``finish_pipelines``: the configuration can run the step's update behind the next
    forward (``optimizer/pipelined_finish.py``), which a state on the device would make
    synchronous; ``"auto"`` then keeps every state on the CPU. On one H200 (940M Llama,
    ``bench/results/gpu_H200/2026-11-27/``) streaming 4 of 17 states through the device left
    the synchronous finish as long as the CPU's alone (0.26 s both): the pinned copies slow
    the CPU kernel by sharing DRAM (``bench/host_contention.py``: 1.8x at 16 threads)."""
    kernel = make_cpu_kernel(cpu_kernel)
    adamw = HostAdamW(param_groups, decoupled, kernel)
    reason = _why_cpu_only(placement, runtime, states, finish_pipelines)
    if reason is not None:
        logger.info("megatrain: optimizer on the CPU (%s), kernel %r", reason, kernel.name)
        return adamw
    if not runtime.is_cuda:
        from megatrain_triton import INTERPRETED

        if not INTERPRETED:
            raise ValueError(
                '"optimizer_device": "gpu" without CUDA needs Triton\'s interpreter: set '
                'TRITON_INTERPRET=1 before triton is first imported (tests do), or use "cpu"'
            )
    from megatrain_ds.optimizer.device_adamw import DeviceAdamW

    device = DeviceAdamW(runtime, grad_dtype)
    # Backward order: the blocks last to first, then the resident state (embedding last).
    order = list(range(len(states) - 2, -1, -1)) + [len(states) - 1]
    if placement == "gpu":
        targets = ["gpu"] * len(states)
        logger.info('megatrain: optimizer on the device ("optimizer_device": "gpu")')
    else:
        calibration = calibrate(runtime, kernel)
        shadow_bytes = 2 if states[0].shadow is not None else 0
        share = device_share(calibration, torch.empty((), dtype=grad_dtype).element_size(), shadow_bytes)
        # Split by the elements each state steps: its trained prefix (frozen ones never are).
        by_order = split([states[i].layout.trained_numel for i in order], share)
        targets = [""] * len(states)
        for index, target in zip(order, by_order):
            targets[index] = target
        gb = 1e9
        logger.info(
            "megatrain: optimizer placement auto: %d state(s) on the device, %d on the CPU (device share %.2f); "
            "measured CPU AdamW %.1f GB/s (%s), host memcpy %.1f GB/s, h2d %.1f GB/s, d2h %.1f GB/s, "
            "device AdamW %.0f GB/s (%s)",
            targets.count("gpu"),
            targets.count("cpu"),
            share,
            calibration.cpu_adam / gb,
            calibration.cpu_kernel,
            calibration.host_copy / gb,
            (calibration.h2d or 0) / gb,
            (calibration.d2h or 0) / gb,
            (calibration.device_adam or 0) / gb,
            calibration.device,
        )
    for state, target in zip(states, targets):
        if target == "gpu":
            adamw.place(state, device)
    return adamw
