"""Speculative optimizer steps: exact against never speculating, and overlapped with backward.

Exactness is bit for bit: restoring the journal is a bit copy, so an engine that steps
its blocks during backward and validates at ``engine.step()`` must end in exactly the
state of an engine that waits for the norm (``speculative_blocks: 0``), whether the
speculation held, was refuted by clipping, or by a changed learning rate. Against plain
PyTorch the parity tests (``test_optimizer_placement.py``) apply.
"""

from __future__ import annotations

import time

import pytest
import tiny_models
import torch
from side_by_side import ds_config
from test_gpu_flows import FORWARD_BEFORE_STEP, forward_before_step

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.optimizer.journal import (
    AUTO_JOURNAL_BYTES_PER_PARAM,
    JournalExtent,
    choose_journal_extents,
    journal_extents,
)
from megatrain_ds.optimizer.speculative_step import StepOutcome, _unstepped
from megatrain_ds.planning.step_time import ModelShape, RunSettings, journal_numel
from megatrain_ds.streaming.streamed_blocks import StreamedBlocks

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

CLIP = 1.6  # clips the first three of five steps of this llama (test_optimizer_placement.py)
KINDS = ("master", "exp_avg", "exp_avg_sq", "shadow")


def _train(config, steps, *, force_speculation=False, before_step=None, num_layers=4):
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(num_layers=num_layers), parse_engine_config(config))
    accumulation = config["gradient_accumulation_steps"]
    reports = []
    for step in range(steps):
        for micro in range(accumulation):
            if force_speculation:
                engine.stepper.speculate_next = True  # whatever the last step predicts
            loss = engine(**tiny_models.make_batch(step * accumulation + micro)).loss
            engine.backward(loss)
            if micro == accumulation - 1 and before_step is not None:
                before_step(engine, step)
            engine.step()
        reports.append(engine.last_step_report)
    engine.settle_optimizer()  # the tests read the host state directly
    return engine, reports


def _assert_same_state(ours, theirs):
    for index, (a, b) in enumerate(zip(ours.states, theirs.states)):
        for kind in KINDS:
            if getattr(a, kind) is not None:
                assert torch.equal(getattr(a, kind), getattr(b, kind)), (index, kind)


@pytest.mark.parametrize(
    "bf16, blocks", [(False, 4), (True, 4), (True, "auto")], ids=["fp32", "bf16", "bf16-part-of-a-block"]
)
def test_speculation_is_bit_exact_through_clipping(bf16, blocks):
    """``"auto"`` on this tiny model journals the trailing elements of the last block only,
    from inside ``down_proj``: its gradient straddles the journal's start, and the part
    before it waits with the deferred ranges."""
    config = ds_config(accumulation=2, clipping=CLIP, bf16=bf16, megatrain={"speculative_blocks": 0})
    waiting, _ = _train(config, 5)
    config["megatrain"]["speculative_blocks"] = blocks
    speculating, reports = _train(config, 5, force_speculation=True)
    try:
        _assert_same_state(speculating, waiting)
        outcomes = [r.outcome for r in reports]
        assert StepOutcome.CLIPPED in outcomes and StepOutcome.APPLIED in outcomes, outcomes
        for report in reports:
            assert report.speculated > 0  # something was stepped during backward every time
            assert (report.restored > 0) == (report.outcome is StepOutcome.CLIPPED)
        extents = speculating.stepper.journal.extents
        if blocks == "auto":
            (extent,) = extents
            down = speculating.states[3].layout.slot("mlp.down_proj.weight")
            assert extent.index == 3 and down.offset < extent.start < down.offset + down.numel, extent
        else:
            assert extents == [JournalExtent(i, 0, speculating.states[i].layout.numel) for i in (3, 2, 1, 0)]
        assert speculating.host_bytes()["journal"] == sum(e.numel for e in extents) * (14 if bf16 else 12)
    finally:
        waiting.destroy()
        speculating.destroy()


def test_a_changed_learning_rate_invalidates_the_speculation():
    """A scheduler (or the user) changing lr between backward and step() forces a redo.

    The gradient worker steps the journaled chunks behind ``backward()``; the sink is
    drained before lr changes so that they certainly read the old lr (a worker that reads it
    after the change already steps with the new one, and there is nothing to redo)."""

    def halve_lr(engine, step):
        engine.sink.drain()
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.5

    config = ds_config(clipping=100.0, megatrain={"speculative_blocks": 0})
    waiting, _ = _train(config, 3, before_step=halve_lr)
    config["megatrain"]["speculative_blocks"] = 4
    speculating, reports = _train(config, 3, before_step=halve_lr)
    try:
        _assert_same_state(speculating, waiting)
        assert all(r.outcome is StepOutcome.APPLIED and r.restored > 0 for r in reports)
    finally:
        waiting.destroy()
        speculating.destroy()


def test_predictor_waits_after_a_clipped_step():
    """Unforced, the engine speculates only after a step that was applied unclipped."""
    config = ds_config(accumulation=2, clipping=CLIP, megatrain={"speculative_blocks": 4})
    engine, reports = _train(config, 5)
    try:
        # Step 1 speculates (no history) and is refuted part-way (the running norm passes
        # the threshold); steps 2-4 follow clipped steps; step 5 follows an unclipped one.
        assert [r.outcome for r in reports] == [StepOutcome.CLIPPED] * 3 + [StepOutcome.APPLIED] * 2
        assert [r.speculated > 0 for r in reports] == [True, False, False, False, True]
    finally:
        engine.destroy()


def test_unstepped_ranges_and_auto_journal_budget():
    engine = MegatrainEngine(tiny_models.llama(num_layers=4), parse_engine_config(ds_config()))
    try:
        state = engine.states[0]
        numel = state.layout.numel
        assert _unstepped(state, []) == [(0, numel)]
        assert _unstepped(state, [(64, 128), (0, 64), (256, numel)]) == [(128, 256)]
        assert _unstepped(state, [(192, 256), (100, 192)]) == [(0, 100), (256, numel)]
        # "auto": the last blocks whole, last first, then the next one's trailing elements
        # (its start rounded up to 64 elements), within the budget: 0.5 B x 50000 / 10 B.
        assert choose_journal_extents([1000] * 4, 10, 50_000, "auto", 0.5) == [
            JournalExtent(3, 0, 1000),
            JournalExtent(2, 0, 1000),
            JournalExtent(1, 512, 1000),
        ]
        assert choose_journal_extents([1000, 0, 1000, 1000], 10, 50_000, "auto", 0.5) == [
            JournalExtent(3, 0, 1000),
            JournalExtent(2, 0, 1000),
            JournalExtent(0, 512, 1000),  # a block with nothing trained takes nothing
        ]
        assert journal_extents(engine.states, 4, 3, 0.0) == [JournalExtent(i, 0, numel) for i in (3, 2, 1)]
        # The default on a tiny model: part of the last block, as much as 0.5 B/param allows.
        (extent,) = engine.stepper.journal.extents
        assert extent.index == 3 and extent.start > 0 and extent.end == numel
        budget = AUTO_JOURNAL_BYTES_PER_PARAM * sum(s.layout.numel for s in engine.states)
        assert budget - 64 * 12 < engine.stepper.journal.nbytes <= budget
    finally:
        engine.destroy()


def test_auto_journals_part_of_a_block_at_the_940m_shape():
    """The first GPU run's 940M Llama (hidden 2048, FFN 5504, 16 blocks, vocab 32000, bf16):
    one block's journal (708 MB) exceeds 0.5 B/param (470 MB), so choosing whole blocks chose
    none. By extents "auto" journals the last block's trailing 33.6M elements (all but 0.2M
    of its MLP, the first gradients backward finishes there), within the budget by less
    than one 64-element alignment; the planner counts the same elements."""
    hidden, ffn, blocks, vocab = 2048, 5504, 16, 32000
    block = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden  # q, k, v, o; gate, up, down; 2 norms
    total = blocks * block + 2 * vocab * hidden + hidden
    assert total == 940_640_256  # bench/results/gpu_H200/compare.json
    budget = AUTO_JOURNAL_BYTES_PER_PARAM * total
    assert 14 * block > budget  # not one whole block fits
    (extent,) = choose_journal_extents([block] * blocks, 14, total, "auto")
    assert extent.index == blocks - 1 and extent.end == block and extent.start % 64 == 0
    assert budget - 14 * 64 < 14 * extent.numel <= budget
    assert 3 * hidden * ffn - 300_000 < extent.numel < 3 * hidden * ffn  # nearly the whole MLP
    shape = ModelShape(blocks, block, blocks * block, total - blocks * block, hidden, vocab, ffn)
    assert journal_numel(shape, RunSettings(seq_len=1024, bf16=True, clipping=True)) == extent.numel


# -- overlap ------------------------------------------------------------------------------

BACKWARD_SLEEP = 0.06  # seconds per block backward (main thread)
UPDATE_SLEEP_PER_ELEMENT = 0.06 / 8000  # ~0.06 s per block update (a block has ~8K elements)


def _step_intervals(speculative_blocks, monkeypatch):
    """The ``(start, end)`` times of each block's backward and of each CPU update in one
    step, both slowed by sleeps (which release the GIL, as the real work does), and the
    step's report."""
    config = ds_config(
        clipping=100.0,
        megatrain={
            "speculative_blocks": speculative_blocks,
            "optimizer_device": "cpu",
            # no back-pressure from the staging pool: a
            # block's ~9 gradients all fit
            "num_staging_buffers": 32,
        },
    )
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(num_layers=4), parse_engine_config(config))
    backwards: list[tuple[float, float]] = []
    updates: list[tuple[float, float]] = []

    def timed(intervals, seconds, call, *args, **kwargs):
        start = time.perf_counter()
        time.sleep(seconds)
        result = call(*args, **kwargs)
        intervals.append((start, time.perf_counter()))
        return result

    try:
        for step in range(2):  # warm-up: allocator, kernels, the predictor's history
            engine.backward(engine(**tiny_models.make_batch(step)).loss)
            engine.step()
        # The warm-up's last update may run behind step(), into the measured forward
        # (optimizer/pipelined_finish.py): landed first, it is none of the measured updates.
        engine.settle_optimizer()
        kernel = engine.adamw.cpu
        original_step, original_backward = kernel.step_, StreamedBlocks._backward_call

        def slow_update(param, *args, **kwargs):
            return timed(updates, param.numel() * UPDATE_SLEEP_PER_ELEMENT, original_step, param, *args, **kwargs)

        def slow_backward(self, *args, **kwargs):
            return timed(backwards, BACKWARD_SLEEP, original_backward, self, *args, **kwargs)

        monkeypatch.setattr(kernel, "step_", slow_update)
        monkeypatch.setattr(StreamedBlocks, "_backward_call", slow_backward)
        engine.backward(engine(**tiny_models.make_batch(7)).loss)
        engine.step()
        engine.settle_optimizer()  # until the update has landed (it may run behind step())
        monkeypatch.undo()
        return backwards, updates, engine.last_step_report
    finally:
        engine.destroy()


def test_cpu_update_overlaps_backward(monkeypatch):
    """With clipping configured, blocks are stepped while backward goes on: some update runs
    before the last block's backward has ended; waiting for the norm, none does.

    Asserted on the order of the intervals, not on the step's duration, so that a loaded
    machine (a worker thread scheduled late) cannot fail it: the serial engine's updates
    start only after the norm, which needs every backward, and the speculating engine's
    first block update waits for one block's backward alone (three more, 0.18 s, follow)."""
    serial_backwards, serial_updates, serial_report = _step_intervals(0, monkeypatch)
    backwards, updates, report = _step_intervals(4, monkeypatch)
    assert serial_report.speculated == 0 and report.speculated > 0
    assert len(backwards) == len(serial_backwards) == 4 and updates and serial_updates
    assert min(start for start, _ in serial_updates) >= max(end for _, end in serial_backwards)
    assert min(start for start, _ in updates) < max(end for _, end in backwards), (updates, backwards)


@pytest.mark.parametrize(
    ("clipping", "megatrain", "warned"), FORWARD_BEFORE_STEP, ids=["nothing-held", "speculated", "waits-for-step"]
)
def test_a_forward_before_step_is_warned_and_ordered(stream_check, clipping, megatrain, warned):
    """A forward between a step's last backward and ``step()`` reads host weights the worker
    may be updating (docs/how-it-works.md, "The optimizer step"): the engine says so exactly
    where it may, and not for a forward between micro-batches or after ``step()``. Under the
    race checker, whose device is apart from the host as a GPU is: that forward's reads are
    ordered after the worker's writes so far and before the rest of the update, the blocks it
    copied ahead for a backward that never comes are not used after the update, and every
    loss and the weights are PyTorch's (``tests/test_gpu_flows.py``'s flow, which runs on
    CUDA too; it holds the tolerances)."""
    forward_before_step(torch.device("cpu"), clipping, megatrain, warned)
