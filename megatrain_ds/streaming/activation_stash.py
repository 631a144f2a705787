"""Activations stashed in host memory between a block's forward and its backward.

With ``"megatrain": {"recompute": "none"}`` (or an integer, for the blocks it does not
recompute) a block's forward builds its block-local autograd graph at once, as the
recompute would in backward, and what autograd saves inside it is *stashed*: intercepted
by ``torch.autograd.graph.saved_tensors_hooks`` (:meth:`BlockStash.saving`), moved to the
host, and brought back ahead of the block's backward, which then runs from the graph built
in forward: no recompute, so dropout masks and every other random draw are the forward's
own. Per stashed block this saves ``2 * P_b * T`` FLOPs and costs the block's saved
activations in host memory and twice over the link.

What is *not* stashed: saved views of the block's streamed weights (a linear layer saves
its weight). They are recorded as (offset, size, stride) into the weight buffer and
re-pointed at the weights the block acquires again for its backward, so weights still
cross host->device exactly twice per step and never travel as activations.

On a GPU a block's saved tensors are copied device->host on the d2h stream when its
forward has been queued (one event for the whole block), into page-locked buffers from a
:class:`~megatrain_ds.runtime.device_runtime.PinnedPool`; they travel back on the h2d
stream when the block's weights are issued for backward. Where the device is the host
(the CPU) a saved tensor already is in host memory: it is kept where it is, and the same
bookkeeping, events and trace spans run with nothing to copy.

[Note: stash ordering]
- stash (``end_block``): the d2h stream waits for the compute that produced the block's
  saved tensors (one event recorded after the block's forward); ``runtime.used_on`` keeps
  the device tensors' memory from being reused before the copies have read them.
  ``copied`` is recorded after the block's last copy. A pooled buffer is written with no
  wait for the h2d copy that last read it: buffers go back to the pool when their stash
  is brought back in backward and are taken again only in a later forward, whose d2h
  copies wait (through ``produced``) for compute that waited for this forward's weights,
  uploaded on the h2d stream after every earlier unstash copy.
- at most :data:`MAX_BLOCKS_IN_FLIGHT` blocks' copies are outstanding: the host waits for
  the oldest (``copied.synchronize()``) before stashing another, so device memory held by
  tensors waiting for their copy stays bounded when the link is slower than compute.
- bring back (``prefetch``): the h2d stream waits on ``copied``, copies into tensors
  allocated on the h2d stream and records ``ready``; the pooled buffers go back to the
  pool. ``unpack`` makes the compute stream wait on ``ready`` and marks the tensor used by
  the compute stream (allocated on the h2d stream, it is dropped by backward, whose
  compute the h2d stream need not have waited for yet).
- ``ready`` is recorded after the block's weights on the h2d stream (the stash is brought
  back when they are issued, ``streamed_blocks.py``), so the compute stream's wait for it
  before a saved activation is unpacked covers the weights too: a stashed block's
  backward needs no wait of its own for fragmented weights.
The race checker judges each of these orders (``tests/test_stream_ordering.py``: a
change to the schedule that breaks one shows up as a race at the free or the write).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event, PinnedPool

MAX_BLOCKS_IN_FLIGHT = 2
"""Blocks whose device->host stash copies may be outstanding at once (see the Note)."""


@dataclass
class _Stashed:
    """One storage whose tensors a stashed block's forward saved for its backward, as
    flat bytes (every saved view of it is rebuilt from them: :class:`_SavedView`)."""

    tensor: torch.Tensor | None
    """The storage on the device, until its copy is issued (``end_block``); ``None`` after."""
    host: torch.Tensor | None = None
    buffer: torch.Tensor | None = None
    device: torch.Tensor | None = None
    """Back on the device (after ``prefetch``), until the block's backward is done."""

    @property
    def nbytes(self) -> int:
        source = self.host if self.host is not None else self.tensor
        assert source is not None
        return source.numel() * source.element_size()


@dataclass(frozen=True)
class _SavedView:
    """A saved tensor: where it lies in a stashed storage."""

    entry: _Stashed
    dtype: torch.dtype
    offset: int
    """Elements of ``dtype`` from the start of the storage."""
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _WeightView:
    """A saved view of the block's streamed weights: re-pointed, never stashed."""

    offset: int
    """Elements from the start of the weight buffer."""
    size: tuple[int, ...]
    stride: tuple[int, ...]


class BlockStash:
    """What one block's forward saved for its backward, on its way to and from the host."""

    def __init__(self, owner: ActivationStash, block: int, weights: torch.Tensor) -> None:
        self.owner = owner
        self.block = block
        self._weights_storage = weights.untyped_storage().data_ptr()
        self._weights_offset = int(weights.storage_offset())  # eager tensors: ints, never SymInts
        self._weights_dtype = weights.dtype
        self._entries: list[_Stashed] = []
        self._by_storage: dict[int, _Stashed] = {}
        self._backward_weights: torch.Tensor | None = None
        self.nbytes = 0
        """Host bytes of the block's stash (each saved tensor counted once)."""
        self.copied: Event | None = None
        self.ready: Event | None = None

    # -- forward ----------------------------------------------------------------------------

    def saving(self) -> contextlib.AbstractContextManager[None]:
        """Autograd saves through this stash while the block's forward runs inside."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device != self.owner.runtime.device:
            return tensor  # e.g. a CPU scalar of a GPU run: nothing to move
        if tensor.dtype == self._weights_dtype and tensor.untyped_storage().data_ptr() == self._weights_storage:
            return _WeightView(
                int(tensor.storage_offset()) - self._weights_offset, tuple(tensor.shape), tuple(tensor.stride())
            )
        # Tensors saved by several ops, or views of one another (a norm's output, and its
        # flattened view that q, k and v read), share a storage: it moves once, whole. The
        # address is unique while the block runs: ``_Stashed`` holds the storage alive.
        storage = tensor.untyped_storage()
        entry = self._by_storage.get(storage.data_ptr())
        if entry is None:
            # The whole storage as flat bytes (a view: nothing is read or written here).
            flat = tensor.as_strided((storage.nbytes() // tensor.element_size(),), (1,), 0).view(torch.uint8)
            entry = _Stashed(flat)
            self._by_storage[storage.data_ptr()] = entry
            self._entries.append(entry)
            self.nbytes += entry.nbytes
        return _SavedView(
            entry, tensor.dtype, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride())
        )

    def end_block(self) -> None:
        """The block's forward is queued: copy what it saved to the host (see the Note)."""
        runtime, in_place = self.owner.runtime, self.owner.in_place
        self._by_storage = {}
        produced = runtime.event()
        produced.record(runtime.compute_stream())
        self.copied = runtime.event()
        with (
            runtime.on(runtime.d2h_stream),
            runtime.tracer.device_span(
                f"stash {self.block}", "stash", runtime.d2h_stream, block=self.block, bytes=self.nbytes
            ),
        ):
            runtime.d2h_stream.wait_event(produced)
            for entry in self._entries:
                tensor = entry.tensor
                assert tensor is not None
                if in_place:  # the device is the host: the tensor already is host memory
                    entry.host = tensor
                else:
                    # Its last reader (an unstash copy) is ordered before: see the Note.
                    entry.buffer = self.owner.pool.take(entry.nbytes)
                    entry.host = entry.buffer[: entry.nbytes]
                    entry.host.copy_(tensor, non_blocking=True)
                    runtime.used_on(tensor, runtime.d2h_stream)
                entry.tensor = None
            self.copied.record(runtime.d2h_stream)

    # -- backward ---------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start bringing the stash back to the device (idempotent)."""
        if self.ready is not None:
            return
        runtime, in_place = self.owner.runtime, self.owner.in_place
        assert self.copied is not None, "a block's stash is brought back before it was stashed"
        self.ready = runtime.event()
        with (
            runtime.on(runtime.h2d_stream),
            runtime.tracer.device_span(
                f"unstash {self.block}", "stash", runtime.h2d_stream, block=self.block, bytes=self.nbytes
            ),
        ):
            runtime.h2d_stream.wait_event(self.copied)
            for entry in self._entries:
                assert entry.host is not None
                if in_place:
                    entry.device = entry.host
                else:
                    entry.device = runtime.device_empty(entry.host.numel(), torch.uint8)
                    entry.device.copy_(entry.host, non_blocking=True)
            self.ready.record(runtime.h2d_stream)
        for entry in self._entries:
            if entry.buffer is not None:  # the copy above reads it first (see the Note)
                self.owner.pool.give(entry.buffer)
                entry.buffer = None
            entry.host = None
        self.owner.host_bytes -= self.nbytes

    def abandon(self) -> None:
        """Never to be used: pooled buffers go back once their stash copy is done."""
        for entry in self._entries:
            if entry.buffer is not None:  # the next writer is the d2h stream that wrote it
                self.owner.pool.give(entry.buffer)
            entry.buffer = entry.host = entry.device = None
        self._entries = []

    def attach_weights(self, weights: torch.Tensor) -> None:
        """The block's weights as acquired for its backward: saved weight views point here."""
        self._backward_weights = weights

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _WeightView):
            weights = self._backward_weights
            assert weights is not None, "a stashed block's backward runs before its weights are acquired"
            return weights.as_strided(packed.size, packed.stride, weights.storage_offset() + packed.offset)
        self.prefetch()
        runtime = self.owner.runtime
        runtime.compute_stream().wait_event(self.ready)
        flat = packed.entry.device
        assert flat is not None, "a stashed tensor is unpacked after its block's backward"
        runtime.used_on(flat, runtime.compute_stream())  # allocated on h2d, freed after this use
        return flat.view(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)

    def finish(self) -> None:
        """The block's backward is queued: drop the device copies and the weights."""
        for entry in self._entries:
            entry.device = None
        self._entries = []
        self._backward_weights = None
        self.owner._by_block.pop(self.block, None)


class ActivationStash:
    """Creates each stashed block's :class:`BlockStash` and keeps the pass's accounts.

    Args:
        runtime: streams, events and the pinned pool's allocations.
    """

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self.in_place = runtime.shares_host_memory
        self.pool = PinnedPool(runtime)
        self._by_block: dict[int, BlockStash] = {}
        self._outstanding: deque[Event] = deque()
        self.host_bytes = 0
        """Host bytes stashed now (blocks forwarded whose stash has not come back yet)."""
        self.peak_host_bytes = 0
        self.block_bytes: dict[int, int] = {}
        """Host bytes of each block's stash, as last measured."""

    def begin_pass(self) -> None:
        """A model forward starts: the stashes of a pass whose backward never ran (or not
        to the end) are dropped, their pinned buffers back in the pool."""
        for stash in self._by_block.values():
            stash.abandon()
        self._by_block = {}
        self.host_bytes = 0

    @contextlib.contextmanager
    def block(self, index: int, weights: torch.Tensor) -> Iterator[BlockStash]:
        """Stash what block ``index``'s forward (run inside) saves; ``weights`` is the
        buffer it computes from (its saved views are re-pointed, not stashed)."""
        while len(self._outstanding) >= MAX_BLOCKS_IN_FLIGHT:
            # Backpressure (see [Note: stash ordering]): the host waits for the oldest copy.
            oldest = self._outstanding.popleft()
            oldest.synchronize()
        stash = BlockStash(self, index, weights)
        with stash.saving():
            yield stash
        stash.end_block()
        assert stash.copied is not None
        self._outstanding.append(stash.copied)
        self._by_block[index] = stash
        self.block_bytes[index] = stash.nbytes
        self.host_bytes += stash.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def prefetch(self, index: int) -> None:
        """Block ``index``'s weights were issued for backward: its stash travels with them."""
        stash = self._by_block.get(index)
        if stash is not None:
            stash.prefetch()
