"""AdamW's arithmetic: the hyperparameters of one update and the op-by-op reference.

For each element (``g`` already multiplied by the clipping scale ``c``)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- m + (1 - b1) * (g - m)                       (torch's lerp form)
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

:func:`adamw_update_` issues the operations ``torch.optim.AdamW`` (single-tensor path)
issues, in the same order, so it agrees with it bit for bit (``tests/test_units.py``). The
CPU kernels (``cpu_adam.py``), the device placement (``device_adamw.py``) and the Triton
kernel are all tested against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

BeforeChunk = Callable[[int, int], None]
"""``before_chunk(start, end)``: called before elements ``[start, end)`` of the range are
overwritten (the speculative step journals them; ``optimizer/speculative_step.py``)."""


@dataclass(frozen=True)
class AdamHyper:
    """One optimizer group's hyperparameters for one update."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool
    """AdamW (True) or Adam with L2 regularisation folded into the gradient (False)."""


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
) -> None:
    """Update ``param``, ``exp_avg`` and ``exp_avg_sq`` in place (all 1-D, same length)."""
    beta1, beta2 = betas
    grad = grad.to(torch.float32)
    if grad_scale != 1.0:
        grad = grad * grad_scale
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
