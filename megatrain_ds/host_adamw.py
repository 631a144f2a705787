"""AdamW on host-resident flat buffers, with the semantics of ``torch.optim.AdamW``.

:class:`HostAdamW` walks a flat state's optimizer-group runs and hands each run to the
state's *placement*: a CPU kernel (``cpu_adam.py``) or the device (``device_adamw.py``).
:func:`adamw_update_` is the op-by-op reference all of them are tested against.

For each element (``g`` already multiplied by the clipping scale ``c``)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- m + (1 - b1) * (g - m)                       (torch's lerp form)
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

:func:`adamw_update_` issues the operations ``torch.optim.AdamW`` (single-tensor path)
issues, in the same order, so it agrees with it bit for bit (``tests/test_units.py``).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

import torch

from megatrain_ds.cpu_adam import AdamHyper, BeforeChunk, CpuAdamKernel, TorchKernel
from megatrain_ds.flat_layout import intersect_runs
from megatrain_ds.host_store import HostFlatState


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


class Placement(Protocol):
    """Where a state's AdamW arithmetic runs: :class:`~megatrain_ds.cpu_adam.CpuAdamKernel`
    or :class:`~megatrain_ds.device_adamw.DeviceAdamW` (same ``step_`` signature)."""

    name: str

    def step_(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, shadow: torch.Tensor | None, *, step: int, hyper: AdamHyper,
              grad_scale: float = 1.0, before_chunk: BeforeChunk | None = None,
              inputs_persist: bool = True) -> None: ...


class HostAdamW:
    """Applies AdamW to ranges of flat host states, reading hyperparameters live.

    Args:
        param_groups: the optimizer's group dicts (``lr``, ``betas``, ``eps``,
            ``weight_decay``); read at every update so schedulers that change them
            take effect.
        decoupled: AdamW (True) or Adam with L2 regularisation (False).
        cpu: the CPU kernel, the placement of every state not given another by :meth:`place`
            (default: the op-by-op torch reference).
    """

    def __init__(self, param_groups: Sequence[dict[str, Any]], decoupled: bool = True,
                 cpu: CpuAdamKernel | None = None) -> None:
        self.param_groups = param_groups
        self.decoupled = decoupled
        self.cpu: CpuAdamKernel = cpu if cpu is not None else TorchKernel()
        self._reference = TorchKernel()
        self._placements: dict[int, Placement] = {}

    def place(self, state: HostFlatState, placement: Placement) -> None:
        """Run ``state``'s updates on ``placement`` from now on."""
        self._placements[id(state)] = placement

    def placement_of(self, state: HostFlatState) -> Placement:
        if state.master.dtype != torch.float32:
            return self._reference  # a bf16 master: only the reference mixes it with fp32 moments
        return self._placements.get(id(state), self.cpu)

    def hyper(self, group: int) -> AdamHyper:
        """Group ``group``'s hyperparameters as they are now."""
        values = self.param_groups[group]
        beta1, beta2 = values["betas"]
        return AdamHyper(lr=float(values["lr"]), betas=(float(beta1), float(beta2)), eps=float(values["eps"]),
                         weight_decay=float(values["weight_decay"]), decoupled=self.decoupled)

    def update_range(self, state: HostFlatState, offset: int, grad: torch.Tensor, *,
                     step: int, grad_scale: float = 1.0, before_chunk: BeforeChunk | None = None,
                     inputs_persist: bool = True) -> None:
        """Step elements ``[offset, offset + grad.numel())`` of ``state`` with ``grad``.

        Adam is elementwise, so any range may be stepped on its own as soon as its
        gradient is final. Frozen runs are skipped; the shadow is refreshed in the same
        pass. ``before_chunk(start, end)`` (state offsets) runs before those elements are
        overwritten. ``inputs_persist``: ``grad`` stays valid after the call (a held
        gradient, not a staging buffer), so a device placement need not wait for its copy.
        """
        placement = self.placement_of(state)
        for run in intersect_runs(state.layout.trained_runs(), offset, offset + grad.numel()):
            lo, hi = run.start, run.end
            journal = None if before_chunk is None else _shifted(before_chunk, lo)
            placement.step_(
                state.master[lo:hi], grad[lo - offset : hi - offset], state.exp_avg[lo:hi],
                state.exp_avg_sq[lo:hi], state.shadow[lo:hi] if state.shadow is not None else None,
                step=step, hyper=self.hyper(run.group), grad_scale=grad_scale, before_chunk=journal,
                inputs_persist=inputs_persist,
            )

    def flush(self) -> None:
        """Wait until every update issued so far has landed in host memory."""
        for placement in {id(p): p for p in self._placements.values()}.values():
            flush = getattr(placement, "flush", None)
            if flush is not None:
                flush()


def _shifted(before_chunk: BeforeChunk, base: int) -> BeforeChunk:
    return lambda start, end: before_chunk(base + start, base + end)
