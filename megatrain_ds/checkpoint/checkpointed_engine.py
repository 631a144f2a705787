"""The engine as checkpoints see it: its flat states, their parameters by name, where each tensor lives.

``save.py`` writes a checkpoint and ``load.py`` reads one; both walk the engine's flat host
states in the engine's own order (``engine.states``: one state per block, in block order,
then the resident parameters' state), each parameter an :class:`Entry` named as in the
Hugging Face model. A state's tensor of a kind (``master``, ``exp_avg``, ...) is read and
written wherever it lives, host memory or the NVMe tier's swap files (:class:`StateTensors`),
and a process holds either all of a state's optimizer state or a part of it
(:func:`held_spans`: its node's span, or its rank's window).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatrain_ds.checkpoint import trainer_state as trainer_states
from megatrain_ds.checkpoint.optimizer_spans import RESIDENT, HeldSpan
from megatrain_ds.config import EngineConfig
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.gradients.sink import GradientPort
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.flat_layout import FROZEN_GROUP, ParamSlot
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.state.placement import Placement
from megatrain_ds.state.state_placement import StatePlacement
from megatrain_ds.streaming.resident_params import ResidentParams
from megatrain_ds.streaming.weight_streamer import WeightStreamer

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's moments: the optimizer state saved for every trained parameter."""
NO_HELD_GRADIENTS = (
    "{path} was saved inside a gradient accumulation window and holds accumulated gradients, but this "
    "engine keeps none (its gradient_clipping and gradient_accumulation_steps differ from the saved run's)"
)


class CheckpointedEngine(Protocol):
    """What saving and loading read and restore of the engine (``MegatrainEngine``; this
    module sits below it). Counters not listed here (``global_samples``, ``skipped_steps``,
    ``optimizer_steps``) are saved when the engine has them."""

    module: torch.nn.Module
    config: EngineConfig
    optimizer: Any
    """The optimizer facade: its ``param_groups`` are saved and restored."""
    lr_scheduler: Any
    data_parallel: DataParallel | None
    runtime: DeviceRuntime
    sink: GradientPort
    streamer: WeightStreamer
    resident: ResidentParams
    placement: Placement
    """Where each buffer of each state lives: what saving and loading branch on."""
    states: list[HostFlatState]
    """One flat state per block, in block order, then the resident parameters' state."""
    windows: list[tuple[int, int]]
    """This rank's ``[start, end)`` of each state (all of it without data parallel)."""
    optimizer_states: list[HostFlatState]
    """Views of each state's window: what this rank's optimizer (and NVMe tier) holds."""
    nvme_tier: NvmeTier | None
    """Holds the blocks' Adam moments when the NVMe tier is on (this rank's windows of
    them with data parallel)."""
    gathered_weights: GatheredWeights | None
    """With the weights on the NVMe tier and data parallel: the blocks' weights, which no
    rank holds whole, gathered from every rank's window (its master on its tier)."""
    block_path: str
    global_steps: int
    micro_steps: int

    @property
    def loss_scaling(self) -> trainer_states.LossScalerState:
        """fp16's loss scaler: its running state is saved and restored with the optimizer's."""
        ...

    def gradient_accumulation_steps(self) -> int: ...


@dataclass(frozen=True)
class Entry:
    """One distinct parameter: its Hugging Face name, its place in a flat host state, and
    where that state's buffers live."""

    name: str
    state: HostFlatState
    slot: ParamSlot
    placement: StatePlacement

    @property
    def trained(self) -> bool:
        return self.slot.group != FROZEN_GROUP

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.slot.offset : self.slot.offset + self.slot.numel].view(self.slot.shape)

    def weight(self, whole: torch.Tensor, flat_of: StateTensors, frozen: torch.Tensor | None = None) -> torch.Tensor:
        """Its weight in ``whole`` (the state's whole weights), or for a frozen weight held
        alone in the shadow, or apart (in host memory or on the NVMe tier: ``flat_of``'s
        ``"frozen"``), there (``state/host_store.py``: [Note: frozen weights]): written and
        read once, in its own dtype. A gathered state's ``whole`` has them all where they are
        in the compute dtype, else ``frozen`` has them, all of a state's frozen weights
        apart gathered exact (``distributed/gathered_weights.py``: [Note: gathered weights])."""
        if frozen is not None and not self.trained:
            return self.state.slot_of(self.slot, frozen)
        if self.placement.frozen_in == "shadow" and not self.trained:
            assert self.state.shadow is not None
            return self.view(self.state.shadow)
        if self.placement.frozen_in == "frozen" and not self.trained and not self.placement.gathered:
            return self.state.slot_of(self.slot, flat_of(self.state, "frozen"))
        return self.view(whole)


class StateTensors:
    """A state's flat buffer of a kind; what the NVMe tier holds (Adam moments, fp32 masters
    with bf16 compute, frozen weights apart) comes mapped from the swap files
    (``NvmeTier.file_views``), kept until :meth:`release`."""

    def __init__(self, on_tier: Callable[[HostFlatState], dict[str, torch.Tensor] | None] | None) -> None:
        self._on_tier = on_tier
        self._mapped: dict[int, dict[str, torch.Tensor] | None] = {}

    def __call__(self, state: HostFlatState, kind: str) -> torch.Tensor:
        if self._on_tier is not None:
            if id(state) not in self._mapped:
                self._mapped[id(state)] = self._on_tier(state)
            mapped = self._mapped[id(state)]
            if mapped is not None and kind in mapped:
                return mapped[kind]
        return getattr(state, kind)

    def release(self) -> None:
        self._mapped.clear()


@contextlib.contextmanager
def state_tensors(engine: CheckpointedEngine) -> Iterator[StateTensors]:
    """Checkpoints read and write each tensor in whichever tier holds it."""
    if engine.nvme_tier is None:
        yield StateTensors(None)
        return
    with engine.nvme_tier.file_views() as on_tier:
        yield StateTensors(on_tier)


def windows_on_rank_tiers(engine: CheckpointedEngine) -> bool:
    """With data parallel and the NVMe tier each rank keeps its windows of the blocks'
    moments in its own swap files (``state/nvme_tier.py``): only that rank reads or writes them."""
    return engine.placement.tier_per_rank


def state_names(engine: CheckpointedEngine) -> list[str]:
    """The name of each of ``engine.states`` in span files: its block (``model.layers.3``),
    and :data:`RESIDENT` for the last, the resident parameters' state."""
    num_blocks = len(engine.states) - 1  # the resident state comes last
    return [f"{engine.block_path}.{index}" for index in range(num_blocks)] + [RESIDENT]


def states_by_name(engine: CheckpointedEngine) -> dict[str, HostFlatState]:
    """Every flat state by its name in span files, in the engine's order (:func:`state_names`)."""
    return dict(zip(state_names(engine), engine.states))


def held_spans(engine: CheckpointedEngine, flat_of: StateTensors) -> dict[str, HeldSpan]:
    """What this process saves and fills of each flat state's optimizer state, by state
    name: the part its node holds (all of it on one node), or with the NVMe tier and data
    parallel this rank's window (:func:`windows_on_rank_tiers`)."""
    names = state_names(engine)
    if not windows_on_rank_tiers(engine):
        return {name: HeldSpan.of_state(state, flat_of) for name, state in zip(names, engine.states)}
    return {
        name: HeldSpan(state.layout.numel, start, end, lambda kind, w=window: flat_of(w, kind))
        for name, state, (start, end), window in zip(names, engine.states, engine.windows, engine.optimizer_states)
    }


def entries_by_state(engine: CheckpointedEngine) -> list[list[Entry]]:
    """The entries of each of ``engine.states`` (the same index: the blocks', then the
    resident parameters'), each state's in flat-buffer order."""
    num_blocks = len(engine.states) - 1  # the resident state comes last
    prefixes = [f"{engine.block_path}.{index}." for index in range(num_blocks)] + [""]
    return [
        [Entry(prefix + slot.name, state, slot, placement) for slot in state.layout.slots]
        for prefix, state, placement in zip(prefixes, engine.states, engine.placement.states)
    ]


def inside_accumulation_window(engine: CheckpointedEngine) -> bool:
    """Whether the engine is between two optimizer steps (its held gradients are then saved)."""
    return engine.micro_steps % engine.gradient_accumulation_steps() != 0


class Quiescent(Protocol):
    """What :func:`quiesce` waits for (the engine; also ``whole_masters.py``'s ``MasterHolder``)."""

    sink: GradientPort
    runtime: DeviceRuntime
    data_parallel: DataParallel | None


def quiesce(engine: Quiescent, what: str = "the checkpoint barrier") -> None:
    """No update may be in flight while the host state is read or overwritten (by any
    rank: with data parallel the state is node-shared). Collective with data parallel: a
    barrier of every rank (``what`` names it)."""
    engine.sink.drain()
    engine.runtime.synchronize()
    if engine.data_parallel is not None:
        engine.data_parallel.world_barrier(what)
