"""AdamW on host-resident flat buffers, with the exact semantics of ``torch.optim.AdamW``.

For each element (``g`` already multiplied by the clipping scale ``c``)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- m + (1 - b1) * (g - m)                       (torch's lerp form)
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The operations are the ones ``torch.optim.AdamW`` (single-tensor path) issues, in the
same order, so results agree with it to the last few ulps.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from megatrain_ds.flat_layout import intersect_runs
from megatrain_ds.host_store import HostFlatState

# The update allocates a few fp32 temporaries per range (grad upcast, scaled grad, denom);
# stepping a long run (a 0.5B-element embedding) in pieces bounds them to ~16 MiB.
UPDATE_CHUNK_ELEMENTS = 1 << 20


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


class HostAdamW:
    """Applies AdamW to ranges of flat host states, reading hyperparameters live.

    Args:
        param_groups: the optimizer's group dicts (``lr``, ``betas``, ``eps``,
            ``weight_decay``); read at every update so schedulers that change them
            take effect.
        decoupled: AdamW (True) or Adam with L2 regularisation (False).
    """

    def __init__(self, param_groups: Sequence[dict[str, Any]], decoupled: bool = True) -> None:
        self.param_groups = param_groups
        self.decoupled = decoupled

    def update_range(self, state: HostFlatState, offset: int, grad: torch.Tensor, *,
                     step: int, grad_scale: float = 1.0) -> None:
        """Step elements ``[offset, offset + grad.numel())`` of ``state`` with ``grad``.

        Adam is elementwise, so any range may be stepped on its own as soon as its
        gradient is final. Frozen runs are skipped; the shadow is refreshed in the same pass.
        """
        for run in intersect_runs(state.layout.trained_runs(), offset, offset + grad.numel()):
            group = self.param_groups[run.group]
            for start in range(run.start, run.end, UPDATE_CHUNK_ELEMENTS):
                end = min(start + UPDATE_CHUNK_ELEMENTS, run.end)
                adamw_update_(
                    state.master[start:end],
                    grad[start - offset : end - offset],
                    state.exp_avg[start:end],
                    state.exp_avg_sq[start:end],
                    step=step,
                    lr=float(group["lr"]),
                    betas=tuple(group["betas"]),  # type: ignore[arg-type]
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    decoupled=self.decoupled,
                    grad_scale=grad_scale,
                )
                state.refresh_shadow(start, end)
