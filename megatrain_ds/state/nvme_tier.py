"""The NVMe tier: each block's optimizer state in a swap file, moved through a small RAM window.

With ``"megatrain": {"nvme_offload": "optimizer"}`` (or ZeRO-Infinity's
``offload_optimizer.device: "nvme"``) a block's optimizer state lives in
``<swap dir>/blockNNNNN.swap`` (``state/swap_directory.py``): its :attr:`NvmeTier.kinds`,
each padded to the I/O engine's alignment, so one block moves in one request
(``state/swap_io.py``). The kinds are Adam's m and v, and the fp32 master too when the
model computes in bf16: the master is then read only by the optimizer (forward and
backward stream the bf16 shadow), so the tier takes 12 of the 16 bytes per parameter.
With fp32 compute the master is the streamed copy, read every forward and backward, and
stays in host memory, as do the shadow and the gradients -- unless the weights are on the
tier too (``"nvme_offload": "all"``): then the master is always a kind, no shadow exists,
and forward and backward read the weights from the tier through a second window
(``state/nvme_weights.py``, :meth:`NvmeTier.read_master`); frozen weights then have a
read-only file of their own (``state/frozen_files.py``: [Note: frozen weights on the tier]).

The block's :class:`HostFlatState` holds meta-device placeholders for the kinds on disk
(:func:`~megatrain_ds.state.host_store.absent_on_host`), so a read that skipped
:meth:`NvmeTier.acquire` fails loudly instead of reading stale memory. The tier moves a
kind in and out of the state only through :meth:`HostFlatState.bind` (a slot's part, or a
mapping of the swap file) and :meth:`HostFlatState.release` (the placeholder again); which
kinds it holds is the engine's ``Placement`` (``TierPlacement.kinds``, ``state/placement.py``). With the master on
disk the block's parameters view the bf16 shadow (:meth:`HostFlatState.point_params_at`),
as a DeepSpeed bf16 model's parameters are bf16; with no shadow either (weights on the
tier) they are meta tensors, as a ZeRO-3 model's are partitioned. Either way
``model.state_dict()`` gives the fp32 masters, read from the swap files through
:meth:`NvmeTier.file_views` (``checkpoint/whole_masters.py``: [Note: one answer from
state_dict]), and a checkpoint (``engine.save_checkpoint``) streams them from there.
When the engine is destroyed the parameters get their fp32 masters back
(:meth:`NvmeTier.close`), so a model trained on and then handed to another engine (the HF
Trainer's second ``train()``) loses no precision.

[Note: adopting blocks one by one]
The engine opens the tier before it migrates the model (:func:`open_nvme_tier` with every
block's flat size) and hands it each block's state as soon as that block is migrated
(:meth:`NvmeTier.adopt`): the master is written to the block's file and its host buffer
freed before the next block is copied, so the fp32 model is never whole in host memory.

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

Checkpoints read and write the tier's kinds through :meth:`NvmeTier.file_views`: the window
is written back and emptied, and the swap files are mapped (``torch.from_file``), one
shard's worth at a time, so a checkpoint streams from the tier that holds each tensor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatrain_ds.config import MegatrainOptions
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.runtime.trace import NullTracer, Tracer
from megatrain_ds.state.frozen_files import FrozenFiles
from megatrain_ds.state.host_store import HostFlatState, TierKind
from megatrain_ds.state.swap_directory import DiskSpaceError, SwapDirectory
from megatrain_ds.state.swap_io import (
    SwapIO,
    SwapIOError,
    Transfer,
    aligned_bytes,
    explained_failure,
    open_swap_io,
)

logger = logging.getLogger(__name__)

FP32 = 4
IO_THREADS = 2
"""One read ahead and one write behind can be in flight at once."""
DISK_WAIT_SHARE = 0.2
"""Warn once the training threads wait for the disk longer than this share of a step."""


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


MOMENTS: tuple[TierKind, ...] = ("exp_avg", "exp_avg_sq")
WITH_MASTER: tuple[TierKind, ...] = ("master", *MOMENTS)


def tier_kinds(master_is_streamed: bool) -> tuple[TierKind, ...]:
    """What the tier holds of each block: m and v, and the fp32 master unless it is the
    copy forward and backward stream (fp32 compute)."""
    return MOMENTS if master_is_streamed else WITH_MASTER


def swap_file_bytes(numel: int, alignment: int, kinds: int = len(MOMENTS)) -> int:
    """Bytes of one block's swap file: ``kinds`` fp32 buffers, each padded to ``alignment``."""
    return kinds * aligned_bytes(numel * FP32, alignment)


class NvmeTier:
    """The NVMe tier of the blocks' optimizer state; see the module docstring and [Note: the NVMe window].

    Args:
        numels: every block's flat size (its trained prefix where frozen parameters have no
            optimizer state), in block order: one swap file each, made now.
        kinds: what the files hold of each block (:func:`tier_kinds`).
        frozen_bytes: each block's frozen weights' bytes, in a read-only file of their own
            (``state/frozen_files.py``), with the weights on the tier; empty: none.
        runtime: host buffers (pinned with CUDA) and the tracer.
        options: ``nvme_path``, ``nvme_window_blocks``, ``nvme_aio``.

    The blocks' states arrive through :meth:`adopt`, in block order (built with
    a placement whose moments are on the tier: placeholders for them, no host memory).

    Attributes:
        settle: waits for asynchronous updates of host state (the device placement), set
            once the optimizer exists; runs before any slot is written back.
    """

    def __init__(
        self,
        numels: Sequence[int],
        kinds: Sequence[TierKind],
        runtime: DeviceRuntime,
        options: MegatrainOptions,
        frozen_bytes: Sequence[int] = (),
    ) -> None:
        self.kinds: tuple[TierKind, ...] = tuple(kinds)
        self.states: list[HostFlatState] = []
        self.runtime = runtime
        self.settle: Callable[[], None] = lambda: None
        self.io: SwapIO = open_swap_io(options.nvme_aio, runtime)
        self._numels = list(numels)
        self._pad = [aligned_bytes(numel * FP32, self.io.alignment) // FP32 for numel in self._numels]
        names = [f"block{index:05d}.swap" for index in range(len(self._numels))]
        self.frozen = FrozenFiles(frozen_bytes, self.io.alignment)
        files = {name: len(self.kinds) * pad * FP32 for name, pad in zip(names, self._pad)}
        try:
            self.directory = SwapDirectory(options.nvme_path or "", files | self.frozen.sizes())
        except BaseException:
            self.io.close()
            raise
        self._paths = [self.directory.files[name] for name in names]
        self.frozen.locate(self.directory.files)
        # What the race checker sees of each swap file's bytes (declare_access in _transfer).
        self._file_tokens = [torch.empty(1) for _ in names]
        self._written: dict[int, Transfer] = {}
        """The last write queued of each block's file: reads of it wait for it."""
        self._versions = [0] * len(names)
        self._index: dict[int, int] = {}
        window = min(options.nvme_window_blocks, max(len(self._numels), 1))
        largest = len(self.kinds) * max(self._pad, default=0)
        self._slots = [_Slot(self.io.buffer(largest)) for _ in range(window)]
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
        self._step_mark: tuple[float, float, int] | None = None  # (time, wait_seconds, bytes moved)
        self._warned = False
        self.closed = False
        """Set by the first :meth:`close`; later calls do nothing."""
        what = "the fp32 master, Adam m and v" if "master" in self.kinds else "Adam m and v"
        logger.info(
            "megatrain: NVMe tier: %s of %d blocks (%.2f GiB) in %s, %d-block window "
            "(%.2f GiB of host memory), I/O engine %s",
            what,
            len(self._numels),
            self.directory.nbytes / 2**30,
            self.directory.path,
            window,
            self.window_bytes / 2**30,
            self.io.name,
        )

    def adopt(self, state: HostFlatState) -> None:
        """Take the next block's state (see [Note: adopting blocks one by one]): with the
        master on the tier it is written to the block's file now (m and v start as the
        file's zeros), its host buffer freed and the block's parameters pointed at the shadow."""
        index = len(self.states)
        if index >= len(self._numels) or state.stepped_numel != self._numels[index]:
            raise ValueError(
                f"block {index} has {state.stepped_numel} elements, the tier was made for "
                f"{self._numels[index] if index < len(self._numels) else 'no more blocks'}"
            )
        if "master" in self.kinds:
            slot = self._slots[0]
            assert slot.index is None and slot.pending is None, "blocks are adopted before any access"
            numel, pad = state.stepped_numel, self._pad[index]
            part = slot.buffer[: len(self.kinds) * pad]
            part.zero_()
            part[:numel].copy_(state.master)
            try:
                self._transfer(part, index, writing=True, slot=slot, tracer=self.runtime.tracer, step={})
            except BaseException:
                self._raise_failure()  # explained: the path and the bytes
                raise
            if state.shadow is not None:
                state.point_params_at(state.shadow)
            else:  # weights on the tier: no host copy to view (state/nvme_weights.py)
                state.park_params()
            self.runtime.free_host(state.master)
            state.release(["master"])  # on the tier alone now
        frozen = state.frozen_for_tier  # not those kept in host memory beside a shadow
        if self.frozen.holds(index) != (frozen is not None and frozen.numel() > 0):
            raise ValueError(f"block {index}'s frozen weights are not where the tier was made for them")
        if frozen is not None:  # written once, never again ([Note: frozen weights on the tier])
            if self.frozen.holds(index):  # not a rank's empty window of them
                self.bytes_written += self.frozen.write(index, frozen)
            self.runtime.free_host(frozen)
            state.release(["frozen"])
        self.states.append(state)
        self._index[id(state)] = index

    # -- the window --------------------------------------------------------------------------

    @property
    def window_bytes(self) -> int:
        """Host memory of the window's slots."""
        return sum(slot.buffer.numel() * FP32 for slot in self._slots)

    @property
    def engine_name(self) -> str:
        return self.io.name

    def holds(self, state: HostFlatState) -> bool:
        return id(state) in self._index

    @property
    def numels(self) -> list[int]:
        """Every block's flat size, in block order."""
        return self._numels

    @property
    def padded_numels(self) -> list[int]:
        """Every block's flat size padded to the I/O engine's alignment (one kind in its file)."""
        return self._pad

    def weight_numel(self, index: int) -> int:
        """Elements of adopted block ``index``'s weights as :meth:`read_master` reads them: the
        trained prefix in its swap file (or a rank's window of it), the frozen weights (or
        the rank's window of them) in theirs after it."""
        return self._numels[index] + self.frozen.numel(index)

    def version(self, index: int) -> int:
        """How many times block ``index``'s master may have changed (see [Note: the NVMe window])."""
        return self._versions[index]

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

    def read_master(
        self, index: int, into: torch.Tensor, staging: torch.Tensor | None, frozen: torch.Tensor | None = None
    ) -> PendingTransfer:
        """Start reading block ``index``'s newest master into ``into`` (its first ``numel``
        elements, in ``into``'s dtype; through ``staging``, an fp32 buffer of the I/O
        engine's alignment, when that is not fp32), and its frozen weights after them
        through ``frozen``, an fp32 buffer of the alignment ([Note: frozen weights on the
        tier]); :meth:`await_transfer` the result before reading ``into``. The newest master
        is the window's, when a slot holds the block (copied on this thread), else the swap
        file's, once its last write is done."""
        assert self.kinds[0] == "master", "the weights are read from the tier only when it holds the masters"
        with self._lock:
            self._raise_failure()
            numel = self._numels[index]
            slot = self._where.get(index)
            from_file = slot is None
            if slot is not None:  # master is the first kind of a slot
                self.await_transfer(slot, index)
                with self.runtime.host_work():  # a host copy, done before any stream reads ``into``
                    into[:numel].copy_(slot.buffer[:numel])  # rounds to bf16 as the shadow is
                if not self.frozen.holds(index):
                    return PendingTransfer(None)
            target = into if staging is None else staging
            if target.dtype != torch.float32 or target.numel() < self._pad[index]:
                raise ValueError("read_master reads into an fp32 buffer of the block's padded size")
            if self.frozen.holds(index) and (frozen is None or frozen.numel() * FP32 < self.frozen.padded_bytes(index)):
                raise ValueError("read_master reads frozen weights into an fp32 buffer of their file's size")
            written = self._written.get(index)
            tracer = self.runtime.tracer
            step = {"step": tracer.step} if tracer.step is not None else {}

            def task() -> None:
                if from_file:
                    self._after_write(written)
                    self._transfer(
                        target, index, writing=False, slot=None, tracer=tracer, step=step, kinds=1, what="weights"
                    )
                    if staging is not None:
                        into[:numel].copy_(staging[:numel])
                if frozen is not None and self.frozen.holds(index):  # never written since adopted: no wait
                    self._transfer(frozen, index, writing=False, slot=None, tracer=tracer, step=step, frozen=True)
                    weights = self.frozen.unpack(index, frozen)
                    into[numel : numel + weights.numel()].copy_(weights)  # rounded where held in the master's dtype

            pending = PendingTransfer(Transfer(self.runtime, task))
            self._tasks.put(pending.pending)
            return pending

    def step_done(self) -> None:
        """Warn (once) when the disk does not keep up: from the second step on, if the
        training threads waited for it longer than :data:`DISK_WAIT_SHARE` of the step."""
        now, moved = time.perf_counter(), self.bytes_read + self.bytes_written
        if self._step_mark is not None and not self._warned:
            began, waited_before, moved_before = self._step_mark
            step, waited = now - began, self.wait_seconds - waited_before
            if waited > DISK_WAIT_SHARE * step:
                self._warned = True
                logger.warning(
                    "megatrain: the NVMe tier's disk traffic does not hide: the step waited %.2f s of %.2f s "
                    "for swap reads (%.2f GB moved at %.2f GB/s, %s). The disk is the bottleneck: raise "
                    "gradient_accumulation_steps (the optimizer state moves once per optimizer step, so "
                    "more micro-batches per step amortise it), put nvme_path on a faster disk (or several), "
                    "or keep the optimizer state in host memory if it fits",
                    waited,
                    step,
                    (moved - moved_before) / 1e9,
                    (moved - moved_before) / 1e9 / step,
                    self.io.name,
                )
        self._step_mark = (now, self.wait_seconds, moved)

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

    @contextlib.contextmanager
    def file_views(self) -> Iterator[Callable[[HostFlatState], dict[str, torch.Tensor] | None]]:
        """Yields ``on_tier(state)``: ``{kind: tensor}`` for each of :attr:`kinds`, mapped from
        the state's swap file (writes go to the file), or None for a state not on the tier.
        Drop the tensors when done with a shard; the files are fsynced on exit."""
        with self._lock:
            upcoming = list(self._schedule)
        self.flush()
        touched: set[int] = set()

        def on_tier(state: HostFlatState) -> dict[str, torch.Tensor] | None:
            index = self._index.get(id(state))
            if index is None:
                return None
            touched.add(index)
            pad, numel = self._pad[index], state.stepped_numel
            mapped = torch.from_file(self._paths[index], shared=True, size=len(self.kinds) * pad, dtype=torch.float32)
            views = {kind: mapped[k * pad : k * pad + numel] for k, kind in enumerate(self.kinds)}
            if self.frozen.holds(index):  # read only in training; a checkpoint load writes it
                views["frozen"] = self.frozen.mapped(index, shared=True)
            return views

        try:
            yield on_tier
        finally:
            for index in touched:
                self._versions[index] += 1  # a checkpoint may have written it
            for index in touched:  # a mapping's writes reach the disk before O_DIRECT reads it
                fd = os.open(self._paths[index], os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if self.frozen.holds(index):
                    self.frozen.fsync(index)
            with self._lock:  # read ahead again what was expected before
                self._schedule = deque(upcoming)
                self._prefetch()

    def close(self) -> None:
        """Stop the I/O threads, free the window, remove the swap directory.

        With the masters on the tier the blocks' parameters first get them back: each
        block's parameters view a private mapping of its swap file (``torch.from_file``,
        ``MAP_PRIVATE``), which outlives the file's removal. The fp32 model then costs page
        cache that the kernel can drop and read again, not host memory, and its disk space
        is freed when the model is.

        Idempotent: a second call would map files that the first one removed."""
        if self.closed:
            return
        self.closed = True
        try:
            if "master" in self.kinds and self._failure is None:
                self.flush()
                for index, state in enumerate(self.states):
                    pad, numel = self._pad[index], state.stepped_numel
                    mapped = torch.from_file(
                        self._paths[index], shared=False, size=len(self.kinds) * pad, dtype=torch.float32
                    )
                    state.bind({"master": mapped[:numel]})
                    if self.frozen.holds(index):
                        state.bind({"frozen": self.frozen.mapped(index, shared=False)})
                    state.point_params_at(state.master)
        finally:
            with self._lock:
                for index in list(self._where):
                    self._unbind(index)
                for _ in self._threads:  # after every queued transfer (one queue, first in first out)
                    self._tasks.put(None)
                for thread in self._threads:
                    thread.join()
                self.io.close()
                self.directory.close()

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


def open_nvme_tier(
    numels: Sequence[int],
    kinds: Sequence[TierKind],
    runtime: DeviceRuntime,
    options: MegatrainOptions,
    frozen_bytes: Sequence[int] = (),
) -> NvmeTier:
    """The tier for blocks of these flat sizes (and frozen weights' bytes); a clear error
    when the swap directory cannot be made."""
    try:
        return NvmeTier(numels, kinds, runtime, options, frozen_bytes)
    except (DiskSpaceError, SwapIOError):
        raise
    except OSError as error:
        raise SwapIOError(
            error.errno or errno.EIO, f"cannot set up the NVMe tier's swap files: {error}", str(options.nvme_path)
        ) from error
