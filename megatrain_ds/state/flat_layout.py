"""Where each parameter of a block lives inside the block's one flat buffer.

Pure bookkeeping, no tensors: offsets, padding and optimizer-group runs. A block moves
host<->device in one copy because all its parameters share one flat buffer; the
optimizer walks it in a few contiguous runs because parameters are ordered by their
optimizer group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Every parameter starts on a 64-element boundary (256 B in fp32): aligned vector loads
# for SIMD and GPU kernels. Padding elements are zero and get zero gradients, so Adam
# leaves them at zero and they never change a result.
ALIGN_ELEMENTS = 64

FROZEN_GROUP = -1
"""Group index of parameters with ``requires_grad=False`` (or in no optimizer group): streamed,
never updated. They are laid out after every trained parameter (:func:`build_flat_layout`), so
the trained elements are the prefix ``[0, FlatLayout.trained_numel)`` and the buffers only
training needs (moments, gradients, an fp32 master beside a bf16 shadow) can stop there."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    group: int
    split_index: int
    """Position of this parameter in ``torch.split(flat, layout.split_sizes)``."""


@dataclass(frozen=True)
class GroupRun:
    """A contiguous span ``[start, end)`` of a flat buffer whose parameters share a group."""

    group: int
    start: int
    end: int


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer: slots, total padded size, and group runs."""

    slots: tuple[ParamSlot, ...]
    numel: int
    runs: tuple[GroupRun, ...]
    split_sizes: tuple[int, ...]

    def slot(self, name: str) -> ParamSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(name)

    def trained_runs(self) -> tuple[GroupRun, ...]:
        return tuple(run for run in self.runs if run.group != FROZEN_GROUP)

    @property
    def trained_numel(self) -> int:
        """End of the trained prefix: every trained element lies in ``[0, trained_numel)``,
        every frozen one after it (frozen slots come last)."""
        trained = self.trained_runs()
        assert all(run.group == FROZEN_GROUP for run in self.runs[len(trained) :]), "frozen slots come last"
        return trained[-1].end if trained else 0

    def window(self, start: int, end: int) -> FlatLayout:
        """Elements ``[start, end)`` as a layout of their own, for the optimizer: group runs
        only, shifted to start at 0 (a data-parallel rank's share, ``distributed/data_parallel.py``)."""
        runs = tuple(
            GroupRun(run.group, run.start - start, run.end - start) for run in intersect_runs(self.runs, start, end)
        )
        return FlatLayout(slots=(), numel=end - start, runs=runs, split_sizes=())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_flat_layout(params: Sequence[tuple[str, torch.Size, int]]) -> FlatLayout:
    """Lay out ``(name, shape, group)`` triples: ordered by group (stable), frozen ones
    (:data:`FROZEN_GROUP`) last, aligned.

    ``split_sizes`` alternates parameter and padding chunks so that one
    ``torch.split`` yields a view of every parameter, and its backward is one ``cat``.
    """
    # Frozen last: the trained elements are then a prefix (FlatLayout.trained_numel).
    ordered = sorted(params, key=lambda item: (item[2] == FROZEN_GROUP, item[2]))
    slots: list[ParamSlot] = []
    split_sizes: list[int] = []
    offset = 0
    for name, shape, group in ordered:
        numel = int(torch.Size(shape).numel())
        slots.append(ParamSlot(name, torch.Size(shape), offset, numel, group, len(split_sizes)))
        split_sizes.append(numel)
        end = _round_up(offset + numel, ALIGN_ELEMENTS)
        if end > offset + numel:
            split_sizes.append(end - offset - numel)
        offset = end
    runs: list[GroupRun] = []
    for slot in slots:
        end = _round_up(slot.offset + slot.numel, ALIGN_ELEMENTS)
        if runs and runs[-1].group == slot.group:
            runs[-1] = GroupRun(slot.group, runs[-1].start, end)
        else:
            runs.append(GroupRun(slot.group, slot.offset, end))
    return FlatLayout(tuple(slots), offset, tuple(runs), tuple(split_sizes))


def intersect_runs(runs: Sequence[GroupRun], start: int, end: int) -> list[GroupRun]:
    """The parts of ``runs`` that fall inside ``[start, end)``."""
    parts = []
    for run in runs:
        lo, hi = max(run.start, start), min(run.end, end)
        if lo < hi:
            parts.append(GroupRun(run.group, lo, hi))
    return parts
