"""The planner's model of fragmented weight streaming and ``"fragment_bytes": "auto"``.

The weight pipeline's exposed ends are checked against sums done by hand for made-up
hardware ([Note: the weight pipeline] in ``planning/step_time.py``); the choice against
GPU-like hardware where a block's copy is exposed (a shallow model of large blocks), where
compute hides it (a deep model at long sequences) and the CPU, where nothing is copied.
The engine test injects a GPU-like hardware the way ``test_recompute.py`` injects host
memory, and runs the GPU's copy path on the CPU (``test_fragments.py``'s ``_copying``).
"""

import json
import logging

import pytest
import tiny_models
import torch
import transformers
from side_by_side import ds_config, train_side_by_side
from test_fragments import _copying
from test_parity import assert_parity
from test_planner import CPU

from megatrain_ds import cli, parse_engine_config
from megatrain_ds.cli import shape_of
from megatrain_ds.config import ConfigError, MegatrainOptions
from megatrain_ds.planning import recompute_policy
from megatrain_ds.planning.planner import (
    FRAGMENT_COPY_OVERHEAD_S,
    FRAGMENT_GAIN_MARGIN,
    GPU_HARDWARE,
    Hardware,
    ModelShape,
    RunSettings,
    choose_fragment_bytes,
    fragment_policies,
    plan,
    predicted_step_seconds,
    step_seconds,
    weight_fill_seconds,
)

# 1 TFLOP/s, 1 GB/s each way; the optimizer never the bound.
SLOW_LINK = Hardware("slow-link", 1e12, 1e9, 1e9, 1e15, 1 << 40)
SMALL = ModelShape(
    num_blocks=4, block_params=1_000_000, total_block_params=4_000_000, resident_params=100_000, hidden=100, vocab=1000
)


def _llama_shape(layers: int) -> ModelShape:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32
    )
    with torch.device("meta"):
        return shape_of(transformers.LlamaForCausalLM(config))


def test_whole_blocks_expose_a_block_per_pass_and_fragments_one_piece_by_hand():
    """100 tokens, bf16: a block is 2 MB (2 ms + overhead to copy), computes 0.2 ms forward
    and 0.6 ms backward (recompute + backward); the head (6 V h T = 60 MFLOP) covers 60 us
    of the backward's first copy. Each pass exposes min(copy, compute) of one piece."""
    settings = RunSettings(seq_len=100, bf16=True, accumulation=2)
    copy = 2e-3 + FRAGMENT_COPY_OVERHEAD_S
    whole = min(copy, 2e-4) + min(copy - 6e-5, 6e-4)
    assert weight_fill_seconds(SMALL, settings, SLOW_LINK) == pytest.approx(2 * whole)
    # 200 kB pieces: a tenth of a block's copy and compute each.
    fragmented = RunSettings(seq_len=100, bf16=True, accumulation=2, fragment_bytes=200_000)
    piece = 2e-4 + FRAGMENT_COPY_OVERHEAD_S
    assert weight_fill_seconds(SMALL, fragmented, SLOW_LINK) == pytest.approx(
        2 * (min(piece, 2e-5) + min(piece - 6e-5, 6e-5))
    )
    # Nine more copies per block per crossing, two crossings per micro-batch, on the link.
    extra = (
        step_seconds(SMALL, fragmented, SLOW_LINK)["host_to_device"]
        - step_seconds(SMALL, settings, SLOW_LINK)["host_to_device"]
    )
    assert extra == pytest.approx(2 * 2 * 4 * 9 * FRAGMENT_COPY_OVERHEAD_S)
    # The predicted step is the bounds' plus the fill; a whole-block run pays the fill.
    assert predicted_step_seconds(SMALL, settings, SLOW_LINK) > max(step_seconds(SMALL, settings, SLOW_LINK).values())


def test_auto_turns_fragments_on_where_a_blocks_copy_is_exposed():
    """Four 7B-sized blocks at 4096 tokens on an H100: each pass waits for a 400 MB block
    (8 ms) out of about 70 ms of compute; fragments cut that to one piece's copy."""
    shape, h100 = _llama_shape(4), GPU_HARDWARE["h100"]
    settings = RunSettings(seq_len=4096)
    chosen = choose_fragment_bytes(shape, settings, h100)
    assert 4096 <= chosen < 2 * shape.block_params
    whole = predicted_step_seconds(shape, settings, h100)
    with_fragments = predicted_step_seconds(shape, RunSettings(seq_len=4096, fragment_bytes=chosen), h100)
    assert with_fragments < whole * (1 - FRAGMENT_GAIN_MARGIN)
    result = plan(shape, settings, h100, host_memory_bytes=1 << 40)
    assert result.recommended["fragment_bytes"] == chosen
    assert result.fragments["chosen"] == {"fragment_bytes": chosen, "predicted_step_seconds": with_fragments}
    assert result.fragments["whole"]["predicted_step_seconds"] == pytest.approx(result.predicted_step_seconds)
    assert result.weight_fill_seconds > 0


@pytest.mark.parametrize("layers, seq_len, gpu", [(32, 16384, "h100"), (4, 4096, "gh200")])
def test_auto_keeps_whole_blocks_where_compute_or_a_fast_link_hides_the_copy(layers, seq_len, gpu):
    """32 blocks computing 16k tokens: the one block's copy each pass waits for is under
    1% of the step. GH200's 400 GB/s link copies a block in 1 ms."""
    shape, hardware = _llama_shape(layers), GPU_HARDWARE[gpu]
    settings = RunSettings(seq_len=seq_len)
    policies = fragment_policies(shape, settings, hardware)
    assert policies["fragments"]["fragment_bytes"] > 0  # a size was tried, and gains too little
    assert policies["fragments"]["predicted_step_seconds"] > policies["whole"]["predicted_step_seconds"] * (
        1 - FRAGMENT_GAIN_MARGIN
    )
    assert choose_fragment_bytes(shape, settings, hardware) == 0
    assert plan(shape, settings, hardware, 1 << 40).recommended["fragment_bytes"] is None


def test_auto_keeps_whole_blocks_on_the_cpu():
    shape = _llama_shape(4)
    for seq_len in (16, 4096):
        settings = RunSettings(seq_len=seq_len, bf16=False)
        assert weight_fill_seconds(shape, settings, CPU) == 0
        assert choose_fragment_bytes(shape, settings, CPU) == 0
        # Nothing is copied: fragments change nothing the cores do.
        policies = fragment_policies(shape, settings, CPU)
        assert policies["fragments"]["predicted_step_seconds"] == pytest.approx(
            policies["whole"]["predicted_step_seconds"]
        )


@pytest.mark.parametrize("value", ["auto", None, 0, 4096, 1 << 20])
def test_fragment_bytes_accepts_auto_off_and_sizes(value):
    assert MegatrainOptions(fragment_bytes=value).fragment_bytes == value


def test_fragment_bytes_defaults_to_auto():
    """A JSON without the key is read as one with ``"auto"`` (and not as whole blocks): the
    engine tests below run on the default, and see the planner's choice made for it."""
    without = parse_engine_config(ds_config()).options
    assert without == parse_engine_config(ds_config(megatrain={"fragment_bytes": "auto"})).options
    assert without != parse_engine_config(ds_config(megatrain={"fragment_bytes": 0})).options


@pytest.mark.parametrize("value", ["big", 100, -4096, True, 4096.0])
def test_fragment_bytes_rejects_other_values_naming_the_key(value):
    with pytest.raises(ConfigError, match='megatrain.fragment_bytes must be "auto"'):
        MegatrainOptions(fragment_bytes=value)


def test_auto_in_the_engine_takes_the_planners_size_on_gpu_like_hardware(monkeypatch, caplog, tmp_path):
    """With the copy path on and a slow link, "auto" resolves at the first training forward
    to the planner's size for this model and batch, every block then crosses in pieces, the
    choice is logged once and written to the trace, and training matches PyTorch."""
    _copying(monkeypatch)
    slow = Hardware("slow-link", 1e9, 1e7, 1e7, 1e15, 1 << 30)
    monkeypatch.setattr(recompute_policy, "hardware_of", lambda runtime: (slow, "injected"))
    caplog.set_level(logging.INFO, logger="megatrain_ds.planning.fragment_policy")
    trace = tmp_path / "trace.json"
    config = ds_config(megatrain={"trace": str(trace), "trace_steps": 1})
    engine, reference, steps = train_side_by_side(tiny_models.llama, config, steps=3)
    try:
        assert_parity(engine, reference, steps)
        shape = shape_of(tiny_models.llama())
        batch = tiny_models.make_batch(0)["input_ids"]
        expected = choose_fragment_bytes(shape, RunSettings(seq_len=batch.numel(), bf16=False), slow)
        assert expected > 0
        assert engine.fragment_choice.fragment_bytes == expected
        assert engine.streamer.fragment_elements == expected // 4
        plans = engine.streamer._plans
        assert sorted(plans) == [0, 1, 2, 3] and all(len(p.ranges) > 1 for p in plans.values())
        messages = [r.getMessage() for r in caplog.records if "fragment_bytes auto" in r.getMessage()]
        assert len(messages) == 1 and f"{expected} bytes on slow-link" in messages[0]
    finally:
        engine.destroy()
    recorded = json.loads(trace.read_text())["otherData"]["fragments"]
    assert recorded["setting"] == "auto" and recorded["fragment_bytes"] == expected
    assert recorded["predicted"]["chosen"]["fragment_bytes"] == expected


def test_auto_in_the_engine_on_the_cpu_copies_nothing_in_pieces(caplog):
    caplog.set_level(logging.INFO, logger="megatrain_ds.planning.fragment_policy")
    engine, reference, steps = train_side_by_side(tiny_models.llama, ds_config(), steps=2)
    try:
        assert engine.fragment_choice.fragment_bytes == 0 and engine.streamer.fragment_elements == 0
        assert not engine.streamer._plans
        assert "whole blocks on cpu" in caplog.text and "nothing is copied" in caplog.text
    finally:
        engine.destroy()


def test_cli_prints_the_step_with_and_without_fragments(capsys):
    # In this process: a launch spends seconds importing what this process has imported
    # (`python -m megatrain_ds.cli` is tests/test_planner.py's CPU plan test).
    argv = ["plan", "--model", "configs/models/tiny_llama.json", "--gpu", "h100", "--host-memory", "64GB"]
    assert cli.main([*argv, "--seq-len", "256"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("fragmented weight streaming"))
    assert "whole blocks" in lines[header + 1] and "predicted step" in lines[header + 1]
    assert "predicted step" in lines[header + 2]
    assert '"fragment_bytes":' in lines[-1]
