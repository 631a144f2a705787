"""Transient host memory on the CPU path: keep it from piling up, hand it back between phases.

On a GPU a step's transients -- activations, weight gradients, logits -- come from the
CUDA caching allocator, and host memory holds the persistent state. When the device is
the host (``DeviceRuntime.shares_host_memory``) they come from glibc's ``malloc`` and
MKL's GEMM, and two habits of theirs put the process's peak well above what is live
(measured at 551M parameters, hidden 1536, 2x128 tokens; README, Performance):

- glibc serves a request below its mmap threshold from a heap, and raises the threshold
  to the size of every mapped block that is freed, up to 32 MiB. After the engine's
  set-up the threshold is above every transient, so weight gradients (up to 25 MB) and
  logits (33 MB) come from the heap, and 1.5 MB activations that outlive them pin its
  pages: the heap grows well past what is live and keeps the difference (0.3-0.5 B/param)
  as free, resident memory.
- MKL keeps the packing buffers of the largest GEMMs it has run (the vocabulary-wide
  output projection's, ~33 MB, and the blocks') for the life of the process.

:func:`keep_large_transients_mapped` fixes glibc's mmap threshold at
:data:`MMAP_THRESHOLD_BYTES`: a transient that large gets pages of its own and returns
them when freed, at the price of faulting its pages in afresh each time (about 5% of the
step at 551M parameters). Smaller ones stay in the heap, where a page fault per use would
cost more than it saves (a 1 MiB threshold made the step about 14% slower).
:func:`return_free_memory` hands back the heap's free pages (``malloc_trim``) and MKL's
unused buffers (``mkl_serv_free_buffers``, which frees only buffers no GEMM is using).
The engine calls it at the step's phase boundaries only (``streaming/streamed_blocks.py``): after
every block it would cost more step time (10-20%: the pages are faulted in again)
than the 0.05 B/param it saves.

Both are process-wide and change only how memory is held, never a tensor's contents;
without glibc, or with a PyTorch built without MKL, they do nothing.

:func:`release_pages` is for the host state on any device: migrating a parameter into its
flat buffer (``state/host_store.py``) copies it a chunk at a time and hands each chunk's
source pages back at once (``madvise(MADV_DONTNEED)``), so the process never holds a second
whole copy of its largest parameter. Unlike the two above it changes contents: the
released pages read as zeros, which is why it is only used on storage nothing else uses.

The threshold is the process's, and several engines may live in one process: each
engine that fixed it (``DeviceRuntime.create``) hands it back once
(:func:`release_large_transients_mapping`, from ``engine.destroy()``), and the last one
restores the threshold that was in force before. glibc has no getter for it: that is
the value of ``MALLOC_MMAP_THRESHOLD_`` or of the ``glibc.malloc.mmap_threshold``
tunable when the process was started with one, else glibc's initial 128 KiB. glibc's
sliding of the threshold (the first habit above) stays off after any ``mallopt`` of it,
ours or the restore: glibc offers no way to switch it back on.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MMAP_THRESHOLD_BYTES = 4 << 20
"""Transients from this size up (MLP activations at 2x128 tokens and up, weight gradients,
logits) are mapped, not taken from the heap."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_MADV_DONTNEED = 4  # Linux's madvise advice (sys/mman.h): drop the pages, zeros on next touch
_GLIBC_INITIAL_MMAP_THRESHOLD = 128 << 10  # DEFAULT_MMAP_THRESHOLD_MIN in glibc's malloc.c


@dataclass
class _ThresholdHolders:
    """How many callers hold :data:`MMAP_THRESHOLD_BYTES` in force (under ``lock``)."""

    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_holders = _ThresholdHolders()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (``mallopt`` and ``malloc_trim`` are glibc's)."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # no process-wide symbol table to open (Windows)
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


@functools.cache
def _mkl_free_buffers() -> Callable[[], object] | None:
    """MKL's ``mkl_serv_free_buffers``, linked into PyTorch's CPU library, if it is there."""
    if not torch.backends.mkl.is_available():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path).mkl_serv_free_buffers
    except (OSError, AttributeError):
        return None


def keep_large_transients_mapped() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (see the module doc).

    Returns whether it was set; each call that returns True is one hold, handed back by
    one :func:`release_large_transients_mapping`. Memory already allocated is not moved.
    """
    libc = _libc()
    if libc is None:
        return False
    with _holders.lock:
        if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
            return False
        _holders.count += 1
        return True


def release_large_transients_mapping() -> None:
    """Hand back one hold of :func:`keep_large_transients_mapped`; the last one restores the
    threshold in force before the first (see the module doc)."""
    libc = _libc()
    with _holders.lock:
        assert _holders.count > 0, "released more often than kept"
        _holders.count -= 1
        if _holders.count == 0 and libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, threshold_before())


def holds_of_large_transients_mapping() -> int:
    """How many holds of :func:`keep_large_transients_mapped` are not handed back yet."""
    return _holders.count


def threshold_before() -> int:
    """The mmap threshold the process started with: its environment's, else glibc's initial."""
    tunables = dict(
        item.split("=", 1) for item in os.environ.get("GLIBC_TUNABLES", "").replace(":", " ").split() if "=" in item
    )
    for value in (os.environ.get("MALLOC_MMAP_THRESHOLD_"), tunables.get("glibc.malloc.mmap_threshold")):
        if value is not None and value.strip().isdigit():
            return int(value)
    return _GLIBC_INITIAL_MMAP_THRESHOLD


def release_pages(tensor: torch.Tensor, start: int, end: int) -> bool:
    """Hand the system back the whole pages inside bytes ``[start, end)`` of ``tensor``'s data,
    whose values are no longer needed: they read as zeros afterwards. For a host tensor that
    alone uses its storage and is about to be freed (the migration's source,
    ``state/host_store.py``): the pages are the storage's own, whether glibc mapped it or took
    it from its heap, so no other allocation loses anything. Returns whether the pages were
    released (not without glibc)."""
    libc = _libc()
    if libc is None:
        return False
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-(tensor.data_ptr() + start) // page) * page  # whole pages only: round inwards
    last = (tensor.data_ptr() + end) // page * page
    if last <= first:
        return True  # nothing whole to release
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0


def return_free_memory() -> None:
    """Give the heap's free pages and MKL's unused GEMM buffers back to the system."""
    free_buffers = _mkl_free_buffers()
    if free_buffers is not None:
        free_buffers()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
