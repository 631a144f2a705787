"""Fragmented weight streaming: a block's weights cross in pieces, each with its own event.

With ``"megatrain": {"fragment_bytes": N}`` the host-to-device copy of a block is issued as
pieces of about ``N`` bytes of its flat buffer (whole alignment units), in the order the
block's modules use them, and each piece records its own ``ready`` event. The block's
compute does not wait for the whole block: before each *part* of the block runs, the
compute stream waits only on the pieces that hold that part's parameters
(:meth:`~megatrain_ds.streaming.weight_streamer.WeightStreamer.wait_for`), so the first
module starts as soon as its piece has arrived while the rest is still in flight.

The parts of a block (:meth:`~megatrain_ds.model.block_template.BlockTemplate.parts`):
part 0 is the parameters the block's module owns itself, waited on before the block runs;
part ``i`` is the ``i``-th direct submodule's (the items of a ``ModuleList``/``ModuleDict``
each count as one), waited on by a forward pre-hook when that submodule is called. A
submodule whose hook did not fire on the template's first run (its parameters were used
without calling it) is moved into part 0 for every later run, and the first run waits for
the whole block. Bytes per step are unchanged: the same buffer crosses, in pieces, into
a slot still sized for the whole block (the block's modules compute on views of it).
Whether to cut blocks at all is ``"fragment_bytes": "auto"``'s question
(``planning/fragment_policy.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS, FlatLayout


@dataclass(frozen=True)
class FragmentPlan:
    """How one block's flat buffer crosses: pieces in copy order, and what each part waits on."""

    ranges: tuple[tuple[int, int], ...]
    """Element ranges ``[start, end)`` of the flat buffer, in the order they are copied."""
    part_fragments: tuple[tuple[int, ...], ...]
    """For each part, the indices into ``ranges`` holding its parameters."""


def plan_fragments(
    layout: FlatLayout, parts: Sequence[Sequence[str]], fragment_elements: int, part_order: Sequence[int] = ()
) -> FragmentPlan:
    """Cut ``layout``'s buffer into pieces of ``fragment_elements`` (rounded up to whole
    alignment units) and order them by the first part that needs them, parts taken in
    ``part_order`` (the order the block uses them; default: as numbered); pieces no part
    needs (padding only) go last."""
    size = max(-(-fragment_elements // ALIGN_ELEMENTS) * ALIGN_ELEMENTS, ALIGN_ELEMENTS)
    pieces = [(start, min(start + size, layout.numel)) for start in range(0, layout.numel, size)]
    slot_of = {slot.name: slot for slot in layout.slots}
    needed: list[list[int]] = []
    for names in parts:
        indices = set()
        for name in names:
            slot = slot_of[name]
            if slot.numel:
                indices.update(range(slot.offset // size, (slot.offset + slot.numel - 1) // size + 1))
        needed.append(sorted(indices))
    order: list[int] = []
    for part in part_order or range(len(parts)):
        order.extend(index for index in needed[part] if index not in order)
    order.extend(index for index in range(len(pieces)) if index not in order)
    position = {piece: at for at, piece in enumerate(order)}
    return FragmentPlan(
        ranges=tuple(pieces[piece] for piece in order),
        part_fragments=tuple(tuple(sorted(position[i] for i in indices)) for indices in needed),
    )
