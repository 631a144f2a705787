"""The placement (``state/placement.py``), the engine's allocations and preflight's estimate agree.

For every combination one process can build -- the NVMe tier holding nothing, the
optimizer state or the weights too; fp32, bf16 compute with an fp32 master, and a bf16
master; with and without frozen (LoRA) weights -- the engine is built (no step: every
persistent buffer exists once ``__init__`` returns) and its buffers, read from its tensors,
are compared with the placement buffer by buffer, and with preflight's estimate kind by
kind: preflight counts each host buffer with the page ``host_empty`` over-allocates
(``planning/preflight.py``), so its figure is the bytes allocated plus a page per tensor,
exactly; and the planner's estimate (``megatrain plan``), given the engine's flat sizes,
counts the same bytes as ``host_bytes()``: all three read the one placement. Data
parallel, nodes and the sharded bf16 master are checked the same way by every rank of the
multi-rank launches of ``tests/test_data_parallel.py`` (``data_parallel_worker._held_report``)
and ``tests/test_state_dict_collectives.py`` (fp32 and bf16, each in host memory, with
"optimizer" and with "all", on one node of 2 ranks, 2 nodes of one rank and 2 nodes of 2
ranks), at no extra launch: each rank against its placement, and against preflight's
estimate for its node -- the rank's own where it is its node, else the node's ranks'
allocations added up (``placement_check.node_preflight_disagreements``).
"""

from __future__ import annotations

import pytest
import tiny_models
import torch
from placement_check import placement_disagreements, planner_disagreements, preflight_disagreements
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.distributed.ownership import Ownership
from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
from megatrain_ds.model.block_discovery import find_blocks
from megatrain_ds.model.frozen_weights import cast_frozen_weights
from megatrain_ds.optimizer.facade import build_optimizer, group_index_of
from megatrain_ds.planning import preflight
from megatrain_ds.state.placement import (
    ElementSizes,
    Placement,
    StateShape,
    TierSettings,
    Topology,
    flat_state_params,
    state_shapes,
)
from megatrain_ds.state.state_placement import Buffer, Where

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": True},
    "bf16-master": {"bf16": True, "megatrain": {"master_dtype": "bf16"}},
}


def _optimizer_state_of_trained_elements_alone(placement: Placement) -> bool:
    """Whether no state's moments or held gradient covers a frozen element (issue 44): each
    is at most the state's trained prefix (a window or span of it, or nothing)."""
    return all(
        max(state.exp_avg.numel, state.exp_avg_sq.numel, state.grad.numel) <= state.numel - state.frozen_numel
        for state in placement.states
    )


def _model(frozen: torch.dtype | None) -> torch.nn.Module:
    """A 2-block tiny Llama; with ``frozen``, peft's LoRA on q and v, the base weights frozen in that dtype."""
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=2)
    if frozen is None:
        return model
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for param in lora.parameters():
        if not param.requires_grad:
            param.data = param.data.to(frozen)
    return lora


def _config(nvme: str, precision: str, swap) -> dict:
    settings = ds_config(
        accumulation=2, clipping=1.0, **{k: v for k, v in PRECISIONS[precision].items() if k == "bf16"}
    )
    megatrain = dict(PRECISIONS[precision].get("megatrain", {}))
    if nvme != "none":
        # The thread pool: its alignment is the one preflight assumes, on any machine.
        megatrain.update(nvme_offload=nvme, nvme_path=str(swap), nvme_window_blocks=2, nvme_aio={"engine": "threads"})
    settings["megatrain"] = megatrain
    return settings


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "lora"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("nvme", ["none", "optimizer", "all"])
def test_placement_is_what_the_engine_allocates_and_preflight_estimates(nvme, precision, frozen, tmp_path):
    compute = torch.bfloat16 if PRECISIONS[precision].get("bf16") else torch.float32
    model = _model(compute if frozen else None)
    config = parse_engine_config(_config(nvme, precision, tmp_path / "swap"))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    run = preflight.PreflightInputs(model, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
    need = preflight.preflight(run, available=preflight.AvailableMemory(host=1 << 50), nvme=nvme)
    engine = MegatrainEngine(model, config)
    try:
        assert placement_disagreements(engine) == []
        assert preflight_disagreements(engine, need) == []
        assert planner_disagreements(engine) == []
        placement = engine.placement
        # The frozen weights at their own cost at every NVMe level (issue 44): with no tier or
        # the optimizer state on it in host memory (the swap files hold the trained prefix
        # alone), with the weights on the tier in a read-only file of their own, in their dtype.
        assert _optimizer_state_of_trained_elements_alone(placement)
        if frozen:
            moments = Where.TRAINED_PREFIX if nvme == "none" else Where.TIER
            assert all(state.exp_avg.where is moments for state in placement.blocks)
            in_shadow = compute != config.master_dtype
            held_in = "frozen" if nvme == "all" else "shadow" if in_shadow else "master"
            assert all(state.frozen_in == held_in for state in placement.blocks)
            assert placement.resident.frozen_in == ("shadow" if in_shadow else "master")
            if nvme == "all":
                sizes = [(state.frozen.where, state.frozen.numel, state.frozen.itemsize) for state in placement.blocks]
                assert sizes == [(Where.TIER, state.frozen_numel, compute.itemsize) for state in placement.blocks]
                assert placement.tier is not None and len(placement.tier.frozen_file_bytes) == len(placement.blocks)
            if placement.tier is not None:
                trained = [state.numel - state.frozen_numel for state in placement.blocks]
                assert list(placement.tier.numels) == trained < [state.numel for state in placement.blocks]
        assert all(state.streamed is (Where.TIER if nvme == "all" else Where.HOST) for state in placement.blocks)
    finally:
        engine.destroy()


@pytest.mark.parametrize("nvme", ["none", "optimizer", "all"])
def test_fp32_frozen_weights_with_bf16_compute_are_held_once_exact(nvme, tmp_path):
    """The one frozen case not in the matrix: frozen fp32 weights (a LoRA base) with bf16
    compute are trained-only at every NVMe level, held once in fp32, exact: in the whole
    master beside the shadow with no tier; with ``"optimizer"``, whose fp32 master (of the
    trained prefix) is cut onto the tier, apart in host memory, the shadow streaming their
    rounding; with ``"all"`` apart on the tier, in fp32, rounded as they are read. The
    moments, gradients and swap files stop at the trained prefix; the engine, preflight and
    the planner agree."""
    model = _model(torch.float32)
    config = parse_engine_config(_config(nvme, "bf16", tmp_path / "swap"))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    cpu = torch.device("cpu")
    run = preflight.PreflightInputs(model, config, optimizer, cpu, STAGING_CHUNK_ELEMENTS)
    need = preflight.preflight(run, available=preflight.AvailableMemory(host=1 << 50), nvme=nvme)
    engine = MegatrainEngine(model, config)
    try:
        assert placement_disagreements(engine) == []
        assert preflight_disagreements(engine, need) == []
        assert planner_disagreements(engine) == []
        placement = engine.placement
        assert _optimizer_state_of_trained_elements_alone(placement)
        assert placement.resident.master.where is Where.HOST and placement.resident.frozen_in == "master"
        for state in placement.blocks:
            trained = state.numel - state.frozen_numel
            assert state.exp_avg.numel == state.grad.numel == trained
            held_in = {"none": "master", "optimizer": "frozen", "all": "frozen"}[nvme]
            assert state.frozen_in == held_in
            if nvme != "none":
                assert state.frozen == Buffer(Where.HOST if nvme == "optimizer" else Where.TIER, state.frozen_numel, 4)
                assert state.master == Buffer(Where.TIER, trained, 4)
        if placement.tier is not None:
            assert list(placement.tier.numels) == [state.numel - state.frozen_numel for state in placement.blocks]
    finally:
        engine.destroy()


def _partly_frozen() -> torch.nn.Module:
    """A 2-block tiny Llama, fp32: its first block frozen whole, the second's MLP frozen."""
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=2)
    model.model.layers[0].requires_grad_(False)
    model.model.layers[1].mlp.requires_grad_(False)
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("nvme", ["none", "optimizer", "all"])
def test_a_block_with_nothing_trained_holds_its_weights_alone(nvme, precision, tmp_path):
    """A block frozen whole (the first; the second's MLP frozen) holds its weights and nothing
    else at every NVMe level: no moment, no held gradient, no journal, a master only where
    the master is its weights (fp32, or the frozen fp32 weights under bf16 compute, which
    keep an exact master); with ``"optimizer"`` no swap file, with ``"all"`` its frozen
    weights apart on the tier (fp32 here, the master's dtype, rounded to bf16 as they are
    streamed) and an empty swap file. The second block's frozen fp32 MLP beside its trained
    attention is trained-only at every level too: with bf16 and ``"optimizer"`` (its fp32
    master cut: on the tier) those frozen weights are apart in host memory, exact, and the
    shadow streams their rounding. The engine, preflight and the planner agree. Four
    micro-batches (bf16, ``"optimizer"`` and ``"all"``) train it bit for bit as the state in
    host memory does: the same rounding of the same fp32 values (the shadow's, or the tier's
    as it is read), the same AdamW."""
    config = parse_engine_config(_config(nvme, precision, tmp_path / "swap"))
    model = _partly_frozen()
    optimizer = build_optimizer(model, None, config.optimizer, None)
    run = preflight.PreflightInputs(model, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
    need = preflight.preflight(run, available=preflight.AvailableMemory(host=1 << 50), nvme=nvme)
    engine = MegatrainEngine(model, config)
    try:
        assert placement_disagreements(engine) == []
        assert preflight_disagreements(engine, need) == []
        assert planner_disagreements(engine) == []
        first, second = engine.placement.blocks
        assert _optimizer_state_of_trained_elements_alone(engine.placement)
        if nvme == "optimizer" and precision == "bf16":
            # The second block's frozen fp32 MLP beside its fp32 master cut on the tier: apart,
            # whole and exact in host memory, their rounding in the shadow, nothing on the tier.
            assert second.frozen_in == "frozen" and second.frozen == Buffer(Where.HOST, second.frozen_numel, 4)
            assert second.master == Buffer(Where.TIER, second.numel - second.frozen_numel, 4)
            held = engine.states[1]
            assert held.frozen is not None and held.shadow is not None and held.frozen_for_tier is None
            trained = held.layout.trained_numel
            assert torch.equal(held.shadow[trained:], held.frozen.to(torch.bfloat16))
        assert first.numel == first.frozen_numel and first.exp_avg.numel == first.grad.numel == 0
        untrained = engine.states[0]
        assert untrained.grad is not None and untrained.exp_avg.numel() == untrained.grad.numel() == 0
        if nvme == "all":
            assert first.frozen.where is second.frozen.where is Where.TIER and first.master.numel == 0
            assert untrained.frozen is not None and untrained.frozen.numel() == first.numel
        else:  # the weights in the master (fp32 frozen weights, exact), which streams or beside the shadow
            assert first.master.where is Where.HOST and first.master.numel == first.numel
        tier = engine.nvme_tier
        if tier is not None:
            assert tier.holds(engine.states[0]) == (nvme == "all") and tier.holds(engine.states[1])
        if nvme != "none" and precision == "bf16":
            _assert_trains_as_in_host_memory(engine, _partly_frozen, parse_engine_config(_config("none", "bf16", None)))
    finally:
        engine.destroy()


def _assert_trains_as_in_host_memory(engine: MegatrainEngine, make_model, config) -> None:
    """Four micro-batches of ``engine`` and of an engine on ``config`` over the same model: the
    same losses and weights, bit for bit."""
    ram = MegatrainEngine(make_model(), config)
    try:
        for micro in range(4):
            losses = []
            for trained in (engine, ram):
                loss = trained(**tiny_models.make_batch(micro)).loss
                trained.backward(loss)
                trained.step()
                losses.append(loss.item())
            assert losses[0] == losses[1], micro
        ours, theirs = engine.module.state_dict(), ram.module.state_dict()
        assert all(torch.equal(value, theirs[name]) for name, value in ours.items())
    finally:
        ram.destroy()


def _topology(nodes: list[list[int]], rank: int = 0) -> Topology:
    """``rank``'s view of data parallel over ``nodes``, as ``DataParallel.topology`` builds it."""
    ownership = Ownership.of(nodes, rank)
    members = set(nodes[ownership.node])
    return Topology(
        node_ranks=len(nodes[ownership.node]),
        span_of=ownership.span if len(nodes) > 1 else None,
        window_of=ownership.window,
        node_windows_of=lambda numel: [(s, e) for owner, s, e in ownership.every_window(numel) if owner in members],
    )


def _shapes(model: torch.nn.Module, compute_dtype: str | None) -> list[StateShape]:
    """The flat states' shapes the engine builds ``model``'s placement from, after the cast
    ``"frozen_weights": compute_dtype`` makes at ``initialize`` (``engine_build.build``)."""
    config = parse_engine_config(_config("none", "bf16", None))
    group_of = group_index_of(model, build_optimizer(model, None, config.optimizer, None))
    if compute_dtype is not None:
        cast_frozen_weights(model, group_of, torch.bfloat16)
    _, blocks = find_blocks(model)
    return state_shapes(flat_state_params(model, blocks), group_of, torch.bfloat16)


def test_frozen_weights_cast_to_the_compute_dtype_take_the_trained_only_path_with_data_parallel():
    """``"frozen_weights": "compute_dtype"`` (``model/frozen_weights.py``) with data parallel,
    several nodes and the NVMe tier: its cast turns an fp32 LoRA base under bf16 compute into
    the states of a base that arrives in bf16 (the same shapes, so the same placement: the
    placement is a function of them), whose data-parallel placements the multi-rank launches
    of ``tests/test_data_parallel.py`` check against the engine's buffers. Every state is
    then trained-only with its frozen weights at 2 B, in the bf16 shadow, or with ``"all"``
    apart on each rank's tier (its window of them). Without the cast every state is
    trained-only too, its fp32 frozen weights held once, exact: where the fp32 master is cut
    (several nodes' spans) apart and whole in the node's host memory beside the shadow, in
    the master where it is whole (one node), with ``"all"`` each rank's window of them on its
    tier in fp32; this rank's placement of the multi-rank launches is checked against its
    buffers, preflight and the planner there (``data_parallel_worker._held_report``)."""
    cast = _shapes(_model(torch.float32), "compute_dtype")
    assert cast == _shapes(_model(torch.bfloat16), None)
    uncast = _shapes(_model(torch.float32), None)
    sizes = ElementSizes(master=4, compute=2, grad=4, with_shadow=True)
    for nodes in ([[0, 1]], [[0], [1]]):
        topology = _topology(nodes)
        for nvme in ("none", "optimizer", "all"):
            placement = Placement.of_sizes(sizes, TierSettings(), nvme, topology, cast)
            assert _optimizer_state_of_trained_elements_alone(placement), (nodes, nvme)
            for state in placement.blocks:
                if nvme == "all":  # this rank's window of the frozen weights, in a file of bf16 values
                    assert state.frozen_in == "frozen" and state.frozen.where is Where.TIER_WINDOW
                    assert state.frozen.itemsize == 2 and state.master.numel < state.numel - state.frozen_numel
                else:  # in the node's bf16 shadow alone
                    assert state.frozen_in == "shadow" and state.master.numel < state.numel
            placed = Placement.of_sizes(sizes, TierSettings(), nvme, topology, uncast)
            assert _optimizer_state_of_trained_elements_alone(placed), (nodes, nvme)
            for state in placed.blocks:
                trained = state.numel - state.frozen_numel
                assert state.exp_avg.numel == (topology.window(trained) if nvme != "none" else topology.span(trained))
                if nvme == "all":  # this rank's window of them on its tier, in fp32
                    assert state.frozen == Buffer(Where.TIER_WINDOW, topology.window(state.frozen_numel), 4)
                elif len(nodes) > 1:  # the fp32 master in the nodes' spans: apart, whole, exact
                    assert state.frozen == Buffer(Where.HOST, state.frozen_numel, 4)
                    assert state.master == Buffer(Where.NODE_SPAN, topology.span(trained), 4)
                else:  # one node: in the whole master, beside the shadow
                    assert state.frozen_in == "master" and state.master == Buffer(Where.HOST, state.numel, 4)
