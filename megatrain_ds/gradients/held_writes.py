"""Which elements of the held gradients this step has written: the first write copies.

Held gradients (clipping, accumulation, skipping non-finite steps, fp16) used to be zeroed
after every step so that every micro-batch could add into them: a pass over all of them
on the host (34 ms per step for a 940M model on an H200). Instead the first write of an
element in a step *is* its value -- a copy (straight from the device where dtypes allow,
``sink.py``), later micro-batches add -- and this ledger says which write is the first.

Every block range reaches the sink in every micro-batch (an unused parameter sends zeros,
``streaming/streamed_blocks.py``), but a resident parameter that got no gradient sends
nothing: :meth:`HeldWrites.settle` zeroes what was not written before the held values are
read (the step, a checkpoint inside an accumulation window).

A state's chunks normally arrive in the same pieces every micro-batch (a parameter, cut
into the sink's chunks, or the row chunks of ``row_chunked.py``), so a chunk is either
wholly written already or not at all; where pieces differ (data parallel's buckets are
cut where backward's hooks happened to flush), the unwritten part of a chunk is zeroed
before the chunk is added.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from megatrain_ds.gradients.sink import Landing
from megatrain_ds.state.flat_layout import intersect_runs
from megatrain_ds.state.host_store import HostFlatState


class HeldWrites:
    """The ranges of each held gradient written since the last :meth:`clear`.

    Claims come from the one thread that pushes into the sink (autograd's, or the
    data-parallel reducer's), in push order; :meth:`settle` and :meth:`clear` run on the
    main thread once the sink has drained.
    """

    def __init__(self, num_states: int) -> None:
        self._starts: list[list[int]] = [[] for _ in range(num_states)]
        self._ends: list[list[int]] = [[] for _ in range(num_states)]
        self._all_written = False

    def claim(self, index: int, start: int, end: int) -> list[tuple[int, int]]:
        """Note a write of elements ``[start, end)`` of state ``index``; returns the parts
        not written before this step (now counted as written): the whole range for its
        first write (the write copies), none when it holds values (it adds)."""
        if self._all_written:
            return []
        starts, ends = self._starts[index], self._ends[index]
        at = bisect.bisect_right(starts, start)
        if at > 0 and ends[at - 1] > start:
            at -= 1  # begins inside an earlier write
        unwritten, cursor = [], start
        while at < len(starts) and starts[at] < end:
            if starts[at] > cursor:
                unwritten.append((cursor, starts[at]))
            cursor = max(cursor, ends[at])
            at += 1
        if cursor < end:
            unwritten.append((cursor, end))
        for lo, hi in unwritten:
            where = bisect.bisect_right(starts, lo)
            starts.insert(where, lo)
            ends.insert(where, hi)
        return unwritten

    def land(
        self, index: int, grad: torch.Tensor, start: int, numel: int, compute_dtype: torch.dtype, speculative: bool
    ) -> Landing:
        """Where elements ``[start, start+numel)`` of state ``index`` land, whose held
        gradient is ``grad``: straight into it when this is their first write this step and
        needs no conversion (held dtype == compute dtype: no accumulation, no fp16), else
        staged for the worker, which copies (first write) or adds. ``speculative``: the
        worker updates the chunk during backward, so it must see a direct one too."""
        end = start + numel
        unwritten = self.claim(index, start, end)
        fresh = unwritten == [(start, end)]
        if unwritten and not fresh:  # partly written: the rest becomes zeros to add to
            for lo, hi in unwritten:
                grad[lo:hi].zero_()
        if not (fresh and grad.dtype == compute_dtype):
            return Landing(fresh=fresh)
        return Landing(held=grad[start:end], fresh=True, notify=speculative)

    def settle(self, states: Sequence[HostFlatState]) -> None:
        """Zero every trained range of each state's held gradient not written this step, and
        count the whole buffer as written (later writes of the step add). Main thread,
        after the sink drained: no write is in flight."""
        if self._all_written:
            return
        for index, state in enumerate(states):
            if state.grad is not None:
                for start, end in self._gaps(index, state):
                    state.grad[start:end].zero_()
        self.mark_all_written()

    def mark_all_written(self) -> None:
        """Every held value counts (loaded from a checkpoint inside an accumulation window)."""
        self._all_written = True

    def clear(self) -> None:
        """The step is done: the next write of every element is its first."""
        for starts, ends in zip(self._starts, self._ends):
            starts.clear()
            ends.clear()
        self._all_written = False

    def _gaps(self, index: int, state: HostFlatState) -> list[tuple[int, int]]:
        gaps, cursor = [], 0
        for start, end in zip(self._starts[index], self._ends[index]):
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < state.layout.numel:
            gaps.append((cursor, state.layout.numel))
        trained = state.layout.trained_runs()
        return [(run.start, run.end) for lo, hi in gaps for run in intersect_runs(trained, lo, hi)]
