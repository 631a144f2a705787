"""What the engine holds in device and host memory, by kind: ``MegatrainEngine.device_bytes()``
and ``host_bytes()`` (the benchmarks and the memory tests read them)."""

from __future__ import annotations

from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.optimizer.journal import Journal
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.state.nvme_weights import NvmeWeights
from megatrain_ds.state.placement import Placement
from megatrain_ds.streaming.resident_params import ResidentParams
from megatrain_ds.streaming.streamed_blocks import StreamedBlocks
from megatrain_ds.streaming.weight_streamer import WeightStreamer


def device_bytes(
    resident: ResidentParams, streamer: WeightStreamer, blocks: StreamedBlocks, placement: Placement
) -> dict[str, int]:
    """Device memory the engine itself holds: weight buffers, peak checkpoints, the resident
    parameters' device copy (none where it is the host buffer itself, or where the placement
    keeps the resident state on the device, counted in ``device_state``) and the GPU tier."""
    copy = 0 if resident.aliases_host else resident.device_flat.numel() * resident.device_flat.element_size()
    return {
        "weight_buffers": streamer.device_bytes,
        "checkpoints_peak": blocks.peak_checkpoint_bytes,
        "resident": 0 if placement.resident.on_device else copy,
        "device_state": sum(placement.device_bytes().values()),  # the GPU tier (state/placement.py)
    }


def host_bytes(
    placement: Placement,
    journal: Journal,
    nvme_tier: NvmeTier | None,
    nvme_weights: NvmeWeights | GatheredWeights | None,
) -> dict[str, int]:
    """Host memory of the persistent training state, by kind: the flat states' buffers where
    the placement puts them in host memory (``state/placement.py``; a block bound to a slot of
    the NVMe window views the slot, counted in ``nvme_window``), the speculation's journal, the
    NVMe tier's windows, and the weights' NVMe window (with data parallel, the gathered
    weights, of which that window is part)."""
    totals = placement.host_bytes()
    if journal.nbytes:
        totals["journal"] = journal.nbytes
    if nvme_tier is not None:
        totals["nvme_window"] = nvme_tier.window_bytes
    if nvme_weights is not None:
        totals["nvme_weights"] = nvme_weights.nbytes
    return totals
