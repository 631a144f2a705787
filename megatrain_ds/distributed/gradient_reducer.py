"""Data parallel: each block's gradient averaged over the ranks behind backward.

Stands between backward and the :class:`GradientSink` when there is more than one rank
(``distributed/data_parallel.py``: [Note: data-parallel step]). ``push_block`` (autograd thread)
queues a block's parameter gradients; the reducer's thread all-reduces them in place on
the comm stream and hands this rank's window of them to the sink. Backward goes on with
the next block meanwhile.

The gradients are reduced where autograd put them, one all-reduce per parameter: no
flat copy of the block (which would cost a block of device memory per buffer and a
device copy per block); a few small collectives per block are cheap against a block's
backward.

[Note: gradient reduction ordering]
- The comm stream waits on an event recorded on the compute stream after the block's
  backward, so the all-reduce reads finished gradients. A synchronous all-reduce leaves
  the comm stream ordered after it (NCCL makes the current stream wait; gloo returns when
  done), and ``sink.push`` -- called on the reducer's thread with the comm stream current
  -- orders its device-to-host copies after that.
- ``runtime.used_on(grad, comm_stream)`` keeps the caching allocator from reusing a
  gradient's memory before the comm stream's work on it is done, even for a gradient no
  part of which is this rank's window (the sink holds the others until their copies end).
- At most ``max_in_flight`` blocks are queued or being reduced: backward waits beyond
  that, which bounds the device memory held by gradients waiting for the network.
- Errors on the reducer's thread are kept and re-raised on the main thread by the next
  ``push``/``drain``; the thread keeps draining its queue, so backward never waits on a
  slot that cannot free.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.gradients.sink import GradientSink
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event


@dataclass
class _Job:
    index: int
    pieces: list[tuple[int, torch.Tensor]]
    """``(state offset, flat device gradient)`` of each trained parameter, reduced in place."""
    final: bool
    produced: Event


class GradientReducer:
    """All-reduces gradients per block behind backward, then feeds this rank's window to ``sink``.

    Args:
        runtime: streams and events (``comm_stream`` runs the all-reduce).
        data_parallel: the ranks and the all-reduce.
        sink: device-to-host transport of the reduced window.
        windows: ``windows[i]`` is ``(start, end)``, the elements of state ``i`` this rank owns.
        max_in_flight: blocks (or resident gradients) queued or being reduced at most. One
            suffices to overlap a block's reduction with the next block's backward (the
            all-reduce is asynchronous to the host on NCCL; on gloo the reducer thread
            runs it while backward computes); each more costs a block of gradients.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        data_parallel: DataParallel,
        sink: GradientSink,
        windows: Sequence[tuple[int, int]],
        max_in_flight: int = 1,
    ) -> None:
        self._runtime = runtime
        self._dp = data_parallel
        self._sink = sink
        self._windows = windows
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._work: queue.Queue[_Job | None] = runtime.host_queue()  # push -> reduce, reduce -> drain
        self._error: BaseException | None = None
        self.on_all_reduce: Callable[[int], None] | None = None
        """Called on the reducer's thread as each state's reduction starts (tests, tracing)."""
        self._thread = runtime.start_thread(self._run, name="megatrain-grad-reducer")

    # -- autograd thread ----------------------------------------------------------------

    def push_block(self, state_index: int, pieces: Sequence[tuple[int, torch.Tensor]], final: bool) -> None:
        """Queue a block's gradients: ``(state offset, flat device gradient)`` per parameter.
        The gradients become the reducer's: they are averaged in place."""
        self._raise_error()
        if not pieces:
            return  # a block with every parameter frozen
        self._slots.acquire()  # back-pressure: bounded gradients waiting for the network
        produced = self._runtime.event()
        produced.record(self._runtime.compute_stream())
        for _, grad in pieces:
            self._runtime.used_on(grad, self._runtime.comm_stream)
        self._work.put(_Job(state_index, list(pieces), final, produced))

    def push(self, state_index: int, offset: int, grad: torch.Tensor, final: bool) -> None:
        """Queue one flat gradient (a resident parameter's); averaged in place."""
        self.push_block(state_index, [(offset, grad)], final)

    def drain(self) -> None:
        """Wait until every queued gradient is reduced and consumed; re-raise failures."""
        self._work.join()
        self._raise_error()
        self._sink.drain()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()
        self._sink.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- reducer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                self._work.task_done()
                return
            try:
                if self._error is None:
                    self._reduce(job)
            except BaseException as error:  # surfaced on the main thread by push()/drain()
                self._error = error
            finally:
                job.pieces.clear()  # drop the gradients before freeing the slot
                self._slots.release()
                self._work.task_done()

    def _reduce(self, job: _Job) -> None:
        runtime = self._runtime
        start, end = self._windows[job.index]
        with runtime.on(runtime.comm_stream):
            runtime.comm_stream.wait_event(job.produced)
            if self.on_all_reduce is not None:
                self.on_all_reduce(job.index)
            for offset, grad in job.pieces:
                with runtime.tracer.device_span(
                    f"all-reduce {job.index}", "comm", stream=runtime.comm_stream, numel=grad.numel()
                ):
                    self._dp.all_reduce_mean_(grad)
                lo, hi = max(offset, start), min(offset + grad.numel(), end)
                if lo < hi:
                    self._sink.push(job.index, lo, grad[lo - offset : hi - offset], job.final)
