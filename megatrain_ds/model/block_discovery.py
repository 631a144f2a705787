"""Find the repeated transformer blocks of a model.

Hugging Face decoder-only models keep their blocks in one ``nn.ModuleList`` of modules
of one class (``model.layers`` for Llama/Qwen/Mistral/Gemma/Phi/Mixtral,
``transformer.h`` for GPT-2). The engine streams exactly those; everything else
(embeddings, final norm, lm_head) stays resident.
"""

from __future__ import annotations

from typing import TypeGuard

from torch import nn


class BlockDiscoveryError(ValueError):
    """The model has no blocks the engine can stream, or ``block_path`` is wrong."""


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_block_list(module: nn.Module) -> TypeGuard[nn.ModuleList]:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return False
    first = type(module[0])
    return all(type(block) is first for block in module) and _param_count(module) > 0


def find_blocks(model: nn.Module, block_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """Return ``(path, blocks)``: the model's repeated decoder blocks.

    Without ``block_path`` the largest (by parameter count) ``ModuleList`` of two or
    more modules of one class is taken; nested lists (e.g. experts inside a block) are
    smaller than the list that holds them, so the outer one wins.
    """
    if block_path is not None:
        try:
            module = model.get_submodule(block_path)
        except AttributeError as error:
            raise BlockDiscoveryError(
                f'megatrain.block_path "{block_path}" does not name a submodule of {type(model).__name__}: {error}'
            ) from None
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            raise BlockDiscoveryError(
                f'megatrain.block_path "{block_path}" is a {type(module).__name__}, '
                "not a non-empty nn.ModuleList of blocks"
            )
        return block_path, module

    candidates = [(name, mod) for name, mod in model.named_modules() if _is_block_list(mod)]
    if not candidates:
        raise BlockDiscoveryError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of two or more "
            'modules of one class with parameters); set "megatrain": {"block_path": ...} '
            "to the list of transformer blocks"
        )
    return max(candidates, key=lambda item: _param_count(item[1]))


def check_blocks_own_their_params(model: nn.Module, blocks: nn.ModuleList) -> None:
    """Reject parameters shared between blocks, or between a block and the rest.

    A shared tensor would be streamed once per owner and updated twice per step.
    """
    owner: dict[int, str] = {}
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if id(param) in owner:
                raise BlockDiscoveryError(
                    f"parameter {name} of block {index} is shared with {owner[id(param)]}; "
                    "the engine needs every block to own its parameters"
                )
            owner[id(param)] = f"block {index}"
    block_ids = set(owner)
    block_modules = {id(m) for block in blocks for m in block.modules()}
    for module_name, module in model.named_modules():
        if id(module) in block_modules:
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in block_ids:
                raise BlockDiscoveryError(
                    f"parameter {module_name}.{name} is also used inside {owner[id(param)]}; "
                    "the engine needs blocks to own their parameters"
                )
