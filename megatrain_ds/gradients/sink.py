"""Device-to-host gradient transport: a dedicated stream, pinned staging, a host worker.

``push`` is called from backward (the autograd thread) with a block's flat gradient on
the device. It copies the gradient into a pinned staging buffer on the d2h stream and
queues it; a worker thread waits for that copy and hands the host chunk to ``consume``
(accumulate, or run the optimizer on it). Backward goes on with the next block meanwhile.
On the CPU the gradient already is in host memory: the worker consumes it in place, and
the same pool bounds the chunks in flight (no staging buffers, no copy).

[Note: gradient ordering]
- The d2h stream waits on an event recorded on the compute stream after the gradient
  was produced, so the copy reads finished values.
- The worker blocks on the copy's ``done`` event (a host wait, but off the main thread)
  before touching the staging buffer, and returns the buffer to the pool afterwards.
- The device gradient is marked used on the d2h stream (``runtime.used_on``:
  ``record_stream``), so when backward drops it the caching allocator does not hand its
  memory to another kernel before the copy has read it.
- When the pool is empty ``push`` waits for the worker: back-pressure bounds pinned
  memory to ``num_staging`` buffers.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event

ConsumeFn = Callable[[int, int, torch.Tensor, bool], None]
"""``consume(state_index, offset, host_chunk, final)``; ``final`` marks the last micro-batch."""


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


class GradientSink:
    """Moves device gradients to the host behind backward and feeds them to ``consume``.

    Args:
        runtime: streams, events and pinned allocation.
        staging_numel: elements per staging buffer; larger gradients go in chunks.
        dtype: staging dtype (the compute dtype: gradients cross PCIe at that width).
        num_staging: staging buffers in the pool.
        consume: called on the worker thread for every chunk, in push order.
    """

    def __init__(
        self, runtime: DeviceRuntime, staging_numel: int, dtype: torch.dtype, num_staging: int, consume: ConsumeFn
    ) -> None:
        self._runtime = runtime
        self._staging_numel = staging_numel
        self._consume = consume
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
            staging = self._pool.get()  # back-pressure: waits while the worker is behind
            done = self._runtime.event()
            with self._runtime.on(self._runtime.d2h_stream):
                self._runtime.d2h_stream.wait_event(produced)
                with self._runtime.tracer.device_span(
                    f"grads {state_index}",
                    "d2h",
                    self._runtime.d2h_stream,
                    state=state_index,
                    offset=offset + start,
                    numel=piece.numel(),
                ):
                    if staging is None:  # the device computes on host memory: nothing to copy
                        host = piece
                    else:
                        staging[: piece.numel()].copy_(piece, non_blocking=True)
                        host = staging[: piece.numel()]
                done.record(self._runtime.d2h_stream)
            if staging is not None:
                self._runtime.used_on(piece, self._runtime.d2h_stream)  # backward may drop it first
            self._work.put(_Chunk(state_index, offset + start, host, staging, final, done))

    def push_block(self, state_index: int, pieces: Sequence[tuple[int, torch.Tensor]], final: bool) -> None:
        """Queue a block's gradients: ``(state offset, flat device gradient)`` per parameter
        (the same interface as ``GradientReducer.push_block``)."""
        for offset, grad in pieces:
            self.push(state_index, offset, grad, final)

    def drain(self) -> None:
        """Wait until every pushed chunk has been consumed; re-raise a worker failure."""
        self._work.join()
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
                chunk.done.synchronize()  # the staging buffer is valid only after the copy
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
                        self._consume(chunk.state_index, chunk.offset, chunk.host, chunk.final)
            except BaseException as error:  # surfaced on the main thread by drain()/push()
                self._error = error
            finally:
                chunk.host = None  # without staging: the gradient itself, freed here
                self._pool.put(chunk.staging)
                self._work.task_done()
