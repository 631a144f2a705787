"""Embedding and output-projection gradients produced a few rows at a time.

The two largest resident parameters of a language model are the token embedding and
the output projection (``lm_head``): ``vocab x hidden`` each, 0.5-2 GB in fp32. Left to
autograd, each one's gradient is one dense ``vocab x hidden`` tensor that lives until
the sink has moved it -- the largest single allocation of the step, on the device and
(on the CPU, where the device is the host) in host memory too.

Here the module's ``forward`` is redirected (an instance attribute, as for the blocks)
through an autograd function whose backward writes the weight's gradient in chunks of
``rows_per_chunk`` rows and hands each to ``push`` at once; autograd sees no weight
gradient at all. Each chunk is what autograd would have produced for those rows:

- output projection: ``grad_W[r0:r1] = grad_out[:, r0:r1]^T @ x``, after ``grad_x``
  (``grad_x`` reads ``W``, which the optimizer may update as soon as a chunk is pushed;
  see streaming/resident_params.py: [Note: resident updates during backward]);
- embedding: zeros with the rows' token gradients added (``index_add_``), the padding
  row left at zero as ``nn.Embedding`` leaves it.

Only a weight used by this one module qualifies: a tied weight gets contributions from
two places, which autograd must add up before anything is pushed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

PushFn = Callable[[int, torch.Tensor], None]
"""``push(offset, flat_device_grad)``: hand a gradient to the sink."""


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would run a matmul in here, or ``None`` when it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _ProjectionFn(torch.autograd.Function):
    """``x @ W^T`` whose weight gradient goes to ``push`` in row chunks."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, offset: int, push: PushFn, rows_per_chunk: int
    ) -> torch.Tensor:
        # Autocast is applied by hand and then turned off, so backward computes in exactly
        # the dtypes forward did without depending on the autocast state it runs under.
        dtype = _autocast_dtype(x.device.type)
        x_c, w_c = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        ctx.save_for_backward(x_c, w_c)
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        ctx.offset, ctx.push, ctx.rows_per_chunk = offset, push, rows_per_chunk
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x_c, w_c)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_out,) = grad_outputs  # one output, one gradient
        x, weight = ctx.saved_tensors
        rows, width = weight.shape
        x2 = x.reshape(-1, width)
        g2 = grad_out.reshape(-1, rows).to(weight.dtype)
        # grad_x first: once a chunk is pushed the optimizer may update those rows of W.
        grad_x = (g2 @ weight).to(ctx.x_dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, ctx.rows_per_chunk):
            end = min(start + ctx.rows_per_chunk, rows)
            chunk = (g2[:, start:end].t() @ x2).to(ctx.weight_dtype)
            ctx.push(ctx.offset + start * width, chunk.reshape(-1))
        return grad_x, None, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    """``weight[ids]`` whose weight gradient goes to ``push`` in row chunks."""

    @staticmethod
    def forward(
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        padding_idx: int | None,
        offset: int,
        push: PushFn,
        rows_per_chunk: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.dtype = weight.shape, weight.dtype
        ctx.padding_idx, ctx.offset, ctx.push, ctx.rows_per_chunk = padding_idx, offset, push, rows_per_chunk
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[None, ...]:
        (grad_out,) = grad_outputs  # one output, one gradient
        (ids,) = ctx.saved_tensors
        rows, width = ctx.shape
        ids = ids.reshape(-1)
        g2 = grad_out.reshape(-1, width).to(ctx.dtype)
        if ctx.padding_idx is not None:
            keep = ids != (ctx.padding_idx % rows)
            ids, g2 = ids[keep], g2[keep]
        for start in range(0, rows, ctx.rows_per_chunk):
            end = min(start + ctx.rows_per_chunk, rows)
            chunk = torch.zeros(end - start, width, dtype=ctx.dtype, device=grad_out.device)
            inside = (ids >= start) & (ids < end)
            chunk.index_add_(0, ids[inside] - start, g2[inside])
            ctx.push(ctx.offset + start * width, chunk.reshape(-1))
        return None, None, None, None, None, None


def _is_plain_embedding(module: nn.Module) -> TypeGuard[nn.Embedding]:
    return (
        isinstance(module, nn.Embedding)
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


def _has_tensor_hooks(weight: torch.Tensor) -> bool:
    """``weight.register_hook`` was used: the hook must see the whole gradient."""
    return bool(getattr(weight, "_backward_hooks", None))


class RowChunkedModule:
    """A module whose weight gradient goes to ``push`` in row chunks (see the module doc).

    A weight with a tensor hook (``weight.register_hook``, e.g. a gradient mask) takes the
    plain path instead: the hook sees the whole gradient, which then reaches ``.grad``.
    ``chunked`` tells whether the last forward with gradients enabled took the chunked path.
    """

    def __init__(self, module: nn.Embedding | nn.Linear, offset: int, push: PushFn, rows_per_chunk: int) -> None:
        self.module = module
        self.chunked = False
        self.offset, self.push, self.rows_per_chunk = offset, push, rows_per_chunk

        def forward(input: torch.Tensor) -> torch.Tensor:  # the signature of the module's own
            weight = module.weight
            if not torch.is_grad_enabled():  # no backward follows: ``chunked`` keeps its value
                if isinstance(module, nn.Embedding):
                    return F.embedding(input, weight, module.padding_idx)
                return F.linear(input, weight, module.bias)
            self.chunked = weight.requires_grad and not _has_tensor_hooks(weight)
            if isinstance(module, nn.Embedding):
                if not self.chunked:
                    return F.embedding(input, weight, module.padding_idx)
                return _EmbeddingFn.apply(input, weight, module.padding_idx, offset, push, rows_per_chunk)
            if not self.chunked:
                return F.linear(input, weight, module.bias)
            out = _ProjectionFn.apply(input, weight, offset, push, rows_per_chunk)
            return out if module.bias is None else out + module.bias.to(out.dtype)

        module.forward = forward

    def weight_grad_push(self) -> Callable[[torch.Tensor], None] | None:
        """For a forward that computes the weight's gradient itself, whole (the chunked loss,
        model/chunked_loss.py): a function that sends it on in row chunks, as this module's
        backward would; ``None`` where the weight takes the plain path (see the class doc)."""
        weight = self.module.weight
        self.chunked = weight.requires_grad and not _has_tensor_hooks(weight)
        return self._push_whole if self.chunked else None

    def _push_whole(self, grad: torch.Tensor) -> None:
        rows, width = grad.shape
        dtype = self.module.weight.dtype
        for start in range(0, rows, self.rows_per_chunk):
            end = min(start + self.rows_per_chunk, rows)
            self.push(self.offset + start * width, grad[start:end].to(dtype).reshape(-1))

    def restore(self) -> None:
        """Give the module its own ``forward`` back."""
        self.module.__dict__.pop("forward", None)


def redirect_row_chunked(module: nn.Module, offset: int, push: PushFn, chunk_elements: int) -> RowChunkedModule | None:
    """Send ``module.weight``'s gradient to ``push`` in chunks of about ``chunk_elements``,
    if ``module`` is a plain ``nn.Embedding`` or ``nn.Linear``; ``offset`` is the weight's
    offset in the flat state ``push`` writes to. Returns ``None`` when it does not qualify.

    The caller guarantees that no other module uses the weight (see the module docstring).
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or not weight.requires_grad or weight.dim() != 2:
        return None
    if not (_is_plain_embedding(module) or type(module) is nn.Linear):
        return None
    return RowChunkedModule(module, offset, push, max(1, chunk_elements // weight.shape[1]))
