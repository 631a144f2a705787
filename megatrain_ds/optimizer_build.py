"""Assembling the engine's optimizer over the host state, as the placement puts it.

:func:`assemble_optimizer` is the step of ``engine_build.build`` after the blocks' host
state and the resident parameters exist: the held gradients, each rank's window of every
state (on its own NVMe tier with data parallel), the host AdamW over them, the GPU tier's
states and their update, the stepper (norm, clipping, speculative steps and their
journal) and the pipelined finish, attached to the client optimizer
(``optimizer/facade.py``'s ``build_optimizer`` made that one, from the config or the
user's). Where each state lives, the GPU tier's share included, is decided before, with
the placement (``engine_build.py``).

The builders are functions over the engine (:class:`OptimizerUnderConstruction`, the parts
they read and set and the engine's callbacks they wire in); like ``engine_build.py``, which
imports this module, it sits beside ``engine.py`` in the layers and imports nothing of it.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from megatrain_ds.config import EngineConfig
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.gradients.held_writes import HeldWrites
from megatrain_ds.optimizer.device_states import DeviceStates
from megatrain_ds.optimizer.facade import MegatrainOptimizer
from megatrain_ds.optimizer.gradient_accumulation import HostAccumulation
from megatrain_ds.optimizer.host_adamw import HostAdamW
from megatrain_ds.optimizer.journal import (
    AUTO_JOURNAL_BYTES_PER_PARAM,
    JournalExtent,
    describe_extents,
    journal_element_bytes,
    journal_extents,
)
from megatrain_ds.optimizer.pipelined_finish import PipelinedFinish, pipelined_finish_for, refusal
from megatrain_ds.optimizer.placement import build_host_adamw
from megatrain_ds.optimizer.speculative_step import OptimizerStepper
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.nvme_tier import NvmeTier, is_on_tier, open_nvme_tier
from megatrain_ds.state.placement import Placement
from megatrain_ds.state.state_placement import Where
from megatrain_ds.streaming.resident_params import ResidentParams

logger = logging.getLogger(__name__)


class OptimizerUnderConstruction(Protocol):
    """``MegatrainEngine`` as the optimizer's builders see it: what they read (the config,
    the placement, the host states and the resident parameters, set before
    :func:`assemble_optimizer`), the parts they set (declared, with what each is, on the
    engine), and the engine's methods they wire into the optimizer and the pipelined finish."""

    config: EngineConfig
    runtime: DeviceRuntime
    data_parallel: DataParallel | None
    optimizer: MegatrainOptimizer
    placement: Placement
    states: list[HostFlatState]
    resident: ResidentParams
    _resident_index: int
    nvme_tier: NvmeTier | None
    windows: list[tuple[int, int]]
    optimizer_states: list[HostFlatState]
    adamw: HostAdamW
    stepper: OptimizerStepper
    accumulation: HostAccumulation
    held_writes: HeldWrites
    pipelined_finish: PipelinedFinish | None
    device_states: DeviceStates | None

    def _finish_optimizer_step(self) -> None: ...

    def _landed(self, index: int) -> None: ...


def assemble_optimizer(engine: OptimizerUnderConstruction, shared: NodeSharedMemory | None) -> None:
    """Gradient buffers, each rank's window of the state (on its own NVMe tier with data
    parallel), the host AdamW over it and the stepper (norm, clipping, speculative
    steps), attached to the client optimizer."""
    options, compute, dp = engine.config.options, engine.config.compute_dtype, engine.data_parallel
    grad_dtype = engine.config.held_gradient_dtype if engine.config.holds_gradients else compute
    for state, placement in zip(engine.states, engine.placement.states):
        first, last = state.held
        if placement.on_device:  # held on the device whatever the run holds on the host
            state.grad = torch.zeros(last - first, dtype=grad_dtype, device=engine.runtime.device)
        elif engine.config.holds_gradients:
            # A rank's own window (gathered weights): its gradients are its alone, not the node's.
            own = placement.grad.where is Where.RANK_WINDOW
            state.grad = engine.runtime.host_zeros(last - first, grad_dtype, None if own else shared)
    if dp is not None:
        # Sync: the node writers have filled the shared state (and taken the first node's
        # weights, engine_build.py's _share_initial_weights); no rank reads it before this.
        dp.shared.written()
        engine.resident.refresh_device()

    # What this rank updates: every state whole, or with data parallel its window of
    # each (distributed/data_parallel.py: [Note: data-parallel step]); either of what the
    # optimizer state covers (stepped_numel: the trained prefix where frozen weights have none).
    engine.windows = [
        dp.window(state.stepped_numel) if dp is not None else (0, state.stepped_numel) for state in engine.states
    ]
    engine.optimizer_states = (
        engine.states if dp is None else [state.window(*window) for state, window in zip(engine.states, engine.windows)]
    )
    if engine.placement.tier_per_rank:
        _open_rank_tier(engine)
    engine.adamw = build_host_adamw(
        engine.optimizer.param_groups,
        engine.optimizer.decoupled,
        engine.optimizer_states,
        engine.runtime,
        options.optimizer_device,
        options.cpu_adam_kernel,
        engine.states[0].grad.dtype if engine.states[0].grad is not None else compute,
        finish_pipelines=_finish_can_pipeline(engine),
    )
    engine.device_states = _device_states(engine)
    engine.stepper = OptimizerStepper(
        engine.optimizer_states,
        engine.adamw,
        clipping=engine.config.gradient_clipping,
        journal_extents=_journal_extents(engine),
        holds_gradients=engine.config.holds_gradients,
        sum_over_ranks=dp.world_sum if dp is not None else None,
        runtime=engine.runtime,
        device_states=engine.device_states,
    )
    if engine.nvme_tier is not None:  # state/nvme_window.py: [Note: the NVMe window]
        engine.nvme_tier.settle = engine.adamw.flush
        engine.adamw.residency = engine.nvme_tier
        engine.stepper.plan_access()
    engine.held_writes = HeldWrites(len(engine.optimizer_states))
    engine.accumulation = HostAccumulation.for_kernel(engine.adamw.cpu)  # fused where DeepSpeed's op loaded
    engine.optimizer.attach(engine._finish_optimizer_step)
    engine.pipelined_finish = pipelined_finish_for(  # optimizer/pipelined_finish.py: [Note: pipelined finish]
        engine.runtime,
        engine._resident_index,
        engine._landed,
        holds_gradients=engine.config.holds_gradients,
        data_parallel=dp is not None,
        nvme_tier=engine.nvme_tier is not None,
        on_host_only=engine.adamw.on_host_only,
    )


def _journal_extents(engine: OptimizerUnderConstruction) -> list[JournalExtent]:
    """What the speculative step journals (``optimizer/journal.py``: [Note: journal extents]),
    logged once: with held gradients only (without, nothing is deferred or undone)."""
    if not engine.config.holds_gradients:
        return []
    setting = engine.config.options.speculative_blocks
    blocks = engine.optimizer_states[: engine._resident_index]
    extents = journal_extents(engine.optimizer_states, engine._resident_index, setting)
    # Never a state on the device: its update is cheap at step() (optimizer/device_states.py).
    extents = [extent for extent in extents if not engine.placement.states[extent.index].on_device]
    element_bytes = journal_element_bytes(blocks[0]) if blocks else 0
    budget = (
        f"at most {AUTO_JOURNAL_BYTES_PER_PARAM} B per parameter"
        if setting == "auto"
        else f"the last {setting} blocks whole"
    )
    logger.info(
        "megatrain: speculative steps journal %s (speculative_blocks %r: %s)",
        describe_extents(extents, [state.layout.trained_numel for state in blocks], element_bytes),
        setting,
        budget,
    )
    return extents


def _device_states(engine: OptimizerUnderConstruction) -> DeviceStates | None:
    """The GPU tier's states and their update (``optimizer/device_states.py``), logged once."""
    indices = engine.placement.device_indices
    if not indices:
        return None
    nbytes = sum(engine.placement.device_bytes().values())
    device_states = DeviceStates(engine.runtime, engine.states, indices, engine.config.options.device_state, nbytes)
    blocks = [str(index) for index in indices if index != engine._resident_index]
    # A state with nothing trained is never one of them (state/placement.py: device_candidates).
    named = (["the resident state"] if engine._resident_index in indices else []) + (
        [f"blocks {', '.join(blocks)}"] if blocks else []
    )
    logger.info(
        "megatrain: device_state %r: %s on the device (%d of %d elements, %.1f MiB), updated there",
        engine.config.options.device_state,
        " and ".join(named),
        device_states.numel,
        sum(state.layout.numel for state in engine.states),
        nbytes / 2**20,
    )
    return device_states


def _finish_can_pipeline(engine: OptimizerUnderConstruction) -> bool:
    """Whether this configuration's update can run behind the next forward with every
    state on the CPU (optimizer/pipelined_finish.py: [Note: pipelined finish])."""
    why_not = refusal(
        holds_gradients=engine.config.holds_gradients,
        data_parallel=engine.data_parallel is not None,
        nvme_tier=engine.nvme_tier is not None,
        on_host_only=True,
    )
    return why_not is None


def _open_rank_tier(engine: OptimizerUnderConstruction) -> None:
    """With data parallel: this rank's NVMe tier, of its window of each block's Adam m and
    v (state/nvme_tier.py). The rank alone steps its windows, so their moments never
    need to be seen by the node's other ranks: each rank's swap files are its own, on
    its node's disk, and only its windows' share of host memory is a window slot. The
    masters stay in the node's shared host memory, which the gather after each step
    updates -- or with the weights on the tier (gathered states) the tier holds the
    windows' masters too, and no rank holds any block whole. An empty window (a state
    smaller than the ranks' windows) has nothing on the tier."""
    blocks = engine.optimizer_states[: engine._resident_index]
    tier = engine.placement.tier
    assert tier is not None and tier.numels == tuple(w.layout.numel for w in blocks if is_on_tier(w))
    gathered = "master" in tier.kinds  # the windows' masters are on the tier alone
    options = engine.config.options
    engine.nvme_tier = open_nvme_tier(tier.numels, tier.kinds, engine.runtime, options, tier.frozen_bytes)
    for state, window in zip(engine.states, blocks):
        if is_on_tier(window):
            # With the master: written to the file, its buffer freed; the frozen weights'
            # window (gathered weights) to a read-only file of its own (state/frozen_files.py).
            engine.nvme_tier.adopt(window)
        else:  # no placeholder left to trip over: nothing to step, nothing to save
            window.bind({"exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0)})
            if window.frozen is not None:
                window.release(["frozen"])
        if gathered:
            state.bind({"master": window.master})  # the state's own reference goes too: on disk only
            if window.frozen is not None:
                state.bind({"frozen": window.frozen})
