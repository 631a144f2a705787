"""Linear projection + cross-entropy over sequence chunks: no ``tokens x vocab`` tensor.

For hidden states ``h`` (``N x H``), an output projection ``W`` (``V x H``, optional bias
``b``) and targets ``t`` (``N``, ``ignore_index`` where no loss is taken)::

    loss = sum_n CE(float(h_n W^T + b), t_n) / denominator

which is what Hugging Face's ``ForCausalLMLoss`` computes on the whole logits tensor
(``denominator`` = the number of non-ignored targets, or ``num_items_in_batch``). Here the
tokens are taken ``chunk_tokens`` at a time; for each chunk the logits, their fp32 copy,
the loss and the gradient of the loss w.r.t. the logits exist only while that chunk is
computed, and their products with ``W`` and ``h`` are taken at once:

    grad_h[chunk] = g W                  (the chunk's rows of the hidden-state gradient)
    grad_W       += g^T h[chunk]         (one ``V x H`` fp32 accumulator)
    grad_b       += sum_rows g

with ``g = d loss / d logits[chunk]`` from torch's own cross-entropy backward (the same
kernel, the same ``1 / denominator`` scaling as the whole-tensor loss). The gradients are
computed in forward, while each chunk's logits exist, so the logits are computed once;
backward only scales them by the incoming gradient (``1``, or ``1/GA`` from
``engine.backward``, times the fp16 loss scale). Peak memory: ``grad_h`` (``N x H``), the accumulator (``V x H``, fp32)
and about four ``chunk_tokens x V`` fp32 tensors, instead of four ``N x V``.

[Note: low-precision gradients of the chunked loss]
In fp16 (and bf16) ``g`` is rounded to the compute dtype before it meets ``W`` and ``h``, as
Hugging Face's loss rounds it, but at forward time, before the incoming gradient (the loss
scale) is known. ``|g| <= 1/denominator``, so unscaled most of it would fall below fp16's
normal range (6.1e-5) and lose bits that loss scaling exists to keep. So ``g`` is rounded
multiplied by ``lift``, the power of two at or below the denominator (``|g lift| <= 1``:
nothing can overflow), and backward multiplies by ``incoming / lift`` in fp32 before
rounding (a loss scale of 2^16 is itself no fp16 number). Powers of two scale exactly, so
where Hugging Face's ``g`` is in the normal range the gradients are bit for bit its own.

The weight gradient can leave through ``push_weight_grad`` (an untied output projection
whose gradient goes to the host in row chunks, gradients/row_chunked.py) instead of
through autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

WeightGradPush = Callable[[torch.Tensor], None]
"""``push(grad_W)``: hand the finished ``V x H`` weight gradient on (row by row chunks)."""


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """See the module docstring; inputs ``(hidden, weight, bias, targets, denominator, ...)``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        denominator: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        push_weight_grad: WeightGradPush | None,
    ) -> torch.Tensor:
        # Autocast is applied by hand (as it would be to the projection) and turned off.
        dtype = _autocast_dtype(hidden.device.type) or weight.dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and want_bias else None
        )
        wants_grad = want_hidden or want_weight or want_bias
        scale = 1.0 / denominator.to(torch.float32)
        # [Note: low-precision gradients of the chunked loss]; a tensor, so no device sync.
        lift = None
        if dtype in (torch.float16, torch.bfloat16):
            lift = torch.exp2(torch.floor(torch.log2(denominator.to(torch.float32).clamp(min=1.0))))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = min(start + chunk_tokens, hidden.shape[0])
                h = hidden[start:end].to(dtype)
                logits = F.linear(h, w, b).float()  # Hugging Face upcasts the logits, as here
                with torch.enable_grad():
                    logits.requires_grad_(wants_grad)
                    loss = (
                        F.cross_entropy(logits, targets[start:end], ignore_index=ignore_index, reduction="sum") * scale
                    )
                    lifted = loss if lift is None else loss * lift
                    grad = torch.autograd.grad(lifted, logits)[0].to(dtype) if wants_grad else None
                total += loss.detach()
                del logits, loss
                if grad is None:
                    continue
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad @ w
                if grad_weight is not None:
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad.t(), h)
                    else:  # a low-precision product, accumulated in fp32
                        grad_weight.add_(grad.t() @ h)
                if grad_bias is not None:
                    grad_bias.add_(grad.sum(0, dtype=torch.float32))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, lift)
        ctx.chunk_tokens = chunk_tokens
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.push_weight_grad = push_weight_grad
        return total

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_loss,) = grad_outputs  # one output, one gradient
        grad_hidden, grad_weight, grad_bias, lift = ctx.saved_tensors
        factor = grad_loss.to(torch.float32) if lift is None else grad_loss.to(torch.float32) / lift
        if grad_hidden is not None:
            if lift is None:
                grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
            else:  # in fp32, a chunk at a time (an fp32 copy of all of it would be the largest tensor)
                scaled = torch.empty_like(grad_hidden)
                for start in range(0, grad_hidden.shape[0], ctx.chunk_tokens):
                    rows = slice(start, start + ctx.chunk_tokens)
                    scaled[rows] = grad_hidden[rows].float().mul_(factor)
                grad_hidden = scaled
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(factor)
            if ctx.push_weight_grad is not None:
                ctx.push_weight_grad(grad_weight)
                grad_weight = None
            else:
                grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(factor).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    denominator: torch.Tensor | float,
    chunk_tokens: int,
    ignore_index: int = -100,
    push_weight_grad: WeightGradPush | None = None,
) -> torch.Tensor:
    """``sum CE(hidden @ weight^T + bias, targets) / denominator`` in chunks of ``chunk_tokens``
    rows (see the module docstring); a 0-dim fp32 loss.

    Args:
        hidden: ``N x H`` final hidden states (the projection's input).
        weight, bias: the output projection (``V x H``, ``V`` or ``None``).
        targets: ``N`` class indices; ``ignore_index`` marks rows without a loss.
        denominator: what the summed loss is divided by (a 0-dim tensor or a number).
        push_weight_grad: takes the weight's fp32 gradient instead of autograd (``weight``
            then receives none through autograd).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match: expected N x H and N"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not isinstance(denominator, torch.Tensor):
        denominator = torch.tensor(float(denominator))
    denominator = denominator.to(device=hidden.device)
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, targets.to(hidden.device), denominator, chunk_tokens, ignore_index, push_weight_grad
    )
