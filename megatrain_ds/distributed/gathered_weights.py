"""Blocks' weights kept only as each rank's window, gathered whole just in time.

With the weights on the NVMe tier and data parallel (``"nvme_offload": "all"``,
ZeRO-Infinity's ``offload_param.device: "nvme"``) no node holds a block's weights whole.
Each rank keeps its window of every block (``distributed/ownership.py``) on its own disk,
the fp32 master beside that window's Adam m and v, and steps it alone. When the weight
streamer (``streaming/weight_streamer.py``) takes a block, every rank reads its window
through its NVMe weight window (``state/nvme_weights.py``, which reads ahead along the
streamer's plan and rounds to the compute dtype), and an all-gather puts the whole block
in host memory on every rank: ZeRO-3's just-in-time gather, from the owners.

[Note: gathered weights]
- Order: a gather is a collective, so every rank must take the same blocks in the same
  order. The streamer takes blocks in program order (its plan, the engine's acquires and
  releases), never by timing, and every rank runs the same program. Reads ahead from disk
  are local and may follow timing freely.
- Buffers: ``capacity`` whole blocks in the compute dtype, more than the streamer holds at
  once. A buffer is the host end of a block's copy to the device, given back with the
  event after which the device no longer reads it (the copy's ``ready`` on a GPU, the
  slot's ``free`` on the CPU, whose compute reads the buffer in place). Before a gather
  overwrites a buffer, the host waits for those events: this module's only host waits
  for the device.
- Network bytes: each take receives ``(N - 1) / N`` of the block's compute-dtype bytes on
  each of the N ranks. A block is taken twice per step (forward, and backward's
  recomputation), as ZeRO-3 gathers twice. Updated weights are never sent: the next take
  gathers them. The gradients' reduce-scatter comes on top (``gradient_reducer.py``).
- Frozen weights (a LoRA base): where a block's are kept apart (``state/frozen_files.py``),
  its trained prefix and its frozen weights are each cut in the ranks' windows on their
  own, so every rank steps an equal share of what is trained; a take gathers the prefix's
  windows, then the frozen weights' after it (two all-gathers, in that order on every
  rank). Their files hold them in their own dtype: the compute dtype where every one
  arrives in it, else the master's (an fp32 base under bf16 compute), whose windows are
  rounded to the compute dtype as they are read from disk, before the gather: the streamer
  gets their rounding, as a shadow would stream it. ``state_dict()`` and checkpoints take
  their exact values from :meth:`GatheredWeights.whole_frozen`, a gather of the files' bytes
  in their dtype (a checkpoint's model files hold them so; it needs that gather only where
  they are not in the compute dtype: else :meth:`GatheredWeights.whole` has them exact).
- The gather runs on the host over gloo (``DataParallel.gather_group``), on GPUs too: there
  every rank's weights still cross PCIe whole. Gathering on the devices over NCCL would cut
  each GPU's PCIe bytes to its window; that is not built yet.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.ownership import window_elements
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.state.nvme_weights import NvmeWeights


def gather_buffer_elements(parts: Sequence[tuple[int, int]], world_size: int) -> tuple[int, int]:
    """``(whole, sent)`` for blocks of these ``(stepped, frozen)`` parts among ``world_size``
    ranks: elements of one whole-block buffer a gather fills, and of the buffer this rank's
    windows of a block are sent from. :class:`GatheredWeights` allocates them and preflight
    counts them (``planning/preflight.py``): one formula, so the two agree."""
    sent = max(window_elements(s, world_size) + window_elements(f, world_size) for s, f in parts)
    # A whole block: the stepped part's windows gathered from 0, then the frozen part's from its
    # start (over the stepped gather's padding: stepped is a multiple of the window alignment).
    whole = max(
        max(world_size * window_elements(s, world_size), s + world_size * window_elements(f, world_size))
        for s, f in parts
    )
    return whole, sent


@dataclass
class _Whole:
    tensor: torch.Tensor
    device_reads: list[Event] = field(default_factory=list)
    """After these the device no longer reads ``tensor``."""


class GatheredWeights:
    """The streamer's source of block weights held only as windows (see [Note: gathered weights]).

    Args:
        windows: this rank's windows of the blocks' weights, on its NVMe tier.
        tier_index: each block's index on that tier; ``None`` where this rank's windows of
            the block are empty (a block smaller than the ranks' windows).
        parts: each block's ``(stepped, frozen)`` elements: the part its optimizer state
            covers (its trained prefix where frozen weights are apart, else every element),
            and its frozen weights kept apart after it (0: none), each cut in the ranks'
            windows on its own and gathered on its own ([Note: gathered weights]).
        data_parallel: the ranks and their windows (:class:`~megatrain_ds.distributed.ownership.Ownership`).
        runtime: allocates the buffers (pinned on a GPU: the source of the copies).
        capacity: whole-block buffers; more than the streamer's device slots.
    """

    def __init__(
        self,
        windows: NvmeWeights,
        tier_index: Sequence[int | None],
        parts: Sequence[tuple[int, int]],
        data_parallel: DataParallel,
        runtime: DeviceRuntime,
        capacity: int,
    ) -> None:
        self.dtype = windows.dtype
        self._windows = windows
        self._tier_index = list(tier_index)
        self._parts = list(parts)
        self._numels = [stepped + frozen for stepped, frozen in self._parts]
        self._dp = data_parallel
        self._runtime = runtime
        whole, mine = gather_buffer_elements(self._parts, data_parallel.world_size)
        self._mine = torch.zeros(mine, dtype=self.dtype)
        # Free buffers in the order they were given back: the one the device let go of first is reused first.
        self._free = deque(_Whole(runtime.host_empty(whole, self.dtype)) for _ in range(capacity))
        self._taken: dict[int, deque[_Whole]] = {}
        """The buffers taken and not given back, by block."""
        self._buffer_bytes = capacity * whole * self._mine.element_size()
        self._lock = threading.Lock()  # the streamer may run on the autograd device thread
        self.gathers = 0
        """Blocks gathered so far (by the streamer and by :meth:`whole`)."""

    @property
    def nbytes(self) -> int:
        """Host memory of the whole-block buffers, the window being sent, and the NVMe weight window."""
        return self._buffer_bytes + self._mine.numel() * self._mine.element_size() + self._windows.nbytes

    def numel(self, block: int) -> int:
        return self._numels[block]

    def prefetch(self, blocks: Sequence[int]) -> None:
        """The blocks the streamer takes next: this rank's windows of them are read ahead from disk."""
        indices = (self._tier_index[block] for block in blocks)
        self._windows.prefetch([index for index in indices if index is not None])

    def take(self, block: int) -> torch.Tensor:
        """``block``'s whole weights in host memory, kept until :meth:`give_back` (collective:
        every rank takes the same blocks in the same order)."""
        with self._lock:
            if not self._free:
                raise RuntimeError(
                    f"no free gather buffer for block {block}: all are held (the streamer holds "
                    "more blocks than the buffers it was sized for)"
                )
            buffer = self._free.popleft()
            for done in buffer.device_reads:
                # Host waits for the device: the copy (GPU) or compute (CPU) that read this
                # buffer's last block is finished before the gather overwrites it.
                done.synchronize()
            buffer.device_reads.clear()
            # Host code on host buffers, finished before the copy that reads the buffer is queued.
            with self._runtime.host_work():
                self._gather_block(block, buffer.tensor)
            self._taken.setdefault(block, deque()).append(buffer)
            return buffer.tensor[: self._numels[block]]

    def give_back(self, block: int, device_done: Event) -> None:
        """The device reads what :meth:`take` returned for ``block`` until ``device_done``."""
        with self._lock:
            buffer = self._taken[block].popleft()
            buffer.device_reads.append(device_done)
            self._free.append(buffer)

    def whole(self, block: int, window: torch.Tensor | None = None) -> torch.Tensor:
        """``block``'s whole weights in a new tensor (collective, like :meth:`take`): every
        rank's ``window`` of its stepped part (its exact fp32 master, for ``state_dict()``;
        frozen weights apart have none: :meth:`whole_frozen`), or by default every weight in
        the compute dtype, as the streamer gets them (a checkpoint's model files)."""
        with self._lock:
            stepped, frozen = self._parts[block]
            if window is not None:
                mine = torch.zeros(self._dp.ownership.chunk(stepped), dtype=window.dtype)
                mine[: window.numel()].copy_(window)
                whole = torch.empty(mine.numel() * self._dp.world_size, dtype=mine.dtype)
                self._gather(block, whole, mine)
                return whole[:stepped]
            ownership, world = self._dp.ownership, self._dp.world_size
            size = max(world * ownership.chunk(stepped), stepped + world * ownership.chunk(frozen))
            whole = torch.empty(size, dtype=self.dtype)
            self._gather_block(block, whole)
            return whole[: stepped + frozen]

    def whole_frozen(self, block: int, window: torch.Tensor) -> torch.Tensor:
        """``block``'s frozen weights kept apart, all of them, in a new tensor of their own
        dtype, exact: every rank's ``window`` of them as its tier's file holds them (a meta
        placeholder where this rank's window of them is empty); collective, like :meth:`take`.
        Not what the streamer gets where they are not in the compute dtype: it gets their
        rounding ([Note: gathered weights])."""
        with self._lock:
            _, frozen = self._parts[block]
            mine = torch.zeros(self._dp.ownership.chunk(frozen), dtype=window.dtype)
            if not window.is_meta:
                mine[: window.numel()].copy_(window)
            else:
                assert window.numel() == 0, "a rank's frozen weights on no tier: its window of them is empty"
            whole = torch.empty(mine.numel() * self._dp.world_size, dtype=mine.dtype)
            self._gather(block, whole, mine)
            return whole[:frozen]

    def _gather_block(self, block: int, whole: torch.Tensor) -> None:
        """Every weight of ``block`` into ``whole`` (under the lock): the stepped part's windows
        from its start, then the frozen weights' windows from theirs, the second gather
        overwriting the padding of the first's last window."""
        stepped, frozen = self._parts[block]
        mine, mine_frozen = self._read_window(block)
        self._gather(block, whole, mine)
        if frozen:
            self._gather(block, whole[stepped:], mine_frozen)

    def _read_window(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows of ``block`` in the compute dtype, each padded to the window
        size: of its stepped part and of its frozen weights apart (under the lock)."""
        ownership = self._dp.ownership
        stepped, frozen = self._parts[block]
        chunk = ownership.chunk(stepped)
        mine = self._mine[: chunk + ownership.chunk(frozen)]
        index = self._tier_index[block]
        if index is None:
            mine.zero_()
            return mine[:chunk], mine[chunk:]
        local = self._windows.take(index)  # waits for the read from disk: the stepped window, then the frozen one
        start, end = ownership.window(stepped)
        length = end - start
        mine[:length].copy_(local[:length])
        mine[length:chunk].zero_()  # the last window may be short
        mine[chunk : chunk + local.numel() - length].copy_(local[length:])
        mine[chunk + local.numel() - length :].zero_()
        self._windows.give_back(index, None)  # copied out: the read buffer is free again
        return mine[:chunk], mine[chunk:]

    def _gather(self, block: int, whole: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's ``mine`` of ``block`` into ``whole``, in window order."""
        gathered = whole[: mine.numel() * self._dp.world_size]
        # gloo reads and writes these unseen by aten; the race checker sees the gather here.
        declare_access(reads=[mine], writes=[gathered], what="the weight gather")
        self._dp.gather_windows_(gathered, mine, f"the weight gather of block {block}")
        self.gathers += 1
