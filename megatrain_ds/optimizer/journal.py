"""The speculative step's journal: which elements it covers, and their pre-step copies.

:class:`~megatrain_ds.optimizer.speculative_step.OptimizerStepper` steps the journaled
elements during backward, before the global gradient norm is known, and copies them back
from here, bit for bit, when clipping or a non-finite norm refutes the speculation
(``optimizer/speculative_step.py``: [Note: speculative steps]). This module holds the
journal itself and the one rule that sizes it, which the engine (``optimizer_build.py``),
preflight (``planning/preflight.py``) and the planner (``planning/step_time.py``) all call.

[Note: journal extents]
The journal covers one *extent* per journaled block: a suffix ``[start, trained_numel)``
of the block's trained elements (``state/flat_layout.py``: trained elements are a prefix
of the layout, frozen ones come last and are never stepped). Extents follow backward's
order: the last block first, whole, then the next to last, ..., and the first block that
does not fit whole gets its trailing elements only, as many as are left.

Why the tail: speculation pays where a range's gradient arrives while much of backward is
still ahead, so the worker updates it in the shadow of backward instead of after it. Blocks
are finished last-first (the streamed blocks' backward walks them in reverse). Within a
block each parameter's gradient is handed over from its post-accumulate-grad hook
(``gradients/outbox.py``), which autograd runs in the reverse of the order forward used
the parameters: for a Llama block ``down_proj``, ``up_proj``, ``gate_proj``, the
post-attention norm, ``o_proj``, ``v``, ``k``, ``q``, the input norm. The layout keeps a
module's registration order within each optimizer group, which for Hugging Face blocks is
forward's order, so the layout's tail is what backward finishes first (the MLP of a Llama
block; small no-decay parameters, norms and biases, may sit after it when the groups split
them, and cost little). A parameter's gradient reaches the worker as ``GradientSink`` pieces
of at most 4M elements in ascending offset, pushed back to back, and the worker consumes in
push order; a piece that straddles ``start`` is stepped from ``start`` on, the rest waits
with the deferred ranges. ``start`` is rounded up to :data:`~megatrain_ds.state.flat_layout.ALIGN_ELEMENTS`
(the kernels' aligned vector loads), so an extent never exceeds its share of the budget.

``speculative_blocks: "auto"`` gives the journal :data:`AUTO_JOURNAL_BYTES_PER_PARAM` bytes
per model parameter. Choosing whole blocks only (the rule before) chose none whenever one
block's journal exceeded that: at 940M (hidden 2048, FFN 5504, 16 blocks of 50.6M
parameters, 14 B per journaled element with a bf16 shadow) one block needs 708 MB against a
470 MB budget. By extents it journals the last block's trailing 33.6M elements, all but
0.2M of its MLP (``tests/test_speculative_step.py``). An integer ``speculative_blocks`` keeps
meaning the last that many blocks, whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.residency import RAM_ONLY, Residency

JOURNALED = ("master", "exp_avg", "exp_avg_sq", "shadow")
"""The buffers a journal slot copies (the gradient is not: a refuted step reads it again)."""

AUTO_JOURNAL_BYTES_PER_PARAM = 0.5
"""Host memory the journal may take with ``speculative_blocks: "auto"``, per model
parameter: bf16 + clipping then stays within 16.5 B/param."""


@dataclass(frozen=True)
class JournalExtent:
    """Elements ``[start, end)`` of block ``index`` (``end``: its trained elements' end)."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def choose_journal_extents(
    trained_numels: Sequence[int],
    element_bytes: int,
    total_numel: int,
    setting: int | str,
    budget_bytes_per_param: float = AUTO_JOURNAL_BYTES_PER_PARAM,
) -> list[JournalExtent]:
    """The journal's extents, in backward's order ([Note: journal extents]): the pure rule.

    Args:
        trained_numels: each block's trained elements (the end of its trained prefix).
        element_bytes: journal bytes per element (master, m, v, and a shadow if any).
        total_numel: the model's elements (every flat state's), which the budget scales with.
        setting: ``speculative_blocks``: an integer (the last that many blocks, whole) or
            ``"auto"`` (as many trailing elements as ``budget_bytes_per_param`` allows).
    """
    order = range(len(trained_numels) - 1, -1, -1)  # backward finishes the last block first
    if setting != "auto":
        return [JournalExtent(i, 0, trained_numels[i]) for i in order[: int(setting)] if trained_numels[i]]
    left = int(budget_bytes_per_param * total_numel) // max(element_bytes, 1)  # elements
    extents = []
    for index in order:
        end = trained_numels[index]
        start = _round_up(max(end - left, 0), ALIGN_ELEMENTS)
        if start < end:
            extents.append(JournalExtent(index, start, end))
            left -= end - start
        if start > 0:  # the budget ends inside this block
            break
    return extents


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def journal_element_bytes(state: HostFlatState) -> int:
    """Bytes a journal slot takes per element of ``state``."""
    return sum(getattr(state, kind).element_size() for kind in JOURNALED if getattr(state, kind) is not None)


def journal_extents(
    states: Sequence[HostFlatState],
    num_blocks: int,
    setting: int | str,
    budget_bytes_per_param: float = AUTO_JOURNAL_BYTES_PER_PARAM,
) -> list[JournalExtent]:
    """:func:`choose_journal_extents` for the engine's flat states (the blocks first)."""
    blocks = states[:num_blocks]
    if not blocks:
        return []
    return choose_journal_extents(
        [state.layout.trained_numel for state in blocks],  # frozen elements are never stepped
        journal_element_bytes(blocks[0]),  # every block holds the same buffers
        sum(state.layout.numel for state in states),
        setting,
        budget_bytes_per_param,
    )


def describe_extents(extents: Sequence[JournalExtent], trained_numels: Sequence[int], element_bytes: int) -> str:
    """The extents for a log line: whole blocks, the partial block, and the bytes."""
    if not extents:
        return "none"
    whole = [e.index for e in extents if e.start == 0 and e.end == trained_numels[e.index]]
    parts = [f"block{'s' if len(whole) > 1 else ''} {', '.join(map(str, whole))} whole"] if whole else []
    parts += [
        f"block {e.index} elements [{e.start}, {e.end}) of {trained_numels[e.index]}"
        for e in extents
        if e.index not in whole
    ]
    numel = sum(e.numel for e in extents)
    return f"{'; '.join(parts)} ({numel} elements, {numel * element_bytes / 2**20:.1f} MiB)"


@dataclass
class _Slot:
    """A journal extent's pre-step copy of its state, and which ranges hold one."""

    extent: JournalExtent
    tensors: dict[str, torch.Tensor]
    ranges: list[tuple[int, int]] = field(default_factory=list)


class Journal:
    """Pre-step copies of the journal extents' state (see [Note: speculative steps])."""

    def __init__(self, states: Sequence[HostFlatState], extents: Sequence[JournalExtent]) -> None:
        self.states = states
        # Ordinary (unpinned) host memory: only the CPU ever reads it.
        self._slots = {
            extent.index: _Slot(
                extent,
                {
                    kind: torch.empty(extent.numel, dtype=getattr(states[extent.index], kind).dtype)
                    for kind in JOURNALED
                    if getattr(states[extent.index], kind) is not None
                },
            )
            for extent in extents
        }

    @property
    def indices(self) -> list[int]:
        """The journaled blocks, in the order backward finishes them."""
        return list(self._slots)

    @property
    def extents(self) -> list[JournalExtent]:
        return [slot.extent for slot in self._slots.values()]

    def __bool__(self) -> bool:
        return bool(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self._slots.values() for t in slot.tensors.values())

    def overlap(self, index: int, start: int, end: int) -> tuple[int, int] | None:
        """The part of elements ``[start, end)`` of state ``index`` the journal covers, if any."""
        slot = self._slots.get(index)
        if slot is None:
            return None
        lo, hi = max(start, slot.extent.start), min(end, slot.extent.end)
        return (lo, hi) if lo < hi else None

    def save(self, index: int, start: int, end: int) -> None:
        """Copy elements ``[start, end)`` of state ``index`` before they are overwritten."""
        slot = self._slots[index]
        base = slot.extent.start
        assert base <= start and end <= slot.extent.end, (slot.extent, start, end)
        for kind, saved in slot.tensors.items():
            saved[start - base : end - base].copy_(getattr(self.states[index], kind)[start:end])
        slot.ranges.append((start, end))

    def ranges(self, index: int) -> list[tuple[int, int]]:
        slot = self._slots.get(index)
        return list(slot.ranges) if slot is not None else []

    def restore(self, residency: Residency = RAM_ONLY) -> int:
        """Copy every saved range back (bit for bit); returns the elements restored.
        ``residency`` brings each state's moments in first (the NVMe tier)."""
        restored = 0
        residency.expect([self.states[index] for index, slot in self._slots.items() if slot.ranges])
        for index, slot in self._slots.items():
            if slot.ranges:
                residency.acquire(self.states[index])
            base = slot.extent.start
            for start, end in slot.ranges:
                for kind, saved in slot.tensors.items():
                    getattr(self.states[index], kind)[start:end].copy_(saved[start - base : end - base])
                restored += end - start
        return restored

    def clear(self) -> None:
        for slot in self._slots.values():
            slot.ranges.clear()
