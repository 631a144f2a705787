"""Host state: page-aligned flat buffers, parameters as views of the master, bytes per parameter."""

import copy

import pytest
import tiny_models
import torch
import transformers
from placement_check import planned_state
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.optimizer.journal import AUTO_JOURNAL_BYTES_PER_PARAM
from megatrain_ds.runtime.device_runtime import PAGE_BYTES
from megatrain_ds.state.placement import Topology


def _mid_llama(num_layers=4):
    """Hidden 64: every tensor is a multiple of the 64-element alignment, so no padding."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def test_blocks_live_in_page_aligned_flat_buffers_viewed_by_the_model():
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config()))
    try:
        for index, state in enumerate(engine.states[:-1]):
            assert state.master.data_ptr() % PAGE_BYTES == 0
            start = state.master.data_ptr()
            end = start + state.master.numel() * 4
            for param in engine.module.model.layers[index].parameters():
                assert param.dtype == torch.float32
                assert start <= param.data_ptr() < end, "block parameter is not a view of its master"
    finally:
        engine.destroy()


def test_state_dict_reports_fp32_masters_in_bf16_compute():
    torch.manual_seed(0)
    model = tiny_models.qwen2()
    original = copy.deepcopy(model.state_dict())
    engine = MegatrainEngine(model, parse_engine_config(ds_config(bf16=True)))
    try:
        # Resident parameters compute in bf16 ...
        assert engine.module.model.embed_tokens.weight.dtype == torch.bfloat16
        state = engine.module.state_dict()
        # ... but the state dict shows the exact fp32 masters, tied keys included.
        assert state.keys() == original.keys()
        for key, value in original.items():
            assert state[key].dtype == torch.float32
            assert torch.equal(state[key], value), key
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "bf16, clipping, accumulation, expected_bytes_per_param",
    [
        (True, 1.0, 1, 4 + 8 + 2 + 2),  # master, m+v, bf16 shadow, bf16 gradients for the norm
        (False, 1.0, 1, 4 + 8 + 4),  # fp32 gradients held for the norm
        (False, 0.0, 1, 4 + 8),  # no clipping: gradients are consumed as they arrive
        (True, 0.0, 2, 4 + 8 + 2 + 4),  # accumulation: fp32 accumulator
    ],
)
def test_host_bytes_per_parameter(bf16, clipping, accumulation, expected_bytes_per_param):
    model = _mid_llama()
    num_params = sum(p.numel() for p in model.parameters())
    engine = MegatrainEngine(
        model, parse_engine_config(ds_config(bf16=bf16, clipping=clipping, accumulation=accumulation))
    )
    try:
        held = engine.host_bytes()
        # The speculative step's journal is sized by its budget, not per parameter: the last
        # block's trailing elements (optimizer/journal.py), at most AUTO_JOURNAL_BYTES_PER_PARAM.
        journal = held.pop("journal", 0)
        assert sum(held.values()) == expected_bytes_per_param * num_params
        assert journal <= AUTO_JOURNAL_BYTES_PER_PARAM * num_params
        total = sum(held.values()) + journal
        if clipping and accumulation == 1:
            assert total / num_params <= 16.5
        if not clipping and accumulation == 1 and not bf16:
            assert total / num_params <= 12.5
    finally:
        engine.destroy()


def test_bf16_master_has_no_shadow_and_is_streamed_directly():
    engine = MegatrainEngine(
        _mid_llama(), parse_engine_config(ds_config(bf16=True, megatrain={"master_dtype": "bf16"}))
    )
    try:
        state = engine.states[0]
        assert state.master.dtype == torch.bfloat16 and state.shadow is None
        assert state.streamed is state.master
    finally:
        engine.destroy()


def test_a_node_span_with_a_bf16_shadow_shards_the_fp32_master_too():
    """Several nodes with bf16 compute (issue 34): ``migrate_to_host`` gives node 1 of 2 the
    whole bf16 shadow, viewed by the parameters, and only its span of the fp32 master,
    exact, like the moments; ``share`` replaces the values before either is made from them.
    The reference is the values laid out by hand at the slots' offsets (zero padding)."""
    from megatrain_ds.distributed.ownership import Ownership
    from megatrain_ds.runtime.device_runtime import DeviceRuntime
    from megatrain_ds.state.flat_layout import build_flat_layout
    from megatrain_ds.state.host_store import migrate_to_host

    torch.manual_seed(0)
    shapes = [(7, 5), (33,), (3, 11), (130,)]  # odd sizes: padding between the slots
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    named = [(f"p{index}", param) for index, param in enumerate(params)]
    slots = build_flat_layout([(name, p.shape, 0) for name, p in named]).slots
    first_node = [torch.randn(shape) for shape in shapes]  # what the "first node" started from
    originals = [param.detach().clone() for param in params]
    span_of = Ownership.of([[0], [1]], rank=1).span

    def share(values: torch.Tensor) -> None:  # the first node's weights, as the engine broadcasts them
        for slot, value in zip(slots, first_node):
            values[slot.offset : slot.offset + slot.numel].copy_(value.flatten())

    runtime = DeviceRuntime.create(torch.device("cpu"), pin_memory=False)
    group_of = dict.fromkeys(params, 0)
    nodes = Topology(node_ranks=1, span_of=span_of)
    placement = planned_state(named, group_of, (torch.float32, torch.bfloat16), nodes)
    assert placement.master_split  # the master too: this node's span
    state = migrate_to_host(
        named, group_of, runtime, torch.float32, torch.bfloat16, placement, span_of=span_of, share=share
    )
    numel = state.layout.numel
    start, end = span_of(numel)
    assert 0 < start < end == numel and state.master_held == state.held == (start, end)
    expected = torch.zeros(numel)
    for slot, value in zip(slots, first_node):
        expected[slot.offset : slot.offset + slot.numel] = value.flatten()
    assert torch.equal(state.master, expected[start:end])  # exact fp32, the span only
    assert state.shadow is not None and torch.equal(state.shadow, expected.bfloat16())
    for slot, param, original in zip(slots, params, originals):
        assert param.dtype == torch.bfloat16 and param.data_ptr() == state.shadow[slot.offset :].data_ptr()
        assert not torch.equal(param.float(), original)  # its own values were replaced by share's
    assert state.nbytes_by_kind() == {
        "master": 4 * (end - start),
        "shadow": 2 * numel,
        "exp_avg": 4 * (end - start),
        "exp_avg_sq": 4 * (end - start),
    }
    assert state.weights is state.shadow
    # A window (a rank's share, inside the span) sees the master at span-relative offsets.
    window = state.window(start + 64, end)
    assert torch.equal(window.master, expected[start + 64 : end])
    window.master.add_(1.0)
    state.refresh_shadow(start + 64, end)
    assert torch.equal(state.shadow[start + 64 :], (expected[start + 64 :] + 1).bfloat16())
    assert torch.equal(state.shadow[:start], expected[:start].bfloat16())  # outside the span: untouched

    # fp32 compute (no shadow) on the same span: only the moments are sharded.
    fp32 = [torch.nn.Parameter(value.clone()) for value in first_node]
    named_fp32, group_fp32 = [(f"p{i}", p) for i, p in enumerate(fp32)], dict.fromkeys(fp32, 0)
    placement = planned_state(named_fp32, group_fp32, (torch.float32, torch.float32), nodes)
    whole = migrate_to_host(named_fp32, group_fp32, runtime, torch.float32, torch.float32, placement, span_of=span_of)
    assert whole.master_held == (0, numel) and torch.equal(whole.master, expected)
    assert whole.weights is whole.master and whole.exp_avg.numel() == end - start


def test_a_node_span_of_a_trained_only_state_leaves_frozen_weights_in_the_shadow():
    """Several nodes with bf16 compute and frozen bf16 weights (issue 44): node 1 of 2 holds
    its span of the *trained prefix* (``HostFlatState.stepped_numel``) of the fp32 master and
    of the moments, exact; the frozen weights are in the whole bf16 shadow alone, bit for
    bit, and stay there when the parameters are re-pointed (as the NVMe tier does). The
    reference is the values laid out by hand (trained slots first, then the frozen ones)."""
    from megatrain_ds.distributed.ownership import Ownership
    from megatrain_ds.runtime.device_runtime import DeviceRuntime
    from megatrain_ds.state.flat_layout import FROZEN_GROUP
    from megatrain_ds.state.host_store import migrate_to_host

    torch.manual_seed(0)
    trained = [torch.nn.Parameter(torch.randn(shape)) for shape in [(7, 5), (130,), (3, 11)]]
    frozen = [torch.nn.Parameter(torch.randn(shape).bfloat16(), requires_grad=False) for shape in [(33,), (9, 9)]]
    named = [(f"p{index}", param) for index, param in enumerate(trained + frozen)]
    group_of = {param: 0 for param in trained} | {param: FROZEN_GROUP for param in frozen}
    values = {name: param.detach().clone() for name, param in named}
    span_of = Ownership.of([[0], [1]], rank=1).span
    runtime = DeviceRuntime.create(torch.device("cpu"), pin_memory=False)
    placement = planned_state(named, group_of, (torch.float32, torch.bfloat16), Topology(1, span_of))
    assert placement.master_split and placement.frozen_in == "shadow"
    state = migrate_to_host(named, group_of, runtime, torch.float32, torch.bfloat16, placement, span_of=span_of)
    layout, (start, end) = state.layout, state.held
    assert state.stepped_numel == layout.trained_numel < layout.numel
    assert (start, end) == span_of(layout.trained_numel) and 0 < start < end == layout.trained_numel
    assert state.master_held == (start, end) and state.master.numel() == end - start
    expected = torch.zeros(layout.numel)
    for slot in layout.slots:
        expected[slot.offset : slot.offset + slot.numel] = values[slot.name].float().flatten()
    assert torch.equal(state.master, expected[start:end]) and state.exp_avg.numel() == end - start
    assert state.shadow is not None and torch.equal(state.shadow, expected.bfloat16())
    for index, slot in enumerate(layout.slots):
        if slot.group == FROZEN_GROUP:
            assert torch.equal(state.weight_view(index), values[slot.name])
    state.point_params_at(state.shadow)  # what the tier does while the master is away
    for slot, param in zip(layout.slots, state.params):
        assert param.data_ptr() == state.shadow[slot.offset :].data_ptr()
    window = state.window(start, end)  # a rank's window: inside the trained prefix
    assert torch.equal(window.master, expected[start:end])


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_window_without_a_shadow_keeps_only_its_master_span_and_parks_the_parameters(compute: torch.dtype):
    """The weights on the NVMe tier with data parallel (issue 34): ``migrate_to_host`` with
    that placement (gathered) and a rank's window keeps only that window of the fp32 master,
    exact, and no whole copy at all (the blocks are gathered from every rank's window when
    used): the parameters become meta tensors of their shapes and dtype. ``share`` (rank 0's
    values, as the engine broadcasts them) replaces the values first. The reference is the
    values laid out by hand at the slots' offsets."""
    from megatrain_ds.distributed.ownership import Ownership
    from megatrain_ds.runtime.device_runtime import DeviceRuntime
    from megatrain_ds.state.flat_layout import build_flat_layout
    from megatrain_ds.state.host_store import migrate_to_host

    torch.manual_seed(0)
    shapes = [(7, 5), (33,), (3, 11), (130,)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    named = [(f"p{index}", param) for index, param in enumerate(params)]
    slots = build_flat_layout([(name, p.shape, 0) for name, p in named]).slots
    rank0 = [torch.randn(shape) for shape in shapes]
    window_of = Ownership.of([[0, 1, 2]], rank=1).window

    def share(values: torch.Tensor) -> None:
        for slot, value in zip(slots, rank0):
            values[slot.offset : slot.offset + slot.numel].copy_(value.flatten())

    runtime = DeviceRuntime.create(torch.device("cpu"), pin_memory=False)
    group_of = dict.fromkeys(params, 0)
    ranks = Topology(node_ranks=3, window_of=window_of)
    placement = planned_state(named, group_of, (torch.float32, compute), ranks, nvme="all")
    assert placement.gathered and placement.master_split
    state = migrate_to_host(named, group_of, runtime, torch.float32, compute, placement, span_of=window_of, share=share)
    start, end = window_of(state.layout.numel)
    assert 0 < start < end < state.layout.numel and state.master_held == state.held == (start, end)
    expected = torch.zeros(state.layout.numel)
    for slot, value in zip(slots, rank0):
        expected[slot.offset : slot.offset + slot.numel] = value.flatten()
    assert torch.equal(state.master, expected[start:end])  # exact fp32, the window only
    assert state.shadow is None
    for param, shape in zip(params, shapes):
        assert param.is_meta and param.shape == shape and param.dtype == torch.float32
    assert state.nbytes_by_kind() == {"master": 4 * (end - start)}  # m and v: on the tier


def test_migration_copies_a_large_parameter_in_chunks_handing_its_pages_back(monkeypatch):
    """A parameter of ``RELEASE_CHUNK_BYTES`` or more that alone uses its storage is copied
    into its slot a chunk at a time, each chunk's source pages handed back as soon as it is
    copied (``release_pages``): migration never holds a second whole copy of it. Its slot
    is exact. One whose storage the user's ``state_dict()`` tensor also uses is copied whole,
    and that tensor keeps its values."""
    from megatrain_ds.runtime.device_runtime import DeviceRuntime
    from megatrain_ds.state import host_store

    released: list[tuple[int, int]] = []
    real_release = host_store.release_pages

    def recording(tensor: torch.Tensor, start: int, end: int) -> bool:
        released.append((start, end))
        return real_release(tensor, start, end)

    monkeypatch.setattr(host_store, "release_pages", recording)
    chunk = host_store.RELEASE_CHUNK_BYTES
    numel = 2 * chunk // 4 + 1000  # two whole chunks and part of a third
    torch.manual_seed(0)
    alone, shared = torch.nn.Parameter(torch.randn(numel)), torch.nn.Parameter(torch.randn(numel))
    users_copy = shared.detach()  # as model.state_dict() hands it out: the same storage
    expected = {"alone": alone.detach().clone(), "shared": shared.detach().clone()}
    runtime = DeviceRuntime.create(torch.device("cpu"), pin_memory=False)
    named = [("alone", alone), ("shared", shared)]
    group_of = dict.fromkeys([alone, shared], 0)
    placement = planned_state(named, group_of, (torch.float32, torch.float32))
    state = host_store.migrate_to_host(named, group_of, runtime, torch.float32, torch.float32, placement)
    for slot, param in zip(state.layout.slots, state.params):
        assert torch.equal(state.master[slot.offset : slot.offset + slot.numel], expected[slot.name])
        assert param.data_ptr() == state.master[slot.offset :].data_ptr()  # re-pointed at its slot
    assert released == [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 4 * numel)]  # "alone"'s only
    assert torch.equal(users_copy, expected["shared"])
