"""What an engine actually allocated, against what its ``Placement`` (``state/placement.py``) says.

Shared by ``tests/test_placement.py`` (one process, every combination in-process),
``tests/data_parallel_worker.py`` and ``tests/entry_points_worker.py`` (each rank of the
multi-rank launches checks its own, and where a node has several ranks reports its share,
:func:`node_share`, which the test adds up with :func:`node_preflight_disagreements`);
:func:`planned_state` plans one state for the tests that build states themselves.
The actual side is read from the engine's tensors, not from the placement or
``engine.host_bytes()`` (which now derives from the placement): each flat state's buffers as
they are after construction, a buffer the NVMe tier holds being a meta placeholder. Which
elements a state's buffers hold (trained prefix, node span, frozen weights in the shadow or
apart) the state reads from the placement it was built with (``HostFlatState.placement``),
so that agrees by construction once that placement is the engine's; the sizes of the
buffers allocated are what can still differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from megatrain_ds import MegatrainEngine
from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
from megatrain_ds.planning.planner import ModelShape, RunSettings, gpu_bytes, host_bytes
from megatrain_ds.planning.preflight import MemoryNeed, _Shapes, estimate_from_shapes
from megatrain_ds.runtime.device_runtime import PAGE_BYTES
from megatrain_ds.state.flat_layout import FROZEN_GROUP
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.placement import ElementSizes, Placement, StateShape, TierSettings, Topology, state_shapes
from megatrain_ds.state.state_placement import BUFFERS, StatePlacement, Where


def planned_state(
    named: Sequence[tuple[str, nn.Parameter]],
    group_of: dict[nn.Parameter, int],
    dtypes: tuple[torch.dtype, torch.dtype],
    topology: Topology | None = None,
    nvme: str = "none",
    grad_itemsize: int | None = None,
) -> StatePlacement:
    """The placement an engine gives a block of these parameters (``dtypes``: the master's
    and the compute dtype; one process unless ``topology`` says otherwise; gradients held
    in ``grad_itemsize`` bytes, or not): what ``migrate_to_host`` and a hand-built
    ``HostFlatState`` take."""
    master, compute = dtypes
    sizes = ElementSizes(master.itemsize, compute.itemsize, grad_itemsize, compute != master)
    shapes = state_shapes([named, []], group_of, compute)  # the block, then an empty resident state
    return Placement.of_sizes(sizes, TierSettings(), nvme, topology or Topology(), shapes).states[0]


def allocated_host_tensors(engine: MegatrainEngine) -> dict[str, list[int]]:
    """Bytes of every host tensor of the flat states, by buffer name, state by state (a
    meta placeholder, or a buffer of a block bound to the tier's window, is not host memory)."""
    tier = engine.nvme_tier
    found: dict[str, list[int]] = {name: [] for name in BUFFERS}
    for state in engine.states:
        on_tier = tier.kinds if tier is not None and tier.holds(state) else ()
        for name in BUFFERS:
            tensor = getattr(state, name)
            if state.placement.buffers()[name].where.on_device:
                continue  # the GPU tier's: allocated_device_tensors
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and name not in on_tier:
                found[name].append(tensor.numel() * tensor.element_size())
    return found


def allocated_device_tensors(engine: MegatrainEngine) -> dict[str, list[int]]:
    """Bytes of every tensor of the states the GPU tier keeps on the device, by buffer name
    (on the CPU the device is the host: told apart by the placement the state was built on,
    and checked to be on the engine's device)."""
    found: dict[str, list[int]] = {name: [] for name in BUFFERS}
    for state in engine.states:
        for name in BUFFERS:
            tensor = getattr(state, name)
            if state.placement.buffers()[name].where.on_device and isinstance(tensor, torch.Tensor):
                assert tensor.device == engine.runtime.device, (name, tensor.device)
                found[name].append(tensor.numel() * tensor.element_size())
    return found


def placement_disagreements(engine: MegatrainEngine) -> list[str]:
    """Every way the engine's buffers differ from its placement: per state and buffer, in
    host memory or not and its elements; the NVMe tier's files, kinds and window; the
    weight window; the totals ``host_bytes()`` reports. Empty when they agree."""
    placement, problems = engine.placement, []
    tier = engine.nvme_tier
    for index, (state, planned) in enumerate(zip(engine.states, placement.states)):
        on_tier = tier.kinds if tier is not None and tier.holds(state) else ()
        if state.layout.numel != planned.numel:
            problems.append(f"state {index}: {state.layout.numel} elements, planned {planned.numel}")
        for name, buffer in planned.buffers().items():
            tensor = getattr(state, name)
            if buffer.where.on_device:
                sizes = (tensor.numel(), tensor.element_size()) if isinstance(tensor, torch.Tensor) else None
                if sizes != (buffer.numel, buffer.itemsize) or tensor.device != engine.runtime.device:
                    problems.append(f"state {index} {name}: {sizes} on the device, planned {buffer}")
                continue
            held = isinstance(tensor, torch.Tensor) and not tensor.is_meta and name not in on_tier
            if held != buffer.where.on_host:
                problems.append(f"state {index} {name}: in host memory {held}, planned {buffer.where}")
            elif held and (tensor.numel(), tensor.element_size()) != (buffer.numel, buffer.itemsize):
                actual = (tensor.numel(), tensor.element_size())
                problems.append(f"state {index} {name}: {actual}, planned {(buffer.numel, buffer.itemsize)}")
        if state.placement is not planned:  # what the state's views read which elements a buffer holds from
            problems.append(f"state {index}: built on {state.placement}, planned {planned}")
        frozen = state.frozen_for_tier  # the frozen weights apart on the tier: a placeholder of their size and dtype
        apart = (frozen.numel(), frozen.element_size(), frozen.is_meta) if frozen is not None else None
        if apart != ((planned.frozen.numel, planned.frozen.itemsize, True) if planned.frozen.where.on_tier else None):
            problems.append(f"state {index}: frozen weights apart {apart}, planned {planned.frozen}")
    actual = {name: sum(sizes) for name, sizes in allocated_host_tensors(engine).items() if sizes}
    if actual != placement.host_bytes():
        problems.append(f"host bytes {actual}, planned {placement.host_bytes()}")
    host = engine.host_bytes()
    if {name: host[name] for name in BUFFERS if name in host} != actual:
        problems.append(f"engine.host_bytes() {host}, allocated {actual}")
    on_device = {name: sum(sizes) for name, sizes in allocated_device_tensors(engine).items() if sizes}
    if on_device != placement.device_bytes():
        problems.append(f"device bytes {on_device}, planned {placement.device_bytes()}")
    if engine.device_bytes()["device_state"] != sum(on_device.values()):
        problems.append(f"engine.device_bytes() {engine.device_bytes()}, allocated on the device {on_device}")
    problems += _tier_disagreements(engine)
    return problems


def _tier_disagreements(engine: MegatrainEngine) -> list[str]:
    placement, tier = engine.placement, engine.nvme_tier
    planned = placement.tier
    if (tier is None) != (planned is None):
        return [f"NVMe tier {tier}, planned {planned}"]
    if tier is None or planned is None:
        return []
    problems = []
    if (tuple(tier.numels), tier.kinds) != (planned.numels, planned.kinds):
        problems.append(f"tier files {tier.numels} of {tier.kinds}, planned {planned.numels} of {planned.kinds}")
    if tier.io.alignment == planned.alignment:  # the I/O engine configured is the one that opened
        if (tier.directory.nbytes, tier.window_bytes) != (planned.disk_bytes, planned.window_bytes):
            problems.append(
                f"tier disk/window {tier.directory.nbytes}/{tier.window_bytes}, "
                f"planned {planned.disk_bytes}/{planned.window_bytes}"
            )
        if engine.nvme_weights is not None and engine.gathered_weights is None:
            options = engine.config.options
            window = placement.weight_window_bytes(options.num_buffers, options.checkpoint_interval)
            if window != engine.nvme_weights.nbytes:
                problems.append(f"weight window {engine.nvme_weights.nbytes}, planned {window}")
    if placement.blocks[0].streamed is Where.TIER and engine.nvme_weights is None:
        problems.append("weights planned on the tier, no weight window")
    return problems


def engine_preflight(engine: MegatrainEngine) -> MemoryNeed:
    """Preflight's estimate of ``engine``'s run, as the engine planned it (its topology and
    resolved NVMe level), from the flat states it built: each one's sizes and the dtype its
    frozen weights are held in, as they arrived (the module's parameters no longer say it
    after the build: the resident ones view their compute-dtype copy, a block's on the tier
    are meta). Preflight's own reading of a model, before the build, is what
    ``tests/test_placement.py`` checks against the same engines."""
    dp, config = engine.data_parallel, engine.config
    shapes = [
        StateShape(state.layout.numel, state.layout.trained_numel, _frozen_in(state, config.compute_dtype))
        for state in engine.states
    ]
    options = dataclasses.replace(config.options, nvme_offload=engine.placement.nvme)
    return estimate_from_shapes(
        _Shapes(shapes, host_freed=0, device_freed=0),  # what migration freed: not compared
        dataclasses.replace(config, options=options),
        engine.runtime.device.type,
        STAGING_CHUNK_ELEMENTS,
        topology=dp.topology if dp is not None else None,
    )


def _frozen_in(state: HostFlatState, compute: torch.dtype) -> bool:
    """Whether ``state`` has frozen weights, each held (so arrived) in ``compute``."""
    dtypes = {state.weights_of(slot).dtype for slot in state.layout.slots if slot.group == FROZEN_GROUP}
    return bool(dtypes) and dtypes == {compute}


def preflight_disagreements(engine: MegatrainEngine, need: MemoryNeed | None = None) -> list[str]:
    """Every way preflight's figures differ from what ``engine`` allocated: its host
    buffers are the allocated bytes plus a page per host tensor (``host_empty`` over-allocates
    one to align), its disk and window figures the tier's files and slots. Preflight counts
    the node, so this compares a process that is its node (one process, or a node of one
    rank); ``need`` defaults to :func:`engine_preflight`."""
    dp = engine.data_parallel
    assert dp is None or dp.node_size == 1, "preflight counts every rank of the node"
    need = need if need is not None else engine_preflight(engine)
    tensors = allocated_host_tensors(engine)

    def paged(*names: str) -> int:
        return sum(nbytes + PAGE_BYTES for name in names for nbytes in tensors[name])

    actual = {
        "master": paged("master"),
        "adam_m_v": paged("exp_avg", "exp_avg_sq"),
        "gradients": paged("grad"),
        "shadow": paged("shadow"),
        "frozen": paged("frozen"),
    }
    problems = [
        f"preflight {kind} {need.host.get(kind, 0)}, allocated {nbytes} (paged)"
        for kind, nbytes in actual.items()
        if need.host.get(kind, 0) != nbytes
    ]
    tier = engine.nvme_tier
    planned = engine.placement.tier
    if tier is None or planned is None or tier.io.alignment == planned.alignment:  # the engine configured opened
        disk, window = (tier.directory.nbytes, tier.window_bytes) if tier is not None else (0, 0)
        if (need.disk, need.host.get("nvme_window", 0)) != (disk, window):
            problems.append(
                f"preflight disk/window {need.disk}/{need.host.get('nvme_window', 0)}, tier {disk}/{window}"
            )
    # The weight window, and with data parallel the gather's buffers (GatheredWeights.nbytes).
    weights = engine.host_bytes().get("nvme_weights", 0)
    if need.host.get("nvme_weights", 0) != weights:
        problems.append(f"preflight weight window {need.host.get('nvme_weights', 0)}, engine {weights}")
    return problems


def node_share(engine: MegatrainEngine) -> dict[str, object]:
    """This rank's part of its node's allocations, for :func:`node_preflight_disagreements`
    (a rank of a node of several ranks, where preflight counts the node): its host tensors
    by kind, paged as preflight counts them, apart by owner -- ``"shared"``, node-shared
    (every rank of the node maps the same copy), and ``"own"``, this rank's window
    (``Where.RANK_WINDOW``) --, its NVMe tier's swap files and window slots, its weight
    window, and preflight's estimate as this rank computes it."""
    tier, planned_tier = engine.nvme_tier, engine.placement.tier
    shared: dict[str, int] = {}
    own: dict[str, int] = {}
    for state in engine.states:
        on_tier = tier.kinds if tier is not None and tier.holds(state) else ()
        for name, buffer in state.placement.buffers().items():
            tensor = getattr(state, name)
            if buffer.where.on_device or not isinstance(tensor, torch.Tensor) or tensor.is_meta or name in on_tier:
                continue
            kind = _PREFLIGHT_KIND[name]
            held = own if buffer.where is Where.RANK_WINDOW else shared
            held[kind] = held.get(kind, 0) + tensor.numel() * tensor.element_size() + PAGE_BYTES
    need = engine_preflight(engine)
    dp = engine.data_parallel
    assert dp is not None, "a node's share: data parallel"
    return {
        "node": dp.ownership.node,  # which node: the shares of one node add up
        "shared": shared,
        "own": own,
        # The tier's figures only where the I/O engine configured is the one that opened.
        "tier": (tier.directory.nbytes, tier.window_bytes) if tier is not None else (0, 0),
        "tier_as_planned": tier is None or planned_tier is None or tier.io.alignment == planned_tier.alignment,
        "weights": engine.host_bytes().get("nvme_weights", 0),
        "preflight": {**need.host, "disk": need.disk},
    }


_PREFLIGHT_KIND = {
    "master": "master",
    "exp_avg": "adam_m_v",
    "exp_avg_sq": "adam_m_v",
    "grad": "gradients",
    "shadow": "shadow",
    "frozen": "frozen",
}
"""Preflight's name for each buffer's host memory (``planning/preflight.py``)."""


def node_preflight_disagreements(shares: Sequence[dict]) -> list[str]:
    """Every way preflight's estimate for a node differs from what the node's ranks
    allocated together (``shares``: :func:`node_share` of every rank of one node): each
    node-shared buffer once (every rank must map the same), each rank's own window once per
    rank, each rank's NVMe tier and weight window. Empty when they agree."""
    first, problems = shares[0], []
    for rank, share in enumerate(shares):  # what every rank of the node must see alike
        for key in ("node", "shared", "preflight"):
            if share[key] != first[key]:
                problems.append(f"rank {rank} of the node: {key} {share[key]}, the first rank's {first[key]}")
    need = first["preflight"]
    for kind in sorted(set(_PREFLIGHT_KIND.values())):
        allocated = first["shared"].get(kind, 0) + sum(share["own"].get(kind, 0) for share in shares)
        if need.get(kind, 0) != allocated:
            problems.append(f"preflight {kind} {need.get(kind, 0)}, the node allocated {allocated} (paged)")
    if all(share["tier_as_planned"] for share in shares):
        disk, window = (sum(share["tier"][i] for share in shares) for i in (0, 1))
        if (need["disk"], need.get("nvme_window", 0)) != (disk, window):
            problems.append(f"preflight disk/window {need['disk']}/{need.get('nvme_window', 0)}, tiers {disk}/{window}")
    weights = sum(share["weights"] for share in shares)
    if need.get("nvme_weights", 0) != weights:
        problems.append(f"preflight weight windows {need.get('nvme_weights', 0)}, the ranks' {weights}")
    return problems


def planner_disagreements(engine: MegatrainEngine) -> list[str]:
    """Every way the planner (``megatrain plan``), given the engine's flat sizes (padding
    included: a model's parameter counts lack it) and its settings, counts other bytes than
    ``host_bytes()`` reports kind by kind (the NVMe tier's window and the weight window too)
    and ``device_bytes()`` for the GPU tier: it reads the same :class:`Placement` arithmetic
    (``planning/planner.py``: ``placement_of``). Empty when they agree."""
    config, states = engine.config, engine.states
    blocks, resident = states[:-1], states[-1]
    frozen = [state.layout.numel - state.layout.trained_numel for state in states]
    # The dtype each frozen weight is held in, as it arrived (or was cast): the parameters'
    # own are not it after the build (parked on the tier, meta; the resident ones viewing
    # their compute-dtype copy).
    frozen_dtypes = {
        state.weights_of(slot).dtype for state in states for slot in state.layout.slots if slot.group == FROZEN_GROUP
    }
    shape = ModelShape(
        num_blocks=len(blocks),
        block_params=max(state.layout.numel for state in blocks),
        total_block_params=sum(state.layout.numel for state in blocks),
        resident_params=resident.layout.numel,
        hidden=0,
        vocab=0,
        frozen_params=sum(frozen),
        frozen_block_params=max(frozen[:-1]),
        frozen_in_bf16=frozen_dtypes == {torch.bfloat16},
        # Each block as it is: blocks may differ (LoRA on some layers, blocks frozen whole).
        block_sizes=tuple((state.layout.numel, f) for state, f in zip(blocks, frozen)),
    )
    options = config.options
    share = options.device_state if not isinstance(options.device_state, str) else 0.0
    settings = RunSettings(
        seq_len=1,
        accumulation=config.gradient_accumulation_steps,
        bf16=config.compute_dtype.itemsize == 2,
        clipping=config.gradient_clipping > 0,
        master_bytes=config.master_dtype.itemsize,
        checkpoint_interval=options.checkpoint_interval,
        num_buffers=options.num_buffers,
        nvme=engine.placement.nvme != "none",
        nvme_weights=engine.placement.nvme == "all",
        nvme_window_blocks=options.nvme_window_blocks,
        device_state_share=share,
    )
    planned, host = host_bytes(shape, settings), engine.host_bytes()
    pairs = {
        "master": (planned["master"], host.get("master", 0)),
        "adam_m_v": (planned["adam_m_v"], host.get("exp_avg", 0) + host.get("exp_avg_sq", 0)),
        "shadow": (planned.get("bf16_shadow", 0), host.get("shadow", 0)),
        "frozen": (planned.get("frozen", 0), host.get("frozen", 0)),
        "gradients": (planned.get("gradients", 0), host.get("grad", 0)),
        "nvme_window": (planned.get("nvme_window", 0), host.get("nvme_window", 0)),
        "nvme_weights": (planned.get("nvme_weights", 0), host.get("nvme_weights", 0)),
        "device_state": (gpu_bytes(shape, settings).get("device_state", 0), engine.device_bytes()["device_state"]),
    }
    return [f"planner {kind} {ours}, engine {theirs}" for kind, (ours, theirs) in pairs.items() if ours != theirs]
