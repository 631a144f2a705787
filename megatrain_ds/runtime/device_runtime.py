"""Streams, events, threads and host/device allocations: the one owner of CUDA's streams and memory.

Everything else asks a :class:`DeviceRuntime` for streams, events, buffers, host threads
and the queues between them, and this module's functions for the questions that involve
no stream or buffer: whether there is a device and which is current (:func:`default_device`),
the device a rank takes (:func:`take_local_device`), its name and free memory
(:attr:`DeviceRuntime.device_name`, :func:`free_device_bytes`), and the RNG states
(:meth:`DeviceRuntime.rng_state`, :func:`device_rng_states`). No other module of the
package calls ``torch.cuda`` (``tests/test_layering.py`` checks it). On a machine
without CUDA the runtime hands out no-op streams and events and unpinned host memory, so
the CPU runs exactly the scheduling code the GPU runs (see ``[Note: one code path]`` below).

[Note: one code path]
The engine never branches on "is this a GPU". It records events, makes streams wait
on them and issues ``copy_(..., non_blocking=True)`` everywhere. On the CPU those calls
are no-ops or synchronous copies, which is still correct because CPU work is issued in
program order. That the *ordering* is right -- which event guards which buffer, which
stream a freed tensor was used on -- is proved on the CPU by the race checker
(``stream_check.py``): with ``MEGATRAIN_STREAM_CHECK=1`` the runtime hands out virtual
streams and events, keeps "device" buffers apart from host buffers as a GPU would
(``shares_host_memory`` is then false), and raises ``StreamRaceError`` on the first
access that no declared synchronisation orders.
"""

from __future__ import annotations

import bisect
import contextlib
import platform
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from megatrain_ds.runtime import stream_check
from megatrain_ds.runtime.host_heap import (
    keep_large_transients_mapped,
    release_large_transients_mapping,
    return_free_memory,
)
from megatrain_ds.runtime.host_ledger import HostLedger
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.runtime.stream_check import CheckedStream, StreamChecker
from megatrain_ds.runtime.trace import NULL_TRACER, NullTracer, Tracer

PAGE_BYTES = 4096

POOL_SLACK = 1.25
"""A :class:`PinnedPool` request may take a free buffer up to this factor larger."""


class Event(Protocol):
    """What the engine needs of an event (``torch.cuda.Event``, the race checker's
    ``CheckedEvent`` or :class:`NullEvent`). ``stream`` is a :class:`Stream` of the same
    runtime: each kind records only on its own kind of stream, hence ``Any``."""

    def record(self, stream: Any = None, /) -> None: ...

    def synchronize(self) -> None: ...


class Stream(Protocol):
    """What the engine needs of a stream (``torch.cuda.Stream``, the race checker's
    ``CheckedStream`` or :class:`NullStream`). A runtime hands out one kind of streams and
    events, and each kind takes only its own kind as arguments, hence ``Any``."""

    def wait_event(self, event: Any, /) -> None: ...

    def wait_stream(self, stream: Any, /) -> None: ...

    def synchronize(self) -> None: ...


class NullEvent:
    """Event of the CPU path: work is complete the moment it has been issued."""

    def record(self, stream: object = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass


class NullStream:
    """Stream of the CPU path: work runs in program order, so waiting is a no-op."""

    def wait_event(self, event: Event) -> None:
        del event

    def wait_stream(self, stream: object) -> None:
        del stream

    def synchronize(self) -> None:
        pass


class HostClockEvent:
    """Timing event of the CPU path: work is done when issued, so the host clock read at
    ``record`` is when it happened (``runtime/trace.py``: [Note: trace clocks])."""

    def __init__(self) -> None:
        self.ns = 0

    def record(self, stream: object = None) -> None:
        del stream
        self.ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        pass

    def host_ns(self, anchor: ClockAnchor) -> int:
        del anchor
        return self.ns


class CudaClockEvent:
    """A timing CUDA event, read as the host-clock time at which the device reached it."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self, stream: object = None) -> None:
        self.event.record(cast("torch.cuda.Stream | None", stream))  # a CUDA runtime's stream

    def synchronize(self) -> None:
        self.event.synchronize()

    def host_ns(self, anchor: ClockAnchor) -> int:
        """Needs both events complete; ``elapsed_time`` is in milliseconds (~0.5 us resolution)."""
        start = anchor.event
        assert isinstance(start, CudaClockEvent)  # the anchor comes from the same (CUDA) runtime
        return anchor.host_ns + round(start.event.elapsed_time(self.event) * 1e6)


@dataclass(frozen=True)
class ClockAnchor:
    """A timing event whose host-clock time is known: device times are read relative to it."""

    event: HostClockEvent | CudaClockEvent
    host_ns: int


def canonical_device(device: torch.device) -> torch.device:
    """``device`` as the tensors on it name theirs. Plain ``cuda`` becomes ``cuda:<current>``:
    ``tensor.cuda()`` is on ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``,
    so the engine's checks would refuse a batch on the very device it computes on."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cuda_available() -> bool:
    """Whether this process can compute on a CUDA device."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """Where the engine computes unless told: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def take_local_device(local_rank: int) -> None:
    """Make ``cuda:<local_rank>`` this process's current device: each data-parallel rank of
    a node computes on its own GPU, and NCCL's groups bind to the current device."""
    torch.cuda.set_device(local_rank)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` now, as CUDA reports it; ``None`` for the CPU (host memory
    is the planner's other question)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def device_rng_states() -> list[torch.Tensor] | None:
    """The RNG state of every CUDA device this process sees, ``None`` without CUDA."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def restore_device_rng_states(states: list[torch.Tensor]) -> int | None:
    """Restore the first devices' RNG states from ``states`` (as many as both sides have);
    returns how many devices this process sees (``None`` without CUDA, nothing restored)."""
    if not torch.cuda.is_available():
        return None
    devices = torch.cuda.device_count()
    for index, state in enumerate(states[:devices]):
        torch.cuda.set_rng_state(state, index)
    return devices


@dataclass
class DeviceRuntime:
    """The compute device, the engine's side streams, and how host memory is allocated.

    Attributes:
        device: where blocks compute (``cuda:N`` or ``cpu``).
        h2d_stream: host-to-device weight copies; overlaps the compute of the previous block.
        d2h_stream: device-to-host gradient copies; overlaps the backward of the next block.
        optimizer_stream: host-to-device copies of optimizer state and the device AdamW
            kernel (``optimizer/device_adamw.py``); overlaps backward, apart from the weight prefetch
            so that a block's weights never queue behind a chunk of optimizer state.
        comm_stream: the data-parallel gradient reduction (``distributed/gradient_reducer.py``);
            overlaps the backward of the blocks before the one being reduced.
        pin_memory: whether host buffers are page-locked (needed for asynchronous copies).
        tracer: where spans of copies, compute and the optimizer go (``runtime/trace.py``); the
            no-op :data:`~megatrain_ds.runtime.trace.NULL_TRACER` unless a traced step is running.
    """

    device: torch.device
    h2d_stream: Stream
    d2h_stream: Stream
    pin_memory: bool
    optimizer_stream: Stream = field(default_factory=NullStream)
    comm_stream: Stream = field(default_factory=NullStream)
    tracer: NullTracer | Tracer = field(default=NULL_TRACER, repr=False)
    checker: StreamChecker | None = field(default=None, repr=False)
    _registered: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Host tensors pinned with cudaHostRegister; held so none is freed while registered."""
    holds_mmap_threshold: bool = field(default=False, repr=False)
    """This runtime fixed the process's mmap threshold (``runtime/host_heap.py``) and has not
    handed it back yet (:meth:`release_host_memory`)."""

    @classmethod
    def create(cls, device: torch.device, pin_memory: bool = True) -> DeviceRuntime:
        """Streams for ``device``; pinned host memory only where CUDA can use it."""
        device = canonical_device(device)
        if device.type == "cuda":
            # Created once here; every other module refers to these two by purpose.
            return cls(
                device=device,
                h2d_stream=torch.cuda.Stream(device),
                d2h_stream=torch.cuda.Stream(device),
                optimizer_stream=torch.cuda.Stream(device),
                comm_stream=torch.cuda.Stream(device),
                pin_memory=pin_memory,
            )
        if stream_check.requested():
            checker = StreamChecker()
            return cls(
                device=device,
                h2d_stream=checker.stream("h2d"),
                d2h_stream=checker.stream("d2h"),
                optimizer_stream=checker.stream("optimizer"),
                comm_stream=checker.stream("comm"),
                pin_memory=False,
                checker=checker,
            )
        # The step's transients will be host memory: keep the large ones out of glibc's heap.
        held = keep_large_transients_mapped()
        return cls(
            device=device, h2d_stream=NullStream(), d2h_stream=NullStream(), pin_memory=False, holds_mmap_threshold=held
        )

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def shares_host_memory(self) -> bool:
        """The device computes on host memory (the CPU): a host buffer needs no device copy
        to be computed on, and a "device" buffer costs host memory. Not under the race
        checker, which keeps the two apart to judge the copies a GPU would make."""
        return self.device.type == "cpu" and self.checker is None

    @property
    def host_ledger(self) -> HostLedger | None:
        """The host traffic counted per step (``runtime/host_ledger.py``): kept by the race
        checker, which sees every access; ``None`` unless it is on."""
        return self.checker.ledger if self.checker is not None else None

    def compute_stream(self) -> Stream:
        """The stream the caller computes on (the current stream, as PyTorch sets it)."""
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return self.checker.current_stream() if self.checker is not None else NullStream()

    def event(self) -> Event:
        if self.is_cuda:
            return torch.cuda.Event()
        return self.checker.event() if self.checker is not None else NullEvent()

    def clock_event(self) -> HostClockEvent | CudaClockEvent:
        """An event that also tells when the device reached it (for traces only: timing
        events cost more than the engine's synchronisation events)."""
        return CudaClockEvent() if self.is_cuda else HostClockEvent()

    def clock_anchor(self) -> ClockAnchor:
        """Relates the device's clock to the host's (once per trace; synchronizes)."""
        event = self.clock_event()
        self.synchronize()  # the device is idle: the event completes as soon as it is issued
        before = time.perf_counter_ns()
        event.record(self.compute_stream())
        event.synchronize()
        after = time.perf_counter_ns()
        # The device reached the event between the two host readings: the midpoint is off
        # by at most half the round trip of one event (microseconds on CUDA).
        return ClockAnchor(event, (before + after) // 2)

    @property
    def device_name(self) -> str:
        """The device as a person names it (for traces and warnings)."""
        if self.is_cuda:
            return torch.cuda.get_device_name(self.device)
        return _cpu_name()

    def rng_state(self) -> torch.Tensor | None:
        """The compute device's RNG state (``None`` on the CPU, whose state is torch's global one)."""
        return torch.cuda.get_rng_state(self.device) if self.is_cuda else None

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore the compute device's RNG state from :meth:`rng_state`'s value."""
        torch.cuda.set_rng_state(state, self.device)

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        """Issue the enclosed work on ``stream``."""
        if self.is_cuda:
            with torch.cuda.stream(cast(torch.cuda.Stream, stream)):  # a CUDA runtime's stream
                yield
        elif self.checker is not None:
            with self.checker.use_stream(cast(CheckedStream, stream)):  # one the checker handed out
                yield
        else:
            yield

    # -- host threads and what they share (the race checker sees these handoffs) -----------

    def observe(self) -> AbstractContextManager[None]:
        """Run the enclosed engine call with its tensor accesses checked (a no-op unless
        the race checker is on; re-entrant)."""
        return self.checker.observe() if self.checker is not None else contextlib.nullcontext()

    def host_work(self) -> AbstractContextManager[None]:
        """The enclosed ops are host code on host buffers, run by the calling thread (the
        optimizer's end of step): for the race checker, not work queued on a stream."""
        return self.checker.host_work() if self.checker is not None else contextlib.nullcontext()

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a daemon host thread running ``target`` (observed by the race checker)."""
        if self.checker is not None:
            return self.checker.start_thread(target, name)
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def host_queue(self) -> queue.Queue:
        """A queue between host threads; under the race checker it carries their ordering
        (``put`` before ``get``, every ``task_done`` before ``join``)."""
        return self.checker.queue() if self.checker is not None else queue.Queue()

    def host_empty(self, numel: int, dtype: torch.dtype, shared: NodeSharedMemory | None = None) -> torch.Tensor:
        """A flat host tensor starting on a page boundary, pinned when CUDA is used.

        Page alignment lets the copy engine and SIMD code take whole pages; the
        over-allocation costs at most one page per buffer. Pinning registers the pages in
        place (``cudaHostRegister``) rather than taking them from PyTorch's pinned caching
        allocator, which rounds every request up to a power of two -- up to 2x the host
        memory for a store that is most of the machine's RAM.

        With ``shared`` the tensor is mapped by every rank of the node (a collective call,
        see ``runtime/node_shared_memory.py``); each rank pins its own mapping.
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if shared is not None:
            tensor = shared.empty(numel, dtype)
        else:
            raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
            start = (-raw.data_ptr()) % PAGE_BYTES
            tensor = raw[start : start + nbytes].view(dtype)
        if self.pin_memory and nbytes > 0:
            error = _cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(
                    f"could not pin {nbytes} bytes of host memory (cudaHostRegister error "
                    f"{int(error)}); raise the locked-memory limit (ulimit -l) or set "
                    '"megatrain": {"pin_memory": false}'
                )
            self._registered.append(tensor)
        if self.checker is not None:
            self.checker.tag_host(tensor)
        return tensor

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A short-lived host tensor for asynchronous copies, from PyTorch's pinned caching
        allocator (which keeps a freed block until the copies that used it are done)."""
        tensor = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory and self.is_cuda)
        if self.checker is not None:
            self.checker.tag_host(tensor)
        return tensor

    def free_host(self, tensor: torch.Tensor) -> None:
        """Let a :meth:`host_empty` tensor go: unpinned now (when pinned), freed with its last
        reference. The caller must hold no pending copy from or into it (the NVMe tier
        frees a block's master once it is on disk, before any stream has used it)."""
        for index, registered in enumerate(self._registered):
            if registered.data_ptr() == tensor.data_ptr():
                _cudart().cudaHostUnregister(registered.data_ptr())
                del self._registered[index]
                return

    def release_host_memory(self) -> None:
        """Unpin every registered host tensor (they stay valid as ordinary memory) and hand back
        this runtime's hold of the process's mmap threshold (the last holder restores the
        setting from before). Idempotent: a second call finds nothing left to release."""
        for tensor in self._registered:
            _cudart().cudaHostUnregister(tensor.data_ptr())
        self._registered.clear()
        if self.holds_mmap_threshold:
            self.holds_mmap_threshold = False
            release_large_transients_mapping()

    def return_transient_memory(self) -> None:
        """Called between the step's phases (``streaming/streamed_blocks.py``). When the device is the
        host, give the system back what the last phase's transients left cached in glibc's
        heap and MKL (``runtime/host_heap.py``). On a GPU nothing: the caching allocator keeps its
        blocks for the next phase, as it should."""
        if self.shares_host_memory:
            return_free_memory()

    def host_zeros(self, numel: int, dtype: torch.dtype, shared: NodeSharedMemory | None = None) -> torch.Tensor:
        if shared is not None:
            return self.host_empty(numel, dtype, shared)  # born zero, and untouched stays unpaid
        return self.host_empty(numel, dtype).zero_()

    def used_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` (allocated on another stream) is also used on ``stream``: the caching
        allocator must not reuse its memory before that work is done (``record_stream``)."""
        if self.is_cuda:
            tensor.record_stream(cast(torch.cuda.Stream, stream))  # a CUDA runtime's stream
        elif self.checker is not None:
            self.checker.used_on(tensor, cast(CheckedStream, stream))  # one the checker handed out

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def measure_copy_rates(self, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float] | None:
        """Host-to-device and device-to-host bytes per second of a pinned copy (best of
        ``repeats``, timed by the device); ``None`` where the device is the host (nothing
        is copied there). Synchronizes: call it once, outside the hot path."""
        if not self.is_cuda:
            return None
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rates = []
        for target, source in ((device, host), (host, device)):
            best = float("inf")
            for _ in range(repeats + 1):  # the first copy warms up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                target.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            rates.append(nbytes / best)
        return rates[0], rates[1]

    def synchronize(self) -> None:
        """Wait for all queued device work (used only outside the hot path)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        elif self.checker is not None:
            self.checker.synchronize()


class PinnedPool:
    """Reusable page-locked host buffers, served best-fit by byte size.

    Activations stashed between forward and backward (``streaming/activation_stash.py``)
    have the same sizes every step, so after the first step every request is served from
    a free list and no buffer is pinned again. Buffers come from
    :meth:`DeviceRuntime.host_empty` (page-aligned, ``cudaHostRegister``): exact sizes, not
    the power-of-two rounding of PyTorch's caching host allocator, which could double
    the host memory of a stash that may be most of the machine's RAM. A request may take a
    free buffer up to :data:`POOL_SLACK` larger, so sizes that vary a little from step to
    step (tokens routed to an expert) reuse buffers instead of pinning new ones.
    """

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self._free: dict[int, list[torch.Tensor]] = {}
        self._sizes: list[int] = []
        """Sizes with free buffers, ascending."""
        self.nbytes = 0
        """Host bytes the pool has allocated (in use or free)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` buffer of at least ``nbytes`` (use its first ``nbytes``)."""
        at = bisect.bisect_left(self._sizes, nbytes)
        if at < len(self._sizes) and self._sizes[at] <= nbytes * POOL_SLACK:
            size = self._sizes[at]
            free = self._free[size]
            buffer = free.pop()
            if not free:
                del self._free[size]
                self._sizes.pop(at)
            return buffer
        self.nbytes += nbytes
        return self.runtime.host_empty(nbytes, torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        """Return ``buffer`` (taken from this pool) for reuse."""
        size = buffer.numel()
        if size not in self._free:
            bisect.insort(self._sizes, size)
        self._free.setdefault(size, []).append(buffer)


def _cudart() -> Any:
    """CUDA's runtime API (``cudaHostRegister``...). ``torch.cuda.cudart()`` is typed optional
    because its import fails on CPU builds, but there it raises rather than return ``None``."""
    cudart = torch.cuda.cudart()
    assert cudart is not None  # torch.cuda's initialisation raised otherwise
    return cudart


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
