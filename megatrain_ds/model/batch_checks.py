"""Clear errors for batches a model cannot take, before any block is streamed.

Without these a wrong batch fails deep inside an embedding or an attention kernel
("Expected tensor for argument #1 'indices' to have one of the following scalar types",
"index out of range in self", "Expected all tensors to be on the same device") or, for
positions past a learned position table, silently reads garbage on some devices.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# Keyword arguments of Hugging Face models that hold token or position indices.
_INDEX_ARGUMENTS = ("input_ids", "position_ids", "token_type_ids", "cache_position")
_POSITION_LIMITS = ("max_position_embeddings", "n_positions")


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position embeddings cover, if its config says."""
    config = getattr(model, "config", None)
    for key in _POSITION_LIMITS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_batch(model: nn.Module, device: torch.device, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the argument for a tensor on the wrong device, token
    indices that are not integers, or a sequence longer than the model's positions."""
    named = dict(kwargs)
    if args:  # positional arguments by the names the model's forward gives them
        try:
            names = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            names = []
        named.update((name, value) for name, value in zip(names, args) if name not in named)
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.device != device:
            raise ValueError(
                f"batch tensor {name!r} is on {value.device}, but the engine computes on {device}: "
                f"move the batch there first (tensor.to({str(device)!r}))"
            )
        if name in _INDEX_ARGUMENTS and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            raise ValueError(
                f"batch tensor {name!r} has dtype {value.dtype}; it holds token indices and "
                "must be an integer tensor (torch.long)"
            )
        if name == "inputs_embeds" and not value.is_floating_point():
            raise ValueError(f"batch tensor 'inputs_embeds' has dtype {value.dtype}; it must be floating point")
    limit = max_positions(model)
    tokens = named.get("input_ids", named.get("inputs_embeds"))
    if limit is None or not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return
    length = tokens.shape[1]
    past = named.get("past_key_values")
    get_seq_length = getattr(past, "get_seq_length", None)  # a transformers Cache
    past_length = int(get_seq_length()) if get_seq_length is not None else 0
    if past_length + length <= limit:
        return
    # [Note: packed rows]
    packed = packed_positions(named)
    if packed is None:
        cached = f" after {past_length} cached" if past_length else ""
        raise ValueError(
            f"the batch has sequences of {length} tokens{cached}, more than the "
            f"{limit} positions the model has (config.max_position_embeddings / n_positions); "
            "if each row packs several sequences, pass position_ids restarting at 0 for each "
            "(or cu_seq_lens_q/cu_seq_lens_k)"
        )
    needed, source = packed
    if needed > limit:
        raise ValueError(
            f"the batch packs sequences needing {needed} positions ({source}), more than the "
            f"{limit} positions the model has (config.max_position_embeddings / n_positions)"
        )


def packed_positions(named: Mapping[str, Any]) -> tuple[int, str] | None:
    """The positions a packed (padding-free) batch needs and the argument that says so, or
    ``None`` when the batch does not say how its rows are split.

    [Note: packed rows]
    Packing (TRL's ``packing=True``, its padding-free collator, Hugging Face's
    ``DataCollatorWithFlattening``) concatenates several sequences in one row, so a row may
    be longer than the model's position table while every sequence fits. The positions the
    model indexes are then ``position_ids`` (restarting at 0 per sequence; the row length
    means nothing), and the flash-attention varlen keywords ``cu_seq_lens_q``/``_k``
    (cumulative sequence lengths) and ``max_length_q``/``_k`` say the same for attention.
    ``position_ids`` wins when given: it is what indexes rotary and learned position
    tables. Reading a device tensor's maximum synchronises the device once per forward; it
    is only done for rows longer than the table, i.e. packed batches.
    """
    position_ids = named.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.numel():
        return int(position_ids.max()) + 1, "the largest position_ids + 1"
    lengths = [value for key in ("max_length_q", "max_length_k") if isinstance(value := named.get(key), int)]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = named.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() > 1:
            lengths.append(int(value.diff().max()))
    if lengths:
        return max(lengths), "the longest sequence of cu_seq_lens_q/cu_seq_lens_k/max_length_q/max_length_k"
    return None


def reject_unsupported_outputs(model: nn.Module) -> None:
    """Raise ``ValueError`` for model outputs the engine cannot produce (router logits)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits=True is not supported yet: router logits are "
            "captured by hooks on the model's own submodules, which the engine replaces "
            "with streamed templates; set output_router_logits=False"
        )
