"""The weight window: blocks' weights read from the NVMe tier ahead of forward and backward.

With ``"nvme_offload": "all"`` (ZeRO-Infinity's ``offload_param.device: "nvme"``) no host
copy of a block's weights lives between its uses: the fp32 master is the first kind of the
block's swap file (``state/nvme_tier.py``), and the weight streamer
(``streaming/weight_streamer.py``) takes each block's host weights from this window instead
of the block's state. The host then holds, of a block, only its held gradient.

[Note: the weight window]
- ``capacity`` buffers, each the largest block in the compute dtype (with bf16 compute also
  an fp32 staging buffer the master is read into and rounded from, to nearest even as the
  shadow is, so the streamed bytes are those of the engine without the tier; where blocks
  have frozen weights apart, one more the largest frozen file is read into:
  ``state/frozen_files.py``).
- Read ahead along the streamer's plan (:meth:`NvmeWeights.prefetch`): the first blocks
  not held are read into free buffers on the tier's I/O threads, the buffer whose block is
  needed last being reused first. A block wanted out of plan is read on demand.
- A buffer is the host end of a block's copy to the device: the streamer takes it
  (:meth:`NvmeWeights.take`, which waits for its read) and gives it back with the event
  after which the device no longer reads it (:meth:`NvmeWeights.give_back`): the copy's
  ``ready`` on a GPU, the device slot's ``free`` on the CPU, whose compute reads the host
  buffer in place. Before a buffer is read into again the host synchronises with those
  events -- the window's only host waits for the device.
- Freshness: a buffer remembers the tier's :meth:`~NvmeTier.version` of its block when it
  was read; a block whose version moved on (the optimizer stepped it, a checkpoint was
  loaded) is read again. Reads go through :meth:`NvmeTier.read_master`, which serves the
  newest master: the tier window's slot when it holds the block, else the swap file, after
  the write of it in flight. A block's backward never meets its own update: the optimizer
  writes a block's master only after its last use in the step (``gradients/outbox.py``:
  [Note: complete gradients]), so the forward's buffers serve the backward too.
- With ``capacity > num_slots`` (the streamer holds at most one take per device slot) a
  take always finds a buffer to read into.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatrain_ds.runtime.device_runtime import Event
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.state.nvme_window import PendingTransfer
from megatrain_ds.state.swap_io import aligned_bytes


def weight_window_buffers(num_buffers: int, checkpoint_interval: int, nvme_window_blocks: int) -> int:
    """Buffers of the weight window: one more than the streamer's device slots
    (``num_buffers + checkpoint_interval - 1``) can hold, plus ``nvme_window_blocks - 1`` read ahead."""
    return num_buffers + checkpoint_interval - 1 + nvme_window_blocks - 1


@dataclass
class _Buffer:
    weights: torch.Tensor
    """The compute dtype, aligned for the tier's I/O engine when it is fp32 (read into directly)."""
    staging: torch.Tensor | None
    """fp32, aligned: what the master is read into when the compute dtype is not fp32."""
    frozen: torch.Tensor | None
    """fp32, aligned: what a block's frozen weights' file is read into (none without one)."""
    block: int | None = None
    version: int = -1
    read: PendingTransfer | None = None
    holders: int = 0
    """Takes not given back yet."""
    device_reads: list[Event] = field(default_factory=list)
    """After these the device no longer reads ``weights`` (given back with the takes)."""


class NvmeWeights:
    """The streamer's source of block weights when they live on the NVMe tier (see the module docstring).

    Args:
        tier: the NVMe tier holding every block's master.
        dtype: the compute dtype (what the device buffers hold).
        capacity: buffers in the window; more than the streamer's device slots.
    """

    def __init__(self, tier: NvmeTier, dtype: torch.dtype, capacity: int) -> None:
        self.tier = tier
        self.dtype = dtype
        largest = max(tier.padded_numels, default=0)  # a block's master in its file
        # A block's weights, its frozen ones too, padded as the master's file is.
        weights = (aligned_bytes(4 * tier.weight_numel(index), tier.io.alignment) for index in range(len(tier.states)))
        whole = max(weights, default=0) // 4
        frozen = tier.frozen.largest() // 4
        io = tier.io

        def buffer() -> _Buffer:
            apart = io.buffer(frozen) if frozen else None
            if dtype == torch.float32:
                return _Buffer(io.buffer(whole), None, apart)
            return _Buffer(tier.runtime.host_empty(whole, dtype), io.buffer(largest), apart)

        self._buffers = [buffer() for _ in range(capacity)]
        self._where: dict[int, _Buffer] = {}
        self._taken: dict[int, deque[_Buffer]] = {}
        self._upcoming: deque[int] = deque()
        self._lock = threading.Lock()  # the streamer may run on the autograd device thread
        self.reads = 0
        """Blocks read into the window so far (from the tier's window or its files)."""

    @property
    def nbytes(self) -> int:
        """Host memory of the window's buffers."""
        return sum(
            t.numel() * t.element_size()
            for b in self._buffers
            for t in (b.weights, b.staging, b.frozen)
            if t is not None
        )

    def numel(self, block: int) -> int:
        """Elements of ``block``'s weights (its frozen ones too; with data parallel this rank's
        windows of both, one after the other)."""
        return self.tier.weight_numel(block)

    def prefetch(self, blocks: Sequence[int]) -> None:
        """The blocks the streamer will take next, in order: read the first ones ahead."""
        with self._lock:
            self._upcoming = deque(blocks)
            self._read_ahead()

    def take(self, block: int) -> torch.Tensor:
        """``block``'s weights in host memory, kept until :meth:`give_back`."""
        with self._lock:
            while self._upcoming:
                if self._upcoming.popleft() == block:
                    break
            buffer = self._fresh(block)
            if buffer is None:
                buffer = self._victim(protect=set(), demand=True)
                if buffer is None:
                    raise RuntimeError(
                        f"no free weight buffer for block {block}: all {len(self._buffers)} are "
                        "held (the window must have more buffers than the streamer's slots)"
                    )
                self._read(buffer, block)
            self._read_ahead()
            if buffer.read is not None:
                # The read (on an I/O thread) is handed over before the device reads the buffer.
                self.tier.await_transfer(buffer.read, block)
                buffer.read = None
            buffer.holders += 1
            self._taken.setdefault(block, deque()).append(buffer)
            return buffer.weights[: self.numel(block)]

    def give_back(self, block: int, device_done: Event | None) -> None:
        """The device reads what :meth:`take` returned for ``block`` until ``device_done``
        (``None``: nothing reads it any more, the host copied it out)."""
        with self._lock:
            buffer = self._taken[block].popleft()
            buffer.holders -= 1
            if device_done is not None:
                buffer.device_reads.append(device_done)

    # -- internals (under the lock) ------------------------------------------------------------

    def _fresh(self, block: int) -> _Buffer | None:
        buffer = self._where.get(block)
        if buffer is not None and buffer.version != self.tier.version(block):
            del self._where[block]  # stale: read again (the old buffer is reused once given back)
            buffer.block = None
            return None
        return buffer

    def _victim(self, protect: set[int], demand: bool) -> _Buffer | None:
        """A buffer to read into: an empty one, else the one whose block is needed last (not
        at all first); never one held, and for a read ahead not one protected."""
        upcoming = list(self._upcoming)

        def rank(buffer: _Buffer) -> tuple[int, int]:
            if buffer.block is None:
                return (0, 0)
            return (1, -(upcoming.index(buffer.block) if buffer.block in upcoming else len(upcoming)))

        candidates = [b for b in self._buffers if b.holders == 0 and (demand or b.block not in protect)]
        return min(candidates, key=rank, default=None)

    def _read(self, buffer: _Buffer, block: int) -> None:
        previous = buffer.block
        if previous is not None:
            del self._where[previous]
        if buffer.read is not None:  # a read ahead never taken: its I/O thread may still write the buffer
            self.tier.await_transfer(buffer.read, previous if previous is not None else block)
        for done in buffer.device_reads:
            # Host waits for the device: the copy (GPU) or the compute (CPU) that read this
            # buffer is finished before an I/O thread overwrites it.
            done.synchronize()
        buffer.device_reads.clear()
        buffer.block, buffer.version = block, self.tier.version(block)
        self._where[block] = buffer
        buffer.read = self.tier.read_master(block, buffer.weights, buffer.staging, buffer.frozen)
        self.reads += 1

    def _read_ahead(self) -> None:
        held = sum(1 for b in self._buffers if b.holders)
        ahead = list(self._upcoming)[: len(self._buffers) - held - 1]
        protect = set(ahead)
        for block in ahead:
            if self._fresh(block) is not None:
                continue
            buffer = self._victim(protect, demand=False)
            if buffer is None:
                return
            self._read(buffer, block)
