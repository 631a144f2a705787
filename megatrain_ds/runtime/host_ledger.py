"""The host ledger: per optimizer step, the host memory traffic the engine's host side costs.

The race checker (``stream_check.py``, ``MEGATRAIN_STREAM_CHECK=1``) already sees every
tensor access of the engine with its extent and knows who performed it: a host thread, or
a virtual stream (device work). It feeds each access to a :class:`HostLedger`, which adds
up what the host pays for a step. Read a step's figures from
``engine.last_host_ledger`` (a :class:`LedgerCounts`), from the ``host_ledger`` argument
of the ``step`` spans of a trace taken with the checker on (``"megatrain": {"trace": ...}``),
or with ``bench/host_pipeline.py``.

[Note: what the host ledger counts]
The checker runs the CPU path as a GPU would run it: "device" buffers apart from host
buffers, work issued to virtual streams. On that model:

- *host storage*: memory the checker knows as host memory: buffers of
  ``runtime.host_empty``/``pinned_empty`` (the masters, shadows, Adam moments, held
  gradients, staging, the journal) and what host threads allocate (their temporaries).
  Model weights in the streamer's slots, activations and device gradients are device
  storage: the model's forward and backward compute on the CPU stands for the GPU's work
  and is never counted.
- *host traffic* (``host_read_bytes``, ``host_written_bytes``): bytes of host storage read
  and written by ops that a host thread performs (the gradient worker, the caller's
  thread inside ``runtime.host_work()`` or on host buffers alone, the data-parallel
  reducer). An op's bytes are its tensors' bytes (``numel * element_size``, at most the
  extent it spans, so a broadcast input counts once): inputs are read; outputs and
  overwritten arguments (``copy_``'s destination, ``out=``) are written; an argument
  updated in place (``add_``'s ``self``, AdamW's master and moments) is read *and*
  written. Accesses that bypass aten count as declared (``declare_access``: ``reads``,
  ``writes``, ``updates``).
- *copy traffic* (``copy_read_bytes``, ``copy_written_bytes``): bytes of host storage that
  ops issued to a stream read (host-to-device copies: weights, resident parameters) or
  write (device-to-host copies: gradient chunks into staging). On a GPU the copy engine,
  not a host thread, moves them; they still cross the host's memory bus. Device-only
  bytes on a stream are not counted.
- ``host_ops``: host-thread ops that touch host storage (each an aten call or a declared
  kernel call: a Python-level dispatch the GIL serialises).

A step is everything between the previous step's close and this one's (the engine closes
a step in ``engine.step()`` at the accumulation boundary, just before the optimizer
finish), so a step with gradient accumulation counts every micro-batch's work, and a
step's figures hold the finish of the step before it: its update runs behind
``engine.step()`` where it is pipelined (``optimizer/pipelined_finish.py``), so only this
boundary gives every step the same work whatever the timing. The first step has no
finish before it; a steady step's figures are one whole step's. Per parameter figures divide by the
parameters the engine trains and streams (every parameter of every flat state, padding
excluded).

There is a ledger only under the checker: the plain CPU path computes on host memory and
copies nothing (its figures would say nothing of a GPU's), and on a GPU nothing observes
the accesses (``runtime.host_ledger`` and ``engine.last_host_ledger`` are then ``None``).
Since the CPU path runs the GPU's code with virtual streams (``[Note: one code path]`` in
``device_runtime.py``), the checker's counts are the host traffic a GPU run has.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LedgerCounts:
    """Host traffic, copy traffic and host ops (see [Note: what the host ledger counts])."""

    host_read_bytes: int = 0
    host_written_bytes: int = 0
    copy_read_bytes: int = 0
    """Host bytes read by ops issued to a stream (host-to-device copies)."""
    copy_written_bytes: int = 0
    """Host bytes written by ops issued to a stream (device-to-host copies)."""
    host_ops: int = 0

    @property
    def host_bytes(self) -> int:
        """Bytes host threads touch on host storage."""
        return self.host_read_bytes + self.host_written_bytes

    @property
    def copy_bytes(self) -> int:
        """Host bytes the copies move."""
        return self.copy_read_bytes + self.copy_written_bytes

    @property
    def traffic_bytes(self) -> int:
        """All host memory traffic of the step: host threads' and the copies'."""
        return self.host_bytes + self.copy_bytes

    def __sub__(self, other: LedgerCounts) -> LedgerCounts:
        return LedgerCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(LedgerCounts)))

    def as_dict(self) -> dict[str, int]:
        """Every count, and the totals."""
        return {
            **dataclasses.asdict(self),
            "host_bytes": self.host_bytes,
            "copy_bytes": self.copy_bytes,
            "traffic_bytes": self.traffic_bytes,
        }

    def per_param(self, num_params: int) -> dict[str, float]:
        """:meth:`as_dict` divided by ``num_params`` (bytes or ops per parameter)."""
        return {name: value / num_params for name, value in self.as_dict().items()}


def tensor_bytes(tensor: torch.Tensor, extent_bytes: int) -> int:
    """Bytes an op touches of ``tensor``: its elements, at most the ``extent_bytes`` it
    spans (an expanded tensor's repeated elements are one read)."""
    return min(tensor.numel() * tensor.element_size(), extent_bytes)


class HostLedger:
    """Running totals of host and copy traffic, closed into one :class:`LedgerCounts` per step.

    Fed by the race checker (:meth:`count`, under its lock); read by the engine
    (:meth:`close_step`). A lock of its own keeps a close from splitting a count made on
    another thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys((f.name for f in dataclasses.fields(LedgerCounts)), 0)
        self._closed = LedgerCounts()
        self.steps: list[LedgerCounts] = []
        """Every closed step, in order."""

    @property
    def totals(self) -> LedgerCounts:
        """Everything counted so far."""
        with self._lock:
            return LedgerCounts(**self._totals)

    def count(
        self,
        reads: Iterable[torch.Tensor],
        writes: Iterable[torch.Tensor],
        *,
        on_stream: bool,
        host_extent: Callable[[torch.Tensor], int | None],
    ) -> None:
        """One op (or declared kernel call): ``reads`` are read, ``writes`` written (a
        tensor updated in place is in both). ``on_stream``: issued to a stream (device work,
        so its host bytes are a copy's), else performed by a host thread.
        ``host_extent(t)``: the bytes ``t`` spans if its storage is host memory, else ``None``.
        """
        read = sum(tensor_bytes(t, n) for t in reads if (n := host_extent(t)) is not None)
        written = sum(tensor_bytes(t, n) for t in writes if (n := host_extent(t)) is not None)
        if read == 0 and written == 0:
            return  # device work, or host code on no host storage (a Python scalar)
        with self._lock:
            if on_stream:
                self._totals["copy_read_bytes"] += read
                self._totals["copy_written_bytes"] += written
            else:
                self._totals["host_read_bytes"] += read
                self._totals["host_written_bytes"] += written
                self._totals["host_ops"] += 1

    def close_step(self) -> LedgerCounts:
        """What was counted since the last close (the step that just finished)."""
        totals = self.totals
        step, self._closed = totals - self._closed, totals
        self.steps.append(step)
        return step
