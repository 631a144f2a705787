"""The records of where a flat state's buffers live: :class:`StatePlacement`, its :class:`Buffer`
and :class:`Where`.

Pure values, below everything that holds or computes a state: ``state/host_store.py``'s
``HostFlatState`` carries its own :class:`StatePlacement` and reads which elements each of its
buffers holds from it, and ``state/placement.py`` computes every state's from (config,
topology, model) (``Placement.of``: [Note: the placement model] there). Kept apart from that
computation because it needs the NVMe tier's file sizes (``state/nvme_tier.py``), which
build on the host state: the records import nothing of the package, so the state can read
its placement without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

BUFFERS = ("master", "shadow", "exp_avg", "exp_avg_sq", "grad", "frozen")
"""The buffers of a flat state, by the names ``HostFlatState.nbytes_by_kind`` gives them
(``"frozen"``: the frozen weights kept apart, :attr:`StatePlacement.frozen`)."""


class Where(Enum):
    """Where a buffer of a flat state lives, and which of its elements it holds."""

    HOST = "whole on this host"
    TRAINED_PREFIX = "the trained prefix on this host (frozen parameters have none)"
    NODE_SPAN = "this node's span, on this host"
    RANK_WINDOW = "this rank's window, in its own host memory"
    TIER = "whole on this process's NVMe tier"
    TIER_WINDOW = "this rank's window on its NVMe tier"
    GATHERED = "gathered from the ranks' windows when used"
    DEVICE = "whole on the compute device (``device_state``: the GPU tier)"
    NOWHERE = "not kept"

    @property
    def on_host(self) -> bool:
        """Whether the buffer is allocated in host memory for the whole run."""
        return self in (Where.HOST, Where.TRAINED_PREFIX, Where.NODE_SPAN, Where.RANK_WINDOW)

    @property
    def on_tier(self) -> bool:
        return self in (Where.TIER, Where.TIER_WINDOW)

    @property
    def on_device(self) -> bool:
        """Whether the buffer is allocated on the compute device for the whole run
        (``"device_state"``: ``state/placement.py``, [Note: the GPU tier])."""
        return self is Where.DEVICE


@dataclass(frozen=True)
class Buffer:
    """One buffer of one state: where it lives, and the elements and element size it holds there."""

    where: Where
    numel: int = 0
    itemsize: int = 0

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tensor (``numel * element_size``); 0 where it is not in host memory."""
        return self.numel * self.itemsize if self.where.on_host else 0

    @property
    def device_bytes(self) -> int:
        """Bytes of the device tensor; 0 where it is not on the compute device."""
        return self.numel * self.itemsize if self.where.on_device else 0


NOWHERE = Buffer(Where.NOWHERE)


@dataclass(frozen=True)
class StatePlacement:
    """Where one flat state's buffers live (``state/placement.py``: [Note: the placement model]),
    and so which of its elements each holds: what ``HostFlatState``'s views read."""

    numel: int
    """Elements of the state's flat layout."""
    master: Buffer
    shadow: Buffer
    exp_avg: Buffer
    exp_avg_sq: Buffer
    grad: Buffer
    streamed: Where
    """Where forward and backward read the weights from: host memory (the shadow, or the
    master where there is none), the NVMe tier (the weight window), or gathered."""
    frozen_numel: int
    """Elements of frozen parameters (after the trained prefix): the optimizer state covers
    the trained prefix alone, frozen parameters having none ([Note: the placement model])."""
    frozen_in: str
    """The buffer that holds the frozen weights: ``"master"``, ``"shadow"`` where they are
    held there alone ([Note: frozen weights] in ``state/host_store.py``), or ``"frozen"``
    where they are a buffer of their own (:attr:`frozen`); ``""`` without any."""
    frozen: Buffer = NOWHERE
    """The frozen weights held apart (:attr:`frozen_in` ``"frozen"``), in their own dtype: with
    the weights on the NVMe tier a read-only file of their own, in one process all of them
    (``Where.TIER``), with data parallel this rank's window of them (``Where.TIER_WINDOW``);
    with the weights in host memory, beside a trained prefix whose fp32 master is cut and
    frozen weights not in the compute dtype, all of them in host memory (``Where.HOST``,
    node-shared with data parallel). Else nowhere: they are in the buffer :attr:`frozen_in` names."""

    @property
    def stepped_numel(self) -> int:
        """Elements the optimizer state is laid over, which data-parallel windows and node
        spans divide: the trained prefix."""
        return self.numel - self.frozen_numel

    @property
    def on_device(self) -> bool:
        """Whether the whole state lives on the compute device (``"device_state"``: its
        update runs there, its gradients never leave it, its weights are never copied)."""
        return self.master.where.on_device

    def buffers(self) -> dict[str, Buffer]:
        """Every buffer by its name (:data:`BUFFERS`)."""
        return {name: getattr(self, name) for name in BUFFERS}

    @property
    def gathered(self) -> bool:
        """Whether no whole copy of the weights is kept here: this rank holds its window."""
        return self.streamed is Where.GATHERED

    @property
    def master_split(self) -> bool:
        """Whether the master is split across processes (this node's span, or this rank's
        window on its tier): its whole value exists only by gathering the parts, and the
        checkpoint's span files hold the exact masters."""
        return self.master.where in (Where.NODE_SPAN, Where.TIER_WINDOW)

    @property
    def master_in_host_memory(self) -> bool:
        """Whether the whole master (or its trained prefix, the frozen weights being in the
        shadow alone) is a host buffer of this process: the parameters view it."""
        return self.master.where in (Where.HOST, Where.TRAINED_PREFIX)

    @property
    def weights_in(self) -> str:
        """The buffer that holds every weight on this node: ``"shadow"`` where the master is
        this node's span (the shadow is streamed whole), else ``"master"`` (for a gathered
        state, the master of this rank's window: the whole weights are gathered)."""
        return "shadow" if self.master.where is Where.NODE_SPAN else "master"


def whole_in_host_memory(
    numel: int, master_itemsize: int, shadow_itemsize: int = 0, grad_itemsize: int = 0
) -> StatePlacement:
    """The placement of a state whose every buffer holds all of its ``numel`` elements in host
    memory, with nothing frozen (shadow and held gradients where their item sizes are given):
    a rank's window of a state (``HostFlatState.window``: views of the state's buffers, a
    placeholder's where the state's buffer is on the NVMe tier), stepped as a state of its
    own, or one a benchmark or test builds by hand."""
    whole = Buffer(Where.HOST, numel, 4)
    return StatePlacement(
        numel,
        Buffer(Where.HOST, numel, master_itemsize),
        Buffer(Where.HOST, numel, shadow_itemsize) if shadow_itemsize else NOWHERE,
        whole,
        whole,
        Buffer(Where.HOST, numel, grad_itemsize) if grad_itemsize else NOWHERE,
        Where.HOST,
        0,
        "",
    )
