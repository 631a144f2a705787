"""The host's AdamW rate as a run uses it: the probe behind ``megatrain plan --probe`` and the CPU profile.

The planner times the host's optimizer pass at a rate measured here (``planning/step_time.py``,
[Note: a step's phases]); :func:`probe_adam` measures it alone and beside the link's copies.

[Note: probing AdamW as the run runs it]
The fourth H200 run's in-run probe read 139 GB/s alone and did not probe the rate beside
copies at all (``adam_beside_copies_bytes_per_s`` 0.0), while the run's pipelined AdamW pass
ran at 102 GB/s (0.258 s for 0.189 s predicted). The probe differed from the run in four
ways, each of which can make it read fast; it now does what the run does:

- **The kernel's path.** The probe stepped an fp32 gradient at scale 1 without a shadow: one
  whole-range call of DeepSpeed's op. A bf16 run widens a bf16 gradient, scales it by the
  clipping factor and rounds a bf16 shadow in the blocked pass (``optimizer/cpu_adam.py``,
  [Note: one pass over DeepSpeed's kernel]: 8-16% slower on the same states). :func:`adam_work`
  takes the gradient's dtype, the shadow and a clipping scale from the run's settings.
- **The thread.** The run calls the kernel from a thread of its own (the finish worker
  behind the next forward, the gradient worker behind backward), whose OpenMP team is
  ``torch.get_num_threads()`` there, which need not be the main thread's (on the H200 the
  pipelined finish ran at 2.9 G elements/s against 3.9 for the same pass on the main
  thread; ``optimizer/cpu_adam.py``). The probe runs on a fresh thread too, so it gets the
  team, and whatever else differs off the main thread, that the run's workers get.
- **The calls.** The run makes a call per state (a block's parameters; a few per state, one
  per parameter group): the probe makes one call per block-sized range, not one call on an
  array of its own size.
- **Beside copies.** Without held gradients the AdamW pass runs behind backward while the
  gradients come down and the weights go up: the same DRAM. With a CUDA device the probe
  times the same pass again while pinned copies run both ways on the runtime's streams
  (:class:`PinnedCopyLoad`; ``bench/host_contention.py`` measures beside a load of the same
  kind: 1.8x slower at 16 threads on the H200 host). Without one it is not probed: the plan
  says so, and ``step_time.optimizer_seconds`` takes the rate alone.

What it still does not do: the pipelined finish runs beside the next forward (its weight
copies one way, the training thread issuing the blocks' kernels), for which the model takes
the rate alone; whether that holds is for the next GPU run to show (its trace's AdamW spans
against this probe's figure).

The states stay past the last-level cache (:func:`adam_probe_elements`, the first H200 probe's
256 MB sat in that host's L3 and read 3.3x fast), and each figure is the fastest pass of
several: other processes only ever slow a pass down.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.planning.step_time import RunSettings
from megatrain_ds.runtime.device_runtime import DeviceRuntime

ADAM_PROBE_CACHE_MULTIPLE = 4
"""The probe's states (master, gradient, m, v) together are at least this many times the
last-level cache: a cyclic pass over them then finds next to nothing cached, as a model's
states do."""

MIN_PROBE_ELEMENTS = 1 << 24
"""Elements the probe steps at least, whatever the cache (the H200 host: 16M elements)."""

MAX_CALL_ELEMENTS = 1 << 27
"""Elements per kernel call at most: a 7B block's state (202M elements) is stepped in two
calls, so that the probe's arrays stay a few GB (one call of 128M elements is already far
past any cache, and the blocked pass's speed does not depend on the call's length)."""

COPY_LOAD_BYTES = 256 << 20
"""Bytes of each pinned copy of :class:`PinnedCopyLoad` (both ways at once)."""

PROBE_HYPER = AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.01, True)
PROBE_CLIP_SCALE = 0.5
"""The clipping scale the probe hands the kernel when the run clips: any value but 1 takes
the scaling path (the run's scale changes every step; the kernel's speed does not)."""


def _cache_size_bytes(text: str) -> int:
    """sysfs' cache size (``"32768K"``, ``"16M"``) in bytes."""
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def last_level_cache_bytes() -> int:
    """The host's last-level cache, summed over its instances (one per socket or die):
    what the kernel reports in sysfs, else ``sysconf``, else 64 MiB (0 never: the probe
    must stay past the caches on hosts that hide them)."""
    instances: dict[tuple[int, str], int] = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            size = _cache_size_bytes((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        instances[(level, shared)] = size
    if instances:
        top = max(level for level, _ in instances)
        return sum(size for (level, _), size in instances.items() if level == top)
    names = ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE")
    sizes = [os.sysconf(name) for name in names if name in os.sysconf_names]
    return max([size for size in sizes if size > 0], default=64 << 20)


def adam_probe_elements(cache_bytes: int) -> int:
    """Elements the probe steps for a last-level cache of ``cache_bytes`` (16 bytes per
    element of fp32 master, gradient, m and v: the smallest the run's states take)."""
    return max(MIN_PROBE_ELEMENTS, ADAM_PROBE_CACHE_MULTIPLE * cache_bytes // 16)


@dataclass(frozen=True)
class AdamWork:
    """One AdamW pass as the engine runs it on the host ([Note: probing AdamW as the run runs it])."""

    elements: int
    """Elements of each state array the pass steps (past the last-level cache)."""
    call_elements: int
    """Elements per kernel call: one block's state (at most :data:`MAX_CALL_ELEMENTS`)."""
    grad_dtype: torch.dtype
    """The held or consumed gradient's dtype: fp32 when accumulating, else the compute dtype."""
    shadow: bool
    """Whether a bf16 shadow of the fp32 master is written (bf16 compute)."""
    grad_scale: float
    """The clipping scale handed to the kernel (1.0: no clipping)."""

    @property
    def bytes_per_element(self) -> int:
        """Host bytes touched per element, as the planner counts them (``24 + g + s``:
        master, m and v read and written, the gradient read, the shadow written)."""
        return 24 + torch.empty(0, dtype=self.grad_dtype).element_size() + (2 if self.shadow else 0)


def adam_work(settings: RunSettings, state_elements: int, cache_bytes: int | None = None) -> AdamWork:
    """The pass a run of ``settings`` makes, in calls of ``state_elements`` (a block's
    trained parameters), over states past ``cache_bytes`` (default: this host's last level).
    Blocks with nothing trained make no pass: the probe then times whole-array calls (calls
    of one element would take hours over an array past the cache)."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    past_cache = adam_probe_elements(cache)
    call = min(state_elements, MAX_CALL_ELEMENTS) if state_elements > 0 else min(past_cache, MAX_CALL_ELEMENTS)
    elements = max(past_cache, call)
    grad_dtype = torch.float32 if settings.grad_bytes == 4 else torch.bfloat16
    # As the planner counts the pass (step_time.optimizer_seconds): fp32 master, m and v,
    # and a bf16 shadow with bf16 compute (bf16 masters are not timed apart there either).
    shadow = settings.bf16
    return AdamWork(elements, call, grad_dtype, shadow, PROBE_CLIP_SCALE if settings.clipping else 1.0)


def fastest_seconds(work: Callable[[], object], budget: float, min_runs: int = 3) -> float:
    """The fastest of repeated runs of ``work`` (after a warm-up) within about ``budget``
    seconds: other load on the machine only ever slows a run down."""
    work()
    best, started, runs = float("inf"), time.perf_counter(), 0
    while runs < min_runs or time.perf_counter() - started < budget:
        begin = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - begin)
        runs += 1
    return best


def _on_fresh_thread(measure: Callable[[], float]) -> float:
    """``measure()`` run on a thread started for it: a thread OpenMP did not start, as the
    engine's finish and gradient workers are (their team size is the process default)."""
    result: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(measure())
        except BaseException as error:  # re-raised on the caller's thread below
            errors.append(error)

    thread = threading.Thread(target=run, name="megatrain adam probe")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def adam_bytes_per_s(work: AdamWork, seconds: float, beside: PinnedCopyLoad | None = None) -> float:
    """Host bytes per second (:attr:`AdamWork.bytes_per_element`) of the engine's CPU AdamW
    kernel making ``work``'s pass on a fresh thread, the fastest of passes within about
    ``seconds``; with ``beside``, while that load keeps the link's copies running."""
    from megatrain_ds.optimizer.cpu_adam import make_cpu_kernel

    kernel = make_cpu_kernel("auto")
    n, call = work.elements, work.call_elements
    # Filled, not random: the values do not change the kernel's speed, and filling is fast.
    p, g, m, v = (torch.full((n,), value) for value in (1.0, 1e-3, 0.0, 1e-6))
    grad = g.to(work.grad_dtype)
    del g
    shadow = torch.empty(n, dtype=torch.bfloat16) if work.shadow else None

    def one_pass() -> None:
        for start in range(0, n, call):
            end = min(start + call, n)
            kernel.step_(
                p[start:end],
                grad[start:end],
                m[start:end],
                v[start:end],
                None if shadow is None else shadow[start:end],
                step=10,
                hyper=PROBE_HYPER,
                grad_scale=work.grad_scale,
            )

    def measure() -> float:
        if beside is None:
            return fastest_seconds(one_pass, seconds)
        with beside:
            return fastest_seconds(one_pass, seconds)

    return work.bytes_per_element * n / _on_fresh_thread(measure)


class PinnedCopyLoad:
    """A thread that keeps pinned copies running both ways on the runtime's host-to-device
    and device-to-host streams while it is entered: the link's traffic beside which the
    AdamW pass runs behind backward. Counts the bytes moved each way. (With the CPU's
    runtime both copies are host copies, twice the host traffic of the link's per byte
    each way: :func:`probe_adam` loads only a CUDA runtime; the tests use the CPU's.)"""

    def __init__(self, runtime: DeviceRuntime, nbytes: int = COPY_LOAD_BYTES) -> None:
        self.runtime = runtime
        self.host = [runtime.pinned_empty((nbytes,), torch.uint8) for _ in range(2)]
        self.device = [runtime.device_empty(nbytes, torch.uint8) for _ in range(2)]
        self.moved = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def _run(self) -> None:
        try:
            self._copy_until_stopped()
        except BaseException as failure:  # raised on the entering thread by __exit__
            self._failure = failure

    def _copy_until_stopped(self) -> None:
        runtime = self.runtime
        while not self._stop.is_set():
            with runtime.on(runtime.h2d_stream):
                self.device[0].copy_(self.host[0], non_blocking=True)
            with runtime.on(runtime.d2h_stream):
                self.host[1].copy_(self.device[1], non_blocking=True)
            # Both copies done before the next pair: the load never queues more than one
            # pair, so it stops within a copy of being asked to, and counts what moved.
            runtime.h2d_stream.synchronize()
            runtime.d2h_stream.synchronize()
            self.moved += self.host[0].numel()

    def __enter__(self) -> PinnedCopyLoad:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="megatrain copy load", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        assert self._thread is not None  # entered before
        self._thread.join()
        # A load that died (a CUDA error, out of pinned memory) would have let the pass run
        # alone, and its rate be taken for the one beside copies: the probe fails instead.
        if self._failure is not None:
            raise RuntimeError("the probe's copy load failed: no rate beside copies") from self._failure


@dataclass(frozen=True)
class AdamRates:
    """The host AdamW rates the planner takes (``Hardware``'s fields of the same names)."""

    adam_bytes_per_s: float
    adam_beside_copies_bytes_per_s: float
    """0.0: not probed (no CUDA device here): the rate alone stands in."""


def probe_adam(work: AdamWork, seconds: float, runtime: DeviceRuntime | None = None) -> AdamRates:
    """``work``'s rate alone and, with a CUDA ``runtime``, beside pinned copies both ways."""
    alone = adam_bytes_per_s(work, seconds)
    if runtime is None or not runtime.is_cuda:
        return AdamRates(alone, 0.0)
    return AdamRates(alone, adam_bytes_per_s(work, seconds, beside=PinnedCopyLoad(runtime)))
