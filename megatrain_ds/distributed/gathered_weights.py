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
from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.state.nvme_weights import NvmeWeights


@dataclass
class _Whole:
    tensor: torch.Tensor
    device_reads: list[Event] = field(default_factory=list)
    """After these the device no longer reads ``tensor``."""


class GatheredWeights:
    """The streamer's source of block weights held only as windows (see [Note: gathered weights]).

    Args:
        windows: this rank's windows of the blocks' weights, on its NVMe tier.
        tier_index: each block's index on that tier; ``None`` where this rank's window of
            the block is empty (a block smaller than the ranks' windows).
        numels: each block's flat size.
        data_parallel: the ranks and their windows (:class:`~megatrain_ds.distributed.ownership.Ownership`).
        runtime: allocates the buffers (pinned on a GPU: the source of the copies).
        capacity: whole-block buffers; more than the streamer's device slots.
    """

    def __init__(
        self,
        windows: NvmeWeights,
        tier_index: Sequence[int | None],
        numels: Sequence[int],
        data_parallel: DataParallel,
        runtime: DeviceRuntime,
        capacity: int,
    ) -> None:
        self.dtype = windows.dtype
        self._windows = windows
        self._tier_index = list(tier_index)
        self._numels = list(numels)
        self._dp = data_parallel
        self._runtime = runtime
        chunk = max(data_parallel.ownership.chunk(numel) for numel in self._numels)
        self._mine = torch.zeros(chunk, dtype=self.dtype)
        # Free buffers in the order they were given back: the one the device let go of first is reused first.
        self._free = deque(
            _Whole(runtime.host_empty(chunk * data_parallel.world_size, self.dtype)) for _ in range(capacity)
        )
        self._taken: dict[int, deque[_Whole]] = {}
        """The buffers taken and not given back, by block."""
        self._buffer_bytes = capacity * chunk * data_parallel.world_size * self._mine.element_size()
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
                self._gather(block, buffer.tensor, self._read_window(block))
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
        rank's ``window`` of them (its exact fp32 master, for ``state_dict()``), or by default
        the compute-dtype weights the streamer gets (a checkpoint's model files)."""
        with self._lock:
            if window is None:
                mine = self._read_window(block)
            else:
                mine = torch.zeros(self._dp.ownership.chunk(self._numels[block]), dtype=window.dtype)
                mine[: window.numel()].copy_(window)
            whole = torch.empty(mine.numel() * self._dp.world_size, dtype=mine.dtype)
            self._gather(block, whole, mine)
            return whole[: self._numels[block]]

    def _read_window(self, block: int) -> torch.Tensor:
        """This rank's window of ``block`` in the compute dtype, padded to the window size (under the lock)."""
        mine = self._mine[: self._dp.ownership.chunk(self._numels[block])]
        index = self._tier_index[block]
        if index is None:
            return mine.zero_()
        local = self._windows.take(index)  # waits for the read from disk
        mine[: local.numel()].copy_(local)
        mine[local.numel() :].zero_()  # the last window may be short
        self._windows.give_back(index, None)  # copied out: the read buffer is free again
        return mine

    def _gather(self, block: int, whole: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's ``mine`` of ``block`` into ``whole``, in window order."""
        gathered = whole[: mine.numel() * self._dp.world_size]
        # gloo reads and writes these unseen by aten; the race checker sees the gather here.
        declare_access(reads=[mine], writes=[gathered], what="the weight gather")
        self._dp.gather_windows_(gathered, mine, f"the weight gather of block {block}")
        self.gathers += 1
