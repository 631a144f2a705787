"""Where the optimizer asks for a state's optimizer state before touching it: in host memory
(:data:`RAM_ONLY`), or on the NVMe tier (``state/nvme_tier.py``'s ``NvmeTier``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from megatrain_ds.state.host_store import HostFlatState


class Residency(Protocol):
    """Where the optimizer asks for a state's optimizer state before touching it."""

    def acquire(self, state: HostFlatState) -> None:
        """Make ``state.exp_avg``/``exp_avg_sq`` (and ``master``) real host tensors until the next acquire."""

    def expect(self, states: Sequence[HostFlatState]) -> None:
        """The order of the next accesses (a hint: prefetch follows it)."""

    def step_done(self) -> None:
        """An optimizer step has finished (the tier checks whether the disk kept up)."""


class RamResidency:
    """Everything in host memory: nothing to do."""

    def acquire(self, state: HostFlatState) -> None:
        del state

    def expect(self, states: Sequence[HostFlatState]) -> None:
        del states

    def step_done(self) -> None:
        pass


RAM_ONLY = RamResidency()
