"""AdamW on host-resident flat buffers, with the semantics of ``torch.optim.AdamW``.

:class:`HostAdamW` walks a flat state's optimizer-group runs and hands each run to the
state's *placement*: a CPU kernel (``cpu_adam.py``) or the device (``device_adamw.py``),
which compute the arithmetic of ``adamw_math.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from megatrain_ds.optimizer.adamw_math import AdamHyper, BeforeChunk
from megatrain_ds.optimizer.cpu_adam import CpuAdamKernel, TorchKernel
from megatrain_ds.state.flat_layout import intersect_runs
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.residency import RAM_ONLY, Residency


class Placement(Protocol):
    """Where a state's AdamW arithmetic runs: :class:`~megatrain_ds.optimizer.cpu_adam.CpuAdamKernel`
    or :class:`~megatrain_ds.optimizer.device_adamw.DeviceAdamW` (same ``step_`` signature)."""

    name: str

    def step_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        shadow: torch.Tensor | None,
        *,
        step: int,
        hyper: AdamHyper,
        grad_scale: float = 1.0,
        before_chunk: BeforeChunk | None = None,
    ) -> None: ...


class HostAdamW:
    """Applies AdamW to ranges of flat host states, reading hyperparameters live.

    Args:
        param_groups: the optimizer's group dicts (``lr``, ``betas``, ``eps``,
            ``weight_decay``); read at every update so schedulers that change them
            take effect.
        decoupled: AdamW (True) or Adam with L2 regularisation (False).
        cpu: the CPU kernel, the placement of every state not given another by :meth:`place`
            (default: the op-by-op torch reference).

    Attributes:
        residency: asked for a state's moments before each range update (the NVMe tier,
            ``state/nvme_tier.py``; by default everything is in host memory).
    """

    def __init__(
        self, param_groups: Sequence[dict[str, Any]], decoupled: bool = True, cpu: CpuAdamKernel | None = None
    ) -> None:
        self.param_groups = param_groups
        self.decoupled = decoupled
        self.cpu: CpuAdamKernel = cpu if cpu is not None else TorchKernel()
        self._reference = TorchKernel()
        self._placements: dict[int, Placement] = {}
        self.residency: Residency = RAM_ONLY

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
        return AdamHyper(
            lr=float(values["lr"]),
            betas=(float(beta1), float(beta2)),
            eps=float(values["eps"]),
            weight_decay=float(values["weight_decay"]),
            decoupled=self.decoupled,
        )

    def snapshot(self) -> tuple[AdamHyper, ...]:
        """Every group's hyperparameters as they are now (an update run later, behind
        ``engine.step()``, must not see a scheduler's change made after it)."""
        return tuple(self.hyper(group) for group in range(len(self.param_groups)))

    @property
    def on_host_only(self) -> bool:
        """Whether every state's update runs on the CPU (no state placed on the device)."""
        return not self._placements

    def update_range(
        self,
        state: HostFlatState,
        offset: int,
        grad: torch.Tensor,
        *,
        step: int,
        grad_scale: float = 1.0,
        before_chunk: BeforeChunk | None = None,
        hypers: Sequence[AdamHyper] | None = None,
    ) -> None:
        """Step elements ``[offset, offset + grad.numel())`` of ``state`` with ``grad``.

        Adam is elementwise, so any range may be stepped on its own as soon as its
        gradient is final. Frozen runs are skipped; the shadow is refreshed in the same
        pass. ``before_chunk(start, end)`` (state offsets) runs before those elements are
        overwritten. ``hypers``: each group's hyperparameters (:meth:`snapshot`); by default
        read now.
        """
        placement = self.placement_of(state)
        self.residency.acquire(state)  # the moments may be on the NVMe tier
        for run in intersect_runs(state.layout.trained_runs(), offset, offset + grad.numel()):
            lo, hi = run.start, run.end
            journal = None if before_chunk is None else _shifted(before_chunk, lo)
            placement.step_(
                state.master[lo:hi],
                grad[lo - offset : hi - offset],
                state.exp_avg[lo:hi],
                state.exp_avg_sq[lo:hi],
                state.shadow[lo:hi] if state.shadow is not None else None,
                step=step,
                hyper=hypers[run.group] if hypers is not None else self.hyper(run.group),
                grad_scale=grad_scale,
                before_chunk=journal,
            )

    def flush(self) -> None:
        """Wait until every update issued so far has landed in host memory."""
        for placement in {id(p): p for p in self._placements.values()}.values():
            flush = getattr(placement, "flush", None)
            if flush is not None:
                flush()


def _shifted(before_chunk: BeforeChunk, base: int) -> BeforeChunk:
    return lambda start, end: before_chunk(base + start, base + end)
