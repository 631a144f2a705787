"""Host memory mapped by every rank of one node: the node keeps one copy of the training state.

[Note: node-shared host state]
Data-parallel ranks train the same weights, so the ranks of a node keep *one* copy of
the fp32 masters, Adam moments, shadows and held gradients, mapped by all of them;
each rank updates its own window of every state (``distributed/data_parallel.py``), so no two
ranks ever write the same element. Host memory per node then stays the
single-process budget plus each rank's own buffers, whatever the number of ranks.

Each buffer is a memfd (anonymous shared memory): unlike a file in ``/dev/shm`` it is
not capped by that mount's size (often 64 MiB in containers, half the RAM elsewhere)
and nothing is left behind when a rank crashes. The node's writer creates it and
broadcasts ``(pid, fd)``; the others map it through ``/proc/<pid>/fd/<fd>``; once every
rank has mapped it, the writer closes the descriptor and the memory lives as long as a
mapping does. A new memfd reads as zeros and costs no memory until it is written.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class NodeSharedMemory:
    """Allocates host tensors that every rank of ``group`` maps at once.

    Every allocation is a collective over ``group``: all its ranks must call
    :meth:`empty` in the same order with the same sizes (they build the same model).

    Args:
        group: the (gloo) process group of this node's ranks.
        writer: global rank of the node's writer, which creates the memory and fills it.
        rank: this process's global rank.
    """

    def __init__(self, group: dist.ProcessGroup, writer: int, rank: int) -> None:
        self.group = group
        self.writer = writer
        self.is_writer = rank == writer

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``numel``-element tensor in node-shared memory, page-aligned and zero."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        where: list[tuple[int, int] | None] = [None]
        fd = -1
        if self.is_writer:
            fd = os.memfd_create("megatrain-state", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            where = [(os.getpid(), fd)]
        dist.broadcast_object_list(where, src=self.writer, group=self.group)
        received = where[0]
        assert received is not None  # the writer's (pid, fd), broadcast to every rank
        pid, remote_fd = received
        # mmap(MAP_SHARED) of the same pages in every rank: page-aligned, untouched.
        mapped = torch.from_file(f"/proc/{pid}/fd/{remote_fd}", shared=True, size=nbytes, dtype=torch.uint8)
        # Sync: the writer's descriptor must stay open until every rank has mapped it.
        dist.barrier(group=self.group)
        if self.is_writer:
            os.close(fd)
        return mapped.view(dtype)

    def written(self) -> None:
        """Wait until the writer has filled everything allocated so far (a barrier)."""
        dist.barrier(group=self.group)
