"""Whole tensors read into a process that holds only part of a flat state: :func:`reshard`.

A checkpoint's model and per-parameter optimizer files hold each tensor whole, while a
process may hold only elements ``[start, end)`` of a flat state (a :class:`HeldSpan`):
its node's span of the optimizer state or of a sharded master (several nodes), or its
rank's window (the NVMe tier with data parallel). The files' tensors of such a state are
read into one whole temporary per state and kind, and the held part is kept once every
file of the read has been read into it. Span files need no whole temporary: they hold
spans, and ``SpanFiles.read_into`` reads a span that only overlaps the held part into a
temporary of that span alone (its checksum covers the span) and keeps the overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from megatrain_ds.checkpoint.optimizer_spans import HeldSpan


@dataclass(frozen=True)
class _Temporary:
    """A whole temporary, the part it is kept in, and where its whole value also goes."""

    part: torch.Tensor
    """The held elements ``[start, end)``."""
    start: int
    end: int
    whole: torch.Tensor
    whole_into: torch.Tensor | None


class WholeTemporaries:
    """The whole temporaries of one read (:func:`reshard`), one per ``(key, kind)``."""

    def __init__(self) -> None:
        self._made: dict[tuple[Hashable, str], _Temporary] = {}

    def whole(
        self,
        key: Hashable,
        held: HeldSpan,
        kind: str,
        outside: torch.Tensor | None = None,
        whole_into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A whole buffer of ``held``'s state of ``kind`` (its ``numel`` elements, in the
        held tensor's dtype) to read whole tensors into; the same one for every call with
        ``key`` (the state's identity) and ``kind``.

        Its held elements start as the held values, so a tensor the files lack keeps its
        value there; the others start as ``outside`` (the state's whole values, converted),
        or zeros. At the end of the read the held elements are kept (:meth:`keep_held`),
        and the whole buffer is also copied into ``whole_into`` (converted), when given.
        """
        made = self._made.get((key, kind))
        if made is None:
            part = held.tensor(kind)
            if outside is not None:
                whole = outside.to(dtype=part.dtype, copy=True)
            else:
                whole = torch.zeros(held.numel, dtype=part.dtype)
            whole[held.start : held.end] = part
            made = self._made[key, kind] = _Temporary(part, held.start, held.end, whole, whole_into)
        return made.whole

    def keep_held(self) -> None:
        """Copy each temporary's held elements into the part, and its whole value into
        ``whole_into``; then drop the temporaries."""
        for made in self._made.values():
            made.part.copy_(made.whole[made.start : made.end])
            if made.whole_into is not None:
                made.whole_into.copy_(made.whole)
        self._made.clear()


@contextlib.contextmanager
def reshard() -> Iterator[WholeTemporaries]:
    """Whole temporaries for reads of whole tensors into held parts (:class:`WholeTemporaries`),
    whose held parts are kept when the block ends without an error (a failed read keeps
    nothing of what it read into them)."""
    temporaries = WholeTemporaries()
    yield temporaries
    temporaries.keep_held()
