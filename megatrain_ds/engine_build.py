"""Building the engine: the model taken over, in the order of the pipeline it then runs.

:func:`build` is what ``MegatrainEngine.__init__`` runs (``engine.py``): check that the run
fits (planning/preflight.py) before anything is allocated, find the blocks, decide where
every buffer lives (state/placement.py), move the blocks' state to the host block by block
(into the NVMe tier where it has one), then the resident parameters, the optimizer over
that state (assembled by ``optimizer_build.py``), the streams that carry weights and
gradients, the streamed blocks, and the long-context pieces (chunked loss, tiled MLPs).
Every builder here branches on the placement, and on nothing else. What needs the tokens
of a batch is decided at the first training forward (:func:`decide_at_first_forward`).

The builders are functions over the engine (:class:`EngineUnderConstruction`, the parts
they set and the engine's callbacks they wire in); this module sits beside ``engine.py``
in the layers and imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from typing import Any, Protocol

import torch
from torch import nn

from megatrain_ds.checkpoint.safetensors_source import SafetensorsSource, materialize_meta_buffers, open_source
from megatrain_ds.config import ConfigError
from megatrain_ds.config.megatrain_options import DEVICE_STATE_AUTO_SHARE, DEVICE_STATE_HEADROOM_BYTES
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.distributed.gradient_reducer import GradientReducer
from megatrain_ds.gradients.sink import GradientPort, GradientSink, Landing
from megatrain_ds.model.batch_checks import reject_unsupported_outputs
from megatrain_ds.model.block_discovery import check_blocks_own_their_params, find_blocks
from megatrain_ds.model.block_template import BlockTemplate, structure_key
from megatrain_ds.model.causal_lm_loss import ChunkedCausalLMLoss, linear_head, unsupported_reason
from megatrain_ds.model.frozen_weights import cast_frozen_weights
from megatrain_ds.optimizer.facade import group_index_of
from megatrain_ds.optimizer_build import OptimizerUnderConstruction, assemble_optimizer
from megatrain_ds.planning.fragment_policy import FragmentChoice, choose_fragments
from megatrain_ds.planning.long_context import choose_loss_chunk_tokens, choose_mlp_tile_tokens, ffn_width
from megatrain_ds.planning.preflight import PreflightInputs, available_memory, preflight, wants_nvme_tier
from megatrain_ds.planning.recompute_policy import RecomputeChoice, choose_recompute, planned_run, stashed_blocks_of
from megatrain_ds.planning.transfer_hiding import tokens_per_pass
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.state.host_store import HostFlatState, TensorSource, migrate_to_host
from megatrain_ds.state.nvme_tier import is_on_tier, open_nvme_tier
from megatrain_ds.state.nvme_weights import NvmeWeights, weight_window_buffers
from megatrain_ds.state.placement import (
    Placement,
    StateShape,
    Topology,
    device_prefix,
    device_prefix_within,
    flat_state_params,
    state_shapes,
)
from megatrain_ds.state.state_placement import StatePlacement
from megatrain_ds.streaming.activation_offload import ActivationOffloader
from megatrain_ds.streaming.activation_stash import ActivationStash
from megatrain_ds.streaming.resident_params import ResidentParams
from megatrain_ds.streaming.streamed_blocks import StreamedBlocks
from megatrain_ds.streaming.tiled_mlp import tile_token_wise
from megatrain_ds.streaming.weight_streamer import WeightStreamer

logger = logging.getLogger(__name__)

# Gradients cross to the host in pieces of at most this many elements (8 MiB in bf16):
# large enough for full PCIe bandwidth, small enough that staging costs a fraction of a block.
STAGING_CHUNK_ELEMENTS = 1 << 22


class EngineUnderConstruction(OptimizerUnderConstruction, Protocol):
    """``MegatrainEngine`` as its builders see it: what they read (set by ``__init__``
    before :func:`build`), the parts they set (declared, with what each is, on the engine),
    and the engine's methods they wire into the streams and the optimizer. The optimizer's
    parts are :class:`~megatrain_ds.optimizer_build.OptimizerUnderConstruction`'s."""

    block_path: str
    num_templates: int
    nvme_weights: NvmeWeights | None
    gathered_weights: GatheredWeights | None
    sink: GradientPort
    streamer: WeightStreamer
    blocks: StreamedBlocks
    stashed_blocks: int
    recompute_choice: RecomputeChoice | None
    fragment_choice: FragmentChoice | None
    mlp_tile_tokens: int
    causal_loss: ChunkedCausalLMLoss | None

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def _land_gradient(self, index: int, offset: int, numel: int, final: bool) -> Landing: ...

    def _consume_gradient(self, index: int, offset: int, grad: torch.Tensor, final: bool, landing: Landing) -> None: ...


def build(engine: EngineUnderConstruction, model: nn.Module) -> None:
    """Take ``model`` over, in the order of the pipeline it then runs: check that the run
    fits, find the blocks, move their state to the host, then the resident parameters,
    the optimizer over that state, the streams that carry weights and gradients, and the
    streamed blocks that run forward and backward from them. With ``"frozen_weights":
    "compute_dtype"`` the frozen weights are first cast in place (model/frozen_weights.py)."""
    topology = engine.data_parallel.topology if engine.data_parallel is not None else Topology()
    group_of = group_index_of(model, engine.optimizer)  # the cast keeps every nn.Parameter object
    if engine.config.options.frozen_weights == "compute_dtype":
        # Before anything reads the model's dtypes (preflight, the placement, the migration):
        # from here a frozen weight is in the compute dtype, held once (model/frozen_weights.py).
        cast_frozen_weights(model, group_of, engine.config.compute_dtype)
    nvme = _check_before_allocating(engine, model, topology)
    blocks = _discover_blocks(engine, model)
    # load_from: values come from safetensors shards, one tensor at a time, so a model
    # built on the meta device is never in host memory twice (checkpoint/safetensors_source.py).
    source = open_source(model, engine.config.options.load_from)
    materialize_meta_buffers(model, source)
    # Where every buffer lives (state/placement.py): what the builders below branch on.
    shapes = state_shapes(flat_state_params(model, blocks), group_of, engine.config.compute_dtype)
    device_states = _device_state_count(engine, model, nvme, topology, shapes)
    engine.placement = Placement.of(engine.config, nvme, topology, shapes, device_states)
    dp = engine.data_parallel
    shared = dp.shared if dp is not None else None  # one host copy per node
    templates = _build_host_state(engine, blocks, group_of, source, shared)
    resident, block_modules = _build_resident(engine, model, blocks, group_of, source, shared)
    assemble_optimizer(engine, shared)  # optimizer_build.py
    _build_streams(engine, templates)
    _build_streamed_blocks(engine, model, blocks, templates, block_modules)
    _build_long_context(engine, model, list(dict.fromkeys(templates)))
    logger.info(
        "megatrain: %d blocks at %s (%d template(s)), %d resident parameters, device %s",
        len(blocks),
        engine.block_path,
        engine.num_templates,
        len(resident),
        engine.runtime.device,
    )


def _check_before_allocating(engine: EngineUnderConstruction, model: nn.Module, topology: Topology) -> str:
    """Where the NVMe tier comes in (``"none"``, ``"auto"``'s choice or ``"all"``), after
    checking that the run is supported and fits: nothing is allocated before this."""
    # The NVMe tier ("auto": only as much as host memory is short of) holds the blocks' Adam
    # moments (and fp32 masters, with bf16 compute), or with "all" their weights too.
    # With several nodes, each holds only its share of the optimizer state (_span_of); with
    # data parallel each rank keeps its own tier of its windows' m and v (optimizer_build.py),
    # and with "all" of its windows' masters, the weights gathered whole when used.
    run = PreflightInputs(
        model, engine.config, engine.optimizer, engine.runtime.device, STAGING_CHUNK_ELEMENTS, topology
    )
    nvme = wants_nvme_tier(run)
    if engine.config.options.preflight:  # fail before allocating anything (planning/preflight.py)
        preflight(run, nvme=nvme)
    reject_unsupported_outputs(model)
    return nvme


def _discover_blocks(engine: EngineUnderConstruction, model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks (``block_path`` names where they were found)."""
    path, blocks = find_blocks(model, engine.config.options.block_path)
    check_blocks_own_their_params(model, blocks)
    engine.block_path = path
    return blocks


def _device_state_count(
    engine: EngineUnderConstruction, model: nn.Module, nvme: str, topology: Topology, shapes: list[StateShape]
) -> int:
    """How many states (the resident state, then blocks 0, 1, ...) the GPU tier keeps on the
    device (``state/placement.py``: [Note: the GPU tier]): ``device_state``'s fraction of the
    trained elements, or with ``"auto"`` as many as fit in ``DEVICE_STATE_AUTO_SHARE`` of the
    device memory free after the engine's own planned peak and a headroom (none, logged at
    INFO, without CUDA or with data parallel)."""
    options = engine.config.options
    if not options.wants_device_state:
        return 0
    if options.device_state == "auto":
        return _auto_device_state_count(engine, model, nvme, topology, shapes)
    if topology.data_parallel:
        raise ConfigError(
            f"megatrain.device_state {options.device_state!r} does not support data parallel yet (each rank "
            'would step its windows on its device); set it to "none" (offload_optimizer.ratio 1.0)'
        )
    assert nvme == "none", "engine_config.py refuses the NVMe tier with device_state"
    if not engine.runtime.is_cuda and not _triton_interpreted():
        # No GPU: the "device" is the host, where the states live anyway, and the tier's
        # kernel could only run in Triton's interpreter (which the tests turn on).
        logger.warning(
            "megatrain: device_state %r: no CUDA device, every state stays in host memory", options.device_state
        )
        return 0
    return device_prefix(options.device_state, shapes)


def _auto_device_state_count(
    engine: EngineUnderConstruction, model: nn.Module, nvme: str, topology: Topology, shapes: list[StateShape]
) -> int:
    """``device_state: "auto"`` (the default): the longest prefix of the states that fits in
    ``DEVICE_STATE_AUTO_SHARE`` of the CUDA memory free after the engine's own planned peak
    and ``DEVICE_STATE_HEADROOM_BYTES``; none, logged at INFO, where the tier cannot run."""
    if topology.data_parallel:
        logger.info('megatrain: device_state "auto": data parallel, every optimizer state stays in host memory')
        return 0
    assert nvme == "none", 'engine_config.py turns "auto" into "none" with the NVMe tier'
    free = available_memory(engine.runtime.device).device
    if free is None:
        # No CUDA (Triton's interpreter or not): the "device" is the host, where the states
        # live anyway, so the CPU path stays the one it always was.
        logger.info('megatrain: device_state "auto": no CUDA device, every optimizer state stays in host memory')
        return 0
    if importlib.util.find_spec("triton") is None:  # the tier's update is a Triton kernel
        logger.info('megatrain: device_state "auto": no Triton, every optimizer state stays in host memory')
        return 0
    run = PreflightInputs(
        model, engine.config, engine.optimizer, engine.runtime.device, STAGING_CHUNK_ELEMENTS, topology
    )
    planned_peak = preflight(run, nvme=nvme).device_total  # the engine's own device memory, no state on it
    budget = int(DEVICE_STATE_AUTO_SHARE * max(free - planned_peak - DEVICE_STATE_HEADROOM_BYTES, 0))
    return device_prefix_within(Placement.of(engine.config, nvme, topology, shapes, len(shapes)), budget)


def _triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter here (``TRITON_INTERPRET=1``)."""
    from megatrain_triton import INTERPRETED  # imports triton: only when device_state asks

    return INTERPRETED


def _build_host_state(
    engine: EngineUnderConstruction,
    blocks: nn.ModuleList,
    group_of: dict[nn.Parameter, int],
    source: SafetensorsSource | None,
    shared: NodeSharedMemory | None,
) -> list[BlockTemplate]:
    """Each block's flat host state (``engine.states``, migrated one block at a time, into
    the NVMe tier where it has one) and its weightless template, one per structure."""
    tier = engine.placement.tier
    if tier is not None and not engine.placement.tier_per_rank:
        # Opened first, to take each block as it is migrated (state/nvme_tier.py); with
        # data parallel each rank's tier opens over its windows (optimizer_build.py).
        # With the weights on it, frozen weights get read-only files of their own (state/frozen_files.py).
        options = engine.config.options
        engine.nvme_tier = open_nvme_tier(tier.numels, tier.kinds, engine.runtime, options, tier.frozen_bytes)

    templates_by_key: dict[tuple, BlockTemplate] = {}
    templates: list[BlockTemplate] = []
    engine.states = []
    for index, block in enumerate(blocks):
        key = structure_key(block)
        if key not in templates_by_key:
            templates_by_key[key] = BlockTemplate(block, engine.runtime.device)
        template = templates_by_key[key]
        template.admit(block, index)
        templates.append(template)
        # Migrating block by block frees each block's original storage before the
        # next is copied: the model never exists twice in host memory.
        scoped = source.scoped(f"{engine.block_path}.{index}.") if source is not None else None
        engine.states.append(_migrate_block(engine, block, group_of, scoped, shared, engine.placement.states[index]))
        if engine.placement.states[index].on_device:  # the GPU tier: filled on the host, then moved
            engine.states[-1].move_to_device(engine.runtime)
        if engine.nvme_tier is not None and is_on_tier(engine.states[-1]):
            engine.nvme_tier.adopt(engine.states[-1])
    engine.num_templates = len(templates_by_key)
    return templates


def _migrate_block(
    engine: EngineUnderConstruction,
    block: nn.Module,
    group_of: dict[nn.Parameter, int],
    source: TensorSource | None,
    shared: NodeSharedMemory | None,
    placement: StatePlacement,
) -> HostFlatState:
    """One block's flat host state, as ``placement`` says. Gathered weights (the weights
    on the NVMe tier and data parallel): only this rank's window of it, in its own memory,
    the whole weights gathered when used (``distributed/gathered_weights.py``), every
    rank taking its window of rank 0's."""
    master, compute, dp = engine.config.master_dtype, engine.config.compute_dtype, engine.data_parallel
    named = list(block.named_parameters())
    if placement.gathered:
        assert dp is not None
        return migrate_to_host(
            named,
            group_of,
            engine.runtime,
            master,
            compute,
            placement,
            source=source,
            span_of=dp.window,
            share=dp.broadcast_from_rank0_,
        )
    return migrate_to_host(
        named,
        group_of,
        engine.runtime,
        master,
        compute,
        placement,
        source=source,
        shared=shared,
        span_of=functools.partial(_span_of, engine),
        share=functools.partial(_share_initial_weights, engine),
    )


def _build_resident(
    engine: EngineUnderConstruction,
    model: nn.Module,
    blocks: nn.ModuleList,
    group_of: dict[nn.Parameter, int],
    source: SafetensorsSource | None,
    shared: NodeSharedMemory | None,
) -> tuple[list[tuple[str, nn.Parameter]], set[int]]:
    """The parameters outside the blocks (embeddings, final norm, head), their state last
    in ``engine.states``, and the buffers outside the blocks on the device. Returns the
    resident parameters and the ids of the blocks' modules."""
    block_params = {id(p) for block in blocks for p in block.parameters()}
    resident = [(n, p) for n, p in model.named_parameters() if id(p) not in block_params]
    master, compute = engine.config.master_dtype, engine.config.compute_dtype
    engine.resident = ResidentParams(
        resident,
        group_of,
        engine.runtime,
        master,
        compute,
        engine.placement.resident,
        source=source,
        shared=shared,
        span_of=functools.partial(_span_of, engine),
        share=functools.partial(_share_initial_weights, engine),
    )
    if source is not None:
        source.report_unused(name for name, _ in model.named_buffers())
    engine.states.append(engine.resident.state)
    engine._resident_index = len(engine.states) - 1
    block_modules = {id(m) for m in blocks.modules()}
    for module in model.modules():
        if id(module) not in block_modules:
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(engine.runtime.device)
    return resident, block_modules


def _build_streams(engine: EngineUnderConstruction, templates: list[BlockTemplate]) -> None:
    """What crosses between host and device: gradients out (the sink, behind the
    reducer with data parallel) and weights in (the streamer, from the NVMe tier's
    weight window where the weights live there)."""
    options, compute = engine.config.options, engine.config.compute_dtype
    largest = max(state.layout.numel for state in engine.states[: engine._resident_index])
    sink = GradientSink(
        engine.runtime,
        min(largest, STAGING_CHUNK_ELEMENTS),
        compute,
        options.num_staging_buffers,
        engine._consume_gradient,
        land=engine._land_gradient,
        norm=engine.stepper.norm,
    )
    dp = engine.data_parallel
    engine.sink = (
        sink if dp is None else GradientReducer(engine.runtime, dp, sink, [s.stepped_numel for s in engine.states])
    )
    num_slots = options.num_buffers + options.checkpoint_interval - 1
    if engine.placement.weights_on_tier:  # forward and backward read the blocks' weights from the tier
        assert engine.nvme_tier is not None  # opened above with any placement on the tier
        engine.nvme_weights = NvmeWeights(
            engine.nvme_tier,
            compute,
            weight_window_buffers(options.num_buffers, options.checkpoint_interval, options.nvme_window_blocks),
        )
        if engine.placement.weights_gathered:  # each rank's tier holds its windows: gathered whole when used
            assert dp is not None
            engine.gathered_weights = _gather_from_windows(engine, engine.nvme_weights, dp, num_slots + 1)
    engine.streamer = WeightStreamer(
        engine.runtime,
        engine.states[: engine._resident_index],
        num_slots=num_slots,
        source=engine.gathered_weights or engine.nvme_weights,
        # "auto" crosses whole blocks until the first training forward decides.
        fragment_elements=(options.fragment_bytes if isinstance(options.fragment_bytes, int) else 0)
        // compute.itemsize,
        parts_of=lambda block: templates[block].parts_in_use(),
        pending_updates=engine.pipelined_finish,
        device_resident=engine.device_states,
    )


def _gather_from_windows(
    engine: EngineUnderConstruction, windows: NvmeWeights, dp: DataParallel, capacity: int
) -> GatheredWeights:
    """The streamer's source when every rank keeps only its windows of the weights on its
    NVMe tier ([Note: gathered weights]); a rank's empty window is on no tier."""
    tier_index: list[int | None] = []
    on_tier = 0
    for window in engine.optimizer_states[: engine._resident_index]:
        tier_index.append(on_tier if is_on_tier(window) else None)
        on_tier += is_on_tier(window)
    # What each block's windows divide: its stepped part, and its frozen weights where they are apart.
    parts = [(state.stepped_numel, state.layout.numel - state.stepped_numel) for state in engine.states]
    return GatheredWeights(windows, tier_index, parts[: engine._resident_index], dp, engine.runtime, capacity)


def _build_streamed_blocks(
    engine: EngineUnderConstruction,
    model: nn.Module,
    blocks: nn.ModuleList,
    templates: list[BlockTemplate],
    block_modules: set[int],
) -> None:
    """The blocks run from streamed weights (checkpointed, recomputed or stashed), and the
    resident parameters' gradients hooked into the sink."""
    options = engine.config.options
    # "recompute": the first ``stashed_blocks`` blocks stash their activations, the
    # last ones are recomputed (planning/recompute_policy.py); "auto" decides at the
    # first training forward and recomputes every block until then.
    recompute = options.recompute
    engine.stashed_blocks = stashed_blocks_of(recompute, len(blocks)) or 0
    engine.recompute_choice = None  # decided at the first training forward
    engine.fragment_choice = None
    engine.blocks = StreamedBlocks(
        blocks,
        templates,
        engine.states[: engine._resident_index],
        engine.streamer,
        engine.sink,
        engine.runtime,
        options.checkpoint_interval,
        ActivationOffloader(engine.runtime) if options.offload_checkpoints else None,
        engine.is_gradient_accumulation_boundary,
        STAGING_CHUNK_ELEMENTS,
        stash=ActivationStash(engine.runtime) if recompute != "full" else None,
        stashes=lambda index: index < engine.stashed_blocks,
    )
    engine.blocks.install()
    engine.resident.hook_gradients(
        lambda offset, grad: engine.sink.push(
            engine._resident_index, offset, grad, engine.is_gradient_accumulation_boundary()
        ),
        (m for m in model.modules() if id(m) not in block_modules),
        STAGING_CHUNK_ELEMENTS,
    )


def _build_long_context(engine: EngineUnderConstruction, model: nn.Module, templates: list[BlockTemplate]) -> None:
    """The chunked loss and the blocks' tiled MLPs (planning/long_context.py)."""
    options = engine.config.options
    available = available_memory(engine.runtime.device)
    free = available.device if available.device is not None else available.host
    width = engine.config.compute_dtype.itemsize
    engine.mlp_tile_tokens = 0
    if options.mlp_tile_tokens != 0:
        for template in templates:
            ffn = ffn_width(template.module)
            tokens = (
                options.mlp_tile_tokens
                if options.mlp_tile_tokens != "auto"
                else choose_mlp_tile_tokens(ffn, width, free)
                if ffn
                else 0
            )
            if tokens and tile_token_wise(template.module, tokens):
                engine.mlp_tile_tokens = tokens
    engine.causal_loss = None
    if options.loss_chunk_tokens == 0:
        return
    if options.loss_chunk_tokens == "auto":
        reason = unsupported_reason(model)
        if reason is not None:
            logger.info("megatrain: the loss is computed by the model, not in chunks: %s", reason)
            return
    head = linear_head(model)  # None: ChunkedCausalLMLoss raises, saying why
    tokens = options.loss_chunk_tokens
    if tokens == "auto":
        assert head is not None  # unsupported_reason(model) was None
        tokens = choose_loss_chunk_tokens(head.weight.shape[0], width, free)
    redirected = engine.resident.row_chunked(head) if head is not None else None
    engine.causal_loss = ChunkedCausalLMLoss(
        model, tokens, lambda: redirected.weight_grad_push() if redirected is not None else None
    )


def _span_of(engine: EngineUnderConstruction, numel: int) -> tuple[int, int] | None:
    """This node's share of a ``numel``-element optimizer state; ``None``: all of it."""
    dp = engine.data_parallel
    return dp.span(numel) if dp is not None and dp.num_nodes > 1 else None


def _share_initial_weights(engine: EngineUnderConstruction, values: torch.Tensor) -> None:
    """Every node starts from the first node's weights (as DDP starts from rank 0's):
    ``migrate_to_host`` hands each state's whole values, on node writers, to this before
    keeping anything of them (a sharded master keeps only its span: its other nodes'
    values, in fp32, exist only then)."""
    if engine.data_parallel is not None:
        engine.data_parallel.broadcast_from_first_node_(values)


def decide_at_first_forward(
    engine: EngineUnderConstruction, model: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The choices deferred to the first training forward, now that the tokens per weight pass
    are known: ``"recompute": "auto"`` (or a check that the stash asked for fits) and
    ``"fragment_bytes": "auto"`` (planning/recompute_policy.py, planning/fragment_policy.py).
    Returns what was chosen, for the trace's metadata."""
    counted = tokens_per_pass(args, kwargs)
    options = engine.config.options
    if counted is None or (options.recompute == "full" and options.fragment_bytes != "auto"):
        return {}
    resident = engine._resident_index
    numels = [state.layout.numel for state in engine.states[:resident]]
    shape, settings, hardware = planned_run(
        engine.runtime, engine.config, model, numels, engine.states[resident].layout.numel, counted[1]
    )
    chosen: dict[str, Any] = {}
    if options.recompute != "full":
        choice = choose_recompute(engine.runtime, engine.config, (shape, settings, hardware))
        engine.recompute_choice, engine.stashed_blocks = choice, choice.stashed_blocks
        chosen["recompute"] = {
            "setting": options.recompute,
            "stashed_blocks": choice.stashed_blocks,
            "planned_stash_bytes_per_block": choice.stash_bytes_per_block,
            "predicted": choice.predicted,
        }
    if options.fragment_bytes == "auto":
        settings = dataclasses.replace(settings, stashed_blocks=engine.stashed_blocks)
        fragments = engine.fragment_choice = choose_fragments((shape, settings, hardware))
        # No block has a fragment plan yet: plans are made from the next copy on.
        engine.streamer.fragment_elements = fragments.fragment_bytes // engine.config.compute_dtype.itemsize
        chosen["fragments"] = {"setting": "auto", **dataclasses.asdict(fragments)}
    return chosen
