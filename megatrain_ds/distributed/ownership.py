"""Which rank owns which elements of a flat state, and which node holds which span.

Pure arithmetic, no processes: the same answer on every rank, from the node grouping
(``distributed/data_parallel.py``). See ``[Note: sharded host state]`` there.

Every flat state of ``numel`` elements is cut into ``world_size`` windows of one size
(``chunk``, a multiple of 64 elements: aligned SIMD), one per rank, in *position* order:
the ranks of the first node, then of the second, and so on. A rank alone reduces,
clips and steps its window. A node holds the *span* of its ranks' windows, which is
contiguous because its ranks' positions are; the last windows may be short or empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS


def window_elements(numel: int, world_size: int) -> int:
    """Elements of one window of a ``numel``-element state cut among ``world_size`` ranks
    (:meth:`Ownership.chunk`): ``numel / world_size``, rounded up to 64."""
    return -(-numel // (world_size * ALIGN_ELEMENTS)) * ALIGN_ELEMENTS


@dataclass(frozen=True)
class Ownership:
    """Windows of ranks and spans of nodes over any flat state.

    Attributes:
        nodes: each node's global ranks, nodes in position order.
        rank: this process's global rank.
    """

    nodes: tuple[tuple[int, ...], ...]
    rank: int

    @classmethod
    def of(cls, nodes: Sequence[Sequence[int]], rank: int) -> Ownership:
        return cls(tuple(tuple(members) for members in nodes), rank)

    @property
    def positions(self) -> tuple[int, ...]:
        """Global ranks in position order (node by node)."""
        return tuple(rank for members in self.nodes for rank in members)

    @property
    def node(self) -> int:
        """Index of this rank's node."""
        return next(index for index, members in enumerate(self.nodes) if self.rank in members)

    def chunk(self, numel: int) -> int:
        """Elements of one window: ``numel / world_size``, rounded up to 64."""
        return window_elements(numel, len(self.positions))

    def _bounds(self, first: int, end: int, numel: int) -> tuple[int, int]:
        chunk = self.chunk(numel)
        return min(first * chunk, numel), min(end * chunk, numel)

    def windows(self, numel: int) -> list[tuple[int, int, int]]:
        """``(owner rank, start, end)`` of every non-empty window, in position order."""
        return [(owner, start, end) for owner, start, end in self.every_window(numel) if start < end]

    def every_window(self, numel: int) -> list[tuple[int, int, int]]:
        """``(owner rank, start, end)`` of every rank's window, empty ones included, in position order."""
        return [(owner, *self._bounds(position, position + 1, numel)) for position, owner in enumerate(self.positions)]

    def window(self, numel: int) -> tuple[int, int]:
        """``[start, end)``: the elements this rank owns (may be empty)."""
        position = self.positions.index(self.rank)
        return self._bounds(position, position + 1, numel)

    def spans(self, numel: int) -> list[tuple[int, int, int]]:
        """``(node's first rank, start, end)`` of every node's span, empty ones included."""
        found, first = [], 0
        for members in self.nodes:
            start, end = self._bounds(first, first + len(members), numel)
            found.append((members[0], start, end))
            first += len(members)
        return found

    def span(self, numel: int) -> tuple[int, int]:
        """``[start, end)``: the elements this rank's node holds of a sharded state."""
        _, start, end = self.spans(numel)[self.node]
        return start, end
