"""The trained weights whole, as the optimizer holds them, wherever they live: what ``state_dict()`` reports.

The engine answers every way of taking the model's weights -- ``model.state_dict()``,
``save_pretrained``, Accelerate's ``get_state_dict``, DeepSpeed's
``_zero3_consolidated_16bit_state_dict`` and ``save_16bit_model`` -- with one value per
parameter: its master, the weights the optimizer updates (fp32 unless
``megatrain.master_dtype`` says otherwise), for every placement of the state. The
engine's state-dict hook (``engine.py``) puts these in place of the parameters' values.

[Note: one answer from state_dict]
Where each state's master is (the engine's ``Placement``, ``state/placement.py``: its
``master.where``), and what taking it costs:

- Host memory, whole (no NVMe tier; ``"optimizer"`` with fp32 compute, or with data
  parallel on one node, which keeps only Adam's moments on the tier; data parallel on one
  node without the tier): the parameters are views of the master. The state dict holds
  those views: no copy, no collective.
- The NVMe tier, one process, with bf16/fp16 compute (``"optimizer"``, where the tier takes
  the master too) or with the weights on it (``"all"``): the parameters view the
  compute-dtype shadow, or are meta tensors. The masters are read from the swap files
  (``NvmeTier.file_views``) and copied: no collective.
- The weights on the NVMe tier with data parallel (gathered states): each rank holds its
  window of the master on its own tier. Each block's master is gathered whole from every
  rank's window (``GatheredWeights.whole``, an all-gather over the gather group), then its
  frozen weights kept apart, from every rank's window of them as its tier's file holds them,
  exact in their dtype (``GatheredWeights.whole_frozen``).
- Frozen weights kept apart in host memory beside a cut master (fp32 ones under bf16
  compute: ``state/placement.py``, [Note: the placement model]) are whole and live there:
  the state dict holds views of them, whatever else of the state is read or gathered.
- Several nodes with bf16/fp16 compute (``Where.NODE_SPAN``): each node
  holds its span of the master, the parameters view the whole shadow. Every node's span is
  broadcast by its leader to every rank (``DataParallel.gather_spans_to_every_rank_``,
  over the control group).

The last two are collectives: every rank must take the state dict, and takes the states
in the same order (block order, then the resident state), so the n-th gather of every
rank is the same state's. :func:`state_dict_is_collective` says whether a run is one of
them (``Placement.masters_split``); :func:`join_state_dict_collectives` runs a rank's part without keeping anything (a
rank that writes nothing, in ``save_16bit_model``).
Before anything is read from the tier or sent, the gradient worker is drained, the device
synchronised and, with data parallel, every rank waits at a barrier (``checkpointed_engine.quiesce``,
as for a checkpoint): no update is in flight on any rank while the masters are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from megatrain_ds.checkpoint.checkpointed_engine import quiesce
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.gradients.sink import GradientPort
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.stream_check import declare_access
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.state.placement import Placement
from megatrain_ds.state.state_placement import Where

OnTier = Callable[[HostFlatState], "dict[str, torch.Tensor] | None"]


class MasterHolder(Protocol):
    """What taking the masters reads of the engine (``MegatrainEngine``; this module sits below it)."""

    placement: Placement
    """Where each state's master lives: what every branch below asks."""
    states: list[HostFlatState]
    """One flat state per block, in block order, then the resident parameters' state."""
    optimizer_states: list[HostFlatState]
    """This rank's window of each state: what its NVMe tier holds with data parallel."""
    nvme_tier: NvmeTier | None
    gathered_weights: GatheredWeights | None
    data_parallel: DataParallel | None
    sink: GradientPort
    runtime: DeviceRuntime


def state_dict_is_collective(engine: MasterHolder) -> bool:
    """Whether taking the masters runs collectives (see [Note: one answer from state_dict]):
    then every rank must take them, in the same order."""
    return engine.placement.masters_split


def masters_by_param(engine: MasterHolder) -> dict[int, torch.Tensor]:
    """``id(param) -> its master`` for every parameter of the engine's states (views of the
    live host masters where they are whole in host memory, else copies). Collective where
    :func:`state_dict_is_collective`: every rank calls it."""
    masters: dict[int, torch.Tensor] = {}
    for state, whole, frozen in _whole_masters(engine):
        for slot, param in zip(state.layout.slots, state.params):
            # A frozen weight past a trained prefix has no master: it is held once, in its own
            # dtype, in the streamed buffer or apart on the NVMe tier (``host_store.py``:
            # [Note: frozen weights]), and that is its value.
            apart = frozen if frozen is not None else state.streamed
            masters[id(param)] = state.slot_of(slot, whole if slot.offset + slot.numel <= whole.numel() else apart)
    return masters


def join_state_dict_collectives(engine: MasterHolder) -> None:
    """This rank's part of the collectives of :func:`masters_by_param`, keeping nothing (one
    state's master at a time): for a rank whose state dict nobody uses. A no-op where none
    is collective."""
    if not state_dict_is_collective(engine):
        return
    for _ in _whole_masters(engine):
        pass


def _whole_masters(engine: MasterHolder) -> Iterator[tuple[HostFlatState, torch.Tensor, torch.Tensor | None]]:
    """``(state, its whole master, its frozen weights held apart or None)`` for every state
    in order: block order, then the resident state (every rank the same)."""
    if all(_master_is_live(engine, index) for index in range(len(engine.states))):
        for state in engine.states:  # nothing to read or send
            yield state, state.master, state.frozen
        return
    # Sync: the gradient worker may still be stepping blocks (on the tier too); nothing is
    # read or sent while an update is in flight on any rank. With data parallel only
    # gathered or sharded masters lead here, so every rank comes to this barrier.
    quiesce(engine, "the state_dict barrier")
    with contextlib.ExitStack() as stack:
        on_tier: OnTier | None = None
        if engine.nvme_tier is not None:
            on_tier = stack.enter_context(engine.nvme_tier.file_views())
        for index, state in enumerate(engine.states):
            yield state, _whole_master(engine, index, on_tier), _frozen_apart(engine, index, on_tier)


def _frozen_apart(engine: MasterHolder, index: int, on_tier: OnTier | None) -> torch.Tensor | None:
    """State ``index``'s frozen weights held apart, all of them (a new tensor unless they are
    in host memory here); ``None`` where they are not apart."""
    state = engine.states[index]
    if state.frozen is None:
        return None
    if engine.placement.states[index].frozen.where.on_host:  # beside a shadow: live, whole, exact
        return state.frozen
    if engine.placement.states[index].gathered:  # every rank's window of them gathered (collective)
        assert engine.gathered_weights is not None and on_tier is not None  # gathered states are on the tier
        window = engine.optimizer_states[index]
        mapped = on_tier(window)  # None: this rank's windows of the block are on no tier
        mine = mapped["frozen"] if mapped is not None and "frozen" in mapped else window.frozen
        assert mine is not None, "gathered frozen weights apart: every rank has its window of them"
        return engine.gathered_weights.whole_frozen(index, mine)
    mapped = on_tier(state) if on_tier is not None else None
    return mapped["frozen"].clone() if mapped is not None else state.frozen  # the mapping goes with file_views


def _master_is_live(engine: MasterHolder, index: int) -> bool:
    """Whether state ``index``'s master is its whole master, current, in this process's host
    memory: where the placement puts it there, or on the NVMe tier once the tier has given
    the masters back for good (``engine.destroy()``: ``NvmeTier.close`` maps them, and the
    parameters view them). A block on the tier that is bound to a window slot has a master
    in host memory that the tier may take back: not live."""
    where = engine.placement.states[index].master.where
    tier = engine.nvme_tier
    if where is Where.TIER and tier is not None and tier.closed:
        return not engine.states[index].master.is_meta  # meta: the tier failed before handing it back
    return engine.placement.states[index].master_in_host_memory


def _whole_master(engine: MasterHolder, index: int, on_tier: OnTier | None) -> torch.Tensor:
    """State ``index``'s whole master, from wherever its placement puts it (a new tensor
    unless it is live here)."""
    state, where = engine.states[index], engine.placement.states[index].master.where
    if _master_is_live(engine, index):
        return state.master
    if where is Where.TIER_WINDOW:  # this rank's window on its tier: every rank's gathered
        assert engine.gathered_weights is not None and on_tier is not None  # gathered states are on the tier
        window = on_tier(engine.optimizer_states[index])  # None: this rank's window is empty
        mine = window["master"] if window is not None else torch.zeros(0, dtype=torch.float32)
        return engine.gathered_weights.whole(index, mine)
    if where is Where.NODE_SPAN:  # this node's span: every node's broadcast to every rank
        dp = engine.data_parallel
        assert dp is not None  # only several nodes shard the master
        first, last = state.master_held
        whole = torch.empty(state.stepped_numel, dtype=state.master.dtype)  # frozen weights: in the shadow
        whole[first:last].copy_(state.master)
        # gloo writes the received spans unseen by aten; the race checker sees them here.
        declare_access(reads=[state.master], writes=[whole], what="the master gather for state_dict")
        dp.gather_spans_to_every_rank_(whole, f"the master gather of state {index} for state_dict")
        return whole
    if where is Where.DEVICE:  # the GPU tier (one process): a host copy, as every other master here
        # Settled: the engine waited for the device update before it asked (settle_optimizer).
        return state.master.to("cpu", copy=True)
    # One process, the master on the NVMe tier (the parameters view the shadow, or are meta).
    assert where is Where.TIER, (index, where)
    mapped = on_tier(state) if on_tier is not None else None
    assert mapped is not None and "master" in mapped, f"state {index}: its master is nowhere"
    return mapped["master"].clone()  # the mapping goes with file_views
