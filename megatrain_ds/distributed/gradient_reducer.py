"""Data parallel: each block's gradient reduced to the owners of its windows behind backward.

Stands between backward and the :class:`GradientSink` when there is more than one rank
(``distributed/data_parallel.py``: [Note: data-parallel step]). ``push_block`` (autograd thread)
queues a block's parameter gradients; the reducer's thread gathers each contiguous run
of them into one flat bucket on the comm stream, reduces each owner's window of it to
that owner (one collective per owner and run, however many parameters the run has: the
bytes of a reduce-scatter) and hands this rank's window to the sink. Backward goes on
with the next block meanwhile.

[Note: gradient reduction ordering]
- The comm stream waits on an event recorded on the compute stream after the block's
  backward, so the bucket copies read finished gradients. A synchronous reduce leaves
  the comm stream ordered after it (NCCL makes the current stream wait; gloo returns when
  done), and ``sink.push`` -- called on the reducer's thread with the comm stream current
  -- orders its device-to-host copies after that.
- ``runtime.used_on(grad, comm_stream)`` keeps the caching allocator from reusing a
  gradient's memory before the comm stream has copied it into the bucket. The bucket is
  allocated on the comm stream, so its reuse is ordered there; the sink marks what it
  still copies from it.
- At most ``max_in_flight`` blocks are queued or being reduced: backward waits beyond
  that, which bounds the device memory held by gradients (and buckets) waiting for the
  network.
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
from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS


@dataclass
class _Job:
    index: int
    pieces: list[tuple[int, torch.Tensor]]
    """``(state offset, flat device gradient)`` of each trained parameter, in offset order."""
    final: bool
    produced: Event


class GradientReducer:
    """Reduces gradients per block behind backward, then feeds this rank's window to ``sink``.

    Args:
        runtime: streams and events (``comm_stream`` runs the reduces).
        data_parallel: the ranks, their windows and the reduce.
        sink: device-to-host transport of the reduced window.
        numels: ``numels[i]`` is the size of flat state ``i`` (its windows follow from it).
        max_in_flight: blocks (or resident gradients) queued or being reduced at most. One
            suffices to overlap a block's reduction with the next block's backward (the
            reduce is asynchronous to the host on NCCL; on gloo the reducer thread
            runs it while backward computes); each more costs a block of gradients.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        data_parallel: DataParallel,
        sink: GradientSink,
        numels: Sequence[int],
        max_in_flight: int = 1,
    ) -> None:
        self._runtime = runtime
        self._dp = data_parallel
        self._sink = sink
        self._windows = [data_parallel.ownership.windows(numel) for numel in numels]
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._work: queue.Queue[_Job | None] = runtime.host_queue()  # push -> reduce, reduce -> drain
        self._error: BaseException | None = None
        self.on_reduce: Callable[[int], None] | None = None
        """Called on the reducer's thread as each state's reduction starts (tests, tracing)."""
        self._thread = runtime.start_thread(self._run, name="megatrain-grad-reducer")

    # -- autograd thread ----------------------------------------------------------------

    def push_block(self, state_index: int, pieces: Sequence[tuple[int, torch.Tensor]], final: bool) -> None:
        """Queue a block's gradients: ``(state offset, flat device gradient)`` per parameter."""
        self._raise_error()
        if not pieces:
            return  # a block with every parameter frozen
        self._slots.acquire()  # back-pressure: bounded gradients waiting for the network
        produced = self._runtime.event()
        produced.record(self._runtime.compute_stream())
        for _, grad in pieces:
            self._runtime.used_on(grad, self._runtime.comm_stream)
        self._work.put(_Job(state_index, sorted(pieces, key=lambda piece: piece[0]), final, produced))

    def push(self, state_index: int, offset: int, grad: torch.Tensor, final: bool) -> None:
        """Queue one flat gradient (a resident parameter's, or a chunk of one); averaged in place."""
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
        with runtime.on(runtime.comm_stream):
            runtime.comm_stream.wait_event(job.produced)
            if self.on_reduce is not None:
                self.on_reduce(job.index)
            for run in _contiguous_runs(job.pieces):
                offset, bucket = _bucket(run)
                with runtime.tracer.device_span(
                    f"reduce {job.index}", "comm", stream=runtime.comm_stream, numel=bucket.numel()
                ):
                    mine = self._dp.reduce_mean_to_owners(bucket, offset, self._windows[job.index])
                if mine is not None:
                    self._sink.push(job.index, mine[0], mine[1], job.final)


def _contiguous_runs(pieces: Sequence[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
    """``pieces`` (in offset order) split where a parameter that is not among them lies
    between two of them. A bucket arrives in backward order, which is not the layout's:
    reducing the gap as zeros would hand its owner a second, empty gradient for elements
    whose real one comes in another bucket. Only alignment padding may lie inside a run."""
    runs: list[list[tuple[int, torch.Tensor]]] = []
    end = 0
    for offset, grad in pieces:
        if not runs or offset != -(-end // ALIGN_ELEMENTS) * ALIGN_ELEMENTS:  # not the next aligned slot
            runs.append([])
        runs[-1].append((offset, grad))
        end = offset + grad.numel()
    return runs


def _bucket(run: Sequence[tuple[int, torch.Tensor]]) -> tuple[int, torch.Tensor]:
    """``(state offset, flat tensor)`` holding a contiguous run of pieces: a lone piece as it
    is, several copied into one buffer on the current stream (the gaps between them are
    the layout's alignment padding: zero, as their gradient is)."""
    if len(run) == 1:
        return run[0]
    start = run[0][0]
    end = run[-1][0] + run[-1][1].numel()
    bucket = torch.zeros(end - start, dtype=run[0][1].dtype, device=run[0][1].device)
    for offset, grad in run:
        bucket[offset - start : offset - start + grad.numel()].copy_(grad)
    return start, bucket
