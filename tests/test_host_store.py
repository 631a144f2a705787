"""Host state: page-aligned flat buffers, parameters as views of the master, bytes per parameter."""

import copy

import pytest
import tiny_models
import torch
import transformers
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime.device_runtime import PAGE_BYTES


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
        total = sum(engine.host_bytes().values())
        assert total == expected_bytes_per_param * num_params
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
