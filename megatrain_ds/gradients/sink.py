"""Device-to-host gradient transport: a dedicated stream, pinned staging, a host worker.

``push`` is called from backward (the autograd thread) with a block's flat gradient on
the device. Each chunk of it lands one of two ways, as ``land`` (the engine) says:

- **held, direct**: copied on the d2h stream straight into the held gradient buffer (the
  first write of those elements this step, in the held dtype: no accumulation, no fp16
  unscaling), and on the final micro-batch its squared norm added on the device
  (``squared_norm.py``). No staging buffer, no host pass, no worker hop -- unless the
  optimizer steps the chunk speculatively (``optimizer/speculative_step.py``), when the
  worker gets the held view to update from.
- **on the device**: a device state's (``state/placement.py``: [Note: the GPU tier]) is
  copied or added on the d2h stream into its held gradient, which is on the device too,
  its squared norm summed there on the final micro-batch: it never leaves the device.
- **staged**: copied into a pinned staging buffer and queued; the worker thread waits for
  the copy and hands the host chunk to ``consume`` (add into the held gradients, unscale,
  or without held gradients run the optimizer on it).

Backward goes on with the next block meanwhile. On the CPU the gradient already is in
host memory: a staged chunk is consumed in place, and the same pool bounds the chunks in
flight (no staging buffers, no copy); a direct chunk is copied on the calling thread.

[Note: gradient ordering]
- The d2h stream waits on an event recorded on the compute stream after the gradient
  was produced, so the copy (and a direct chunk's norm) reads finished values.
- The worker blocks on the copy's ``done`` event (a host wait, but off the main thread)
  before touching the staging buffer or the held view, and returns a staging buffer to
  the pool afterwards.
- The device gradient is marked used on the d2h stream (``runtime.used_on``:
  ``record_stream``), so when backward drops it the caching allocator does not hand its
  memory to another kernel before the copy (and the norm) have read it.
- When the pool is empty ``push`` waits for the worker: back-pressure bounds pinned
  memory to ``num_staging`` buffers. Direct chunks take no buffer; ``push`` waits instead
  for the copy ``num_staging`` direct chunks back, which bounds the device memory held by
  gradients waiting for the link (back-pressure only: nothing reads what it orders).
- ``drain`` waits for the worker's queue and then, on the host, for the last direct
  chunk's ``done`` event: every direct copy and device norm addition issued before it on
  the d2h stream is complete, so the main thread may read the held gradients and the
  device norm (``SquaredNorm.take``) -- the step's one wait for the d2h stream.
- The next step's copies into the held buffers are issued by backward after
  ``engine.step()`` has returned: the host's reads of the step (``OptimizerStepper.finish``,
  with the device optimizer's write-backs flushed) precede them in program order, so a
  held buffer is never overwritten before the step has read it.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from megatrain_ds.gradients.squared_norm import SquaredNorm
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event


@dataclass(frozen=True)
class Landing:
    """Where one chunk of a gradient lands (the engine's ``land`` decides at push time)."""

    held: torch.Tensor | None = None
    """The held gradient's host view to copy the chunk straight into (same dtype, the first
    write of these elements this step); ``None``: staged, for ``consume``."""
    fresh: bool = False
    """The first write of these elements this step: written over, not added to."""
    notify: bool = True
    """Whether ``consume`` sees the chunk (always when staged; a held chunk only when the
    optimizer updates it speculatively)."""
    on_device: bool = False
    """``held`` is a device state's gradient (``state/placement.py``: [Note: the GPU tier]):
    the chunk is copied into it (``fresh``) or added to it on the device, in its dtype, and on
    the final micro-batch the held sum's squared norm is added there; it never leaves."""
    zero: tuple[tuple[int, int], ...] = ()
    """A device landing's ranges of ``held`` (chunk offsets) written by no earlier piece of
    this step: zeroed on the d2h stream before the chunk is added (``gradients/held_writes.py``)."""


STAGED = Landing()
"""The default: staged, consumed on the worker, added to what the held gradients hold."""

ConsumeFn = Callable[[int, int, torch.Tensor, bool, Landing], None]
"""``consume(state_index, offset, host_chunk, final, landing)``; ``final`` marks the last
micro-batch; with ``landing.held`` the chunk is already in place (``host_chunk`` is it)."""

LandFn = Callable[[int, int, int, bool], Landing]
"""``land(state_index, offset, numel, final)``, on the pushing thread, once per chunk."""


class GradientPort(Protocol):
    """Where backward hands gradients: the :class:`GradientSink`, or with data parallel the
    ``GradientReducer`` in front of it."""

    def push(self, state_index: int, offset: int, grad: torch.Tensor, final: bool) -> None: ...

    def push_block(self, state_index: int, pieces: Sequence[tuple[int, torch.Tensor]], final: bool) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Chunk:
    state_index: int
    offset: int
    host: torch.Tensor | None
    """The chunk's values on the host, valid once ``done`` has completed."""
    staging: torch.Tensor | None
    """Where ``host`` lies, returned to the pool after the consume; ``None`` without staging."""
    final: bool
    done: Event
    landing: Landing


class GradientSink:
    """Moves device gradients to the host behind backward and feeds them to ``consume``.

    Args:
        runtime: streams, events and pinned allocation.
        staging_numel: elements per staging buffer; larger gradients go in chunks.
        dtype: staging dtype (the compute dtype: gradients cross PCIe at that width).
        num_staging: staging buffers in the pool.
        consume: called on the worker thread for every chunk it sees, in push order.
        land: where each chunk lands; none: every chunk staged.
        norm: where a direct chunk of the final micro-batch adds its squared norm.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        staging_numel: int,
        dtype: torch.dtype,
        num_staging: int,
        consume: ConsumeFn,
        land: LandFn | None = None,
        norm: SquaredNorm | None = None,
    ) -> None:
        self._runtime = runtime
        self._staging_numel = staging_numel
        self._consume = consume
        self._land = land
        self._norm = norm
        self._num_staging = num_staging
        self._direct_in_flight: collections.deque[Event] = collections.deque()
        """``done`` events of the latest direct chunks, oldest first (at most ``num_staging``)."""
        # Where the device computes on host memory (the CPU) a gradient is consumed where
        # autograd put it: the pool holds tokens instead of buffers, and bounds the same
        # number of chunks in flight.
        # Both queues order the threads that share the chunks (the race checker sees them):
        # the worker reads a chunk after its push, a staging buffer is refilled after the
        # worker has returned it, and drain() returns after every consume.
        self._pool: queue.Queue[torch.Tensor | None] = runtime.host_queue()
        for _ in range(num_staging):
            self._pool.put(None if runtime.shares_host_memory else runtime.host_empty(staging_numel, dtype))
        self._work: queue.Queue[_Chunk | None] = runtime.host_queue()
        self._error: BaseException | None = None
        self._worker = runtime.start_thread(self._run, name="megatrain-grad-worker")

    def push(self, state_index: int, offset: int, grad: torch.Tensor, final: bool) -> None:
        """Queue the flat device gradient ``grad`` of elements ``[offset, offset+numel)``."""
        self._raise_worker_error()
        produced = self._runtime.event()
        produced.record(self._runtime.compute_stream())
        for start in range(0, grad.numel(), self._staging_numel):
            piece = grad[start : start + self._staging_numel]
            landing = self._land(state_index, offset + start, piece.numel(), final) if self._land else STAGED
            converts = landing.held is not None and landing.held.dtype != piece.dtype and not landing.on_device
            if converts:  # needs the worker's conversion (a device landing converts on the device)
                landing = dataclasses.replace(landing, held=None, notify=True)
            if landing.held is not None:
                self._push_direct(state_index, offset + start, piece, final, landing, produced)
            else:
                self._push_staged(state_index, offset + start, piece, final, landing, produced)

    def _push_staged(
        self, state_index: int, offset: int, piece: torch.Tensor, final: bool, landing: Landing, produced: Event
    ) -> None:
        staging = self._pool.get()  # back-pressure: waits while the worker is behind
        done = self._runtime.event()
        with self._runtime.on(self._runtime.d2h_stream):
            self._runtime.d2h_stream.wait_event(produced)
            with self._copy_span(state_index, offset, piece):
                if staging is None:  # the device computes on host memory: nothing to copy
                    host = piece
                else:
                    staging[: piece.numel()].copy_(piece, non_blocking=True)
                    host = staging[: piece.numel()]
            done.record(self._runtime.d2h_stream)
        if staging is not None:
            self._runtime.used_on(piece, self._runtime.d2h_stream)  # backward may drop it first
        self._work.put(_Chunk(state_index, offset, host, staging, final, done, landing))

    def _push_direct(
        self, state_index: int, offset: int, piece: torch.Tensor, final: bool, landing: Landing, produced: Event
    ) -> None:
        """Copy ``piece`` straight into ``landing.held`` (and add its squared norm on the
        device on the final micro-batch); the worker sees it only if ``landing.notify``."""
        held = landing.held
        assert held is not None and (landing.on_device or (held.dtype == piece.dtype and landing.fresh))
        if len(self._direct_in_flight) >= self._num_staging:
            oldest = self._direct_in_flight.popleft()
            oldest.synchronize()  # back-pressure: device memory waiting for the link stays bounded
        done = self._runtime.event()
        with self._runtime.on(self._runtime.d2h_stream):
            self._runtime.d2h_stream.wait_event(produced)
            with self._copy_span(state_index, offset, piece):
                if landing.fresh:
                    held.copy_(piece, non_blocking=True)
                else:  # a device state's later micro-batch: added where it is held
                    for lo, hi in landing.zero:
                        held[lo:hi].zero_()
                    held.add_(piece)
                if final:
                    assert self._norm is not None, "a direct final chunk needs the step's SquaredNorm"
                    # The held sum's: a device state's accumulated gradient (else the piece itself).
                    self._norm.add_on_device(held if landing.on_device else piece)
            done.record(self._runtime.d2h_stream)
        self._runtime.used_on(piece, self._runtime.d2h_stream)  # backward may drop it first
        self._direct_in_flight.append(done)
        if landing.notify:
            self._work.put(_Chunk(state_index, offset, held, None, final, done, landing))

    def _copy_span(self, state_index: int, offset: int, piece: torch.Tensor) -> AbstractContextManager[None]:
        return self._runtime.tracer.device_span(
            f"grads {state_index}",
            "d2h",
            self._runtime.d2h_stream,
            state=state_index,
            offset=offset,
            numel=piece.numel(),
        )

    def push_block(self, state_index: int, pieces: Sequence[tuple[int, torch.Tensor]], final: bool) -> None:
        """Queue a block's gradients: ``(state offset, flat device gradient)`` per parameter
        (the same interface as ``GradientReducer.push_block``)."""
        for offset, grad in pieces:
            self.push(state_index, offset, grad, final)

    def drain(self) -> None:
        """Wait until every pushed chunk has been consumed and every direct copy has landed;
        re-raise a worker failure."""
        self._work.join()
        if self._direct_in_flight:
            last = self._direct_in_flight[-1]
            self._direct_in_flight.clear()
            last.synchronize()  # the d2h stream's work so far: every direct copy and device norm
        self._raise_worker_error()

    def close(self) -> None:
        self._work.put(None)
        self._worker.join()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the gradient worker failed; this step's update is lost") from error

    def _run(self) -> None:
        while True:
            chunk = self._work.get()
            if chunk is None:
                self._work.task_done()
                return
            try:
                chunk.done.synchronize()  # the staging buffer (or held view) is valid only after the copy
                if self._error is None:
                    assert chunk.host is not None
                    with self._runtime.tracer.span(
                        f"consume {chunk.state_index}",
                        "optimizer worker",
                        state=chunk.state_index,
                        offset=chunk.offset,
                        numel=chunk.host.numel(),
                        final=chunk.final,
                    ):
                        self._consume(chunk.state_index, chunk.offset, chunk.host, chunk.final, chunk.landing)
            except BaseException as error:  # surfaced on the main thread by drain()/push()
                self._error = error
            finally:
                chunk.host = None  # without staging: the gradient itself, freed here
                self._pool.put(chunk.staging)
                self._work.task_done()
