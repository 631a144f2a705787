"""Finding the repeated blocks of Hugging Face models, and errors for models without them."""

import copy

import pytest
import tiny_models
import torch
from side_by_side import ds_config
from torch import nn

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.model.block_discovery import BlockDiscoveryError, find_blocks

EXPECTED_PATHS = {
    "llama": "model.layers",
    "qwen2": "model.layers",
    "mistral": "model.layers",
    "mixtral": "model.layers",
    "gpt2": "transformer.h",
    "gemma": "model.layers",
    "gemma2": "model.layers",
    "phi": "model.layers",
    "qwen3": "model.layers",
    "qwen2_moe": "model.layers",
}


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


class _ScaledBlock(nn.Module):
    """Blocks that differ only by a scalar attribute used in forward."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.scale + x


class _ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_ScaledBlock(0.5 * (i + 1)) for i in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).sum()


def test_per_block_scalar_attributes_reach_the_shared_template():
    torch.manual_seed(0)
    model = _ToyModel()
    reference = copy.deepcopy(model)
    engine = MegatrainEngine(model, parse_engine_config(ds_config(clipping=0.0)))
    try:
        assert engine.num_templates == 1
        x = torch.randn(5, 4)
        ours = engine(x)
        engine.backward(ours)
        engine.step()
        theirs = reference(x)
        theirs.backward()
        torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1).step()
        torch.testing.assert_close(ours, theirs)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(engine.module.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    finally:
        engine.destroy()
