"""Reading and writing swap files with O_DIRECT: DeepSpeed's async I/O op, or a thread fallback.

The NVMe tier (``state/nvme_tier.py``) moves one block's optimizer state per request,
hundreds of megabytes at a time, on its own I/O threads while the engine computes. What
it needs from an engine is a blocking ``read``/``write`` of one aligned host buffer at a
file offset that releases the GIL for the whole transfer, and aligned host buffers:

- :class:`AioEngine`: DeepSpeed's async I/O op (its ``aio_handle``; libaio, O_DIRECT),
  built once per machine (``runtime/built_ops.py``). Its ``sync_pread``/``sync_pwrite``
  split a request over ``thread_count`` threads of ``block_size`` pieces, ``queue_depth``
  deep, with the GIL released. Buffers come from the handle's page-locked allocator, which
  the op uses without a bounce copy -- but only on the handle that allocated them, so there is one
  handle, and requests from several threads take turns on it (one disk: the op's own
  queue is where the parallelism is). Where the runtime pins host memory for CUDA its own
  pinned buffers are used instead (the op accepts CUDA-pinned memory too).
- :class:`ThreadedDirectEngine`: the fallback where the op cannot be built (no libaio,
  no compiler): ``os.preadv``/``os.pwritev`` (which release the GIL) on an O_DIRECT file
  descriptor, ``block_size`` pieces spread over ``thread_count`` threads.

:func:`open_swap_io` picks one ("auto": DeepSpeed's op when it builds, with the reason
logged when it does not) and the log names the engine that runs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatrain_ds.config import AioSettings
from megatrain_ds.runtime.built_ops import deepspeed_op
from megatrain_ds.runtime.device_runtime import PAGE_BYTES, DeviceRuntime
from megatrain_ds.runtime.measurement_cache import cached_measurement
from megatrain_ds.state.swap_directory import DiskSpaceError

logger = logging.getLogger(__name__)

DIRECT_ALIGNMENT = 4096
"""Byte alignment of O_DIRECT offsets, lengths and buffers (the logical block size of
every common NVMe drive and filesystem; 512-byte devices accept it too)."""


class SwapIOError(OSError):
    """A swap file read or write failed; the message names the file and the bytes."""


class Transfer:
    """One slot's queued I/O task, finished once. Its completion is a handoff the race
    checker sees (``runtime.host_queue``): whoever synchronises with it is ordered after
    the I/O thread's accesses to the slot's buffer."""

    def __init__(self, runtime: DeviceRuntime, work: Callable[[], None]) -> None:
        self.work = work
        self.error: BaseException | None = None
        self._finished = threading.Event()
        self._outcome = runtime.host_queue()

    def run(self) -> None:
        """On an I/O thread: do the work, then hand its outcome over."""
        try:
            self.work()
        except BaseException as error:  # the tier raises it on the training thread (``NvmeTier._failure``)
            self.error = error
        self._outcome.put(None)
        self._finished.set()

    def done(self) -> bool:
        """Whether the work has finished (no ordering: :meth:`synchronize` before touching its buffer)."""
        return self._finished.is_set()

    def synchronize(self) -> None:
        """Block until the work has finished. Each caller takes the outcome and puts it
        back, so every one of them is ordered after the I/O thread."""
        self._outcome.put(self._outcome.get())


def explained_failure(error: BaseException, path: str, nbytes: int, writing: bool, what: str) -> BaseException:
    """The error the training thread raises for a failed swap transfer of ``nbytes`` of ``what``
    to or from ``path``: a full disk as :class:`DiskSpaceError`, another ``OSError`` as
    :class:`SwapIOError`, each naming the file and the bytes; anything else as it is."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(
            error.errno,
            f"the disk is full: writing {nbytes} bytes of {what} "
            "failed. The step is incomplete; the last checkpoint is intact: "
            "free space there and resume from it",
            path,
        )
    if isinstance(error, OSError):
        return SwapIOError(
            error.errno or errno.EIO,
            f"{'writing' if writing else 'reading'} {nbytes} bytes of {what} failed: {error.strerror or error}",
            path,
        )
    return error


class SwapIO(Protocol):
    """An I/O engine for swap files (see the module docstring)."""

    name: str
    alignment: int
    """Every request's length and file offset are multiples of this many bytes."""

    def read(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        """Fill ``buffer`` (contiguous, aligned) from ``path`` at ``offset``; blocks, GIL released."""

    def write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        """Write ``buffer`` to ``path`` at ``offset`` (the file exists, preallocated)."""

    def buffer(self, numel: int) -> torch.Tensor:
        """An fp32 host buffer of ``numel`` elements the engine transfers without a copy."""
        ...

    def close(self) -> None:
        """Free the engine's buffers and threads."""


@functools.cache
def deepspeed_aio_op() -> Any:
    """DeepSpeed's async I/O op, loaded once per process and shared by every tier in it; built
    once per machine (``megatrain_ds/runtime/built_ops.py``), after the pinned-memory op whose
    symbols it resolves. Where it is built already, nothing probes the CPU or checks for
    libaio (the build links it)."""
    # Only deepspeed.ops below integration/. Its builders are module attributes set in a loop.
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder  # pyright: ignore[reportAttributeAccessIssue]

    deepspeed_op(PinMemoryBuilder, global_symbols=True)
    return deepspeed_op(AsyncIOBuilder, requires="libaio: apt-get install libaio-dev")


@dataclass
class AioEngine:
    """DeepSpeed's async I/O op (see the module docstring)."""

    settings: AioSettings
    runtime: DeviceRuntime
    name: str = "deepspeed-aio"

    def __post_init__(self) -> None:
        self._module = deepspeed_aio_op()
        s = self.settings
        self._handle = self._module.aio_handle(
            s.block_size, s.queue_depth, s.single_submit, s.overlap_events, s.thread_count
        )
        # A handle's wait() waits for all of its requests: one request at a time on it.
        self._turn = threading.Lock()
        self._locked: list[torch.Tensor] = []
        self.alignment = DIRECT_ALIGNMENT * s.thread_count

    def read(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        with self._turn:  # waiting here releases the GIL, as the transfer does
            failed = self._handle.sync_pread(buffer, path, offset) < 0
        if failed:
            raise SwapIOError(
                errno.EIO, f"reading {buffer.nbytes} bytes at offset {offset} failed (DeepSpeed async_io)", path
            )

    def write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        with self._turn, _first_write_alone():
            failed = self._handle.sync_pwrite(buffer, path, offset) < 0
        if failed:
            raise SwapIOError(
                errno.EIO, f"writing {buffer.nbytes} bytes at offset {offset} failed (DeepSpeed async_io)", path
            )

    def buffer(self, numel: int) -> torch.Tensor:
        if self.runtime.pin_memory:
            return self.runtime.host_empty(numel, torch.float32)  # CUDA-pinned: the op takes it as is
        tensor = self._handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
        self._locked.append(tensor)
        return tensor

    def close(self) -> None:
        for tensor in self._locked:
            self._handle.free_cpu_locked_tensor(tensor)
        self._locked.clear()


_FIRST_WRITE_LOCK = threading.Lock()
_first_write_done = threading.Event()


@contextlib.contextmanager
def _first_write_alone() -> Iterator[None]:
    """Let the process's first write through DeepSpeed's op run alone (no later write waits).

    DeepSpeed's ``sync_pwrite`` logs a once-per-process warning (heavy writes wear consumer
    SSDs) from a C++ ``call_once`` it enters while holding the GIL, and the logging inside
    can hand the GIL over: a second I/O thread entering the ``call_once`` then blocks holding
    the GIL, and the first cannot finish (seen with DeepSpeed 0.19 and two engines writing
    at once for the first time). A second first writer waits here instead, on a Python lock,
    which releases the GIL; DeepSpeed's own warning is logged as it is, once. (This replaces
    setting the op's private "already warned" attribute on ``deepspeed.utils``: no
    third-party state is touched, see ``integration/compat.py``.)"""
    if _first_write_done.is_set():
        yield
        return
    with _FIRST_WRITE_LOCK:
        yield
        _first_write_done.set()


@dataclass
class ThreadedDirectEngine:
    """``os.preadv``/``os.pwritev`` on O_DIRECT descriptors over a thread pool (see the
    module docstring)."""

    settings: AioSettings
    runtime: DeviceRuntime
    name: str = "threads-odirect"

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.settings.thread_count, thread_name_prefix="megatrain-swap-io")
        self.alignment = DIRECT_ALIGNMENT

    def read(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._transfer(buffer, path, offset, write=False)

    def write(self, buffer: torch.Tensor, path: str, offset: int) -> None:
        self._transfer(buffer, path, offset, write=True)

    def _transfer(self, buffer: torch.Tensor, path: str, offset: int, write: bool) -> None:
        # numpy's stub gives ndarray the buffer protocol on Python >= 3.12 only (it has it on 3.10).
        view = memoryview(buffer.view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
        fd = open_direct(path, write)
        try:
            # thread_count aligned pieces (at least block_size), one syscall each, all at once:
            # large transfers, and the drive's queue filled from threads.
            share = aligned_bytes(-(-len(view) // self.settings.thread_count), DIRECT_ALIGNMENT)
            piece = max(self.settings.block_size, share)
            starts = range(0, len(view), piece)
            done = list(
                self._pool.map(
                    lambda start: _transfer_piece(fd, view[start : start + piece], offset + start, write), starts
                )
            )
            if sum(done) != len(view):
                raise SwapIOError(
                    errno.EIO,
                    f"short {'write' if write else 'read'}: {sum(done)} of {len(view)} bytes at offset {offset}",
                    path,
                )
        finally:
            os.close(fd)

    def buffer(self, numel: int) -> torch.Tensor:
        return self.runtime.host_empty(numel, torch.float32)  # page-aligned: O_DIRECT takes it

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _transfer_piece(fd: int, view: memoryview, offset: int, write: bool) -> int:
    done = 0
    while done < len(view):
        part = view[done:]
        count = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        if count <= 0:
            break
        done += count
    return done


def open_direct(path: str, write: bool) -> int:
    """An O_DIRECT descriptor of ``path``; a clear error where the filesystem refuses O_DIRECT."""
    flags = (os.O_WRONLY if write else os.O_RDONLY) | getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags)
    except OSError as error:
        if error.errno == errno.EINVAL:
            raise SwapIOError(
                errno.EINVAL,
                "the filesystem does not support O_DIRECT (tmpfs does not); "
                "put nvme_path on a local disk filesystem (ext4, xfs)",
                path,
            ) from None
        raise


def open_swap_io(settings: AioSettings, runtime: DeviceRuntime) -> SwapIO:
    """The engine ``settings.engine`` names; ``"auto"``: DeepSpeed's op, else the threads."""
    if settings.engine in ("auto", "aio"):
        try:
            return AioEngine(settings, runtime)
        except Exception as error:
            if settings.engine == "aio":
                raise RuntimeError(
                    f'megatrain.nvme_aio.engine is "aio" but DeepSpeed\'s async_io op cannot be used: {error}'
                ) from error
            logger.warning(
                "megatrain: DeepSpeed's async_io op cannot be used (%s); the NVMe tier uses "
                "O_DIRECT reads and writes on a thread pool instead",
                error,
            )
    return ThreadedDirectEngine(settings, runtime)


def aligned_bytes(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to ``alignment``."""
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential O_DIRECT bandwidth of a filesystem, bytes per second."""

    read: float
    write: float


def measure_disk_bandwidth(directory: str, nbytes: int = 1 << 30, piece: int = 16 << 20) -> DiskBandwidth:
    """The disk's own sequential O_DIRECT bandwidth under ``directory``: one thread, ``piece``
    transfers through one page-aligned buffer, over a fresh preallocated file of ``nbytes``
    (written, then read; removed afterwards). The reference the tier's achieved bandwidth
    is compared with (``bench/nvme.py``) and the planner's disk figure."""
    nbytes = aligned_bytes(nbytes, piece)
    raw = torch.empty(piece + PAGE_BYTES, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE_BYTES
    # numpy's stub gives ndarray the buffer protocol on Python >= 3.12 only (it has it on 3.10).
    view = memoryview(raw[start : start + piece].numpy())  # pyright: ignore[reportArgumentType]
    raw[start : start + piece].fill_(1)  # not zero pages: some devices shortcut those
    path = os.path.join(directory, f".megatrain-bandwidth-{os.getpid()}")
    with open(path, "wb") as handle:
        os.posix_fallocate(handle.fileno(), 0, nbytes)
    try:
        timings = []
        for write in (True, False):
            fd = open_direct(path, write)
            try:
                began = time.perf_counter()
                for offset in range(0, nbytes, piece):
                    if (os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)) != piece:
                        raise SwapIOError(errno.EIO, "short transfer while measuring the disk", path)
                if write:
                    os.fsync(fd)
                timings.append(time.perf_counter() - began)
            finally:
                os.close(fd)
    finally:
        os.unlink(path)
    return DiskBandwidth(read=nbytes / timings[1], write=nbytes / timings[0])


def cached_disk_bandwidth(directory: str, cache: Path, recalibrate: bool = False) -> DiskBandwidth:
    """:func:`measure_disk_bandwidth` of ``directory``'s filesystem, measured once per
    machine and filesystem and kept in ``cache`` (JSON; ``recalibrate`` measures again)."""
    os.makedirs(directory, exist_ok=True)
    key = f"{socket.gethostname()}|dev {os.stat(directory).st_dev}"

    def measure() -> dict:
        measured = measure_disk_bandwidth(directory)
        return {"read": measured.read, "write": measured.write, "measured_in": directory}

    figures = cached_measurement(cache, key, measure, recalibrate)
    return DiskBandwidth(read=figures["read"], write=figures["write"])
