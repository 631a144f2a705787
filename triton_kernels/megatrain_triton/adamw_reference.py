"""Pure-torch reference for the fused AdamW kernel in ``adamw.py``.

Per element, all in fp32 (``g`` is the gradient after the clipping scale)::

    g = float(grad) * grad_scale
    decoupled (AdamW): p = p * (1 - lr * wd)        else (Adam + L2): g = g + wd * p
    m = m + (1 - beta1) * (g - m)                    (torch's lerp form)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    shadow = bf16(p)                                 (optional, round to nearest even)

It issues the same torch ops, in the same order, as the engine's host optimizer
(``megatrain_ds.optimizer.adamw_math.adamw_update_``), which mirrors the single-tensor path of
``torch.optim.AdamW``; the tests check the three agree. It is written out here rather
than imported so that the kernel package does not depend on the engine.
"""

from __future__ import annotations

import math

import torch


def adamw_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
    shadow: torch.Tensor | None = None,
) -> None:
    """One AdamW step on 1-D tensors, in place; same contract as ``adamw_step_``.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32; ``grad`` is fp32 or bf16 and is
    not modified; ``shadow`` (bf16), when given, receives ``param`` rounded after the step.
    """
    beta1, beta2 = betas
    grad = grad.to(torch.float32)
    if grad_scale != 1.0:
        grad = grad * grad_scale  # new tensor: the caller's grad stays untouched
    if weight_decay != 0.0:
        if decoupled:
            param.mul_(1.0 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if shadow is not None:
        shadow.copy_(param)
