"""A block's token-wise MLP run over sequence tiles, its intermediate never whole.

A transformer block's MLP maps each token on its own: ``T x hidden -> T x FFN -> T x
hidden``. Run whole, its ``T x FFN`` intermediates (gate, up, their activation and
product: about four of them, 2.75-3.5x wider than the hidden state) are the largest
tensors of a block at long context -- in forward while they are computed, and in the
recompute, where autograd keeps them for backward.

:func:`tile_token_wise` redirects the ``forward`` of a template's MLP submodule (an
instance attribute, as the engine redirects blocks) so that a batch of more than
``tile_tokens`` tokens is computed a tile at a time; tiles are runs of rows of the batch's
``B*T x hidden`` view (contiguous, possibly spanning two sequences: tokens are
independent here), each given to the module as a ``1 x rows x hidden`` batch:

- without gradients (the streamed forward): tile by tile into one output tensor;
- with gradients (the recompute in backward): inside :class:`_TiledFn`, which keeps only
  the MLP's input and its parameters; its backward recomputes each tile with a graph,
  takes that tile's gradients and drops the graph before the next tile. The price is one
  more MLP forward per block in backward (ALST's TiledMLP; DeepSpeed Ulysses' paper).

The result is that of the whole MLP: tokens do not interact inside it, and each tile's
parameter gradients are summed. Modules with an active dropout are left whole: tiles
would draw their masks in another order than the reference model.

The parameters a template's MLP runs with are the views bound for the current call
(``torch.func.functional_call``); the backward of :class:`_TiledFn` runs after that call
has returned, so it binds the same tensors again itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

logger = logging.getLogger(__name__)

TOKEN_WISE_NAMES = ("mlp", "feed_forward")
"""Names of a block's token-wise submodules (Hugging Face's MLP / MoE attribute names)."""


def _has_active_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


class _TiledFn(torch.autograd.Function):
    """``module(hidden)`` tile by tile, recomputed tile by tile in backward."""

    @staticmethod
    def forward(ctx: Any, tiled: TiledTokenWise, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.tiled = tiled
        ctx.autocast = (torch.is_autocast_enabled(hidden.device.type), torch.get_autocast_dtype(hidden.device.type))
        ctx.save_for_backward(hidden, *params)
        return tiled.run_tiles(hidden)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_out,) = grad_outputs  # one output, one gradient
        tiled: TiledTokenWise = ctx.tiled
        hidden, *params = ctx.saved_tensors
        want_hidden = ctx.needs_input_grad[1]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)
        enabled, dtype = ctx.autocast
        flat, grad_flat = tiled.rows(hidden), tiled.rows(grad_out)
        for start, end in tiled.tiles(flat.shape[0]):
            with torch.enable_grad(), torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
                x = flat[start:end].detach().requires_grad_(want_hidden)
                y = functional_call(tiled.module, dict(zip(tiled.names, params)), (x.unsqueeze(0),), tie_weights=False)
                inputs = ([x] if want_hidden else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(y, inputs, grad_flat[start:end].unsqueeze(0), allow_unused=True)
            del y
            if grad_hidden is not None:  # want_hidden
                grad_hidden.view(-1, grad_hidden.shape[-1])[start:end] = grads[0]
                grads = grads[1:]
            for i, grad in zip(wanted, grads):
                if grad is None:
                    continue
                previous = grad_params[i]
                grad_params[i] = grad if previous is None else previous.add_(grad)
        return (None, grad_hidden, *grad_params)


class TiledTokenWise:
    """The ``forward`` of a token-wise submodule, over tiles of ``tile_tokens`` tokens."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        self.module = module
        self.tile_tokens = tile_tokens
        self.whole: Callable[..., Any] = type(module).forward.__get__(module)
        self.names = [name for name, _ in module.named_parameters()]

    def tiles(self, rows: int) -> list[tuple[int, int]]:
        return [(start, min(start + self.tile_tokens, rows)) for start in range(0, rows, self.tile_tokens)]

    @staticmethod
    def rows(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as one row per token (``B*T x hidden``): tiles over it are contiguous."""
        return tensor.reshape(-1, tensor.shape[-1])

    def run_tiles(self, hidden: torch.Tensor) -> torch.Tensor:
        """The module over every token of ``hidden``, a tile of rows at a time (each given
        to the module as a ``1 x rows x hidden`` batch)."""
        flat = self.rows(hidden)
        out: torch.Tensor | None = None
        for start, end in self.tiles(flat.shape[0]):
            part = self.whole(flat[start:end].unsqueeze(0))
            if not isinstance(part, torch.Tensor) or part.shape[:-1] != (1, end - start):
                raise ValueError(
                    f"megatrain.mlp_tile_tokens: {type(self.module).__name__} does not map each token "
                    'to one output row; set "mlp_tile_tokens": 0'
                )
            if out is None:
                out = part.new_empty(flat.shape[0], part.shape[-1])
            out[start:end] = part[0]
            del part
        assert out is not None
        return out.view(*hidden.shape[:-1], out.shape[-1])

    def __call__(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            args
            or kwargs
            or not isinstance(hidden, torch.Tensor)
            or hidden.dim() < 2
            or hidden.numel() <= self.tile_tokens * hidden.shape[-1]
        ):
            return self.whole(hidden, *args, **kwargs)
        if not torch.is_grad_enabled():
            return self.run_tiles(hidden)
        params = [param for _, param in self.module.named_parameters()]  # this call's bound views
        return _TiledFn.apply(self, hidden, *params)


def tile_token_wise(block: nn.Module, tile_tokens: int) -> list[str]:
    """Run ``block``'s token-wise submodules (:data:`TOKEN_WISE_NAMES`) over sequence tiles
    of ``tile_tokens``; returns the names of those redirected."""
    redirected = []
    for name in TOKEN_WISE_NAMES:
        module = getattr(block, name, None)
        if not isinstance(module, nn.Module):
            continue
        if _has_active_dropout(module):
            logger.info(
                "megatrain: %s.%s has dropout; it runs whole, not in sequence tiles", type(block).__name__, name
            )
            continue
        module.forward = TiledTokenWise(module, tile_tokens)
        redirected.append(name)
    return redirected
