"""Preflight: the estimate equals what the engine allocates; a run that does not fit fails
before anything is allocated, with the numbers and settings that fit (available memory is
injected, so the tests do not depend on the machine)."""

import dataclasses
import logging

import pytest
import torch
import transformers
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
from megatrain_ds.optimizer.facade import build_optimizer, group_index_of
from megatrain_ds.planning import preflight
from megatrain_ds.runtime.device_runtime import PAGE_BYTES
from megatrain_ds.state.flat_layout import build_flat_layout

GIB = 1 << 30


pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def _model(num_layers=4):
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def _estimate(model, config, device_type="cpu"):
    optimizer = build_optimizer(model, None, config.optimizer, None)
    shapes = preflight._shapes(model, config, optimizer)
    return preflight.estimate_from_shapes(shapes, config, device_type, STAGING_CHUNK_ELEMENTS)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bf16=True),
        dict(clipping=0.0),
        dict(accumulation=2),
        dict(bf16=True, megatrain={"master_dtype": "bf16", "num_buffers": 3}),
    ],
)
def test_estimate_equals_the_engines_allocations(kwargs):
    """Reference: the tensors the built engine holds (host state, staging, CPU weight
    buffers); the estimate adds the one alignment page each host buffer over-allocates."""
    model = _model()
    config = parse_engine_config(ds_config(**kwargs))
    need = _estimate(model, config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert need.host_freed == weights
    engine = MegatrainEngine(model, config)
    try:
        held = engine.host_bytes()
        buffers = len(engine.states)
        assert need.host["master"] == held["master"] + buffers * PAGE_BYTES
        assert need.host["adam_m_v"] == held["exp_avg"] + held["exp_avg_sq"] + 2 * buffers * PAGE_BYTES
        assert need.host.get("shadow", 0) == held.get("shadow", -buffers * PAGE_BYTES) + buffers * PAGE_BYTES
        assert need.host.get("gradients", 0) == held.get("grad", -buffers * PAGE_BYTES) + buffers * PAGE_BYTES
        staging = [t for t in engine.sink._pool.queue if t is not None]  # none on the CPU
        assert need.host.get("staging", 0) == sum(t.numel() * t.element_size() + PAGE_BYTES for t in staging)
        assert need.host["weight_buffers"] == engine.device_bytes()["weight_buffers"]
    finally:
        engine.destroy()


def test_cuda_run_counts_device_buffers_and_pinned_bytes():
    model = _model()
    config = parse_engine_config(ds_config(bf16=True))
    need = _estimate(model, config, device_type="cuda")
    largest_block = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    resident = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel() + model.model.norm.weight.numel()
    assert need.device["weight_buffers"] == 2 * largest_block * 2  # two bf16 slots (no padding at hidden 64)
    assert need.device["resident_copy"] == resident * 2
    assert "weight_buffers" not in need.host and need.pinned == sum(need.host.values())


def _available(monkeypatch, host, device=None, memlock=None):
    monkeypatch.setattr(
        preflight,
        "available_memory",
        lambda device_: preflight.AvailableMemory(host=host, host_source="injected", device=device, memlock=memlock),
    )


def test_a_run_that_does_not_fit_fails_before_allocating_with_the_numbers(monkeypatch):
    model = _model()
    config = parse_engine_config(ds_config(bf16=True, clipping=1.0))
    need = _estimate(model, config)
    budget = need.host_total - 4 * need.host["gradients"] // 5  # dropping the held gradients fits
    _available(monkeypatch, budget)
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(preflight.InsufficientMemoryError) as raised:
        MegatrainEngine(model, config)
    message = str(raised.value)
    assert f"host memory: needs {preflight.format_bytes(need.host_total)}" in message
    assert f"{preflight.format_bytes(budget)} available (injected)" in message
    assert '"gradient_clipping": 0' in message
    assert [p.data_ptr() for p in model.parameters()] == pointers, "something was migrated"
    # The setting it names makes the same run fit under the same budget.
    engine = MegatrainEngine(model, parse_engine_config(ds_config(bf16=True, clipping=0.0)))
    engine.destroy()


def test_settings_that_fit_only_together_are_listed_together(monkeypatch):
    """Accumulation 2 with clipping: dropping either alone keeps an fp32 gradient buffer."""
    model = _model()
    config = parse_engine_config(ds_config(accumulation=2, clipping=1.0))
    without = parse_engine_config(ds_config(accumulation=1, clipping=0.0))
    budget = _estimate(model, without).host_total
    _available(monkeypatch, budget)
    with pytest.raises(preflight.InsufficientMemoryError) as raised:
        MegatrainEngine(model, config)
    message = str(raised.value)
    assert "no single setting fits; these together would:" in message
    assert '"gradient_accumulation_steps": 1' in message and '"gradient_clipping": 0' in message
    MegatrainEngine(model, without).destroy()


def test_nothing_fits_says_so(monkeypatch):
    _available(monkeypatch, 1 << 20)
    with pytest.raises(preflight.InsufficientMemoryError, match="no combination of settings makes it fit"):
        MegatrainEngine(_model(), parse_engine_config(ds_config()))


def test_device_shortage_names_device_memory_and_fixes():
    model = _model()
    config = parse_engine_config(ds_config(megatrain={"num_buffers": 4, "checkpoint_interval": 2}))
    shapes = preflight._shapes(model, config, build_optimizer(model, None, config.optimizer, None))
    need_of = lambda c: preflight.estimate_from_shapes(shapes, c, "cuda", STAGING_CHUNK_ELEMENTS)  # noqa: E731
    need = need_of(config)
    available = preflight.AvailableMemory(host=64 * GIB, device=need.device_total - 1)
    with pytest.raises(preflight.InsufficientMemoryError) as raised:
        preflight.check(need_of, config, available)
    message = str(raised.value)
    assert "device memory: needs" in message and "weight_buffers" in message
    assert '"num_buffers": 2, "checkpoint_interval": 1' in message


def test_pinned_bytes_above_ulimit_l_warn(caplog):
    model = _model()
    config = parse_engine_config(ds_config())
    shapes = preflight._shapes(model, config, build_optimizer(model, None, config.optimizer, None))
    need_of = lambda c: preflight.estimate_from_shapes(shapes, c, "cuda", STAGING_CHUNK_ELEMENTS)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        preflight.check(need_of, config, preflight.AvailableMemory(host=64 * GIB, device=64 * GIB, memlock=64 << 10))
    assert "ulimit -l is 0.1 MiB" in caplog.text and "pin_memory" in caplog.text


def test_preflight_can_be_switched_off(monkeypatch):
    """1 MiB of host memory: the check refuses the run; switched off, it is never asked (its
    estimate would refuse), and the engine is built and trains a step."""
    import tiny_models

    _available(monkeypatch, 1 << 20)
    with pytest.raises(preflight.InsufficientMemoryError):
        MegatrainEngine(_model(), parse_engine_config(ds_config()))
    asked = []
    monkeypatch.setattr(preflight, "available_memory", lambda device: asked.append(device))
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"preflight": False})))
    try:
        assert asked == []
        loss = engine(**tiny_models.make_batch(0)).loss
        engine.backward(loss)
        engine.step()
        assert engine.global_steps == 1 and engine.was_step_applied()
    finally:
        engine.destroy()


def test_meta_model_needs_its_whole_state():
    with torch.device("meta"):
        model = _model()
    need = _estimate(model, parse_engine_config(ds_config()))
    assert need.host_freed == 0 and need.host_total == sum(need.host.values())


def test_available_memory_reads_this_machine():
    have = preflight.available_memory(torch.device("cpu"))
    with open("/proc/meminfo") as handle:
        total = int(next(line for line in handle if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < have.host <= total and have.device is None
    assert dataclasses.replace(have, host=1).host == 1


def test_with_several_nodes_only_this_nodes_share_of_the_optimizer_state_is_counted(tmp_path) -> None:
    """Node 0 of 4 holds a quarter of Adam's moments and of the held gradients and the whole
    master: the preflight check (and nvme_offload "auto") count that, so a model whose whole
    state does not fit one node's memory still starts on 4 nodes."""
    import tiny_models

    from megatrain_ds.distributed.ownership import Ownership

    model = tiny_models.llama()
    config = parse_engine_config(ds_config(megatrain={"nvme_path": str(tmp_path), "nvme_offload": "auto"}))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    span_of = Ownership.of([[0], [1], [2], [3]], rank=0).span
    cpu = torch.device("cpu")
    run = preflight.PreflightInputs(model, config, optimizer, cpu, STAGING_CHUNK_ELEMENTS)
    on_node_0 = dataclasses.replace(run, topology=preflight.topology_of(span_of, None))
    whole = preflight.preflight(run, nvme="none")
    share = preflight.preflight(on_node_0, nvme="none")
    assert share.host["master"] == whole.host["master"]
    for kind in ("adam_m_v", "gradients"):
        assert whole.host[kind] / 4 - 16 * PAGE_BYTES <= share.host[kind] <= whole.host[kind] / 4 + 16 * PAGE_BYTES
    room = preflight.AvailableMemory(host=share.host_total + PAGE_BYTES)  # the share fits, the whole does not
    assert preflight.wants_nvme_tier(on_node_0, room) == "none"
    assert preflight.wants_nvme_tier(run, room) != "none"
    preflight.preflight(on_node_0, room, nvme="none")
    with pytest.raises(preflight.InsufficientMemoryError):
        preflight.preflight(run, room, nvme="none")


def test_with_data_parallel_each_rank_has_a_tier_of_its_windows_and_auto_goes_up_to_the_weights(tmp_path) -> None:
    """With data parallel each rank keeps its own NVMe tier of its windows' m and v; the
    fp32 masters stay in the node's host memory even with bf16 compute (the gather after a
    step updates them there). With the weights on the tier too ("all") each rank's tier
    holds its windows' masters as well, no block's weights are in host memory, and each
    rank has gather buffers of whole blocks (distributed/gathered_weights.py): "auto" goes
    up to it, and preflight then names what still does not fit."""
    import tiny_models

    model = tiny_models.llama()
    config = parse_engine_config(ds_config(bf16=True, megatrain={"nvme_path": str(tmp_path), "nvme_offload": "auto"}))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    cpu = torch.device("cpu")

    run = preflight.PreflightInputs(model, config, optimizer, cpu, STAGING_CHUNK_ELEMENTS)
    two_ranks = dataclasses.replace(run, topology=preflight.topology_of(None, 2))

    def need(nvme: str, of: preflight.PreflightInputs = run) -> preflight.MemoryNeed:
        return preflight.preflight(of, nvme=nvme)

    alone, ranks, whole = need("optimizer"), need("optimizer", two_ranks), need("none")
    assert alone.host["master"] < whole.host["master"] == ranks.host["master"]  # one rank: the tier takes the master
    assert alone.disk == 1.5 * ranks.disk  # m, v and master against m and v (blocks of whole 4 KiB pages here)
    all_alone, all_ranks = need("all"), need("all", two_ranks)
    assert all_ranks.host["master"] == all_alone.host["master"] < ranks.host["master"]  # the resident state's only
    assert all_ranks.disk == all_alone.disk == alone.disk  # the masters, m and v (each rank its windows of them)
    # Two ranks' weight windows of half a block each, plus each rank's whole blocks gathered
    # (one more than its 2 device slots) and the buffer its window of a block is sent from
    # (half a block), bf16: 2 x 3.5 x the largest block x 2 bytes.
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    padding = 64 * len(list(model.model.layers[0].parameters()))  # alignment of each slot
    gather_buffers = all_ranks.host["nvme_weights"] - all_alone.host["nvme_weights"]
    assert 2 * 3.5 * largest * 2 <= gather_buffers <= 2 * 3.5 * (largest + padding) * 2
    room = preflight.AvailableMemory(host=4096)  # nothing fits
    assert preflight.wants_nvme_tier(run, room) == "all"
    assert preflight.wants_nvme_tier(two_ranks, room) == "all"
    with pytest.raises(preflight.InsufficientMemoryError, match="does not fit"):
        preflight.preflight(two_ranks, room)


def test_with_several_nodes_and_bf16_compute_only_the_nodes_span_of_the_master_is_counted() -> None:
    """bf16 compute on 4 nodes: node 0 holds the whole bf16 shadow and a quarter of the fp32
    master (host_store.migrate_to_host), of the moments and of the held gradients; the
    estimate counts each buffer as the engine allocates it (one page of alignment each),
    computed here from the flat sizes and node 0's spans."""
    import tiny_models

    from megatrain_ds.distributed.ownership import Ownership

    model = tiny_models.llama()
    config = parse_engine_config(ds_config(bf16=True))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    span_of = Ownership.of([[0], [1], [2], [3]], rank=0).span
    run = preflight.PreflightInputs(
        model, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS, preflight.topology_of(span_of, None)
    )
    share = preflight.preflight(run, nvme="none")
    group_of = group_index_of(model, optimizer)
    blocks = list(model.model.layers)
    block_ids = {id(p) for block in blocks for p in block.parameters()}
    flats = [[(n, p.shape, group_of[p]) for n, p in block.named_parameters()] for block in blocks]
    flats.append([(n, p.shape, group_of[p]) for n, p in model.named_parameters() if id(p) not in block_ids])
    numels = [build_flat_layout(flat).numel for flat in flats]
    spans = [span_of(numel) for numel in numels]
    assert share.host["master"] == sum(4 * (end - start) + PAGE_BYTES for start, end in spans)
    assert share.host["shadow"] == sum(2 * numel + PAGE_BYTES for numel in numels)
    assert share.host["adam_m_v"] == 2 * share.host["master"]
    # W + S/N: 2 + (4 + 8 + 2) / 4 B/param (bf16 held gradients), past the pages of the five
    # buffers of each state, within the spans' alignment (ALIGN_ELEMENTS) of a quarter.
    held = sum(share.host[kind] for kind in ("master", "shadow", "adam_m_v", "gradients"))
    per_param = (held - 5 * len(numels) * PAGE_BYTES) / sum(numels)
    assert abs(per_param - (2 + 14 / 4)) <= 14 * 64 * len(numels) / sum(numels), per_param
