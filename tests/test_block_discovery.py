"""Finding the repeated blocks of Hugging Face models, and errors for models without them."""

import pytest
import torch
from torch import nn

import tiny_models
from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.block_discovery import BlockDiscoveryError, find_blocks
from side_by_side import ds_config

EXPECTED_PATHS = {"llama": "model.layers", "qwen2": "model.layers", "mistral": "model.layers",
                  "mixtral": "model.layers", "gpt2": "transformer.h"}


@pytest.mark.parametrize("family", sorted(EXPECTED_PATHS))
def test_blocks_are_found_automatically(family):
    path, blocks = find_blocks(tiny_models.FAMILIES[family]())
    assert path == EXPECTED_PATHS[family] and len(blocks) == 4


def test_block_path_override_and_its_errors():
    model = tiny_models.llama()
    assert find_blocks(model, "model.layers")[1] is model.model.layers
    with pytest.raises(BlockDiscoveryError, match='"model.blocks" does not name a submodule'):
        find_blocks(model, "model.blocks")
    with pytest.raises(BlockDiscoveryError, match="is a LlamaRMSNorm, not a non-empty nn.ModuleList"):
        find_blocks(model, "model.norm")


def test_model_without_repeated_blocks_is_rejected():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(BlockDiscoveryError, match="has no repeated blocks.*block_path"):
        MegatrainEngine(model, parse_engine_config(ds_config()))


def test_parameters_shared_across_blocks_are_rejected():
    model = tiny_models.llama()
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(BlockDiscoveryError, match="shared with block 0"):
        MegatrainEngine(model, parse_engine_config(ds_config()))


def test_moe_router_logits_output_is_rejected_clearly():
    model = tiny_models.mixtral()
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True is not supported"):
        MegatrainEngine(model, parse_engine_config(ds_config()))


def test_blocks_of_one_structure_share_one_template():
    engine = MegatrainEngine(tiny_models.llama(num_layers=6), parse_engine_config(ds_config()))
    try:
        assert engine.num_templates == 1
        assert all(p.device.type == "meta" for p in engine.blocks.templates[0].module.parameters())
    finally:
        engine.destroy()
