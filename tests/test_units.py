"""Unit tests of the pieces below the engine: layout, host AdamW, streamer, gradient sink."""

import threading

import pytest
import torch

from megatrain_ds.gradients.sink import GradientSink
from megatrain_ds.optimizer.adamw_math import adamw_update_
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.flat_layout import ALIGN_ELEMENTS, FROZEN_GROUP, build_flat_layout, intersect_runs
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.state_placement import whole_in_host_memory
from megatrain_ds.streaming.weight_streamer import WeightStreamer

CPU = DeviceRuntime.create(torch.device("cpu"))


def test_layout_orders_by_group_frozen_last_aligns_and_splits():
    layout = build_flat_layout(
        [
            ("a", torch.Size([3, 5]), 1),
            ("b", torch.Size([7]), 0),
            ("c", torch.Size([64]), FROZEN_GROUP),
            ("d", torch.Size([2]), 1),
        ]
    )
    assert [s.name for s in layout.slots] == ["b", "a", "d", "c"]
    assert all(s.offset % ALIGN_ELEMENTS == 0 for s in layout.slots)
    assert layout.numel % ALIGN_ELEMENTS == 0
    assert [(r.group, r.start, r.end) for r in layout.runs] == [(0, 0, 64), (1, 64, 192), (-1, 192, 256)]
    assert [(r.group, r.start) for r in layout.trained_runs()] == [(0, 0), (1, 64)]
    assert layout.trained_numel == 192  # the frozen slot is the suffix the trained-only buffers leave out
    flat = torch.arange(layout.numel, dtype=torch.float32)
    chunks = torch.split(flat, layout.split_sizes)
    for slot in layout.slots:
        assert torch.equal(chunks[slot.split_index], flat[slot.offset : slot.offset + slot.numel])
    assert [(r.start, r.end) for r in intersect_runs(layout.runs, 180, 200)] == [(180, 192), (192, 200)]


@pytest.mark.parametrize("decoupled", [True, False])
def test_host_adamw_matches_torch_bit_for_bit(decoupled):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000))
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = optimizer_class([param], lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.2)
    master, m, v = param.detach().clone(), torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 6):
        grad = torch.randn(1000)
        param.grad = grad.clone()
        reference.step()
        adamw_update_(
            master, grad, m, v, step=step, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.2, decoupled=decoupled
        )
    assert torch.equal(master, param.detach())


def _states(sizes):
    states = []
    for index, size in enumerate(sizes):
        layout = build_flat_layout([("w", torch.Size([size]), 0)])
        master = torch.full((layout.numel,), float(index))
        moments = (torch.zeros_like(master), torch.zeros_like(master))
        states.append(HostFlatState(layout, master, None, *moments, placement=whole_in_host_memory(layout.numel, 4)))
    return states


def test_streamer_prefetches_along_the_plan_and_recovers_off_plan():
    streamer = WeightStreamer(CPU, _states([10, 200, 30, 70]), num_slots=2)
    streamer.begin(range(4))
    assert dict(streamer.transfers) == {0: 1, 1: 1}  # two slots: block 1 is already in flight
    for block in range(4):
        weights = streamer.acquire(block)
        assert weights.numel() == streamer.states[block].layout.numel
        assert torch.all(weights == block)
        streamer.release(block)
    streamer.begin([3, 2, 1, 0])
    assert torch.all(streamer.acquire(3) == 3)
    assert torch.all(streamer.acquire(1) == 1)  # block 2 skipped: the in-flight copy is dropped ...
    streamer.release(3)
    streamer.release(1)
    # ... and the plan goes on from block 1 as it was: 0.
    assert dict(streamer.transfers) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert torch.all(streamer.acquire(2) == 2)  # a block the plan passed: copied first, then the plan (0)
    assert dict(streamer.transfers) == {0: 3, 1: 2, 2: 3, 3: 2}


def test_streamer_without_a_plan_follows_the_direction_blocks_come_in():
    """A pass the engine could not plan (a reentrant checkpoint re-running blocks inside
    backward): after a lower block follows a higher one, prefetch goes down, never back up
    to blocks the optimizer may be updating."""
    streamer = WeightStreamer(CPU, _states([10, 10, 10, 10]), num_slots=2)
    streamer.begin([])
    streamer.acquire(3)
    streamer.release(3)
    assert dict(streamer.transfers) == {3: 1}  # nothing after block 3 ascending
    streamer.acquire(2)
    streamer.release(2)
    assert dict(streamer.transfers) == {3: 1, 2: 1, 1: 1, 0: 1}  # 2 on demand, then 1 and 0 ahead
    streamer.acquire(1)
    streamer.acquire(1)  # the same block again (a re-run): the direction holds
    assert dict(streamer.transfers) == {3: 1, 2: 1, 1: 2, 0: 1}


def test_streamer_reports_exhausted_buffers():
    streamer = WeightStreamer(CPU, _states([10, 10, 10]), num_slots=2)
    streamer.begin(range(3))
    streamer.acquire(0)
    streamer.acquire(1)
    with pytest.raises(RuntimeError, match="all 2 are held"):
        streamer.acquire(2)


def test_gradient_sink_chunks_in_order_and_surfaces_worker_errors():
    received = []

    def consume(index, offset, chunk, final, landing):
        if index == 99:
            raise ValueError("boom")
        received.append((index, offset, chunk.clone(), final, threading.current_thread().name))

    sink = GradientSink(CPU, staging_numel=4, dtype=torch.float32, num_staging=2, consume=consume)
    try:
        sink.push(3, 8, torch.arange(10, dtype=torch.float32), final=True)
        sink.drain()
        assert [(i, o, f) for i, o, _, f, _ in received] == [(3, 8, True), (3, 12, True), (3, 16, True)]
        assert torch.equal(torch.cat([c for _, _, c, _, _ in received]), torch.arange(10, dtype=torch.float32))
        assert all(name == "megatrain-grad-worker" for *_, name in received)
        sink.push(99, 0, torch.ones(3), final=False)
        with pytest.raises(RuntimeError, match="gradient worker failed"):
            sink.drain()
    finally:
        sink.close()
