"""The NVMe tier's window: a few slots of host memory over the blocks' swap files.

:class:`NvmeWindow` is the half of :class:`~megatrain_ds.state.nvme_tier.NvmeTier` that
moves blocks between their swap files and host memory: the slots and which block each
holds, the order the optimizer will ask for the blocks in, the reads ahead and the writes
behind on the tier's I/O threads (``state/swap_io.py``), and the waits that order every
use of a slot after its transfer. The tier (``state/nvme_tier.py``) is the other half:
it makes the files, adopts the blocks into them, reads the weights for the weight window,
maps the files for checkpoints and closes them.

[Note: the NVMe window]
Every optimizer access to a block's state on the tier goes through ``acquire(state)`` (``HostAdamW``
calls it before each range, the journal before restoring). The window is
``nvme_window_blocks`` slots, each one buffer big enough for the largest block's m and v.

- Correctness never depends on prediction: ``acquire`` of a block not in the window takes
  a slot (writing back the block it held, if changed) and reads the block, waiting for it.
- Prediction only hides the disk: :meth:`NvmeTier.expect` is told the order of the next
  accesses (the speculative blocks in backward order while backward runs, then the
  order ``finish`` walks the blocks), and after each ``acquire`` the tier starts reading
  the next ``window - 1`` expected blocks into free slots on its I/O threads, several
  blocks deep.
- Write-behind: when ``acquire`` moves on from a block that is not expected again, that
  block's write starts at once on an I/O thread; its slot is reused only once the write
  has finished (a slot's write and the next read into it are one task, in that order).
- Only the block being accessed is bound to its state; a block being written is unbound
  first, so nothing can change a buffer while it is on its way to disk.
- Device placements (``optimizer_device: "gpu"``) update the host state asynchronously:
  ``settle`` (``HostAdamW.flush``) runs before any slot is written back.
- The transfers run on observed host threads (``runtime.start_thread``) fed by a
  ``runtime.host_queue``, and each finished transfer is a handoff (``swap_io.Transfer``):
  whoever touches a slot's buffer next -- the optimizer after ``acquire``, the slot's
  next transfer, a checkpoint after ``flush`` -- first calls its ``synchronize``, even
  when it is already done, so the race checker (``MEGATRAIN_STREAM_CHECK=1``) sees every
  access in order; the engines' raw-pointer I/O is declared to it (``declare_access``).
- A block's swap file is read only after its last write was: a read waits for the write
  queued before it (``_written``), which may run on the other I/O thread. The file's
  bytes are declared to the race checker as a token tensor per file, so it sees that
  ordering too.
- :meth:`NvmeTier.version` counts the changes a block's master may have had (each
  optimizer access, a checkpoint's writes): the weight window re-reads a block whose
  version moved on.
- An I/O failure (a full disk, a device error) is remembered and raised by the next
  ``acquire``/:meth:`flush` on the training thread, as :class:`~megatrain_ds.state.swap_io.SwapIOError`
  naming the file and the bytes; the slot keeps the data it failed to write.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.runtime.trace import NullTracer, Tracer
from megatrain_ds.state.frozen_files import FrozenFiles
from megatrain_ds.state.host_store import HostFlatState, TierKind
from megatrain_ds.state.swap_io import SwapIO, Transfer, explained_failure

FP32 = 4
IO_THREADS = 2
"""One read ahead and one write behind can be in flight at once."""


@dataclass
class _Slot:
    buffer: torch.Tensor
    """Flat fp32: the tier's k-th kind at ``[k * pad, (k + 1) * pad)`` of the block it holds."""
    index: int | None = None
    pending: Transfer | None = None
    dirty: bool = False


@dataclass
class PendingTransfer:
    """A transfer into a buffer outside the window (:meth:`NvmeTier.read_master`), awaited like a slot's."""

    pending: Transfer | None


class NvmeWindow:
    """A window of slots over the blocks' swap files ([Note: the NVMe window]): :meth:`acquire`
    binds a block's kinds to a slot, reading them first if needed; the blocks :meth:`expect`
    names next are read ahead, and one left behind is written back, on :data:`IO_THREADS`
    observed host threads. :class:`~megatrain_ds.state.nvme_tier.NvmeTier` extends it: it
    makes the files and adopts the blocks (:attr:`states`, in the order of ``paths``).

    Args:
        runtime: host buffers (pinned with CUDA), host threads and queues, and the tracer.
        io: the I/O engine that moves the bytes (its buffers are the slots).
        kinds: what the files hold of each block, in their order in a file and in a slot.
        pads: every block's flat size padded to ``io``'s alignment (one kind in its file).
        paths: every block's swap file.
        frozen: the frozen weights' read-only files (their reads go through :meth:`_transfer`).
        num_slots: how many blocks the window holds at once.

    Attributes:
        settle: waits for asynchronous updates of host state (the device placement), set
            once the optimizer exists; runs before any slot is written back.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        io: SwapIO,
        kinds: Sequence[TierKind],
        pads: list[int],
        paths: list[str],
        frozen: FrozenFiles,
        num_slots: int,
    ) -> None:
        self.kinds: tuple[TierKind, ...] = tuple(kinds)
        self.states: list[HostFlatState] = []
        self.runtime = runtime
        self.settle: Callable[[], None] = lambda: None
        self.io = io
        self.frozen = frozen
        self._pad = pads
        self._paths = paths
        # What the race checker sees of each swap file's bytes (declare_access in _transfer).
        self._file_tokens = [torch.empty(1) for _ in paths]
        self._written: dict[int, Transfer] = {}
        """The last write queued of each block's file: reads of it wait for it."""
        self._versions = [0] * len(paths)
        """How many times each block's master may have changed (``NvmeTier.version``)."""
        self._index: dict[int, int] = {}
        """``id(state)`` -> its block, for the states :attr:`states` holds (``NvmeTier.adopt``)."""
        largest = len(self.kinds) * max(self._pad, default=0)
        self._slots = [_Slot(self.io.buffer(largest)) for _ in range(num_slots)]
        self._where: dict[int, _Slot] = {}
        self._schedule: deque[int] = deque()
        self._current: int | None = None
        self._failure: BaseException | None = None
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        # Observed host threads fed by a host queue: the race checker sees the handoffs
        # (the submitting thread's accesses before the transfer, the transfer before its waiter).
        self._tasks = runtime.host_queue()
        self._threads = [runtime.start_thread(self._serve, f"megatrain-nvme-{n}") for n in range(IO_THREADS)]
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_seconds = 0.0
        """Time the training threads spent waiting for swap reads (and writes) so far."""

    @property
    def window_bytes(self) -> int:
        """Host memory of the window's slots."""
        return sum(slot.buffer.numel() * FP32 for slot in self._slots)

    def expect(self, states: Sequence[HostFlatState]) -> None:
        with self._lock:
            self._schedule = deque(self._index[id(s)] for s in states if id(s) in self._index)
            self._prefetch()

    def acquire(self, state: HostFlatState, write: bool = True) -> None:
        """Bind ``state``'s kinds on the tier to their slot (reading them first if needed); with
        ``write`` (every optimizer use) the block is written back when it leaves."""
        index = self._index.get(id(state))
        if index is None:
            return  # not a tier state (the resident parameters)
        with self._lock:
            self._raise_failure()
            if write:
                self._versions[index] += 1
            if index == self._current:
                self._where[index].dirty |= write
                return
            while self._schedule and index in self._schedule:
                if self._schedule.popleft() == index:
                    break
            previous, self._current = self._current, index
            if previous is not None:
                self._unbind(previous)
                if previous not in self._schedule:
                    self._write_behind(previous)
            slot = self._where.get(index)
            if slot is None:
                slot = self._victim(protect={index}, demand=True)
                assert slot is not None
                self._load(slot, index)
            self._prefetch()
            self.await_transfer(slot, index)
            slot.dirty |= write
            self._bind(index, slot)

    def await_transfer(self, slot: _Slot | PendingTransfer, index: int) -> None:
        """The training thread waits for ``slot``'s transfer of block ``index`` (traced as
        ``nvme wait`` when it is not done yet), then raises what failed on the I/O threads."""
        if slot.pending is not None:
            began, waiting = time.perf_counter(), not slot.pending.done()
            with (
                self.runtime.tracer.span(f"nvme wait {index}", "nvme wait", block=index)
                if waiting
                else contextlib.nullcontext()
            ):
                # Also when done: the handoff orders this thread's use of the buffer after the transfer.
                slot.pending.synchronize()
            self.wait_seconds += time.perf_counter() - began
        self._raise_failure()
        slot.pending = None

    def flush(self) -> None:
        """Write every changed block back and empty the window (before the swap files are
        read or written directly, and at the end of a run's use)."""
        with self._lock:
            if self._current is not None:
                self._unbind(self._current)
                self._current = None
            self._schedule.clear()
            if any(slot.dirty for slot in self._slots):
                self.settle()
            for slot in self._slots:
                if slot.dirty and slot.index is not None:
                    slot.dirty = False
                    self._submit(slot, write=slot.index, read=None)
            for slot in self._slots:
                if slot.pending is not None:
                    # The next transfer into this slot, or a mapping of its file, comes after this one.
                    slot.pending.synchronize()
            self._raise_failure()
            for slot in self._slots:
                slot.pending = None
            for slot in self._slots:
                if slot.index is not None:
                    self._where.pop(slot.index, None)
                slot.index = None

    # -- internals (under the lock) --------------------------------------------------------------

    def _bind(self, index: int, slot: _Slot) -> None:
        """Block ``index``'s kinds are the slot's parts until :meth:`_unbind`."""
        state, pad = self.states[index], self._pad[index]
        state.bind({kind: slot.buffer[k * pad : k * pad + state.stepped_numel] for k, kind in enumerate(self.kinds)})

    def _unbind(self, index: int) -> None:
        self.states[index].release(self.kinds)

    def _victim(self, protect: set[int], demand: bool) -> _Slot | None:
        """A slot to load into: an empty one, else the one whose block is needed last
        (not at all first); for a prefetch only an idle slot whose block is not protected."""
        upcoming = list(self._schedule)

        def rank(slot: _Slot) -> tuple[int, int, int]:
            if slot.index is None:
                return (0, 0, 0)
            later = upcoming.index(slot.index) if slot.index in upcoming else len(upcoming)
            return (1, -later, int(slot.dirty))

        candidates = [slot for slot in self._slots if slot.index not in protect and slot.index != self._current]
        if not demand:
            candidates = [slot for slot in candidates if slot.pending is None or slot.pending.done()]
        return min(candidates, key=rank, default=None)

    def _load(self, slot: _Slot, index: int) -> None:
        old = slot.index
        if old is not None:
            self._where.pop(old, None)
        write = old if (old is not None and slot.dirty) else None
        if write is not None:
            self.settle()
        slot.index, slot.dirty = index, False
        self._where[index] = slot
        self._submit(slot, write=write, read=index)

    def _write_behind(self, index: int) -> None:
        slot = self._where.get(index)
        if slot is None or not slot.dirty:
            return
        self.settle()
        slot.dirty = False
        self._submit(slot, write=index, read=None)

    def _prefetch(self) -> None:
        ahead = list(self._schedule)[: len(self._slots) - 1]
        protect = set(ahead) | ({self._current} if self._current is not None else set())
        for index in ahead:
            if index in self._where:
                continue
            slot = self._victim(protect, demand=False)
            if slot is None:
                return
            self._load(slot, index)

    def _serve(self) -> None:
        """An I/O thread: run queued transfers until :meth:`close` sends ``None``."""
        while (transfer := self._tasks.get()) is not None:
            transfer.run()

    def _submit(self, slot: _Slot, write: int | None, read: int | None) -> None:
        buffer = slot.buffer
        previous = slot.pending
        # The transfer belongs to the step that queues it, traced or not, even if an I/O
        # thread runs it after that step has ended (a write behind the last block).
        tracer = self.runtime.tracer
        step = {"step": tracer.step} if tracer.step is not None else {}

        written = self._written.get(read) if read is not None else None

        def task() -> None:
            if previous is not None:  # the slot's earlier transfer first (it started before this one)
                previous.synchronize()
                if previous.error is not None:
                    raise previous.error  # its data never reached the disk or the buffer: stop here
            if write is not None:
                self._transfer(buffer, write, writing=True, slot=slot, tracer=tracer, step=step)
            if read is not None:
                self._after_write(written)
                self._transfer(buffer, read, writing=False, slot=slot, tracer=tracer, step=step)

        slot.pending = Transfer(self.runtime, task)
        if write is not None:
            self._written[write] = slot.pending
        self._tasks.put(slot.pending)

    @staticmethod
    def _after_write(written: Transfer | None) -> None:
        """On an I/O thread, before reading a block's file: its last write, queued earlier
        (perhaps on the other I/O thread), has reached the disk."""
        if written is not None:
            written.synchronize()
            if written.error is not None:
                raise written.error  # the file holds older bytes than the window had

    def _transfer(
        self,
        buffer: torch.Tensor,
        index: int,
        writing: bool,
        slot: _Slot | None,
        tracer: NullTracer | Tracer,
        step: dict[str, int],
        kinds: int | None = None,
        what: str = "optimizer state",
        frozen: bool = False,
    ) -> None:
        """Move the first ``kinds`` kinds (all by default) of block ``index`` between ``buffer``
        and its file; with ``frozen``, its frozen weights' file into ``buffer`` instead."""
        path, file, nbytes = (
            self._paths[index],
            self._file_tokens[index],
            (kinds or len(self.kinds)) * self._pad[index] * FP32,
        )
        if frozen:
            path, file, nbytes = self.frozen.file(index)
            what = "frozen weights"
        if nbytes == 0:  # a rank's empty window of the trained prefix, beside its frozen weights' window
            return
        part = buffer[: nbytes // FP32]
        track = "nvme write" if writing else "nvme read"
        try:
            with tracer.span(
                f"{track} {index}", track, block=index, bytes=nbytes, engine=self.io.name, state=what, **step
            ):
                # The engine moves the bytes by raw pointer (libaio or preadv): no aten op the
                # race checker could see, so the access is declared, the file's bytes as its token.
                declare_access(
                    reads=(part,) if writing else (file,),
                    writes=(file,) if writing else (part,),
                    what=f"{track} of {path}",
                )
                (self.io.write if writing else self.io.read)(part, path, 0)
        except BaseException as error:
            # No lock here: the training thread may hold it while waiting for this task.
            if writing and slot is not None:
                slot.dirty = True  # the data is still only here
            self._failure = self._failure or explained_failure(error, path, nbytes, writing, what)
            raise
        with self._count_lock:
            if writing:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure
