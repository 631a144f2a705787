"""Blocks with nothing trained (LoRA on some layers only, blocks frozen whole): their weights alone.

PEFT's ``layers_to_transform`` adapts some blocks and leaves the others wholly frozen; a
full fine-tuning run may freeze its first blocks. Such a block holds its frozen weights, in
their own dtype, and nothing else (``state/placement.py``: [Note: the placement model]): no
fp32 master beside them, no Adam moments, no held gradient, no journal, no NVMe swap file
(with the weights on the tier its frozen weights are a read-only file of their own, as a
trained block's are), no device state. Backward hands no gradient of it to the host, while
the input gradients flow through it to the blocks before.

Tolerances. fp32: the same matmuls as plain PyTorch (``tests/test_parity.py``'s figures: 1e-5
relative per-step loss and norm, 2e-6 global relative weight error of the adapters after 4
steps, their norms summed per block in fp64 against ``clip_grad_norm_``'s). bf16 compute, the
frozen base held in bf16, against the same model in fp32 (the bf16 values exactly):
``tests/test_bf16.py``'s, bf16 compute rounds relatively 2^-9 per value, so per-step losses
agree to ~1e-4 and the adapters after 4 steps to ~1e-3; 1e-3 and 5e-3 are allowed. A resumed
run against the uninterrupted one, and a frozen weight against itself, bit for bit: the
same ops on the same values.
"""

from __future__ import annotations

import copy
import math

import pytest
import tiny_models
import torch
from placement_check import placement_disagreements, planner_disagreements, preflight_disagreements
from safetensors import safe_open
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error, train_side_by_side
from test_lora import _assert_frozen_unchanged, _assert_same_state, _frozen, _swap, _train, lora_llama
from test_placement import _config, _topology

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
from megatrain_ds.model.block_discovery import find_blocks
from megatrain_ds.optimizer.facade import build_optimizer, group_index_of
from megatrain_ds.planning import preflight
from megatrain_ds.runtime.device_runtime import PAGE_BYTES
from megatrain_ds.state.placement import (
    ElementSizes,
    Placement,
    StateShape,
    TierSettings,
    Topology,
    device_candidates,
    device_prefix,
    device_prefix_within,
    device_state_indices,
    flat_state_params,
    state_shapes,
)
from megatrain_ds.state.state_placement import Where

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

ADAPTED = (1, 3)
"""The blocks LoRA adapts (of 4); blocks 0 and 2, and the resident embeddings and head, have nothing trained."""


def lora_on_some_layers(frozen_dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """``test_lora.lora_llama`` with LoRA on blocks 1 and 3 alone (:data:`ADAPTED`)."""
    return lora_llama(frozen_dtype, seed, layers=ADAPTED)


def _assert_untrained_blocks_hold_their_weights_alone(engine: MegatrainEngine) -> None:
    """From the engine's buffers: every state with nothing trained (blocks 0 and 2, the
    resident state) has no moment, gradient, journal or device state, and a master only
    where the master is what holds (and streams) its weights (fp32 compute in host memory);
    with the NVMe tier, no swap file (or with the weights on it an empty one beside its frozen
    weights' file); the adapted blocks have all of them, over their trained prefix alone. The
    placement, preflight and the planner count what the engine holds."""
    untrained = [index for index, state in enumerate(engine.states) if state.layout.trained_numel == 0]
    assert untrained == [0, 2, len(engine.states) - 1]
    tier = engine.nvme_tier
    for index, state in enumerate(engine.states):
        trained = state.layout.trained_numel
        assert not state.placement.on_device
        assert state.exp_avg.numel() == state.exp_avg_sq.numel() == trained
        assert state.grad is not None and state.grad.numel() == trained
        weights_in_master = state.shadow is None and state.frozen is None
        assert state.master.numel() == (state.layout.numel if weights_in_master else trained)
        if tier is not None and index < engine._resident_index:
            apart = engine.placement.weights_on_tier
            assert tier.holds(state) == (trained > 0 or apart), index
    if tier is not None:
        assert tier.numels == [s.layout.trained_numel for s in engine.states[:-1] if tier.holds(s)]
    assert all(extent.numel == 0 or extent.index in ADAPTED for extent in engine.stepper.journal.extents)
    assert placement_disagreements(engine) == []
    assert preflight_disagreements(engine) == []
    assert planner_disagreements(engine) == []


def _count_gradients_handed_on(engine: MegatrainEngine) -> dict[int, int]:
    """Elements backward hands the host per state from now on: the sink's entry points, counted."""
    counts: dict[int, int] = {}
    sink = engine.sink
    push, push_block = sink.push, sink.push_block

    def counting_push(state_index: int, offset: int, grad: torch.Tensor, final: bool) -> None:
        counts[state_index] = counts.get(state_index, 0) + grad.numel()
        push(state_index, offset, grad, final)

    def counting_push_block(state_index: int, pieces, final: bool) -> None:
        counts[state_index] = counts.get(state_index, 0) + sum(grad.numel() for _, grad in pieces)
        push_block(state_index, pieces, final)

    sink.push, sink.push_block = counting_push, counting_push_block  # type: ignore[method-assign]
    return counts


PRECISION_NVME = [("fp32", "none"), ("fp32", "all"), ("bf16", "none"), ("bf16", "optimizer"), ("bf16", "all")]


@pytest.mark.parametrize("precision, nvme", PRECISION_NVME, ids=[f"{p}-{n}" for p, n in PRECISION_NVME])
def test_lora_on_some_layers_trains_as_plain_pytorch_and_resumes_exactly(precision, nvme, tmp_path):
    """4 steps (accumulation 2, clipping that fires) against ``torch.optim.AdamW`` with
    ``clip_grad_norm_`` on the fp32 model (the module docstring's tolerances); a checkpoint
    after step 2, loaded into a second engine (other adapters, other frozen weights) that
    trains steps 3-4: the same losses and state bit for bit; the adapters-only checkpoint
    (``exclude_frozen_parameters``) holds no frozen weight; the frozen weights bit for bit as
    they were in both engines. Backward hands the host no gradient of the untrained states."""
    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = ds_config(accumulation=2, clipping=0.05, bf16=bf16, megatrain=_swap(nvme, tmp_path / "swap"))
    model = lora_on_some_layers(dtype)
    frozen = _frozen(model)
    reference = copy.deepcopy(model).float()
    engine = MegatrainEngine(model, parse_engine_config(config))
    try:
        _assert_untrained_blocks_hold_their_weights_alone(engine)
        handed_on = _count_gradients_handed_on(engine)
        losses = _train(engine, 2)
        engine.save_checkpoint(tmp_path, tag="step2")
        losses += _train(engine, 2, first=2)
        assert set(handed_on) == set(ADAPTED)
        _assert_tracks_pytorch(engine, reference, losses, rel_loss=1e-3 if bf16 else 1e-5)
        _assert_frozen_unchanged(engine, frozen)
        engine.save_checkpoint(tmp_path, tag="adapters", exclude_frozen_parameters=True)
        other = MegatrainEngine(lora_on_some_layers(dtype, seed=1), parse_engine_config(config))
        try:
            other.load_checkpoint(tmp_path, tag="step2")
            assert _train(other, 2, first=2) == losses[4:]
            engine.settle_optimizer()  # the host state is read directly
            other.settle_optimizer()
            _assert_same_state(engine, other)
            _assert_frozen_unchanged(other, frozen)
            _assert_untrained_blocks_hold_their_weights_alone(other)
        finally:
            other.destroy()
    finally:
        engine.destroy()
    with safe_open(str(tmp_path / "adapters" / "model-00001-of-00001.safetensors"), "pt") as adapters:
        saved = set(adapters.keys())
    assert saved == {name for name, p in reference.named_parameters() if p.requires_grad}


def _assert_tracks_pytorch(engine: MegatrainEngine, reference: torch.nn.Module, losses: list[float], rel_loss: float):
    """Trains ``reference`` (fp32) on the engine's batches with AdamW and clipping, and compares
    the per-micro-batch losses and the adapters' global relative error (the module docstring)."""
    trainable = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    clipped = []
    for step in range(len(losses) // 2):
        for micro in range(2):
            loss = reference(**tiny_models.make_batch(step * 2 + micro)).loss
            (loss / 2).backward()
            assert math.isclose(losses[step * 2 + micro], loss.item(), rel_tol=rel_loss), (step, micro)
        clipped.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)) > 0.05)
        optimizer.step()
        optimizer.zero_grad()
    assert any(clipped), "clipping is exercised"
    ours, theirs = engine.module.state_dict(), reference.state_dict()
    trained = [name for name, p in reference.named_parameters() if p.requires_grad]
    diff = sum(float(((ours[n].double() - theirs[n].double()) ** 2).sum()) for n in trained)
    norm = sum(float((theirs[n].double() ** 2).sum()) for n in trained)
    bound = 5e-3 if engine.config.compute_dtype == torch.bfloat16 else 2e-6
    assert math.sqrt(diff / norm) < bound


def test_lora_with_device_state_trains_as_plain_pytorch_and_keeps_frozen_weights_off_it():
    """``"device_state": 0.5`` (the GPU tier, through Triton's interpreter on the CPU) on LoRA
    over some layers, fp32, accumulation 2 and clipping: PyTorch's numbers (the module
    docstring's fp32 tolerances, as ``tests/test_device_state.py``'s: the Triton kernel rounds
    a few multiply-adds differently, < 1 ulp per step). Half the trained elements is block 1's
    adapters: block 1 alone is on the device, its moments and gradient over its trained prefix
    alone; the states with nothing trained (the resident embeddings and head, blocks 0 and 2)
    are not, and block 3 is the host's, as with ``"none"``."""
    config = ds_config(accumulation=2, clipping=0.05, megatrain={"device_state": 0.5})
    frozen = _frozen(lora_on_some_layers())
    engine, reference, trace = train_side_by_side(lora_on_some_layers, config, steps=4)
    try:
        for ours, theirs in zip(trace.engine_losses, trace.reference_losses):
            assert math.isclose(ours, theirs, rel_tol=1e-5)
        for ours, theirs in zip(trace.engine_norms, trace.reference_norms):
            assert math.isclose(ours, theirs, rel_tol=1e-5)
        assert relative_weight_error(engine, reference) < 2e-6
        _assert_frozen_unchanged(engine, frozen)
        assert engine.placement.device_indices == (1,)
        state = engine.states[1]
        trained = state.layout.trained_numel
        assert state.exp_avg.device == engine.runtime.device
        assert state.exp_avg.numel() == state.exp_avg_sq.numel() == trained
        assert state.grad is not None and state.grad.numel() == trained
        assert engine.device_bytes()["device_state"] == sum(engine.placement.device_bytes().values())
        assert placement_disagreements(engine) == [] and planner_disagreements(engine) == []
        assert engine.streamer.transfers[1] == 0 and all(engine.streamer.transfers[b] > 0 for b in (0, 2, 3))
    finally:
        engine.destroy()


def test_the_gpu_tier_takes_only_states_with_something_to_train():
    """The GPU tier's prefix (``state/placement.py``: ``device_candidates``) skips the states with
    nothing trained, by a fraction of the trained elements and by device bytes (``"auto"``): a
    LoRA-on-some-layers model's resident state and blocks 0 and 2 are never among them."""
    shapes = [StateShape(128, 0, True), StateShape(192, 64, True), StateShape(128, 0, True), StateShape(192, 64, True)]
    shapes.append(StateShape(256, 0, True))  # the resident state: embeddings and head, frozen
    assert device_candidates(shapes) == [1, 3]
    assert device_prefix(0.5, shapes) == 1 and device_prefix(1.0, shapes) == 2
    assert device_state_indices(shapes, 2) == [1, 3]
    sizes = ElementSizes(master=4, compute=2, grad=4, with_shadow=True)
    every = Placement.of_sizes(sizes, TierSettings(), "none", Topology(), shapes, len(shapes))
    assert every.device_indices == (1, 3)
    per_state = sum(buffer.device_bytes for buffer in every.states[1].buffers().values())
    assert device_prefix_within(every, per_state) == 1 and device_prefix_within(every, 2 * per_state) == 2


def test_lora_with_device_state_in_bf16_tracks_pytorch_and_keeps_frozen_weights_off_it():
    """``"device_state": 0.5`` with bf16 compute on LoRA over some layers, the frozen base
    held in bf16, accumulation 2 and clipping that fires: against fp32 plain PyTorch on the
    same model (the frozen bf16 values exactly), the module docstring's bf16 bounds, 1e-3
    relative per-step loss and 5e-3 relative error of the adapters after 4 steps. The GPU
    tier adds no more than the same order: its device shadow of block 1's adapters is
    written by the Triton kernel, which under the interpreter truncates to bf16 where the
    host rounds (``tests/test_device_state.py``), at most 2^-8 relative per value instead
    of 2^-9, through the same 4 steps of bf16 matmuls (measured: 4e-5 and 1.1e-3, the run
    without the GPU tier 7e-5 and 1.1e-3). The frozen weights stay bit for bit (none is ever
    written), and get no device state: block 1 alone is on the device, its moments,
    gradient and fp32 master over its trained prefix (its frozen bf16 weights in the shadow
    alone, as on the host); the states with nothing trained stay in host memory."""
    config = ds_config(accumulation=2, clipping=0.05, bf16=True, megatrain={"device_state": 0.5})
    model = lora_on_some_layers(torch.bfloat16)
    frozen = _frozen(model)
    reference = copy.deepcopy(model).float()
    engine = MegatrainEngine(model, parse_engine_config(config))
    try:
        losses = _train(engine, 4)
        _assert_tracks_pytorch(engine, reference, losses, rel_loss=1e-3)
        _assert_frozen_unchanged(engine, frozen)
        assert engine.placement.device_indices == (1,)
        for index, state in enumerate(engine.states):
            assert state.placement.on_device == (index == 1) and state.placement.frozen_in == "shadow"
        state = engine.states[1]
        trained = state.layout.trained_numel
        assert state.exp_avg.device == state.master.device == engine.runtime.device
        assert state.exp_avg.numel() == state.exp_avg_sq.numel() == state.master.numel() == trained
        assert state.grad is not None and state.grad.numel() == trained
        assert state.shadow is not None and state.shadow.numel() == state.layout.numel
        assert placement_disagreements(engine) == [] and planner_disagreements(engine) == []
        assert engine.streamer.transfers[1] == 0 and all(engine.streamer.transfers[b] > 0 for b in (0, 2, 3))
    finally:
        engine.destroy()


def _first_block_frozen(num_layers: int, frozen_dtype: torch.dtype) -> torch.nn.Module:
    """A tiny Llama whose blocks' MLPs are frozen, in ``frozen_dtype``; with 3 blocks the
    first is frozen whole (the 2 others are then what the 2-block model's are)."""
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=num_layers)
    if num_layers == 3:
        model.model.layers[0].requires_grad_(False)
    for block in model.model.layers[num_layers - 2 :]:
        block.mlp.requires_grad_(False)
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(frozen_dtype)
    return model


def _planned(model: torch.nn.Module, config, nvme: str, topology: Topology) -> tuple[Placement, preflight.MemoryNeed]:
    """``model``'s placement on one rank of ``topology``, as the engine computes it, and
    preflight's estimate of the rank's node (no engine is built)."""
    optimizer = build_optimizer(model, None, config.optimizer, None)
    _, blocks = find_blocks(model)
    shapes = state_shapes(flat_state_params(model, blocks), group_index_of(model, optimizer), config.compute_dtype)
    run = preflight.PreflightInputs(model, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS, topology)
    need = preflight.preflight(run, available=preflight.AvailableMemory(host=1 << 50), nvme=nvme)
    return Placement.of(config, nvme, topology, shapes), need


DATA_PARALLEL = {"one node of 2 ranks": [[0, 1]], "2 nodes of one rank": [[0], [1]]}


@pytest.mark.parametrize(
    "precision, frozen_dtype",
    [("fp32", torch.float32), ("bf16", torch.float32), ("bf16", torch.bfloat16)],
    ids=["fp32", "bf16-exact", "bf16-frozen-in-bf16"],
)
def test_a_block_with_nothing_trained_holds_its_weights_alone_with_data_parallel(precision, frozen_dtype, tmp_path):
    """Data parallel (a node of 2 ranks, and 2 nodes), every rank's placement, no launch: a
    block frozen whole costs its weights alone with ``"none"`` and ``"optimizer"``, against
    the same model without it (its other blocks the same): no moments, held gradient or
    swap file on any rank (every rank's window of its empty trained prefix is empty), its
    weights whole on every node, in the fp32 master where they arrive in fp32 (exact, even
    where nodes cut the other states' masters) or in the bf16 shadow alone. Preflight,
    which models data parallel, counts the same: the weights, a page per empty tensor, no
    disk. (The planner plans one process: ``test_a_block_with_nothing_trained_holds_its_
    weights_alone``.) With ``"all"`` each rank's tier holds its window of the frozen weights,
    the windows tiling them, in their own dtype (fp32 ones under bf16 compute too: rounded
    as they are read, before the gather: ``[Note: the placement model]``)."""
    with_shadow, in_master = precision == "bf16", frozen_dtype == torch.float32
    for layout, nodes in DATA_PARALLEL.items():
        for nvme in ("none", "optimizer", "all"):
            config = parse_engine_config(_config(nvme, precision, tmp_path / "swap"))
            frozen_windows = 0
            for rank in (0, 1):
                topology = _topology(nodes, rank)
                placement, need = _planned(_first_block_frozen(3, frozen_dtype), config, nvme, topology)
                without, need_without = _planned(_first_block_frozen(2, frozen_dtype), config, nvme, topology)
                first, case = placement.blocks[0], (layout, nvme, rank)
                assert first.numel == first.frozen_numel > 0
                assert first.exp_avg.numel == first.exp_avg_sq.numel == 0, case
                assert first.grad.numel == 0 and not first.on_device, case
                if nvme == "all":
                    assert first.frozen.where is Where.TIER_WINDOW and first.master.numel == 0, case
                    assert first.frozen.itemsize == (4 if in_master else config.compute_dtype.itemsize), case
                    frozen_windows += first.frozen.numel
                    continue
                held = {"master": 4 * first.numel if in_master else 0}
                if with_shadow:
                    held["shadow"] = 2 * first.numel
                added = {k: v - without.host_bytes().get(k, 0) for k, v in placement.host_bytes().items()}
                added = {k: v for k, v in added.items() if k != "frozen" or v}  # none apart: nothing trained
                assert added == {**dict.fromkeys(["exp_avg", "exp_avg_sq", "grad"], 0), **held}, case
                assert (placement.tier, placement.node_tiers) == (without.tier, without.node_tiers), case
                # Preflight: a page per host tensor; block 0's master, moments and gradient are empty
                # tensors but where they live elsewhere (the weights in the shadow: an empty master).
                moments = 2 * PAGE_BYTES if nvme == "none" else 0
                counted = {"master": held["master"] + PAGE_BYTES, "adam_m_v": moments, "gradients": PAGE_BYTES}
                counted.update({"shadow": held["shadow"] + PAGE_BYTES} if with_shadow else {})
                assert {k: need.host[k] - need_without.host[k] for k in counted} == counted, case
                assert need.disk == need_without.disk, case
                assert need.host.get("nvme_window") == need_without.host.get("nvme_window"), case
            if frozen_windows:  # the two ranks' windows of block 0's frozen weights: each element once
                assert frozen_windows == placement.blocks[0].numel, layout
