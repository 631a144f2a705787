"""Held gradients without a host pass: direct copies, the norm where the gradient is, no zeroing.

What is checked, each against an independent reference:

- Without accumulation (held dtype == compute dtype) every chunk lands in the held buffer
  by the copy alone: the worker never sees a chunk (no add, no norm on the host), the
  step does not zero the buffers afterwards, and what was in them before is overwritten,
  not added to (a NaN left there must not reach the norm).
- The norm summed "on the device" (``SquaredNorm.add_on_device``; the CPU here) is the
  norm the host worker sums, bit for bit: the same fp32 chunk norms squared and added in
  fp64 in the same order. Against a float64 reference its relative error is bounded by
  the fp32 chunk norms': a pairwise fp32 sum of ``n`` squares errs by at most about
  ``log2(n) * 2**-24`` relative (plus one rounding of the square root), i.e. below 1e-6
  for the 4096-element chunks below.
- With accumulation the first micro-batch copies and the later ones add: the held
  gradients equal plain PyTorch's accumulated ``.grad`` (fp32 compute; the engine
  recomputes blocks with one leaf per parameter, so the last bits may differ: the
  parity suite's 1e-5 relative, per tensor).
"""

from __future__ import annotations

import math

import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.gradients.held_writes import HeldWrites
from megatrain_ds.gradients.squared_norm import SquaredNorm
from megatrain_ds.optimizer.gradient_accumulation import HostAccumulation
from megatrain_ds.state.flat_layout import FROZEN_GROUP, build_flat_layout

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def _engine(config: dict) -> MegatrainEngine:
    torch.manual_seed(0)
    return MegatrainEngine(tiny_models.llama(num_layers=3), parse_engine_config(config))


def _micro_batch(engine: MegatrainEngine, seed: int) -> None:
    engine.backward(engine(**tiny_models.make_batch(seed)).loss)
    engine.step()


def test_without_accumulation_chunks_reach_the_held_gradients_by_the_copy_alone(monkeypatch):
    config = ds_config(accumulation=1, clipping=1.0, megatrain={"speculative_blocks": 0})
    engine = _engine(config)
    reference = _engine(config)
    consumed = []
    monkeypatch.setattr(engine.sink, "_consume", lambda *chunk: consumed.append(chunk[:2]))
    try:
        _micro_batch(engine, 0)
        _micro_batch(reference, 0)
        engine.settle_optimizer()  # the step's update reads the held gradients written below
        for state in engine.optimizer_states:
            assert state.grad is not None and state.grad.abs().sum() > 0, "the step zeroed the held gradients"
            state.grad.fill_(math.nan)  # whatever is left must be written over, never added to
        _micro_batch(engine, 1)
        _micro_batch(reference, 1)
        assert consumed == [], "the gradient worker saw chunks that need no host pass"
        assert engine.get_global_grad_norm() == reference.get_global_grad_norm()
        assert math.isfinite(engine.get_global_grad_norm())
        engine.settle_optimizer(), reference.settle_optimizer()  # the host state is read directly
        for ours, theirs in zip(engine.optimizer_states, reference.optimizer_states):
            assert torch.equal(ours.master, theirs.master)
    finally:
        engine.destroy()
        reference.destroy()


def test_device_and_host_norms_agree_bit_for_bit_and_with_float64():
    torch.manual_seed(1)
    chunks = [torch.randn(4096) * scale for scale in (1e-3, 1.0, 30.0)]
    on_device, on_host = SquaredNorm(torch.device("cpu")), SquaredNorm(torch.device("cpu"))
    for chunk in chunks:
        on_device.add_on_device(chunk)
        on_host.add_on_host(chunk)
    assert on_host.lower_bound() > 0 and on_device.lower_bound() == 0.0  # device sums unseen until take
    ours, host = on_device.take(), on_host.take()
    # Equal bits though the device side may fuse its multiply-add (addcmul_) and Python's
    # does not: the fp64 square of a widened fp32 norm is exact, so both round once, at the add.
    assert ours == host
    exact = float(sum((c.double() ** 2).sum() for c in chunks))
    assert math.isclose(ours, exact, rel_tol=1e-6)
    assert on_device.take() == 0.0, "take() starts the next step from zero"
    on_device.add_on_device(torch.tensor([1.0, math.inf]))
    assert on_device.take() == math.inf


def test_the_staged_path_sums_the_same_norm_as_the_direct_path(monkeypatch):
    """One step through the worker (the sink told to stage everything: each chunk is its
    elements' first write, copied) against the direct path. With torch's ops the worker
    sums the same fp32 chunk norms as the device: the same norm bits. With the fused pass
    (``optimizer/gradient_accumulation.py``) it sums the squares in fp64, more exactly:
    the norms then differ by the fp32 chunk norms' error, below 1e-6 relative (as above),
    and the updates by what that does to the clipping scale."""
    config = ds_config(accumulation=1, clipping=1.0, megatrain={"speculative_blocks": 0})
    direct, staged, staged_torch = _engine(config), _engine(config), _engine(config)
    assert staged.accumulation.fused, "the engine's CPU Adam kernel is DeepSpeed's here"
    monkeypatch.setattr(staged.sink, "_land", None)
    monkeypatch.setattr(staged_torch.sink, "_land", None)
    staged_torch.accumulation = HostAccumulation(None)
    try:
        for engine in (direct, staged, staged_torch):
            _micro_batch(engine, 0)
        assert direct.get_global_grad_norm() == staged_torch.get_global_grad_norm()
        assert math.isclose(direct.get_global_grad_norm(), staged.get_global_grad_norm(), rel_tol=1e-6)
    finally:
        for engine in (direct, staged, staged_torch):
            engine.destroy()


def test_accumulated_held_gradients_match_pytorch():
    """fp32 compute: the first micro-batch lands by the copy, the others are added on the
    worker; per tensor within 1e-5 relative of PyTorch's accumulated gradients."""
    accumulation = 3
    config = ds_config(accumulation=accumulation, clipping=1.0)
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=3)
    reference = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    reference_model = tiny_models.llama(num_layers=3)
    reference_model.load_state_dict({name: t.detach() for name, t in reference.items()})
    engine = MegatrainEngine(model, parse_engine_config(config))
    names = {id(p): name for name, p in engine.module.named_parameters()}
    try:
        for micro in range(accumulation):
            batch = tiny_models.make_batch(micro)
            engine.backward(engine(**batch).loss)
            (reference_model(**batch).loss / accumulation).backward()
            if micro < accumulation - 1:
                engine.step()
        engine.sink.drain()
        expected = {name: p.grad for name, p in reference_model.named_parameters()}
        for state in engine.optimizer_states:
            assert state.grad is not None and state.grad.dtype == torch.float32
            for slot, param in zip(state.layout.slots, state.params):
                ours = state.grad[slot.offset : slot.offset + slot.numel]
                theirs = expected[names[id(param)]].reshape(-1)
                error = float((ours.double() - theirs.double()).norm() / theirs.double().norm())
                assert error < 1e-5, (names[id(param)], error)
    finally:
        engine.destroy()


def _layout():
    """Two trained parameters (two groups: two runs) and a frozen one."""
    groups = (0, FROZEN_GROUP, 1)
    return build_flat_layout([(f"p{i}", torch.Size([40]), group) for i, group in enumerate(groups)])


def test_held_writes_first_write_copies_later_ones_add_and_partial_ones_split():
    writes = HeldWrites(2)
    assert writes.claim(0, 0, 10) == [(0, 10)]
    assert writes.claim(0, 10, 20) == [(10, 20)]
    assert writes.claim(1, 0, 10) == [(0, 10)]
    assert writes.claim(0, 0, 10) == []  # the second micro-batch adds
    assert writes.claim(0, 5, 30) == [(20, 30)]  # partly written: only the rest is new
    assert writes.claim(0, 40, 50) == [(40, 50)]
    assert writes.claim(0, 35, 45) == [(35, 40)]
    writes.clear()
    assert writes.claim(0, 0, 10) == [(0, 10)]
    writes.mark_all_written()
    assert writes.claim(0, 60, 70) == []


def test_held_writes_settle_zeroes_only_unwritten_trained_ranges():
    layout = _layout()
    grad = torch.full((layout.numel,), 7.0)

    class _State:  # what settle reads of a HostFlatState
        def __init__(self) -> None:
            self.layout = layout
            self.grad = grad

    writes = HeldWrites(1)
    trained = layout.trained_runs()
    assert len(trained) == 2
    first = trained[0]
    writes.claim(0, first.start, first.end)  # the first trained run was written this step
    writes.settle([_State()])  # type: ignore[list-item]
    assert torch.all(grad[first.start : first.end] == 7.0)
    for run in trained[1:]:
        assert torch.all(grad[run.start : run.end] == 0.0)
    frozen = [run for run in layout.runs if run.group == FROZEN_GROUP]
    assert frozen and all(torch.all(grad[run.start : run.end] == 7.0) for run in frozen)
    assert writes.claim(0, 0, 10) == [], "settled: later writes add"
