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

The window of host-memory slots through which every access to a block's state on the tier
goes, and the ordering of its transfers, are ``state/nvme_window.py``'s (:class:`NvmeWindow`,
which :class:`NvmeTier` extends; [Note: the NVMe window] there).

Checkpoints read and write the tier's kinds through :meth:`NvmeTier.file_views`: the window
is written back and emptied, and the swap files are mapped (``torch.from_file``), one
shard's worth at a time, so a checkpoint streams from the tier that holds each tensor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from megatrain_ds.config import MegatrainOptions
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.frozen_files import FrozenFiles
from megatrain_ds.state.host_store import HostFlatState, TierKind
from megatrain_ds.state.nvme_window import FP32, NvmeWindow, PendingTransfer
from megatrain_ds.state.swap_directory import DiskSpaceError, SwapDirectory
from megatrain_ds.state.swap_io import SwapIOError, Transfer, aligned_bytes, open_swap_io

logger = logging.getLogger(__name__)

DISK_WAIT_SHARE = 0.2
"""Warn once the training threads wait for the disk longer than this share of a step."""


MOMENTS: tuple[TierKind, ...] = ("exp_avg", "exp_avg_sq")
WITH_MASTER: tuple[TierKind, ...] = ("master", *MOMENTS)


def tier_kinds(master_is_streamed: bool) -> tuple[TierKind, ...]:
    """What the tier holds of each block: m and v, and the fp32 master unless it is the
    copy forward and backward stream (fp32 compute)."""
    return MOMENTS if master_is_streamed else WITH_MASTER


def swap_file_bytes(numel: int, alignment: int, kinds: int = len(MOMENTS)) -> int:
    """Bytes of one block's swap file: ``kinds`` fp32 buffers, each padded to ``alignment``."""
    return kinds * aligned_bytes(numel * FP32, alignment)


def is_on_tier(state: HostFlatState) -> bool:
    """Whether a block's state (with data parallel a rank's window of it) is on the NVMe
    tier: unless what its optimizer state covers is empty (a block with nothing trained, a
    rank's empty window), and so are its frozen weights, or its window of them, where those
    are apart (``state/placement.py``: the tier has files for the others alone)."""
    frozen = state.frozen_for_tier
    return state.stepped_numel > 0 or (frozen is not None and frozen.numel() > 0)


class NvmeTier(NvmeWindow):
    """The NVMe tier of the blocks' optimizer state; see the module docstring, and
    [Note: the NVMe window] (``state/nvme_window.py``) for the window it moves them through.

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
    """

    def __init__(
        self,
        numels: Sequence[int],
        kinds: Sequence[TierKind],
        runtime: DeviceRuntime,
        options: MegatrainOptions,
        frozen_bytes: Sequence[int] = (),
    ) -> None:
        io = open_swap_io(options.nvme_aio, runtime)
        self._numels = list(numels)
        pads = [aligned_bytes(numel * FP32, io.alignment) // FP32 for numel in self._numels]
        names = [f"block{index:05d}.swap" for index in range(len(self._numels))]
        frozen = FrozenFiles(frozen_bytes, io.alignment)
        files = {name: len(kinds) * pad * FP32 for name, pad in zip(names, pads)}
        try:
            self.directory = SwapDirectory(options.nvme_path or "", files | frozen.sizes())
        except BaseException:
            io.close()
            raise
        frozen.locate(self.directory.files)
        window = min(options.nvme_window_blocks, max(len(self._numels), 1))
        # The window's slots and I/O threads (state/nvme_window.py), once the files exist.
        super().__init__(runtime, io, kinds, pads, [self.directory.files[name] for name in names], frozen, window)
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
        """How many times block ``index``'s master may have changed (see [Note: the NVMe window]
        in ``state/nvme_window.py``)."""
        return self._versions[index]

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
