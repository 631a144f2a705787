"""How the CPU path holds transient host memory (``runtime/host_heap.py``), measured through glibc's
own counters and the process's resident set size."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain_ds.runtime.host_heap import (
    MMAP_THRESHOLD_BYTES,
    keep_large_transients_mapped,
    release_large_transients_mapping,
    release_pages,
    return_free_memory,
)

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc 2.33+ only: the behaviour under test is glibc's")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _mapped_bytes(libc: ctypes.CDLL) -> int:
    return libc.mallinfo2().hblkhd


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_large_transients_get_pages_of_their_own():
    """In a fresh process: malloc serves a request from a free chunk of the heap big enough
    for it before it maps pages, whatever the threshold, and a test worker's heap has such
    chunks after other tests (which one depends on the order xdist hands the tests out)."""
    _glibc()
    _in_fresh_process("_large_transients_get_pages_of_their_own")


def _in_fresh_process(function: str, env: dict[str, str] | None = None) -> None:
    """Run this module's ``function`` in a new interpreter; fail with its error output."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_host_heap as t; "
    code += f"t.{function}()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def _large_transients_get_pages_of_their_own() -> None:
    libc = _glibc()
    # Free a 20 MiB block first: left to itself glibc would now serve the 8 MiB tensor
    # below from its heap (its threshold rises to the size of a mapped block freed).
    raises_threshold = torch.empty(20 * MIB, dtype=torch.uint8)
    del raises_threshold
    assert keep_large_transients_mapped()
    before = _mapped_bytes(libc)
    large = torch.empty(MMAP_THRESHOLD_BYTES * 2, dtype=torch.uint8)
    assert _mapped_bytes(libc) - before >= large.numel()
    small = torch.empty(MMAP_THRESHOLD_BYTES // 4, dtype=torch.uint8)
    assert _mapped_bytes(libc) - before < large.numel() + small.numel()
    del large, small


def test_free_heap_pages_go_back_to_the_system():
    _glibc()
    assert keep_large_transients_mapped()
    # Heap-sized tensors, written so their pages are resident, with a kept one after each:
    # freeing the others leaves holes, which glibc keeps (it can only shrink the heap's top).
    pairs = [
        (
            torch.ones(MMAP_THRESHOLD_BYTES // 4, dtype=torch.uint8),
            torch.ones(MMAP_THRESHOLD_BYTES // 4, dtype=torch.uint8),
        )
        for _ in range(32)
    ]
    kept = [keep for _, keep in pairs]
    freed = sum(hole.numel() for hole, _ in pairs)
    del pairs
    before = _rss_bytes()
    return_free_memory()
    assert before - _rss_bytes() >= freed // 2, "most of the freed heap pages should have left the process"
    del kept


def _mkl_gemm_buffers_go_back_to_the_system() -> None:
    _glibc()
    assert keep_large_transients_mapped()
    # The shape of a vocabulary-wide output projection, 1024 tokens. How much MKL keeps
    # depends on the kernels it dispatches: ~29 MiB with AVX-512 (Intel), ~14 MiB with AVX2
    # (what it runs on AMD; 256 tokens there keep under 3 MiB), so the figure is measured.
    x, weight = torch.randn(1024, 1536), torch.randn(32000, 1536)
    ctypes.CDLL(None).malloc_trim(0)
    without_buffers = _rss_bytes()
    logits = x @ weight.t()
    del logits  # mapped (over the threshold): gone from RSS at once
    ctypes.CDLL(None).malloc_trim(0)  # the heap's free pages go first, so what follows is MKL's
    before = _rss_bytes()
    kept = before - without_buffers
    assert kept >= 4 * MIB, f"MKL kept {kept / MIB:.1f} MiB after the GEMM: nothing for the test to free"
    return_free_memory()
    freed = before - _rss_bytes()
    assert freed >= 0.75 * kept, f"MKL's packing buffers for the GEMM should have been freed: {freed} of {kept} B"


def test_mkl_gemm_buffers_go_back_to_the_system():
    """In a fresh process with torch's default threads: MKL's buffers are per process and
    thread, and a test worker process (pytest-xdist) runs on one thread after other GEMMs."""
    _glibc()
    if not torch.backends.mkl.is_available():
        pytest.skip("PyTorch built without MKL")
    # torch's own thread count (a worker's OMP_NUM_THREADS=1 makes MKL keep no packing
    # buffers to free while the other cores are busy).
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    _in_fresh_process("_mkl_gemm_buffers_go_back_to_the_system", env)


def test_the_last_holder_restores_the_threshold():
    """Two engines in one process: the threshold stays fixed until both have handed it back,
    then glibc maps a request of its initial threshold and up again. In a fresh process, with
    no ``MALLOC_MMAP_THRESHOLD_`` (its value would be the one restored)."""
    _glibc()
    env = {key: value for key, value in os.environ.items() if key not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    _in_fresh_process("_the_last_holder_restores_the_threshold", env)


def _the_last_holder_restores_the_threshold() -> None:
    libc = _glibc()
    size = MMAP_THRESHOLD_BYTES * 3 // 4  # under the fixed threshold, far over glibc's 128 KiB
    assert keep_large_transients_mapped() and keep_large_transients_mapped()
    release_large_transients_mapping()  # one holder left: still fixed
    before = _mapped_bytes(libc)
    from_the_heap = torch.ones(size, dtype=torch.uint8)  # kept: its heap chunk stays taken
    assert _mapped_bytes(libc) - before < size
    release_large_transients_mapping()  # the last: glibc's threshold again
    before = _mapped_bytes(libc)
    mapped = torch.ones(size, dtype=torch.uint8)
    assert _mapped_bytes(libc) - before >= size
    del from_the_heap, mapped


def test_release_pages_hands_back_the_whole_pages_inside_the_range_only():
    """The pages wholly inside the byte range read as zeros afterwards (their memory went back
    to the system); the bytes around them, in the partial pages at either end, are untouched."""
    tensor = torch.ones(1 << 20)  # 4 MiB
    before = tensor.view(torch.uint8).clone()
    assert release_pages(tensor, 1000, 3 * MIB + 5)
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-(tensor.data_ptr() + 1000) // page) * page - tensor.data_ptr()
    last = (tensor.data_ptr() + 3 * MIB + 5) // page * page - tensor.data_ptr()
    after = tensor.view(torch.uint8)
    assert 1000 <= first < last <= 3 * MIB + 5
    assert bool(after[first:last].eq(0).all())
    assert torch.equal(after[:first], before[:first]) and torch.equal(after[last:], before[last:])
