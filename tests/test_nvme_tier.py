"""The NVMe tier: Adam m and v in swap files, read ahead and written behind a small window.

Parity: the engine with the tier trains as plain PyTorch does (the tolerances of
``tests/test_parity.py``), and bit for bit as the engine without it (same losses, weights
and moments, ``torch.equal``): the tier only moves bytes, the arithmetic is the same.
Each configuration exercises a different path of the optimizer step: clipping 1.0 (the
speculation is refuted and the journal restored into swapped states), a high clipping
threshold with speculative blocks (the speculation holds), no clipping (blocks stepped
as their gradients arrive), accumulation 2 (fp32 held gradients). A 2-block window over
4-5 blocks forces evictions and write-behind every step.
"""

import json
import logging
from pathlib import Path

import pytest
import tiny_models
import torch
from side_by_side import ds_config, train_side_by_side, unchecked
from test_parity import assert_parity

from megatrain_ds import ConfigError, MegatrainEngine, parse_engine_config
from megatrain_ds.runtime.host_heap import holds_of_large_transients_mapping
from megatrain_ds.state.nvme_tier import NvmeTier

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def nvme_options(path, engine: str = "auto", window: int = 2, **more) -> dict:
    return {
        "nvme_offload": "optimizer",
        "nvme_path": str(path),
        "nvme_window_blocks": window,
        "nvme_aio": {"engine": engine},
        **more,
    }


def tier_state_of(engine: MegatrainEngine) -> list[dict[str, torch.Tensor]]:
    """Every state's master, m and v, copied out of whichever tier holds them."""
    kinds = ("master", "exp_avg", "exp_avg_sq")
    tier = engine.nvme_tier
    if tier is None:
        return [{k: getattr(s, k).clone() for k in kinds} for s in engine.states]
    with tier.file_views() as on_tier:
        return [{k: (on_tier(s) or {}).get(k, getattr(s, k)).clone() for k in kinds} for s in engine.states]


def assert_bit_identical(a: MegatrainEngine, b: MegatrainEngine) -> None:
    """Same masters and moments; the models' state dicts agree too, dtype and bits (both
    give the masters, wherever they are: ``checkpoint/whole_masters.py``)."""
    ours, theirs = a.module.state_dict(), b.module.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    for index, (x, y) in enumerate(zip(tier_state_of(a), tier_state_of(b))):
        for kind in x:
            assert torch.equal(x[kind], y[kind]), (index, kind)
            assert x[kind].abs().sum() > 0, "never written"


CASES = {
    "clip-refuted-ga1": dict(accumulation=1, clipping=1.0),
    "clip-refuted-ga2": dict(accumulation=2, clipping=1.0),
    "speculation-holds-ga1": dict(accumulation=1, clipping=1e3, speculative_blocks=3),
    "speculation-holds-ga2": dict(accumulation=2, clipping=1e3, speculative_blocks=2),
    "no-clipping": dict(accumulation=1, clipping=0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_bit_identical_to_ram_only(tmp_path, case):
    spec = dict(CASES[case])
    speculative = spec.pop("speculative_blocks", "auto")
    ram_config = ds_config(**spec, megatrain={"speculative_blocks": speculative})
    tier_config = ds_config(**spec, megatrain={"speculative_blocks": speculative, **nvme_options(tmp_path)})
    with unchecked():  # the RAM-only path's own checked runs are test_parity.py's
        ram, _, ram_trace = train_side_by_side(tiny_models.llama, ram_config)
    tiered, reference, trace = train_side_by_side(tiny_models.llama, tier_config)
    try:
        assert isinstance(tiered.nvme_tier, NvmeTier)
        assert_parity(tiered, reference, trace)
        assert trace.engine_losses == ram_trace.engine_losses
        assert_bit_identical(tiered, ram)
        if spec["clipping"] == 1.0:
            assert tiered.last_step_report.restored > 0 or tiered.last_step_report.speculated == 0
        if speculative != "auto":
            assert tiered.last_step_report.speculated > 0, "the speculative path was not taken"
        # Four blocks through a two-block window: every step reads and writes at least the
        # two blocks the window cannot keep from the step before.
        block_file = tiered.nvme_tier.directory.nbytes // 4
        assert tiered.nvme_tier.bytes_read >= 5 * (4 - 2) * block_file
        assert tiered.nvme_tier.bytes_written >= 5 * (4 - 2) * block_file
        host = tiered.host_bytes()
        assert host["exp_avg"] == ram.host_bytes()["exp_avg"] - sum(
            4 * s.layout.numel for s in ram.states[:-1]
        )  # only the resident state's moments in RAM
        assert host["nvme_window"] == tiered.nvme_tier.window_bytes
    finally:
        ram.destroy()
        tiered.destroy()


@pytest.mark.parametrize("io_engine", ["aio", "threads"])
def test_both_io_engines_give_the_same_run(tmp_path, io_engine, caplog):
    """DeepSpeed's async I/O op and the O_DIRECT thread fallback: same results, and the log
    names the engine that ran."""
    config = ds_config(accumulation=2, clipping=1.0, megatrain=nvme_options(tmp_path, engine=io_engine, window=3))
    with caplog.at_level(logging.INFO, logger="megatrain_ds"):
        engine, reference, trace = train_side_by_side(lambda: tiny_models.qwen2(num_layers=5), config, steps=3)
    try:
        expected = {"aio": "deepspeed-aio", "threads": "threads-odirect"}[io_engine]
        assert engine.nvme_tier.engine_name == expected
        assert any(f"I/O engine {expected}" in record.getMessage() for record in caplog.records)
        assert_parity(engine, reference, trace)
    finally:
        engine.destroy()


def test_swap_directory_is_removed_by_destroy(tmp_path):
    config = ds_config(megatrain=nvme_options(tmp_path))
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    directory = engine.nvme_tier.directory.path
    assert directory.parent == tmp_path and len(list(directory.glob("block*.swap"))) == 4
    engine.destroy()
    assert not directory.exists()


def test_destroy_twice_is_destroy_once(tmp_path):
    """DeepSpeed's ``__del__`` calls ``destroy`` again after the user's call. With the
    masters on the tier the first call maps each block's swap file into its parameters and
    removes the files; a second must neither map the removed files again (it raised, or
    gave the model other bytes) nor hand the process's mmap threshold back twice."""
    config = ds_config(megatrain=nvme_options(tmp_path, nvme_offload="all"))
    holds = holds_of_large_transients_mapping()
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    assert "master" in engine.nvme_tier.kinds
    assert holds_of_large_transients_mapping() == holds + engine.runtime.holds_mmap_threshold
    loss = engine(**tiny_models.make_batch(0)).loss
    engine.backward(loss)
    engine.step()
    engine.destroy()
    weights = {name: tensor.clone() for name, tensor in engine.module.state_dict().items()}
    assert engine.nvme_tier.closed and holds_of_large_transients_mapping() == holds
    engine.destroy()
    engine.nvme_tier.close()
    assert holds_of_large_transients_mapping() == holds
    for name, tensor in engine.module.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_a_missed_fetch_fails_loudly(tmp_path):
    """A moment on disk is a meta placeholder, never stale host memory."""
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain=nvme_options(tmp_path))))
    try:
        state = engine.states[1]
        assert state.exp_avg.is_meta and state.exp_avg.numel() == state.layout.numel
        with pytest.raises((NotImplementedError, RuntimeError)):
            torch.zeros(state.layout.numel).copy_(state.exp_avg)
    finally:
        engine.destroy()


def test_bf16_compute_is_bit_identical_to_ram_only(tmp_path):
    """bf16 compute: the journal also keeps the shadow; the tier still only moves bytes."""
    config = dict(accumulation=2, clipping=1.0, bf16=True)
    with unchecked():  # the RAM-only bf16 path's own checked runs: test_nonfinite_steps.py, test_speculative_step.py
        ram, _, ram_trace = train_side_by_side(tiny_models.llama, ds_config(**config), steps=3)
    tiered, _, trace = train_side_by_side(
        tiny_models.llama, ds_config(**config, megatrain=nvme_options(tmp_path)), steps=3
    )
    try:
        assert tiered.nvme_tier.kinds == ("master", "exp_avg", "exp_avg_sq")
        # The block the optimizer touched last is still bound to a slot of the window: its
        # master is host memory, counted once, as the window's (nvme_window), not as a master.
        assert any(not s.master.is_meta for s in tiered.states[:-1])
        assert tiered.host_bytes()["master"] == 4 * tiered.states[-1].layout.numel  # the resident state only
        tiered.nvme_tier.flush()  # the window written back: nothing bound
        assert all(s.master.is_meta for s in tiered.states[:-1]), "the blocks' fp32 masters live on the tier"
        assert trace.engine_losses == ram_trace.engine_losses
        assert_bit_identical(tiered, ram)
    finally:
        ram.destroy()
        tiered.destroy()
    # Destroyed, the tier hands the fp32 masters back to the model: nothing trained is lost.
    ours, theirs = tiered.module.state_dict(), ram.module.state_dict()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


def test_with_the_master_on_the_tier_the_fp32_model_is_never_whole_in_host_memory(tmp_path, monkeypatch):
    """Each block's master goes to its swap file as soon as the block is migrated: when the
    next block is copied in, no earlier block's fp32 master is still in host memory."""
    from megatrain_ds import engine_build

    made, in_memory_at_each_migration = [], []
    migrate = engine_build.migrate_to_host

    def observed(*args, **kwargs):
        in_memory_at_each_migration.append(sum(not state.master.is_meta for state in made))
        made.append(migrate(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engine_build, "migrate_to_host", observed)
    engine = MegatrainEngine(
        tiny_models.llama(), parse_engine_config(ds_config(bf16=True, megatrain=nvme_options(tmp_path)))
    )
    try:
        assert len(in_memory_at_each_migration) == 4 and set(in_memory_at_each_migration) == {0}
        param = engine.module.model.layers[2].mlp.up_proj.weight
        assert param.dtype == torch.bfloat16
        assert param.untyped_storage().data_ptr() == engine.states[2].shadow.untyped_storage().data_ptr()
    finally:
        engine.destroy()
    assert param.dtype == torch.float32  # the master, handed back


def test_auto_uses_the_tier_only_when_host_memory_is_short(tmp_path, monkeypatch, caplog):
    from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
    from megatrain_ds.optimizer.facade import build_optimizer
    from megatrain_ds.planning import preflight

    config = parse_engine_config(ds_config(megatrain={"nvme_offload": "auto", "nvme_path": str(tmp_path)}))
    probe = tiny_models.llama()
    optimizer = build_optimizer(probe, None, config.optimizer, None)
    run = preflight.PreflightInputs(probe, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
    ram_only = preflight.preflight(run, nvme="none")
    with_tier = preflight.preflight(run, nvme="optimizer")
    assert with_tier.host_total < ram_only.host_total
    for available, expected in ((ram_only.host_total + (1 << 20), False), (ram_only.host_total - 1, True)):
        monkeypatch.setattr(
            preflight, "available_memory", lambda device, room=available: preflight.AvailableMemory(host=room)
        )
        with caplog.at_level(logging.INFO, logger="megatrain_ds"):
            engine = MegatrainEngine(tiny_models.llama(), config)
        try:
            assert (engine.nvme_tier is not None) is expected
            assert any('nvme_offload "auto"' in r.getMessage() for r in caplog.records)
        finally:
            engine.destroy()


# -- the weights on the tier too ("nvme_offload": "all") ---------------------------------------

ALL_CASES = {
    "clip-refuted-ga1": dict(accumulation=1, clipping=1.0),
    "speculation-holds-ga2": dict(accumulation=2, clipping=1e3, speculative_blocks=2),
    "no-clipping": dict(accumulation=1, clipping=0.0),
    "bf16-clip-refuted-ga2": dict(accumulation=2, clipping=1.0, bf16=True),
}


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_weights_on_the_tier_match_pytorch_and_are_bit_identical_to_ram_only(tmp_path, case):
    """Forward and backward read every block's weights from the swap files through the
    weight window (three buffers over four blocks: each pass reads again what the window
    could not keep), the optimizer writes them back: same losses, weights and moments as
    the engine without the tier, bit for bit, and plain PyTorch's to the parity tolerances
    (fp32; bf16 compute is compared with the RAM-only engine only)."""
    spec = dict(ALL_CASES[case])
    speculative = spec.pop("speculative_blocks", "auto")
    with unchecked():  # the RAM-only path's own checked runs: test_parity.py, test_speculative_step.py
        ram, _, ram_trace = train_side_by_side(
            tiny_models.llama, ds_config(**spec, megatrain={"speculative_blocks": speculative})
        )
    options = {**nvme_options(tmp_path), "nvme_offload": "all", "speculative_blocks": speculative}
    tiered, reference, trace = train_side_by_side(tiny_models.llama, ds_config(**spec, megatrain=options))
    try:
        assert tiered.nvme_tier.kinds == ("master", "exp_avg", "exp_avg_sq")
        if not spec.get("bf16"):
            assert_parity(tiered, reference, trace)
        assert trace.engine_losses == ram_trace.engine_losses
        assert_bit_identical(tiered, ram)  # the state dict comes from the swap files
        if speculative != "auto":
            assert tiered.last_step_report.speculated > 0, "the speculative path was not taken"
        # No host copy of a block's weights: no master, no shadow, parameters without storage.
        tiered.nvme_tier.flush()
        blocks = tiered.states[:-1]
        assert all(s.master.is_meta and s.shadow is None for s in blocks)
        assert all(p.is_meta for s in blocks for p in s.params)
        host = tiered.host_bytes()
        assert host["master"] == 4 * tiered.states[-1].layout.numel  # the resident state only
        assert host["nvme_weights"] == tiered.nvme_weights.nbytes > 0
        # Every pass took its blocks from the window; backward reused what forward had read.
        takes = sum(tiered.streamer.transfers.values())
        assert 0 < tiered.nvme_weights.reads < takes
        assert tiered.streamer.transfers == ram.streamer.transfers  # still two crossings per pass pair
    finally:
        ram.destroy()
        tiered.destroy()
    # Destroyed, the tier hands the fp32 masters back to the model's parameters.
    for (key, ours), theirs in zip(tiered.module.state_dict().items(), ram.module.state_dict().values()):
        assert not ours.is_meta and torch.equal(ours, theirs), key


def test_a_zero_infinity_config_with_offload_param_on_nvme_puts_the_weights_on_the_tier(tmp_path):
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
    }
    config = parse_engine_config({**ds_config(), "zero_optimization": zero})
    assert (config.options.nvme_offload, config.options.nvme_path, config.options.nvme_window_blocks) == (
        "all",
        str(tmp_path),
        3,
    )
    only_optimizer = parse_engine_config(
        {
            **ds_config(),
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        }
    )
    assert only_optimizer.options.nvme_offload == "optimizer"
    shipped = json.loads((Path(__file__).parents[1] / "configs" / "ds_megatrain_zero_infinity.json").read_text())
    assert parse_engine_config(shipped).options.nvme_offload == "all"
    with pytest.raises(ConfigError, match='offload_param.device is "nvme" but no nvme_path'):
        parse_engine_config({**ds_config(), "zero_optimization": {"offload_param": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match='"none", "optimizer", "all", "auto"'):
        parse_engine_config(ds_config(megatrain={"nvme_offload": "weights", "nvme_path": str(tmp_path)}))


def test_auto_puts_as_little_on_the_tier_as_host_memory_allows(tmp_path, monkeypatch, caplog):
    """Preflight's estimates order the levels (each holds less in host memory than the one
    before, for blocks large next to the windows' alignment), and "auto" takes the least
    one that fits."""
    import transformers

    from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
    from megatrain_ds.optimizer.facade import build_optimizer
    from megatrain_ds.planning import preflight

    def model() -> torch.nn.Module:  # 16 blocks of 41K parameters
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=tiny_models.VOCAB,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=16,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )

    config = parse_engine_config(ds_config(megatrain={"nvme_offload": "auto", "nvme_path": str(tmp_path)}))
    probe = model()
    optimizer = build_optimizer(probe, None, config.optimizer, None)
    run = preflight.PreflightInputs(probe, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
    needs = {level: preflight.preflight(run, nvme=level) for level in ("none", "optimizer", "all")}
    assert needs["all"].host_total < needs["optimizer"].host_total < needs["none"].host_total
    assert needs["all"].host["nvme_weights"] > 0 and needs["all"].disk > needs["optimizer"].disk
    for room, expected in ((needs["optimizer"].host_total, "optimizer"), (needs["optimizer"].host_total - 1, "all")):
        monkeypatch.setattr(
            preflight, "available_memory", lambda device, room=room: preflight.AvailableMemory(host=room)
        )
        engine = MegatrainEngine(model(), config)
        try:
            assert (engine.nvme_weights is not None) is (expected == "all")
            assert engine.nvme_tier is not None
            if expected == "all":  # the estimate is what the engine holds
                assert engine.host_bytes()["nvme_weights"] == needs["all"].host["nvme_weights"]
        finally:
            engine.destroy()


def test_save_pretrained_mid_training_with_the_weights_on_the_tier(tmp_path):
    """The blocks' parameters have no values while the engine runs; ``save_pretrained``
    (through ``state_dict``) still writes the trained fp32 weights, those of the RAM-only
    engine after the same steps, and copying a parameter out fails loudly."""
    import transformers

    engines = []
    for options in ({}, {**nvme_options(tmp_path / "swap"), "nvme_offload": "all"}):
        torch.manual_seed(0)
        engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain=options)))
        engines.append(engine)
        for micro in range(2):
            batch = tiny_models.make_batch(micro)
            engine.backward(engine(**batch).loss)
            engine.step()
    ram, tiered = engines
    try:
        weight = tiered.module.model.layers[1].mlp.up_proj.weight
        assert weight.is_meta
        with pytest.raises((NotImplementedError, RuntimeError)):
            weight.tolist()
        tiered.module.save_pretrained(tmp_path / "saved")
        saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
        expected = ram.module.state_dict()
        assert saved.keys() == expected.keys()
        for key in expected:
            assert torch.equal(saved[key], expected[key]), key
    finally:
        for engine in engines:
            engine.destroy()
