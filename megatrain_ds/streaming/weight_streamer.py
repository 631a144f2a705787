"""Double-buffered host-to-device weight streaming over a small pool of device buffers.

The streamer follows a *plan*: the order in which blocks will be asked for (forward:
0..L-1; backward: segments in reverse). Whenever a device buffer is free it copies the
next planned block into it on the host-to-device stream, so while block ``i`` computes,
block ``i+1`` is already in flight.

[Note: buffer ordering]
Each device buffer (a *slot*) carries two events:
- ``ready``: recorded on the h2d stream after the copy into the slot. The compute stream
  waits on it before the block runs (``acquire``) -- the device waits, the host does not.
- ``free``: recorded on the compute stream when the engine is done with the slot
  (``release``). The h2d stream waits on it before overwriting the slot, so a prefetch
  never clobbers weights a queued kernel still reads.
A block the GPU tier keeps on the device (``"device_state"``, ``optimizer/device_states.py``:
[Note: device state ordering]) is not copied: its slot points at the block's device weights,
and at ``acquire`` the compute stream also waits on the block's ``updated`` event (not the
h2d stream, whose copies of the next host blocks need not wait for the device update).
No host-side synchronisation happens here, but one: before a block's host weights are
taken, the host waits until the last optimizer step's update of that block has landed, when
that update runs behind ``engine.step()`` (``pending_updates``;
``optimizer/pipelined_finish.py``: [Note: pipelined finish]). That wait is what lets the
update of blocks ``i+1..`` overlap the forward of block ``i``.

With fragments (``"fragment_bytes"``, ``streaming/weight_fragments.py``) the copy into a
slot is issued piece by piece, each piece recording its own event after ``free`` was
waited on once; ``ready`` is still recorded after the last piece. ``acquire`` then makes
the compute stream wait on nothing: each part of the block waits on its own pieces
(``wait_for_part``) just before it computes. A stashed block's backward, which uses the
block whole, waits for its stash instead, brought back on the h2d stream after the
weights (``streaming/activation_stash.py``: [Note: stash ordering]).

[Note: the host as the device]
When the device computes on host memory (``runtime.shares_host_memory``: the CPU), a
"copy to the device" would only duplicate the block in the same RAM: two slots of the
largest block (0.4 B/param at 551M parameters in fp32) and a memcpy of every block twice
per step. There a slot *is* the block's ``streamed`` host buffer: ``_top_up`` points it
there instead of copying, and everything else -- the plan, the slots in flight and held,
the events, ``transfers`` -- runs as on a GPU. Reading the host buffer in place is safe
for the same reason a prefetch is: the optimizer writes a parameter only after its last
use in the step (``gradients/outbox.py``: [Note: complete gradients]), and the next
forward takes each block only after the step's update of it has landed (``pending_updates``).

Where the host weights come from is the streamer's :class:`WeightSource`: the blocks'
states (:class:`HostWeights`), or the NVMe tier's weight window (``state/nvme_weights.py``),
which is told the plan to read ahead and given each block back with the event after which
the device no longer reads its host buffer: the copy's ``ready``, or on the CPU, where the
slot *is* the host buffer, the slot's ``free``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event, Stream
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.streaming.weight_fragments import FragmentPlan, plan_fragments


class PendingUpdates(Protocol):
    """The optimizer update still running behind ``engine.step()`` (``optimizer/pipelined_finish.py``)."""

    def synchronize(self, index: int) -> None:
        """The calling thread waits until state ``index``'s update has landed."""


class DeviceResident(Protocol):
    """The blocks kept whole on the device (``optimizer/device_states.py``): their weights
    are never copied, the slot points at them once their last update has landed."""

    def __contains__(self, index: object) -> bool: ...

    def wait_on_device(self, index: int, stream: Stream) -> None:
        """``stream`` waits on the device for state ``index``'s last update."""


class WeightSource(Protocol):
    """Where the streamer takes each block's host weights from."""

    dtype: torch.dtype

    def numel(self, block: int) -> int:
        """Elements of ``block``'s weights."""
        ...

    def prefetch(self, blocks: Sequence[int]) -> None:
        """The blocks :meth:`take` will be asked for next, in order (a hint)."""

    def take(self, block: int) -> torch.Tensor:
        """``block``'s weights in host memory, unchanged until :meth:`give_back`."""
        ...

    def give_back(self, block: int, device_done: Event) -> None:
        """The device reads what :meth:`take` returned until ``device_done``."""


class HostWeights:
    """The blocks' weights where they live in host memory: each state's ``streamed`` buffer."""

    def __init__(self, states: Sequence[HostFlatState]) -> None:
        self.states = states
        self.dtype = states[0].streamed.dtype

    def numel(self, block: int) -> int:
        return self.states[block].layout.numel

    def prefetch(self, blocks: Sequence[int]) -> None:
        del blocks

    def take(self, block: int) -> torch.Tensor:
        return self.states[block].streamed

    def give_back(self, block: int, device_done: Event) -> None:
        del block, device_done


@dataclass
class _Slot:
    buffer: torch.Tensor
    ready: Event
    free: Event
    plan: FragmentPlan | None = None
    """How the slot's block was copied; ``None``: in one piece, guarded by ``ready``."""
    fragments: list[Event] = field(default_factory=list)
    """``ready`` of each piece of ``plan``."""
    waited: set[int] = field(default_factory=set)
    """Pieces the compute stream already waits on since ``acquire``."""
    reads_host: int | None = None
    """The block whose host weights the slot is (the CPU's in-place slots), until given back."""
    own: torch.Tensor | None = None
    """The slot's own device buffer, which ``buffer`` leaves while it points at a device
    block's weights (on a GPU; ``None`` on the CPU, whose slots are never copied into)."""


@dataclass
class WeightStreamer:
    """Streams each block's ``HostFlatState.streamed`` buffer into device slots.

    Args:
        runtime: streams, events and allocation.
        states: host state of every block, indexed by block number (their layouts).
        num_slots: device buffers in the pool (each sized for the largest block).
        source: where the host weights come from (default: the states' ``streamed`` buffers).
    """

    runtime: DeviceRuntime
    states: Sequence[HostFlatState]
    num_slots: int
    on_issue: Callable[[int], None] | None = None
    """Called after a block's copy is issued, to send companions (checkpoints) along."""
    transfers: Counter = field(default_factory=Counter)
    """Host-to-device copies issued, per block (for tests and traces)."""
    bytes_copied: int = 0
    """Bytes of weights sent host-to-device (in place on the CPU: the bytes a GPU would copy)."""
    fragment_elements: int = 0
    """Copy blocks in pieces of this many elements (``streaming/weight_fragments.py``); 0: whole."""
    parts_of: Callable[[int], tuple[list[list[str]], list[int]] | None] | None = None
    """A block's parameter names by part and the order it uses them (``BlockTemplate``),
    for fragment plans; ``None`` until known."""

    source: WeightSource | None = None
    pending_updates: PendingUpdates | None = None
    """The last step's update, when it runs behind ``engine.step()``: a block's host weights
    are read only once its update has landed ([Note: buffer ordering])."""
    device_resident: DeviceResident | None = None
    """The blocks whose weights live on the device (``"device_state"``): a slot points at
    them, after the device waited for their last update ([Note: buffer ordering])."""

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = HostWeights(self.states)
        self._source: WeightSource = self.source  # never None from here on
        dtype = self.source.dtype
        # On the CPU the slots view the host buffers ([Note: the host as the device]).
        self._in_place = self.runtime.shares_host_memory
        numel = 0 if self._in_place else max(self.source.numel(block) for block in range(len(self.states)))
        self._slots = [
            _Slot(self.runtime.device_empty(numel, dtype), self.runtime.event(), self.runtime.event())
            for _ in range(self.num_slots)
        ]
        for slot in self._slots:
            slot.own = None if self._in_place else slot.buffer
        self._free: deque[_Slot] = deque(self._slots)
        self._plan: deque[int] = deque()
        self._in_flight: deque[tuple[int, _Slot]] = deque()
        self._held: dict[int, _Slot] = {}
        self._plans: dict[int, FragmentPlan] = {}
        self._last_acquired: int | None = None
        self._descending = False
        """Blocks have been coming in descending order in this pass (backward)."""

    @property
    def device_bytes(self) -> int:
        """Device memory of the buffer pool: independent of model depth (none on the CPU)."""
        if self._in_place:
            return 0
        return sum(slot.own.numel() * slot.own.element_size() for slot in self._slots if slot.own is not None)

    def begin(self, plan: Iterable[int]) -> None:
        """Start a pass that will acquire blocks in the order of ``plan``.

        Blocks still held by an abandoned pass are released; copies already in flight
        are kept when they match the head of the new plan, and dropped otherwise.
        """
        for block in list(self._held):
            self.release(block)
        self._last_acquired, self._descending = None, False
        self._replan(plan)

    def _replan(self, plan: Iterable[int]) -> None:
        plan = deque(plan)
        kept: deque[tuple[int, _Slot]] = deque()
        for block, slot in self._in_flight:
            if plan and plan[0] == block:
                kept.append((block, slot))
                plan.popleft()
            else:
                self._give_back_host(slot, slot.ready)  # never computed on
                self._free.append(slot)
        self._in_flight, self._plan = kept, plan
        self._source.prefetch(list(plan))
        self._top_up()

    def acquire(self, block: int) -> torch.Tensor:
        """The device weights of ``block``, ready for kernels queued on the compute stream.

        A block asked for out of plan is copied now, and the plan goes on from it: a
        block the plan holds further on (the model skipped some) continues the plan from
        there; one it does not hold (a block run again: a reentrant ``torch.utils.checkpoint``
        re-running its forward inside backward) comes first, then the plan as it was, so no
        block is copied ahead that the plan had already passed -- the optimizer may be
        updating its host state by then. With nothing planned (a pass the engine could not
        plan: forward without grad re-run by a reentrant checkpoint), the blocks after it
        in the direction blocks have been coming follow: ascending, or descending once a
        lower block followed a higher one (backward), never back to blocks already passed.
        """
        if self._last_acquired is not None and block != self._last_acquired:
            self._descending = block < self._last_acquired
        self._last_acquired = block
        if not (self._in_flight and self._in_flight[0][0] == block):
            upcoming = [planned for planned, _ in self._in_flight] + list(self._plan)
            if block in upcoming:
                self._replan(upcoming[upcoming.index(block) :])
            elif upcoming:
                self._replan([block, *upcoming])
            elif self._descending:
                self._replan(range(block, -1, -1))
            else:
                self._replan(range(block, len(self.states)))
            if not self._in_flight:
                raise RuntimeError(f"no free device buffer for block {block}: all {self.num_slots} are held")
        _, slot = self._in_flight.popleft()
        # The device waits for the copy (see [Note: buffer ordering]); the host goes on.
        # A fragmented copy is waited on part by part instead (wait_for_part).
        slot.waited = set()
        if slot.plan is None:
            self.runtime.compute_stream().wait_event(slot.ready)
        if self.device_resident is not None and block in self.device_resident:
            # The block's weights are its device state's: its last update (on the optimizer
            # stream) lands before the block computes (optimizer/device_states.py).
            self.device_resident.wait_on_device(block, self.runtime.compute_stream())
        self._held[block] = slot
        self._top_up()
        return slot.buffer[: self.states[block].layout.numel]

    def wait_for_part(self, block: int, part: int) -> None:
        """Part ``part`` of held ``block`` computes next: the compute stream waits for the
        pieces holding its parameters (nothing to do for a block copied whole)."""
        slot = self._held[block]
        if slot.plan is None:
            return
        for index in slot.plan.part_fragments[part]:
            if index not in slot.waited:
                self.runtime.compute_stream().wait_event(slot.fragments[index])
                slot.waited.add(index)

    def _fragment_plan(self, block: int) -> FragmentPlan | None:
        if not self.fragment_elements or self._in_place or self.parts_of is None:
            return None
        if block not in self._plans:
            parts = self.parts_of(block)
            if parts is None:  # the template has not run yet: which parts it calls is not known
                return None
            self._plans[block] = plan_fragments(self.states[block].layout, parts[0], self.fragment_elements, parts[1])
        return self._plans[block]

    def release(self, block: int) -> None:
        """The engine has queued its last use of ``block``'s weights; reuse the slot."""
        slot = self._held.pop(block)
        slot.free.record(self.runtime.compute_stream())
        self._give_back_host(slot, slot.free)
        self._free.append(slot)
        self._top_up()

    def _give_back_host(self, slot: _Slot, device_done: Event) -> None:
        """An in-place slot's host weights are read until ``device_done``."""
        if slot.reads_host is not None:
            self._source.give_back(slot.reads_host, device_done)
            slot.reads_host = None

    def _top_up(self) -> None:
        while self._free and self._plan:
            block = self._plan.popleft()
            slot = self._free.popleft()
            on_device = self.device_resident is not None and block in self.device_resident
            if self.pending_updates is not None and not on_device:
                # Sync: the optimizer's finish worker may still be writing this block's host
                # weights (the last step's update, pipelined into this forward): the copy, or
                # on the CPU the compute reading them in place, comes after it has landed.
                self.pending_updates.synchronize(block)
            source = self._source.take(block)
            with self.runtime.on(self.runtime.h2d_stream):
                # Do not overwrite the slot before kernels that read its last block finish.
                self.runtime.h2d_stream.wait_event(slot.free)
                slot.plan = None if on_device else self._fragment_plan(block)
                with self.runtime.tracer.device_span(f"weights {block}", "h2d", self.runtime.h2d_stream, block=block):
                    self._fill(slot, source, on_device)
                slot.ready.record(self.runtime.h2d_stream)
            if self._in_place:
                slot.reads_host = block  # given back when the slot is released
            else:
                self._source.give_back(block, slot.ready)  # the copy is the host buffer's last reader
            if not on_device:  # a device block crosses nothing
                self.transfers[block] += 1
                self.bytes_copied += source.numel() * source.element_size()
            self._in_flight.append((block, slot))
            if self.on_issue is not None:
                self.on_issue(block)

    def _fill(self, slot: _Slot, source: torch.Tensor, on_device: bool) -> None:
        """Make ``slot`` hold ``source``'s weights (on the h2d stream, after ``free``)."""
        if self._in_place or on_device:
            slot.buffer = source  # nothing to copy: the device reads the block where it lives
            return
        assert slot.own is not None
        slot.buffer = slot.own  # back from a device block's weights
        if slot.plan is None:
            slot.buffer[: source.numel()].copy_(source, non_blocking=True)
        else:
            self._copy_fragments(slot, source)

    def _copy_fragments(self, slot: _Slot, source: torch.Tensor) -> None:
        """Issue ``source`` into ``slot`` piece by piece (on the h2d stream, after ``free``)."""
        assert slot.plan is not None
        while len(slot.fragments) < len(slot.plan.ranges):
            slot.fragments.append(self.runtime.event())
        for (start, end), ready in zip(slot.plan.ranges, slot.fragments):
            slot.buffer[start:end].copy_(source[start:end], non_blocking=True)
            ready.record(self.runtime.h2d_stream)  # this piece's compute may start
