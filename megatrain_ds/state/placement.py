"""Where each buffer of the training state lives, computed once from (config, topology, model).

Every flat state (one per block, then the resident parameters') has the buffers of
``state/host_store.py``: the master (the weights the optimizer updates), the compute shadow
(the streamed copy, when the compute dtype differs from the master's), Adam's moments m and v,
the held gradients, and among the weights the frozen ones (LoRA: ``requires_grad=False`` or
in no optimizer group). :class:`Placement` says, per state and buffer, where it lives
(:class:`Where`) and how many elements of which size it holds there. What reads it instead
of branching on the NVMe level, data parallel, nodes and the master's dtype itself:

- the engine's builders (``engine_build.py``: what ``migrate_to_host`` keeps of each state,
  which tier opens, the weight window or the gather);
- ``MegatrainEngine.host_bytes()``, preflight's estimate (``planning/preflight.py``) and the
  planner's (``planning/planner.py``: :meth:`Placement.of_sizes` from a model's sizes), so
  the figures they report agree by construction (``tests/test_placement.py`` checks them
  against the buffers the engine allocates, and each other);
- ``state_dict()`` (``checkpoint/whole_masters.py``: where each master is read or gathered
  from, and whether that is a collective), save and load (``checkpoint/``: which buffer holds
  the whole weights, which states are gathered, whether the masters go in span files), and
  the weight gather after a data-parallel step (``DataParallel.gather_updated_weights``).

The records (:class:`StatePlacement`, :class:`Buffer`, :class:`Where`) are in
``state/state_placement.py``, below the host state: each
:class:`~megatrain_ds.state.host_store.HostFlatState` carries its placement and reads from it
which elements its buffers hold, so the two cannot disagree; ``tests/placement_check.py``
checks the buffers the engine allocated against it. Pure arithmetic: nothing is allocated
here. (Not to be confused with ``optimizer/placement.py``, which places the optimizer's
arithmetic on the CPU or the device.)

[Note: the placement model]
The combinations, for a block's state (``W``: a shadow exists, compute dtype != master dtype;
"span": this node's share of the trained prefix with several nodes, else all of it;
"window": this rank's part of the trained prefix, ``distributed/ownership.py``)::

  topology / nvme_offload   master               shadow (W)      m, v              grad (held)     streamed from
  one process / "none"      host: whole, or the  host: whole     host: trained     host: trained   host
                            trained prefix (*)                   prefix            prefix
  one process / "optimizer" W: tier, the        host: whole     tier: trained     host: trained   host
                            trained prefix (*);                  prefix            prefix
                            else host: whole
  one process / "all"       tier: the trained    none            tier: trained     host: trained   tier (weight window)
                            prefix (**)                          prefix            prefix
  data parallel / "none"    host: span if W,     host: whole     host: span        host: span      host
                            else whole
  data parallel / "optim."  host: span if W,     host: whole     tier: window      host: span      host
                            else whole
  data parallel / "all"     tier: window (**)    none            tier: window      host: window    gathered from the
                                                                                   (own memory)    windows

The resident state is always in host memory, as a block's with ``"none"``. (*) Frozen
parameters: layouts put them last (``FlatLayout.trained_numel``), and every state is
*trained-only*: the moments, the gradients, the tier's swap files and the ranks' windows and
nodes' spans cover the trained prefix alone (``HostFlatState.stepped_numel``). Where the
weights are in host memory (``"none"`` and ``"optimizer"``, one process or data parallel)
the frozen weights are held once, in one of three places (``StatePlacement.frozen_in``;
``state/host_store.py``: [Note: frozen weights]):

- ``"shadow"``: every frozen weight arrives in the compute dtype and there is a shadow: the
  frozen weights live in the shadow alone, the master covers the trained prefix (2 B a
  frozen parameter in bf16);
- ``"frozen"``: a frozen weight not in the compute dtype (an fp32 base under bf16 compute)
  beside a trained prefix whose fp32 master is cut -- on the tier in one process
  (``"optimizer"``), in the nodes' spans with several nodes: the frozen weights are a
  buffer of their own in host memory (:attr:`StatePlacement.frozen`, ``Where.HOST``, whole,
  in the master's dtype, node-shared with data parallel), their exact values, and the
  shadow streams their rounding (6 B a frozen parameter: 4 apart, 2 in the shadow);
- ``"master"``: elsewhere (no shadow, or a master that is whole in host memory: one
  process with no tier, one node), where the master is their exact value (beside a shadow,
  6 B a frozen parameter too).

(**) With the weights on the tier too (``"all"``) the frozen weights are a buffer of their
own on the tier (:attr:`StatePlacement.frozen`: ``Where.TIER``, or each rank's window of
them, ``Where.TIER_WINDOW``, the trained prefix and the frozen weights each cut in the ranks'
windows on its own), in the compute dtype where every frozen weight arrives in it, else in
the master's: written once to a read-only file beside the block's swap file and read with
the master when the block is streamed, rounded to the compute dtype as it is read
(``state/frozen_files.py``: [Note: frozen weights on the tier]), with data parallel gathered
after the prefix's windows (``distributed/gathered_weights.py``), whose saved and
``state_dict()`` values are gathered from the files' exact bytes: no host memory holds
them between uses. A block with nothing trained at all (LoRA on some layers, blocks frozen whole)
is a trained-only state whose trained prefix is empty: its weights alone, in the master
(where that streams, or its frozen weights are not in the compute dtype) or the shadow; in
one process it has nothing on the tier beside them, so no swap file
(:func:`_optimizer_on_tier`), and with ``"all"`` its frozen weights apart and an empty swap
file; with data parallel and ``"none"`` or ``"optimizer"`` (one node or several) no rank
updates any of it, every window and span of its empty trained prefix being empty, so
nothing of its master is cut: every node holds its weights whole, in the master where they
are not in the compute dtype (exact, beside the other states' spans of a master cut in
nodes), and no rank has a swap file of it (:func:`_master_and_frozen`). With data parallel
the host buffers of the node (master, shadow, frozen weights apart, m, v and gradients but
those of a rank's own window) are node-shared: one copy per node; the NVMe tier is each
rank's own, of its windows.

[Note: the GPU tier]
With ``"device_state"`` (``"auto"``, the default, or a fraction of the trained elements;
DeepSpeed's ``offload_optimizer.ratio`` is ``1 - fraction``) a prefix of the states, in the
order the next forward reads them -- the resident state, then blocks 0, 1, ... -- is kept whole on the
compute device (``Where.DEVICE``): master, shadow, m, v and a held gradient (in the compute
dtype where the run holds none on the host). Their weights are never copied (the streamer
points a slot at the shadow), their gradients never leave the device (the sink copies or
adds them into the held gradient there, its squared norm summed there), and they are
updated at ``step()`` by the Triton kernel in place, on the optimizer stream
(``optimizer/device_states.py``: [Note: device state ordering]); the host pass covers the
other states only. Prefix, not any subset: the next forward needs the resident state and
block 0 first, exactly the states whose host update it would otherwise wait for. States
with nothing trained are skipped (:func:`device_candidates`): they have no host update to
wait for, and their frozen weights get no device state (a LoRA model's embeddings and head,
blocks LoRA leaves alone); the device states' moments and gradients cover their trained
prefix alone, as on the host. One process, no NVMe tier, fp32 masters and no fp16 loss
scaling: elsewhere ``"auto"`` keeps every state on the host, logged at INFO, and a fraction
is refused (``config/engine_config.py``; data parallel at the build, ``engine_build.py``).
Nothing of them is in host memory: ``host_bytes()`` leaves them out, ``device_bytes()``
counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatrain_ds.config import EngineConfig
from megatrain_ds.state.flat_layout import FROZEN_GROUP, build_flat_layout
from megatrain_ds.state.host_store import SpanOf, TierKind
from megatrain_ds.state.nvme_tier import MOMENTS, WITH_MASTER, swap_file_bytes
from megatrain_ds.state.nvme_weights import weight_window_buffers
from megatrain_ds.state.state_placement import NOWHERE, Buffer, StatePlacement, Where
from megatrain_ds.state.swap_io import DIRECT_ALIGNMENT, aligned_bytes


@dataclass(frozen=True)
class StateShape:
    """What the placement needs of one flat state, from its parameters' shapes alone."""

    numel: int
    """Elements of the flat buffers (``FlatLayout.numel``, padding included)."""
    trained_numel: int
    """The trained prefix (``FlatLayout.trained_numel``): frozen slots are laid out after it."""
    frozen_in_compute_dtype: bool
    """Whether the state has frozen parameters, every one in the compute dtype."""


def flat_state_params(model: nn.Module, blocks: nn.ModuleList) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters of each flat state: every block's, then the resident ones (the
    model's parameters in no block), as the engine migrates them."""
    in_blocks = {id(param) for param in blocks.parameters()}
    states = [list(block.named_parameters()) for block in blocks]
    states.append([(name, param) for name, param in model.named_parameters() if id(param) not in in_blocks])
    return states


def state_shapes(
    states: Sequence[Sequence[tuple[str, nn.Parameter]]], group_of: dict[nn.Parameter, int], compute: torch.dtype
) -> list[StateShape]:
    """The :class:`StateShape` of each list of named parameters (the blocks', then the
    resident parameters'), from their shapes, groups and dtypes: nothing is allocated."""
    shapes = []
    for named in states:
        layout = build_flat_layout([(name, param.shape, group_of[param]) for name, param in named])
        frozen = {param.dtype for _, param in named if group_of[param] == FROZEN_GROUP}
        shapes.append(StateShape(layout.numel, layout.trained_numel, bool(frozen) and frozen == {compute}))
    return shapes


@dataclass(frozen=True)
class Topology:
    """The processes that share the training state.

    Attributes:
        node_ranks: ranks of this node with data parallel (they share its host memory);
            ``None``: one process.
        span_of: this node's span of a state, with several nodes; ``None``: every element.
        window_of: this rank's window of a state, with data parallel.
        node_windows_of: every window of this node's ranks (for the node's NVMe tiers); by
            default the node's span cut in ``node_ranks`` equal parts, as a plan for a node
            that does not know the other nodes' sizes does.
        world_size: every rank of the run, whose windows a gather of the weights joins
            (``"all"``); ``None``: this node's ranks, as a plan for one node assumes.
    """

    node_ranks: int | None = None
    span_of: SpanOf | None = None
    window_of: Callable[[int], tuple[int, int]] | None = None
    node_windows_of: Callable[[int], list[tuple[int, int]]] | None = None
    world_size: int | None = None

    @property
    def data_parallel(self) -> bool:
        return self.node_ranks is not None

    def span(self, numel: int) -> int:
        """Elements of this node's span of a ``numel``-element state."""
        span = self.span_of(numel) if self.span_of is not None else None
        return numel if span is None else span[1] - span[0]

    def window(self, numel: int) -> int:
        """Elements of this rank's window (the span split evenly when not given)."""
        if self.window_of is not None:
            start, end = self.window_of(numel)
            return end - start
        return -(-self.span(numel) // (self.node_ranks or 1))

    def node_windows(self, numel: int) -> list[int]:
        """Elements of every window of this node's ranks."""
        if self.node_windows_of is not None:
            return [end - start for start, end in self.node_windows_of(numel)]
        return [self.window(numel)] * (self.node_ranks or 1)


@dataclass(frozen=True)
class TierPlacement:
    """One process's NVMe tier: what it holds of each block, and its files."""

    kinds: tuple[TierKind, ...]
    """Buffers per block in the swap files (``state/nvme_tier.py``: ``MOMENTS`` or ``WITH_MASTER``)."""
    numels: tuple[int, ...]
    """Each swap file's elements per kind: a block's (its trained prefix where frozen
    parameters have none), or this rank's non-empty window of it."""
    alignment: int
    """Bytes each kind's part of a file is padded to: the configured I/O engine's
    (``state/swap_io.py``; DeepSpeed's op aligns to a block per thread)."""
    window_blocks: int
    """Blocks the tier's window holds in host memory (``nvme_window_blocks``)."""
    frozen_bytes: tuple[int, ...] = ()
    """Each block's frozen weights' bytes (with data parallel this rank's window of them), in a
    read-only file of its own (0: none), with the weights on the tier; empty without any."""
    frozen_numels: tuple[int, ...] = ()
    """The elements of :attr:`frozen_bytes` (empty without any)."""

    @property
    def file_bytes(self) -> list[int]:
        return [swap_file_bytes(numel, self.alignment, len(self.kinds)) for numel in self.numels]

    @property
    def frozen_file_bytes(self) -> list[int]:
        """Bytes of each frozen weights' file (``state/frozen_files.py``), padded to the alignment."""
        return [aligned_bytes(nbytes, self.alignment) for nbytes in self.frozen_bytes if nbytes]

    @property
    def disk_bytes(self) -> int:
        return sum(self.file_bytes) + sum(self.frozen_file_bytes)

    @property
    def window_bytes(self) -> int:
        """Host memory of the window's slots (``NvmeTier.window_bytes``)."""
        return min(self.window_blocks, max(len(self.numels), 1)) * max(self.file_bytes, default=0)


@dataclass(frozen=True)
class Placement:
    """Where every buffer of the training state lives, and what it takes (see the module docstring).

    Attributes:
        nvme: what the NVMe tier holds: ``"none"``, ``"optimizer"`` or ``"all"`` (``"auto"``
            resolved by preflight).
        topology: the processes sharing the state.
        states: per flat state, the blocks' then the resident parameters'.
        tier: this process's NVMe tier; ``None`` without one.
        node_tiers: the tiers of every rank of this node (this process's alone in one process).
        compute_itemsize: bytes per streamed element (the weight window's buffers).
    """

    nvme: str
    topology: Topology
    states: tuple[StatePlacement, ...]
    tier: TierPlacement | None
    node_tiers: tuple[TierPlacement, ...]
    compute_itemsize: int

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        nvme: str,
        topology: Topology,
        shapes: Sequence[StateShape],
        device_states: int | None = None,
    ) -> Placement:
        """The placement of states of these shapes (the resident state's last) under ``config``,
        with the NVMe tier holding ``nvme`` and ``device_states`` states on the compute device
        ([Note: the GPU tier]; ``None``: what ``device_state``'s fraction gives, none for
        ``"auto"``, which the engine resolves from the free device memory itself)."""
        if device_states is None:
            device_states = device_prefix(config.options.device_state, shapes)
        return cls.of_sizes(ElementSizes.of(config), TierSettings.of(config), nvme, topology, shapes, device_states)

    @classmethod
    def of_sizes(
        cls,
        sizes: ElementSizes,
        tier: TierSettings,
        nvme: str,
        topology: Topology,
        shapes: Sequence[StateShape],
        device_states: int = 0,
    ) -> Placement:
        """:meth:`of` from the element sizes and tier settings alone (the planner's
        ``planning/planner.py`` plans runs it has no config of)."""
        assert nvme in ("none", "optimizer", "all"), nvme
        assert device_states == 0 or (nvme == "none" and not topology.data_parallel), "the GPU tier: one process"
        states = [_state(shape, sizes, nvme, topology) for shape in shapes[:-1]]
        states.append(_state(shapes[-1], sizes, "none", topology))  # the resident state: host memory
        for index in device_state_indices(shapes, device_states):
            states[index] = _on_device(states[index], sizes)
        stepped = [shape.trained_numel for shape in shapes]  # every state is trained-only
        # Frozen weights apart on the tier: every element of them (each rank's tier a window of them).
        frozen = [
            (state.frozen_numel, state.frozen.itemsize) if state.frozen.where.on_tier else (0, 0)
            for state in states[:-1]
        ]
        mine, node = _tiers(tier, nvme, topology, stepped[:-1], sizes, frozen)
        return cls(nvme, topology, tuple(states), mine, tuple(node), sizes.compute)

    @property
    def blocks(self) -> tuple[StatePlacement, ...]:
        return self.states[:-1]

    @property
    def resident(self) -> StatePlacement:
        return self.states[-1]

    @property
    def weights_on_tier(self) -> bool:
        """Whether forward and backward read the blocks' weights from the NVMe tier."""
        return self.nvme == "all"

    @property
    def weights_gathered(self) -> bool:
        """Whether every rank keeps only its windows of the blocks' weights, gathered whole when used."""
        return any(state.gathered for state in self.blocks)

    @property
    def masters_split(self) -> bool:
        """Whether any state's master is split across processes (data parallel only): taking
        the whole masters runs collectives (``checkpoint/whole_masters.py``), and checkpoints
        write the exact masters in span files, the model files in the compute dtype."""
        return any(state.master_split for state in self.states)

    @property
    def tier_per_rank(self) -> bool:
        """Whether each rank opens its own tier over its windows (data parallel), after the
        state is built, rather than one tier taking each block as it is migrated."""
        return self.tier is not None and self.topology.data_parallel

    def host_bytes(self) -> dict[str, int]:
        """Host bytes of the flat states' buffers by kind, as ``HostFlatState.nbytes_by_kind``
        names them, in this process's view (node-shared buffers counted as this rank sees them)."""
        totals: dict[str, int] = {}
        for state in self.states:
            for name, buffer in state.buffers().items():
                if buffer.where.on_host:
                    totals[name] = totals.get(name, 0) + buffer.host_bytes
        return totals

    def device_bytes(self) -> dict[str, int]:
        """Device bytes of the states kept on the compute device ([Note: the GPU tier]), by kind."""
        totals: dict[str, int] = {}
        for state in self.states:
            for name, buffer in state.buffers().items():
                if buffer.where.on_device:
                    totals[name] = totals.get(name, 0) + buffer.device_bytes
        return totals

    @property
    def device_indices(self) -> tuple[int, ...]:
        """The states on the compute device, in the order the next forward reads them: the
        resident state, then blocks 0, 1, ..."""
        return tuple(index for index in _forward_order(len(self.states)) if self.states[index].on_device)

    def node_host_buffers(self, name: str) -> list[int]:
        """Elements of every host tensor called ``name`` on this node, state by state: a
        node-shared or one process's buffer once, a rank's own window once per rank of the
        node (the allocations preflight rounds to pages)."""
        numels: list[int] = []
        for state in self.states:
            buffer = state.buffers()[name]
            if buffer.where is Where.RANK_WINDOW:  # every rank's window of what the optimizer state covers
                numels += self.topology.node_windows(state.stepped_numel)
            elif buffer.where.on_host:
                numels.append(buffer.numel)
        return numels

    def weight_window_bytes(self, num_buffers: int, checkpoint_interval: int) -> int:
        """Host memory of the node's weight windows with the weights on the tier: per rank,
        buffers of its largest block's padded elements in the compute dtype (its largest
        file's, or a block whole where frozen weights are apart), with an fp32 buffer of the
        largest file's to read into when that is not fp32, and one of the largest frozen file
        to read those into (``NvmeWeights.nbytes``). Not the whole-block buffers a gather
        fills with data parallel, nor the buffer a rank's windows are sent from
        (``GatheredWeights.nbytes`` adds them; preflight's ``_weight_window_need`` counts them
        with the same ``gather_buffer_elements``)."""
        if not self.weights_on_tier:
            return 0
        compute = self.compute_itemsize
        buffers = weight_window_buffers(num_buffers, checkpoint_interval, self.node_tiers[0].window_blocks)
        total = 0
        for tier in self.node_tiers:
            largest = max(tier.file_bytes, default=0) // len(tier.kinds) // 4  # padded elements
            with_frozen = zip(tier.numels, tier.frozen_numels)  # a block's weights: its frozen ones too
            apart = [aligned_bytes(4 * (numel + f), tier.alignment) // 4 for numel, f in with_frozen if f]
            whole = max([largest, *apart])
            frozen = max(tier.frozen_file_bytes, default=0)
            total += buffers * (whole * compute + (largest * 4 if compute != 4 else 0) + frozen)
        return total


@dataclass(frozen=True)
class ElementSizes:
    """Bytes per element of each buffer, from the run's dtypes."""

    master: int
    compute: int
    """The streamed copy's (the shadow's, or the master's where it is streamed)."""
    grad: int | None
    """Bytes per held gradient element; ``None``: gradients are applied as they arrive."""
    with_shadow: bool
    """Whether the compute dtype differs from the master's: a shadow is streamed."""

    @classmethod
    def of(cls, config: EngineConfig) -> ElementSizes:
        def size(dtype: torch.dtype) -> int:
            return torch.empty((), dtype=dtype).element_size()

        grad = size(config.held_gradient_dtype) if config.holds_gradients else None
        return cls(
            size(config.master_dtype), size(config.compute_dtype), grad, config.compute_dtype != config.master_dtype
        )


@dataclass(frozen=True)
class TierSettings:
    """What the NVMe tier's files and window take from the settings."""

    alignment: int = DIRECT_ALIGNMENT
    """Bytes each kind's part of a swap file is padded to (:attr:`TierPlacement.alignment`)."""
    window_blocks: int = 4
    """``nvme_window_blocks``."""

    @classmethod
    def of(cls, config: EngineConfig) -> TierSettings:
        aio = config.options.nvme_aio
        # The configured I/O engine's alignment: DeepSpeed's op aligns to a block per thread.
        alignment = DIRECT_ALIGNMENT * (aio.thread_count if aio.engine != "threads" else 1)
        return cls(alignment, config.options.nvme_window_blocks)


def _forward_order(num_states: int) -> list[int]:
    """The resident state (the last), then the blocks in order: what the next forward reads first."""
    return [num_states - 1, *range(num_states - 1)]


def device_candidates(shapes: Sequence[StateShape]) -> list[int]:
    """The states the GPU tier may keep, in the forward's order: those with something to
    train. A state with nothing trained (a block LoRA leaves alone, one frozen whole, a
    LoRA model's resident embeddings and head) has no update for the next forward to wait
    for, and no optimizer state: frozen weights get no device state, and stream as the host
    holds them ([Note: the GPU tier])."""
    return [index for index in _forward_order(len(shapes)) if shapes[index].trained_numel > 0]


def device_state_indices(shapes: Sequence[StateShape], count: int) -> list[int]:
    """The ``count`` states kept on the compute device: the first ``count`` of
    :func:`device_candidates` (the resident state, then blocks 0, 1, ..., those with
    something to train)."""
    return device_candidates(shapes)[:count]


def device_prefix(setting: str | float, shapes: Sequence[StateShape]) -> int:
    """How many states (of :func:`device_candidates`) ``device_state``'s fraction of the
    trained elements takes whole; ``"none"`` and ``"auto"`` (resolved by the engine from its
    free device memory: :func:`device_prefix_within`) take none."""
    if isinstance(setting, str) or setting <= 0:
        return 0
    budget = setting * sum(shape.trained_numel for shape in shapes)
    return _prefix([shapes[index].trained_numel for index in device_candidates(shapes)], budget)


def device_prefix_within(all_on_device: Placement, budget_bytes: int) -> int:
    """How many states (of :func:`device_candidates`) fit whole in ``budget_bytes`` of device
    memory, from the placement with every candidate on the device (``device_state: "auto"``)."""
    states = all_on_device.states
    costs = [sum(b.device_bytes for b in states[index].buffers().values()) for index in all_on_device.device_indices]
    return _prefix(costs, budget_bytes)


def _prefix(costs: Sequence[float], budget: float) -> int:
    """The longest prefix of ``costs`` whose sum is at most ``budget``."""
    used, count = 0.0, 0
    for cost in costs:
        used += cost
        if used > budget * (1 + 1e-9):  # a fraction's rounding must not drop the last state
            break
        count += 1
    return count


def _on_device(state: StatePlacement, sizes: ElementSizes) -> StatePlacement:
    """``state`` kept whole on the compute device ([Note: the GPU tier]): every buffer the
    host would have held, there, and a held gradient even where the run holds none on the
    host (the device update runs at ``step()``, once the global norm is known)."""

    def moved(buffer: Buffer) -> Buffer:
        return Buffer(Where.DEVICE, buffer.numel, buffer.itemsize) if buffer.where.on_host else buffer

    held = state.exp_avg.numel
    grad = moved(state.grad) if state.grad.where.on_host else Buffer(Where.DEVICE, held, sizes.compute)
    return dataclasses.replace(
        state,
        master=moved(state.master),
        shadow=moved(state.shadow),
        exp_avg=moved(state.exp_avg),
        exp_avg_sq=moved(state.exp_avg_sq),
        grad=grad,
        streamed=Where.DEVICE,
    )


def _optimizer_on_tier(shape: StateShape, nvme: str, topology: Topology) -> bool:
    """Whether the tier holds a state's optimizer state (the moments, and the master beside a
    shadow in one process): not in one process for a block with nothing trained, which has
    no swap file (``_tiers``), so that its master, the weights when they are not all in the
    compute dtype, stays whole and exact in host memory."""
    return nvme != "none" and (shape.trained_numel > 0 or topology.data_parallel)


def _master_and_frozen(
    shape: StateShape, sizes: ElementSizes, topology: Topology, on_tier: bool, held: int
) -> tuple[Buffer, Buffer]:
    """The master and the frozen weights kept apart of a state whose weights are in host
    memory (``held``: this node's span of its trained prefix). The master: on the tier in
    one process beside a shadow, this node's span with several nodes beside a shadow, the
    trained prefix where the frozen weights are in the shadow alone or apart, else whole.
    Frozen weights not in the compute dtype beside a trained prefix whose master is cut so
    (the tier, the nodes' spans) are kept apart, whole and exact, in host memory in the
    master's dtype (node-shared with data parallel): the shadow streams their rounding.
    A state with nothing trained keeps its master whole with several nodes too: it is
    its frozen weights' exact value, and no node updates any of it (every span of its empty
    trained prefix is empty)."""
    numel, trained = shape.numel, shape.trained_numel
    in_shadow = sizes.with_shadow and shape.frozen_in_compute_dtype
    one_process_tier = sizes.with_shadow and on_tier and not topology.data_parallel
    spans = sizes.with_shadow and topology.span_of is not None and not (trained == 0 < numel and not in_shadow)
    apart = (one_process_tier or spans) and 0 < trained < numel and not in_shadow
    frozen = Buffer(Where.HOST, numel - trained, sizes.master) if apart else NOWHERE
    if one_process_tier:
        return Buffer(Where.TIER, trained, sizes.master), frozen
    if spans:  # the master's span too
        return Buffer(Where.NODE_SPAN, held, sizes.master), frozen
    if in_shadow:
        return Buffer(Where.TRAINED_PREFIX, trained, sizes.master), frozen
    return Buffer(Where.HOST, numel, sizes.master), frozen


def _state(shape: StateShape, sizes: ElementSizes, nvme: str, topology: Topology) -> StatePlacement:
    """One state's placement ([Note: the placement model]); the resident state's ``nvme`` is
    ``"none"`` whatever the blocks' is. Every state is trained-only: the moments, gradients,
    swap files, windows and spans cover its trained prefix alone."""
    if nvme == "all":
        return _frozen_apart_on_tier(shape, sizes, topology)
    numel, trained = shape.numel, shape.trained_numel
    shadow = Buffer(Where.HOST, numel, sizes.compute) if sizes.with_shadow else NOWHERE
    held = topology.span(trained)
    # Several nodes: every node's span, even one that happens to be all of a small state, so
    # that every node branches alike (the weight gather sends the same buffer from each).
    nodes = topology.span_of is not None
    where = Where.NODE_SPAN if nodes else Where.TRAINED_PREFIX if trained < numel else Where.HOST
    on_tier = _optimizer_on_tier(shape, nvme, topology)
    master, frozen = _master_and_frozen(shape, sizes, topology, on_tier, held)
    moments = Buffer(where, held, 4)
    if on_tier:  # Adam's m and v of the trained prefix on the tier: one process's, or each rank's window
        windowed = Buffer(Where.TIER_WINDOW, topology.window(trained), 4) if topology.data_parallel else None
        moments = windowed or Buffer(Where.TIER, trained, 4)
    grad = Buffer(where, held, sizes.grad) if sizes.grad is not None else NOWHERE
    in_shadow = sizes.with_shadow and shape.frozen_in_compute_dtype
    frozen_in = "frozen" if frozen.where.on_host else "shadow" if in_shadow else "master"
    return StatePlacement(
        numel,
        master,
        shadow,
        moments,
        moments,
        grad,
        Where.HOST,
        numel - trained,
        frozen_in if numel > trained else "",
        frozen,
    )


def _frozen_apart_on_tier(shape: StateShape, sizes: ElementSizes, topology: Topology) -> StatePlacement:
    """A block's placement with the weights on the tier: the trained prefix's master, m and v
    on the tier, its gradients in host memory, the frozen weights apart on the tier in their
    own dtype (the compute dtype where every one arrives in it, else the master's), read
    only ([Note: the placement model]). In one process all of them; with data parallel this
    rank's window of the trained prefix and its window of the frozen weights, each divided
    among the ranks on its own, gathered whole when used."""
    numel, trained = shape.numel, shape.trained_numel
    frozen_itemsize = sizes.compute if shape.frozen_in_compute_dtype else sizes.master
    if topology.data_parallel:
        held, frozen_held = topology.window(trained), topology.window(numel - trained)
        where, grad_where, streamed = Where.TIER_WINDOW, Where.RANK_WINDOW, Where.GATHERED
    else:
        held, frozen_held = trained, numel - trained
        where, grad_where, streamed = Where.TIER, Where.HOST, Where.TIER
    moments = Buffer(where, held, 4)
    grad = Buffer(grad_where, held, sizes.grad) if sizes.grad is not None else NOWHERE
    frozen = Buffer(where, frozen_held, frozen_itemsize) if trained < numel else NOWHERE
    return StatePlacement(
        numel,
        Buffer(where, held, sizes.master),
        NOWHERE,
        moments,
        moments,
        grad,
        streamed,
        numel - trained,
        "frozen" if trained < numel else "",
        frozen,
    )


def _tiers(
    settings: TierSettings,
    nvme: str,
    topology: Topology,
    blocks: Sequence[int],
    sizes: ElementSizes,
    frozen: Sequence[tuple[int, int]],
) -> tuple[TierPlacement | None, list[TierPlacement]]:
    """This process's NVMe tier and those of every rank of its node (none without a tier);
    ``blocks``: the elements each block's optimizer state covers (its trained prefix where
    frozen parameters have none); ``frozen``: each block's frozen weights kept apart on the
    tier, ``(elements, bytes per element)``, elements 0 where none are."""
    if nvme == "none":
        return None, []
    apart = any(numel for numel, _ in frozen)

    def tier(kinds: tuple[TierKind, ...], files: Sequence[tuple[int, int, int]]) -> TierPlacement:
        """A tier of ``(elements, frozen elements, frozen bytes)`` per block it holds."""
        numels = tuple(numel for numel, _, _ in files)
        if not apart:
            return TierPlacement(kinds, numels, settings.alignment, settings.window_blocks)
        frozen_numels, frozen_bytes = tuple(f for _, f, _ in files), tuple(b for _, _, b in files)
        return TierPlacement(kinds, numels, settings.alignment, settings.window_blocks, frozen_bytes, frozen_numels)

    if not topology.data_parallel:
        kinds = WITH_MASTER if nvme == "all" or sizes.with_shadow else MOMENTS
        # A block with nothing on the tier (nothing trained, its weights in host memory) has no files.
        files = [(numel, f, f * size) for numel, (f, size) in zip(blocks, frozen) if numel > 0 or f > 0]
        one = tier(kinds, files)
        return one, [one]
    # Each rank's tier: its non-empty windows (with "all" their masters too: nothing else holds
    # them), a block's window there also where only its window of the frozen weights is not empty.
    kinds = WITH_MASTER if nvme == "all" else MOMENTS

    def windows(numels: Sequence[int], frozen_numels: Sequence[int]) -> list[tuple[int, int, int]]:
        parts = zip(numels, frozen_numels, (size for _, size in frozen))
        return [(numel, f, f * size) for numel, f, size in parts if numel > 0 or f > 0]

    mine = tier(kinds, windows([topology.window(n) for n in blocks], [topology.window(f) for f, _ in frozen]))
    per_block = [topology.node_windows(numel) for numel in blocks]
    per_frozen = [topology.node_windows(f) for f, _ in frozen]
    node = [tier(kinds, windows(numels, f)) for numels, f in zip(zip(*per_block), zip(*per_frozen))]
    return mine, node if per_block else [mine]
