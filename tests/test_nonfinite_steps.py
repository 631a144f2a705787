"""Non-finite steps: skipped exactly, counted, and fatal after too many in a row.

"Exactly" is bit for bit: every master, Adam moment and bf16 shadow after a skipped step
equals its value before it, although the blocks whose gradients arrived before the
non-finite one were already stepped speculatively (and restored from the journal). After
the skip, training goes on as if the batch had never been seen: the engine matches a
plain-PyTorch reference that skips the same batch (parity tolerances of
``test_parity.py``: 1e-5 relative loss, 2e-6 relative weight error).
"""

from __future__ import annotations

import copy
import math

import pytest
import tiny_models
import torch
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.engine import NonFiniteGradientError
from megatrain_ds.optimizer.speculative_step import StepOutcome

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

KINDS = ("master", "exp_avg", "exp_avg_sq", "shadow")
"""Not ``grad``: a held gradient is scratch between steps, written over by the next step's
first write of each element (``gradients/held_writes.py``), never read before it."""


def _snapshot(engine):
    engine.settle_optimizer()  # the host state is read directly
    return (
        [{kind: getattr(s, kind).clone() for kind in KINDS if getattr(s, kind) is not None} for s in engine.states],
        {k: v.clone() for k, v in engine.module.state_dict().items()},
    )


def _assert_unchanged(engine, snapshot):
    states, weights = snapshot
    engine.settle_optimizer()  # the host state is read directly
    for index, (state, saved) in enumerate(zip(engine.states, states)):
        for kind, tensor in saved.items():
            assert torch.equal(getattr(state, kind), tensor), (index, kind)
    for name, tensor in engine.module.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def _poison_block(engine, block, value=float("nan")):
    """Make block ``block``'s gradients non-finite until ``del engine.sink.push``: blocks
    after it in backward order (higher numbers) have been stepped speculatively by then."""
    push = engine.sink.push

    def poisoned(index, offset, grad, final):
        push(index, offset, grad * value if index == block else grad, final)

    engine.sink.push = poisoned


def _poison_embedding(engine, value=float("nan")):
    """The embedding's gradient is the last of backward: every journal block is stepped."""
    return engine.module.get_input_embeddings().weight.register_hook(lambda grad: grad * value)


def _step(engine, seed):
    loss = engine(**tiny_models.make_batch(seed)).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("where", ["embedding", "block"])
@pytest.mark.parametrize(
    "bf16, device, blocks",
    [(False, "cpu", 4), (True, "gpu", 4), (False, "cpu", "auto")],
    ids=["fp32-cpu", "bf16-gpu", "fp32-cpu-part-of-a-block"],
)
def test_nan_step_leaves_every_bit_and_training_continues(where, bf16, device, blocks):
    """``"auto"`` journals the last block's trailing elements only (a tiny model): they are
    stepped and restored, every other range waits."""
    config = ds_config(clipping=100.0, bf16=bf16, megatrain={"speculative_blocks": blocks, "optimizer_device": device})
    torch.manual_seed(0)
    model = tiny_models.llama()
    reference = copy.deepcopy(model)
    engine = MegatrainEngine(model, parse_engine_config(config))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    engine.lr_scheduler = scheduler
    try:
        _step(engine, 0)
        before = _snapshot(engine)
        if where == "embedding":
            handle = _poison_embedding(engine)
            _step(engine, 1)
            handle.remove()
        else:
            _poison_block(engine, 1)
            _step(engine, 1)
            del engine.sink.push  # the instance attribute; the class method again
        report = engine.last_step_report
        assert report.outcome is StepOutcome.SKIPPED and math.isnan(report.norm)
        assert report.restored > 0, "blocks stepped during backward were restored"
        if blocks == "auto":
            (extent,) = engine.stepper.journal.extents
            assert report.restored == report.speculated <= extent.numel < engine.states[3].layout.numel
        _assert_unchanged(engine, before)
        assert (engine.skipped_steps, engine.optimizer_steps, engine.global_steps) == (1, 1, 2)
        assert not engine.was_step_applied() and scheduler.last_epoch == 1  # schedule not advanced
        losses = [_step(engine, seed) for seed in (2, 3)]
        assert engine.was_step_applied() and engine.optimizer_steps == 3 and engine.skipped_steps == 1
    finally:
        engine.destroy()
    if bf16:
        return  # bf16 compute is compared with fp32 training in test_bf16.py
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    reference_losses = []
    for seed in (0, 2, 3):  # batch 1 never happened
        loss = reference(**tiny_models.make_batch(seed)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 100.0)
        optimizer.step()
        optimizer.zero_grad()
        reference_losses.append(loss.item())
    for ours, theirs in zip(losses, reference_losses[1:]):
        assert math.isclose(ours, theirs, rel_tol=1e-5)
    assert relative_weight_error(engine, reference) < 2e-6


def test_inf_with_accumulation_and_clipping_is_skipped():
    """inf in the first micro-batch of two, clipping engaged: the whole window is skipped."""
    config = ds_config(accumulation=2, clipping=1.0, megatrain={"speculative_blocks": 4})
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        before = _snapshot(engine)
        handle = _poison_embedding(engine, float("inf"))
        _step(engine, 0)
        handle.remove()
        _step(engine, 1)
        assert engine.last_step_report.outcome is StepOutcome.SKIPPED and engine.skipped_steps == 1
        _assert_unchanged(engine, before)
        _step(engine, 2)
        _step(engine, 3)
        assert engine.last_step_report.outcome in (StepOutcome.APPLIED, StepOutcome.CLIPPED)
    finally:
        engine.destroy()


def test_too_many_consecutive_skips_raise_with_the_state_intact():
    config = ds_config(clipping=1.0, megatrain={"max_consecutive_skips": 2, "speculative_blocks": 2})
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        _step(engine, 0)
        before = _snapshot(engine)
        handle = _poison_embedding(engine)
        _step(engine, 1)
        _step(engine, 2)  # two in a row are tolerated
        with pytest.raises(NonFiniteGradientError, match=r"not finite \(nan\) in 3 optimizer step\(s\) in a row"):
            _step(engine, 3)
        handle.remove()
        _assert_unchanged(engine, before)
        assert engine.skipped_steps == 3
        _step(engine, 4)  # a finite step resets the count
        assert engine.was_step_applied() and engine._consecutive_skips == 0
    finally:
        engine.destroy()


def test_raise_mode_and_the_configuration_that_holds_no_gradients():
    # No clipping, no accumulation: "auto" means "raise", nothing is held (12 B/param).
    config = ds_config(clipping=0.0)
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        assert "grad" not in engine.host_bytes()
        _poison_embedding(engine)
        with pytest.raises(NonFiniteGradientError, match="already updated.*non_finite_steps"):
            _step(engine, 0)
    finally:
        engine.destroy()
    # "raise" with clipping: the state is restored exactly, then the error.
    config = ds_config(clipping=100.0, megatrain={"non_finite_steps": "raise", "speculative_blocks": 4})
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        before = _snapshot(engine)
        _poison_embedding(engine)
        with pytest.raises(NonFiniteGradientError, match="in 1 optimizer step"):
            _step(engine, 0)
        _assert_unchanged(engine, before)
    finally:
        engine.destroy()


def test_skip_without_clipping_holds_gradients():
    config = ds_config(clipping=0.0, megatrain={"non_finite_steps": "skip", "speculative_blocks": 4})
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        assert engine.host_bytes()["grad"] == engine.host_bytes()["master"]  # fp32 compute: 4 B/param
        _step(engine, 0)
        before = _snapshot(engine)
        _poison_block(engine, 0, float("-inf"))
        _step(engine, 1)
        assert engine.last_step_report.outcome is StepOutcome.SKIPPED
        _assert_unchanged(engine, before)
    finally:
        engine.destroy()
