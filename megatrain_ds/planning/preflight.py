"""Preflight: the memory a run needs, checked before the engine allocates anything.

A run that does not fit should fail in the first second with the numbers, not in the
OOM killer halfway through migrating a 70B model. :func:`estimate` computes, from the
model's parameter shapes and the config alone, every persistent allocation the engine
makes as it is built (``engine_build.py``; flat layouts are pure bookkeeping, so the figures are
exact to the byte, page rounding included). Where each flat state's buffers live, and how
big they are, is the engine's own :class:`~megatrain_ds.state.placement.Placement`, built
here from the same shapes (``tests/test_placement.py`` checks the two agree):

- host: per block and for the resident parameters, the master, the compute-dtype shadow,
  Adam m and v, the gradient buffer (fp32 when accumulating, else compute dtype, only
  with clipping or accumulation), plus the gradient staging buffers; in one process with
  no NVMe tier, frozen parameters count for their weights alone (``state/host_store.py``:
  [Note: frozen weights]); on a CPU-only
  machine blocks compute on their host buffers in place and gradients are consumed where
  they are (no weight buffers, no staging). Migration frees the
  model's current host weights as it goes, so they count as available.
- the NVMe tier (``nvme_offload``): the blocks' state it holds leaves host memory for swap
  files (``disk``), a window of blocks stays (``nvme_window``), and with the weights on
  the tier the weight window too (``nvme_weights``, ``state/nvme_weights.py``).
- device (CUDA): the streamed weight buffers and the resident parameters' compute copy.
- pinned: with CUDA and ``pin_memory`` every host buffer above is page-locked.

Activations and activation checkpoints depend on the batch and are not included.
:func:`check` compares the estimate with :func:`available_memory` (``MemAvailable``, a
cgroup limit when lower, ``cudaMemGetInfo``) and, when it does not fit, raises
:class:`InsufficientMemoryError` listing the numbers and the settings that would fit.
Tests inject the available numbers (``available=``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatrain_ds.config import NVME_OFFLOAD_LEVELS, EngineConfig
from megatrain_ds.distributed.gathered_weights import gather_buffer_elements
from megatrain_ds.model.block_discovery import find_blocks
from megatrain_ds.optimizer.facade import group_index_of
from megatrain_ds.optimizer.journal import choose_journal_extents
from megatrain_ds.runtime.device_runtime import PAGE_BYTES, free_device_bytes
from megatrain_ds.state.host_store import SpanOf
from megatrain_ds.state.placement import Placement, StateShape, Topology, flat_state_params, state_shapes
from megatrain_ds.state.swap_directory import check_free_space

logger = logging.getLogger(__name__)

GIB = float(1 << 30)


class InsufficientMemoryError(MemoryError):
    """The run cannot fit in this machine's memory; the message says what would."""


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a run allocates, by kind, and what migration frees on the way."""

    host: dict[str, int]
    device: dict[str, int]
    host_freed: int = 0
    """Bytes of the model's current host weights that migration frees."""
    pinned: int = 0
    """Host bytes page-locked (CUDA with ``pin_memory``)."""
    disk: int = 0
    """Bytes of swap files under ``nvme_path`` (the NVMe tier)."""

    @property
    def host_total(self) -> int:
        return max(sum(self.host.values()) - self.host_freed, 0)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())


@dataclass(frozen=True)
class AvailableMemory:
    host: int
    host_source: str = "MemAvailable"
    device: int | None = None
    """Free device bytes; ``None`` without CUDA."""
    memlock: int | None = None
    """``ulimit -l`` (soft RLIMIT_MEMLOCK) in bytes; ``None`` when unlimited."""


@dataclass(frozen=True)
class _Shapes:
    """What the estimate needs of a model: its flat states' shapes and what migration frees."""

    states: list[StateShape]
    """The blocks' flat states, then the resident state's (``state/placement.py``)."""
    host_freed: int
    device_freed: int

    @property
    def block_numels(self) -> list[int]:
        return [state.numel for state in self.states[:-1]]

    @property
    def resident_numel(self) -> int:
        return self.states[-1].numel


def _host_buffer(numel: int, itemsize: int) -> int:
    return numel * itemsize + PAGE_BYTES  # host_empty over-allocates one page to align


def _shapes(model: nn.Module, config: EngineConfig, optimizer: torch.optim.Optimizer) -> _Shapes:
    _, blocks = find_blocks(model, config.options.block_path)
    group_of = group_index_of(model, optimizer)
    states = flat_state_params(model, blocks)
    freed = {"cpu": 0, "cuda": 0}
    seen: set[int] = set()
    for param in model.parameters():
        if param.is_meta:
            continue
        storage = param.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        freed["cuda" if param.device.type == "cuda" else "cpu"] += storage.nbytes()
    return _Shapes(state_shapes(states, group_of, config.compute_dtype), freed["cpu"], freed["cuda"])


def topology_of(span_of: SpanOf | None, tier_ranks: int | None) -> Topology:
    """The topology a plan given only ``span_of`` and ``tier_ranks`` assumes: data parallel
    where either is given (a node of one rank where only ``span_of`` is), this node's ranks'
    windows equal parts of its span (the engine passes them exactly: ``DataParallel.topology``)."""
    node_ranks = tier_ranks if tier_ranks is not None else (1 if span_of is not None else None)
    return Topology(node_ranks=node_ranks, span_of=span_of)


def estimate_from_shapes(
    shapes: _Shapes,
    config: EngineConfig,
    device_type: str,
    staging_chunk: int,
    topology: Topology | None = None,
) -> MemoryNeed:
    """The allocations of the engine's build (``engine_build.py``) for these flat sizes (see module doc),
    this node's: where each buffer lives is the :class:`Placement`'s (``state/placement.py``),
    the engine's own.

    ``topology``: the processes sharing the state (``DataParallel.topology``, or a plan's
    from :func:`topology_of`); ``None``: one process."""
    options = config.options
    master = torch.empty((), dtype=config.master_dtype).element_size()
    compute = torch.empty((), dtype=config.compute_dtype).element_size()
    with_shadow = config.compute_dtype != config.master_dtype
    streamed = compute if with_shadow else master
    numels = [*shapes.block_numels, shapes.resident_numel]
    nvme = options.nvme_offload if options.nvme_offload != "auto" else "none"
    placement = Placement.of(config, nvme, topology or Topology(), shapes.states)
    host = {
        "master": sum(_host_buffer(n, master) for n in placement.node_host_buffers("master")),
        "adam_m_v": sum(2 * _host_buffer(n, 4) for n in placement.node_host_buffers("exp_avg")),
    }
    disk = sum(tier.disk_bytes for tier in placement.node_tiers)
    if placement.tier is not None:
        host["nvme_window"] = sum(tier.window_bytes for tier in placement.node_tiers)
    if placement.weights_on_tier:
        host["nvme_weights"] = _weight_window_need(placement, config)
    if with_shadow:
        host["shadow"] = sum(_host_buffer(n, compute) for n in placement.node_host_buffers("shadow"))
    # Frozen weights not in the compute dtype kept apart, exact, beside a cut fp32 master.
    if frozen := placement.node_host_buffers("frozen"):
        host["frozen"] = sum(_host_buffer(n, master) for n in frozen)
    if config.holds_gradients:
        grad = torch.empty((), dtype=config.held_gradient_dtype).element_size()
        host["gradients"] = sum(_host_buffer(n, grad) for n in placement.node_host_buffers("grad"))
        # The speculative-step journal, chosen by the engine's rule (optimizer/journal.py).
        per_element = master + 8 + (compute if with_shadow else 0)
        extents = choose_journal_extents(_journaled(shapes), per_element, sum(numels), options.speculative_blocks)
        if extents:
            host["journal"] = per_element * sum(extent.numel for extent in extents)
    largest = max(shapes.block_numels)
    if device_type == "cuda":  # on the CPU gradients are consumed where they are (gradients/sink.py)
        host["staging"] = options.num_staging_buffers * _host_buffer(min(largest, staging_chunk), compute)
    slots = (options.num_buffers + options.checkpoint_interval - 1) * largest * streamed
    device: dict[str, int] = {}
    if device_type == "cuda":
        device = {"weight_buffers": slots, "resident_copy": shapes.resident_numel * streamed}
    else:
        # The CPU is its own device: blocks and resident parameters are computed on in place
        # (streaming/weight_streamer.py: [Note: the host as the device]), so no weight buffer is allocated.
        host["weight_buffers"] = 0
    on_device = sum(placement.device_bytes().values())  # the GPU tier (state/placement.py)
    if on_device:  # on the CPU the device is the host: there its states take host memory
        (device if device_type == "cuda" else host)["device_state"] = on_device
    pinned = sum(host.values()) if device_type == "cuda" and options.pin_memory else 0
    return MemoryNeed(host=host, device=device, host_freed=shapes.host_freed, pinned=pinned, disk=disk)


def _journaled(shapes: _Shapes) -> list[int]:
    """Each block's elements a journal slot holds: its trained prefix (frozen elements are
    never stepped, so never journaled; ``optimizer/journal.py``)."""
    return [state.trained_numel for state in shapes.states[:-1]]


def _weight_window_need(placement: Placement, config: EngineConfig) -> int:
    """With the weights on the tier: the node's weight windows (``state/nvme_weights.py``),
    and with data parallel each rank's whole blocks gathered from the windows, one more than
    its streamer's slots, and the buffer its windows are sent from (``GatheredWeights``,
    sized by the same :func:`gather_buffer_elements`)."""
    options = config.options
    need = placement.weight_window_bytes(options.num_buffers, options.checkpoint_interval)
    topology = placement.topology
    if topology.data_parallel:
        slots = options.num_buffers + options.checkpoint_interval - 1
        ranks = topology.node_ranks or 1
        parts = [(state.stepped_numel, state.frozen_numel) for state in placement.blocks]
        whole, sent = gather_buffer_elements(parts, topology.world_size or ranks)
        need += ranks * ((slots + 1) * whole + sent) * placement.compute_itemsize
    return need


def available_memory(device: torch.device) -> AvailableMemory:
    """What this machine (and its cgroup) has free now."""
    host, source = _meminfo_available(), "MemAvailable"
    limit = _cgroup_room()
    if limit is not None and limit < host:
        host, source = limit, "the cgroup memory limit"
    free_device = free_device_bytes(device)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return AvailableMemory(
        host=host, host_source=source, device=free_device, memlock=None if soft == resource.RLIM_INFINITY else soft
    )


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1), if limited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return max(int(limit) - usage, 0)
    return None


# Settings that reduce memory, most to least faithful to the user's run; each maps an
# engine config to a changed one (or None when it does not apply). Combinations are
# applied in this order, so one that opens another (accumulation 1 lets clipping go
# without keeping gradients) comes first.
_ALTERNATIVES: list[tuple[str, Callable[[EngineConfig], EngineConfig | None]]] = [
    (
        '"megatrain": {"num_staging_buffers": 1}',
        lambda c: _options(c, num_staging_buffers=1) if c.options.num_staging_buffers > 1 else None,
    ),
    (
        '"megatrain": {"num_buffers": 2, "checkpoint_interval": 1}',
        lambda c: (
            _options(c, num_buffers=2, checkpoint_interval=1)
            if c.options.num_buffers + c.options.checkpoint_interval > 3
            else None
        ),
    ),
    (
        '"gradient_accumulation_steps": 1 with a larger micro-batch (no fp32 gradient accumulator)',
        lambda c: dataclasses.replace(c, gradient_accumulation_steps=1) if c.gradient_accumulation_steps > 1 else None,
    ),
    (
        '"gradient_clipping": 0 (gradients are then applied as they arrive, never held)',
        lambda c: (
            dataclasses.replace(c, gradient_clipping=0.0)
            if c.gradient_clipping > 0 and c.gradient_accumulation_steps == 1
            else None
        ),
    ),
    (
        '"bf16": {"enabled": true} (bf16 compute: half-size streamed weights and gradients)',
        lambda c: dataclasses.replace(c, bf16=True) if not c.bf16 else None,
    ),
    (
        '"megatrain": {"nvme_offload": "optimizer", "nvme_path": "/local_nvme/..."} (Adam m and v, and '
        "with bf16 compute the fp32 master, in swap files on a local disk: 8 or 12 bytes/param less host memory)",
        lambda c: (
            _options(c, nvme_offload="optimizer", nvme_path=c.options.nvme_path or "/")
            if c.options.nvme_offload in ("none", "auto")
            else None
        ),
    ),
    (
        '"megatrain": {"nvme_offload": "all", "nvme_path": "/local_nvme/..."} (the weights too: only '
        "held gradients and a window of blocks stay in host memory; forward and backward read the disk)",
        lambda c: (
            _options(c, nvme_offload="all", nvme_path=c.options.nvme_path or "/")
            if c.options.nvme_offload != "all"
            else None
        ),
    ),
    (
        '"megatrain": {"master_dtype": "bf16"} (rounds small updates away: a last resort)',
        lambda c: _options(c, master_dtype="bf16") if c.options.master_dtype != "bf16" else None,
    ),
]


def _options(config: EngineConfig, **changes: Any) -> EngineConfig:
    return dataclasses.replace(config, options=dataclasses.replace(config.options, **changes))


def format_bytes(nbytes: float) -> str:
    """``12.34 GiB``, or MiB below a GiB (the messages of this module)."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def check(
    need_of: Callable[[EngineConfig], MemoryNeed], config: EngineConfig, available: AvailableMemory
) -> MemoryNeed:
    """Raise :class:`InsufficientMemoryError` when ``need_of(config)`` does not fit, naming what
    is short and the settings that would fit (:func:`_advice`)."""
    need = need_of(config)
    if need.pinned and available.memlock is not None and need.pinned > available.memlock:
        # The NVIDIA driver pins cudaHostRegister'ed pages without charging RLIMIT_MEMLOCK,
        # so this is a hint for when registration fails, not a reason to stop.
        logger.warning(
            "megatrain preflight: %s of host memory will be pinned but ulimit -l is %s; "
            "if pinning fails, raise it (ulimit -l unlimited) or set "
            '"megatrain": {"pin_memory": false}',
            format_bytes(need.pinned),
            format_bytes(available.memlock),
        )
    shortfalls = _shortfalls(need, available)
    if not shortfalls:
        if need.host_total > 0.9 * available.host:
            logger.warning(
                "megatrain preflight: the run needs %s of the %s of host memory available; activations come on top",
                format_bytes(need.host_total),
                format_bytes(available.host),
            )
        return need
    raise InsufficientMemoryError(
        "megatrain preflight: the run does not fit\n  "
        + "\n  ".join(shortfalls)
        + "\n"
        + _advice(need_of, config, available)
        + "\n(activations come on top; "
        '"megatrain": {"preflight": false} skips this check)'
    )


def _shortfalls(need: MemoryNeed, available: AvailableMemory) -> list[str]:
    """A line for each memory ``need`` does not fit in (host, device): what it needs, by
    buffer, what is available and how much is missing; none when it fits."""
    problems = []
    if need.host_total > available.host:
        problems.append(("host", need.host_total, available.host, available.host_source))
    if available.device is not None and need.device_total > available.device:
        problems.append(("device", need.device_total, available.device, "free device memory"))
    lines = []
    for kind, needed, have, source in problems:
        items = need.host if kind == "host" else need.device
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in items.items())
        freed = (
            f" minus {format_bytes(need.host_freed)} of the model's weights that migration frees"
            if kind == "host" and need.host_freed
            else ""
        )
        lines.append(
            f"{kind} memory: needs {format_bytes(needed)} ({parts}{freed}), {format_bytes(have)} available "
            f"({source}); short by {format_bytes(needed - have)}"
        )
    return lines


def _advice(need_of: Callable[[EngineConfig], MemoryNeed], config: EngineConfig, available: AvailableMemory) -> str:
    """The settings of :data:`_ALTERNATIVES` that would make a run that does not fit fit: each
    one that does on its own, else the fewest that do together, else that none does."""

    def fits(candidate: EngineConfig) -> MemoryNeed | None:
        other = need_of(candidate)
        if other.host_total <= available.host and (available.device is None or other.device_total <= available.device):
            return other
        return None

    def needs(other: MemoryNeed) -> str:
        return f"needs {format_bytes(other.host_total)} host" + (
            f", {format_bytes(other.device_total)} device" if available.device is not None else ""
        )

    fixes = []
    for description, change in _ALTERNATIVES:
        changed = change(config)
        if changed is not None and (other := fits(changed)) is not None:
            fixes.append(f"  {description}: {needs(other)}")
    if fixes:
        return "settings that would fit, each on its own:\n" + "\n".join(fixes)
    for size in range(2, len(_ALTERNATIVES) + 1):  # the fewest changes first
        for combination in itertools.combinations(_ALTERNATIVES, size):
            combined: EngineConfig | None = config
            for _, change in combination:
                combined = change(combined) if combined is not None else None
            if combined is not None and (result := fits(combined)) is not None:
                applied = [description for description, _ in combination]
                return (
                    "no single setting fits; these together would:\n"
                    + "\n".join(f"  {d}" for d in applied)
                    + f"\n  ({needs(result)})"
                )
    return "no combination of settings makes it fit: use a machine with more memory or a smaller model"


@dataclass(frozen=True)
class PreflightInputs:
    """The run :func:`preflight` and :func:`wants_nvme_tier` plan for, as the engine is about
    to build it (``engine_build.py`` makes one, before anything is allocated)."""

    model: nn.Module
    config: EngineConfig
    optimizer: torch.optim.Optimizer
    """The client optimizer facade: its groups say which parameters are trained."""
    device: torch.device
    """Where the blocks compute: CUDA counts device buffers, host staging and pinning."""
    staging_chunk: int
    """The most elements of a gradient staged to the host at once (the engine's ``STAGING_CHUNK_ELEMENTS``)."""
    topology: Topology | None = None
    """The processes sharing the state (``DataParallel.topology``); ``None``: one process
    (:func:`topology_of` makes one from a span and a rank count)."""


def preflight(run: PreflightInputs, available: AvailableMemory | None = None, nvme: str | None = None) -> MemoryNeed:
    """Check that ``run`` fits before anything is allocated; returns the estimate.

    ``available``: the memory to fit in (default: :func:`available_memory` of the device).
    ``nvme``: what the NVMe tier holds, "none", "optimizer" or "all" (default:
    ``nvme_offload`` resolved by :func:`wants_nvme_tier`); its swap files must fit in the
    free space under ``nvme_path`` (``DiskSpaceError`` naming the path and the bytes).
    """
    config, device, staging_chunk, topology = run.config, run.device, run.staging_chunk, run.topology
    shapes = _shapes(run.model, config, run.optimizer)
    have = available if available is not None else available_memory(device)
    if have.device is not None and shapes.device_freed:
        have = dataclasses.replace(have, device=have.device + shapes.device_freed)
    if nvme is None:
        nvme = _wants_nvme(shapes, config, device, staging_chunk, have, topology or Topology())
    config = _options(config, nvme_offload=nvme)
    need = check(
        lambda c: estimate_from_shapes(shapes, c, device.type, staging_chunk, topology=topology),
        config,
        have,
    )
    if need.disk:
        check_free_space(config.options.nvme_path or "", need.disk)
    return need


def wants_nvme_tier(run: PreflightInputs, available: AvailableMemory | None = None) -> str:
    """``nvme_offload`` resolved to "none", "optimizer" or "all": "auto" is the least of them
    with which the run's host state (this node's share of it, with several nodes) fits in
    the available host memory ("all" when none does); "optimizer" is "none" where no block
    has a trained weight (:func:`_optimizer_tier_or_none`)."""
    config = run.config
    if config.options.nvme_offload in ("none", "all"):
        return config.options.nvme_offload
    return _wants_nvme(
        _shapes(run.model, config, run.optimizer),
        config,
        run.device,
        run.staging_chunk,
        available if available is not None else available_memory(run.device),
        run.topology or Topology(),
    )


def _wants_nvme(
    shapes: _Shapes,
    config: EngineConfig,
    device: torch.device,
    staging_chunk: int,
    have: AvailableMemory,
    topology: Topology,
) -> str:
    if config.options.nvme_offload == "optimizer":
        return _optimizer_tier_or_none(shapes)
    if config.options.nvme_offload != "auto":
        return config.options.nvme_offload
    levels = NVME_OFFLOAD_LEVELS
    needs = {
        level: estimate_from_shapes(
            shapes, _options(config, nvme_offload=level), device.type, staging_chunk, topology=topology
        ).host_total
        for level in levels
    }
    level = next((level for level in levels if needs[level] <= have.host), levels[-1])
    where = {
        "none": "nothing goes to NVMe",
        "optimizer": "the optimizer state goes to NVMe",
        "all": "the blocks' weights and optimizer state go to NVMe",
    }[level]
    logger.info(
        'megatrain: nvme_offload "auto": %s (host state with nvme_offload %s: %s; available %s)',
        where,
        " / ".join(levels),
        " / ".join(format_bytes(needs[n]) for n in levels),
        format_bytes(have.host),
    )
    return level


def _optimizer_tier_or_none(shapes: _Shapes) -> str:
    """``"optimizer"``, or ``"none"`` where that tier would hold nothing: it holds the blocks'
    optimizer state, which covers their trained prefixes alone (frozen weights have none:
    ``state/host_store.py``, [Note: frozen weights]), so a run in which no block has a
    trained weight -- an engine built without an optimizer, for evaluation only
    (``optimizer/facade.py``: [Note: evaluation-only engines]), or every block frozen -- would
    open swap directories, files of no byte and I/O threads for nothing. The host memory is
    the same either way (each frozen weight held once, where it is held without a tier), so
    the level resolves to ``"none"``, logged. Refusing instead would stop the HF Trainer's
    ``evaluate()`` before ``train()`` on a config that trains with the optimizer on NVMe."""
    if any(state.trained_numel for state in shapes.states[:-1]):
        return "optimizer"
    logger.info(
        'megatrain: nvme_offload "optimizer": no block has a trained weight (no optimizer, or '
        "every block frozen), so there is no optimizer state to put on NVMe: nothing goes there"
    )
    return "none"
