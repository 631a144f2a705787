"""Host-resident training state: one flat fp32 master buffer per block, Adam m/v beside it.

The host is the home of every persistent tensor. Each block (and the set of resident
non-block parameters) owns a :class:`HostFlatState`: page-aligned flat buffers laid out
by :mod:`megatrain_ds.state.flat_layout`, kept as its placement says (the
:class:`~megatrain_ds.state.state_placement.StatePlacement` it carries, which the engine's
``Placement`` computed: where each buffer lives, so which elements it holds). The user's
parameters are re-pointed at views of the whole weights the node holds (the master; the
bf16 shadow where the master is sharded across nodes), so the model has the trained
weights without a second copy; its ``state_dict()`` reports the masters wherever they are
(``checkpoint/whole_masters.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.host_heap import release_pages
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.state.flat_layout import FROZEN_GROUP, FlatLayout, ParamSlot, build_flat_layout
from megatrain_ds.state.state_placement import StatePlacement, Where, whole_in_host_memory

TierKind = Literal["master", "exp_avg", "exp_avg_sq"]
"""A buffer of a flat state that may live in the NVMe tier's swap files and window slots
(the tier's kinds, ``state/nvme_tier.py``)."""
BoundKind = Literal["master", "exp_avg", "exp_avg_sq", "frozen"]
"""A buffer of a flat state that may live elsewhere than its own host allocation: the tier's
kinds and the frozen weights held apart ([Note: frozen weights]), which the tier keeps in a
read-only file of their own: :meth:`HostFlatState.bind` and :meth:`~HostFlatState.release`."""


@dataclass
class HostFlatState:
    """Host tensors of one flat group of parameters (all 1-D, ``layout.numel`` long).

    Attributes:
        layout: where each parameter lives in the flat buffers.
        master: the weights the optimizer updates (fp32 unless ``master_dtype`` says bf16).
        shadow: the compute-dtype copy that is streamed to the device when it differs
            from ``master`` (bf16 compute with an fp32 master); ``None`` otherwise.
        exp_avg, exp_avg_sq: Adam's first and second moments, fp32.
        grad: gradient accumulator, allocated only when gradients must be held until
            the end of backward (clipping, or accumulation over micro-batches).
        placement: where each buffer lives (``state/state_placement.py``), computed by the
            engine's ``Placement`` (``state/placement.py``: [Note: the placement model]). The
            state's own views read from it which elements each buffer holds (:attr:`held`,
            :attr:`master_held`, :attr:`stepped_numel`, :meth:`weights_of`): the moments
            and gradients only the trained prefix ``[0, layout.trained_numel)`` (frozen
            parameters have none: [Note: frozen weights]); the master
            only the ``span`` where it is split (``master_split``: several nodes with a
            shadow, whose whole weights are the shadow; a rank's window of gathered weights),
            only the trained prefix where the frozen weights are held in the shadow alone or
            apart (``frozen_in``).
        span: ``[start, end)``, the elements that ``exp_avg``, ``exp_avg_sq`` and ``grad``
            hold: all of them on one node, with data parallel over several nodes this
            node's share (``distributed/data_parallel.py``: [Note: sharded host state]), with
            gathered weights this rank's window. The offsets, which the placement (sizes,
            the same for every node of a plan) does not hold.
        frozen: the frozen weights ``[layout.trained_numel, layout.numel)`` held apart from
            the master, in their own dtype (the placement's ``frozen_in == "frozen"``;
            ``master`` then holds the trained prefix alone): with the weights on the NVMe
            tier there (:attr:`frozen_for_tier`), or fp32 ones in host memory beside a shadow
            where the fp32 master is cut; ``None`` where they are in ``master`` or ``shadow``.

    [Note: frozen weights]
    A frozen parameter (``requires_grad=False``, or in no optimizer group) is streamed and
    never updated, so it needs its weights once and nothing else. Layouts put frozen slots
    last (``FlatLayout.trained_numel``), so the buffers only training needs stop at the
    trained prefix: Adam's moments and the gradients always, and with a
    bf16 shadow the fp32 master too, when every frozen parameter arrives in the compute dtype
    (``frozen_in == "shadow"``): its weights are then held once, bit for bit, in the shadow that is
    streamed (2 B/param in bf16). A frozen fp32 parameter with bf16 compute keeps its exact
    fp32 value beside its rounding in the shadow (6 B/param): in the whole fp32 master where
    that is in host memory, else, where the master is cut (on the NVMe tier in one process
    with ``"optimizer"``, in several nodes' spans), in a buffer of its own in host memory,
    :attr:`frozen` (``frozen_in == "frozen"``, whole, node-shared with data parallel), the
    master then holding the trained prefix (or the node's span of it) alone. Cast frozen
    weights to the compute dtype before ``initialize`` (``"frozen_weights": "compute_dtype"``
    does, ``model/frozen_weights.py``) to hold them at 2 B/param.
    So it is wherever the weights are in host memory: in one process, and with data
    parallel, where the node's shared copy holds the frozen weights once and the ranks'
    windows and the nodes' spans divide the trained prefix alone (:attr:`stepped_numel`),
    with or without the optimizer state on the NVMe tier (its swap files then hold the
    trained prefix). With the weights on the tier too (``"all"``) there is no shadow: the
    master, moments and gradients cover the trained prefix and the frozen weights are a
    buffer of their own (:attr:`frozen`), in the compute dtype where every frozen weight
    arrives in it, else the master's, which the tier writes once to a read-only file and
    reads with the master when it streams the block
    (``state/frozen_files.py``: [Note: frozen weights on the tier]); with data parallel each
    rank's window of the trained prefix and its window of the frozen weights
    (:attr:`frozen_window`), gathered when used (``distributed/gathered_weights.py``); frozen
    weights not in the compute dtype are read rounded, and gathered exact for ``state_dict()``
    and checkpoints (``state/placement.py``: [Note: the placement model]).
    """

    layout: FlatLayout
    master: torch.Tensor
    shadow: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None = None
    params: list[nn.Parameter] = field(default_factory=list)
    """The user's parameters in slot order (for state_dict mapping and hooks)."""
    span: tuple[int, int] | None = None
    """``None``: the optimizer state covers every element it steps (:attr:`stepped_numel`)."""
    frozen: torch.Tensor | None = None
    frozen_window: tuple[int, int] | None = None
    """``[start, end)`` of the layout's elements :attr:`frozen` holds with data parallel and the
    weights on the tier (this rank's window of the frozen weights, gathered when used);
    ``None``: all of them, ``[layout.trained_numel, layout.numel)``."""
    placement: StatePlacement = field(kw_only=True)

    @property
    def stepped_numel(self) -> int:
        """Elements the optimizer state is laid over: the trained prefix (frozen parameters
        have no optimizer state). Data-parallel windows and node spans
        (``distributed/ownership.py``) divide these."""
        return self.layout.trained_numel

    @property
    def held(self) -> tuple[int, int]:
        """``[start, end)`` of the elements the optimizer state (moments, gradients) holds."""
        if self.span is not None:
            return self.span
        return (0, self.stepped_numel)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state holds only part of the elements."""
        return self.held != (0, self.layout.numel)

    @property
    def master_held(self) -> tuple[int, int]:
        """``[start, end)`` of the elements ``master`` holds (:attr:`held` where it is sharded,
        the trained prefix where the frozen weights are in the shadow alone)."""
        if self.placement.master_split:
            return self.held
        apart = self.placement.frozen_in in ("shadow", "frozen")
        return (0, self.layout.trained_numel) if apart else (0, self.layout.numel)

    @property
    def weights(self) -> torch.Tensor:
        """Every weight of the state: the master, or the shadow where the master is sharded
        (``StatePlacement.weights_in`` says which, for the code that branches on it): what the
        user's parameters view (the trained ones only where the frozen weights are held in the
        shadow alone or apart: :meth:`weights_of`)."""
        if self.placement.weights_in == "shadow":
            assert self.shadow is not None, "a master split in nodes' spans: the shadow is whole"
            return self.shadow
        return self.master

    def weights_of(self, slot: ParamSlot) -> torch.Tensor:
        """The buffer that holds ``slot``'s weight: :attr:`weights`, or for a frozen slot the
        shadow or :attr:`frozen` where its weight is held there ([Note: frozen weights]);
        :meth:`slot_of` finds the slot in it."""
        if self._apart(slot):
            assert self.frozen is not None
            return self.frozen
        if self.placement.frozen_in == "shadow" and slot.group == FROZEN_GROUP:
            assert self.shadow is not None
            return self.shadow
        return self.weights

    def slot_of(self, slot: ParamSlot, flat: torch.Tensor) -> torch.Tensor:
        """``slot``'s weight in ``flat``, the buffer :meth:`weights_of` names or one laid out
        as it is (a mapping of the tier's file): a frozen slot's, where the frozen weights
        are held apart, in a buffer of them (:attr:`frozen`, from the trained prefix on)."""
        start = slot.offset - (self.layout.trained_numel if self._apart(slot) else 0)
        return flat[start : start + slot.numel].view(slot.shape)

    def _apart(self, slot: ParamSlot) -> bool:
        return slot.group == FROZEN_GROUP and self.placement.frozen_in == "frozen"

    @property
    def frozen_for_tier(self) -> torch.Tensor | None:
        """The frozen weights held apart that the NVMe tier keeps in a read-only file of their
        own (``state/frozen_files.py``: the weights on the tier; with data parallel a rank's
        window of them), ``None`` where there are none, or they stay in host memory."""
        return None if self.placement.frozen.where.on_host else self.frozen

    @property
    def streamed(self) -> torch.Tensor:
        """The buffer whose bytes go to the device."""
        return self.shadow if self.shadow is not None else self.master

    def weight_view(self, slot_index: int) -> torch.Tensor:
        """Slot ``slot_index`` of :attr:`weights` (the fp32 master unless it is sharded)."""
        slot = self.layout.slots[slot_index]
        return self.slot_of(slot, self.weights_of(slot))

    def nbytes_by_kind(self) -> dict[str, int]:
        """Host bytes held, by kind (for memory accounting and tests)."""
        tensors = {
            "master": self.master,
            "shadow": self.shadow,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "grad": self.grad,
            "frozen": self.frozen,
        }
        on_device = {name for name, buffer in self.placement.buffers().items() if buffer.where.on_device}
        return {
            kind: t.numel() * t.element_size()
            for kind, t in tensors.items()
            if t is not None and not t.is_meta and kind not in on_device
        }  # meta: a moment on the NVMe tier; on the device: the GPU tier's

    def window(self, start: int, end: int) -> HostFlatState:
        """Views of elements ``[start, end)`` of every buffer, with the matching layout
        (:meth:`FlatLayout.window`): the part of this state one data-parallel rank steps,
        inside the part this node holds (:attr:`held`), a state of its own whose every
        buffer holds all its elements (:func:`whole_in_host_memory`)."""
        first, last = self.held
        assert first <= start <= end <= last, (start, end, self.held)

        def part(tensor: torch.Tensor | None, base: int = 0) -> torch.Tensor | None:
            return None if tensor is None else tensor[start - base : end - base]

        master_first = self.master_held[0]  # a sharded master starts at the span, as the moments do
        shadow, grad = part(self.shadow), part(self.grad, first)
        # Gathered weights: the frozen weights' window goes with the window the rank's tier adopts.
        frozen = self.frozen if self.frozen_window is not None else None
        return HostFlatState(
            layout=self.layout.window(start, end),
            master=self.master[start - master_first : end - master_first],
            shadow=shadow,
            exp_avg=self.exp_avg[start - first : end - first],
            exp_avg_sq=self.exp_avg_sq[start - first : end - first],
            grad=grad,
            frozen=frozen,
            frozen_window=self.frozen_window if frozen is not None else None,
            placement=whole_in_host_memory(
                end - start,
                self.master.element_size(),
                shadow.element_size() if shadow is not None else 0,
                grad.element_size() if grad is not None else 0,
            ),
        )

    def bind(self, buffers: Mapping[BoundKind, torch.Tensor]) -> None:
        """Make ``buffers`` the state's buffers of their kinds: host tensors that hold those
        kinds' current values elsewhere than the state's own allocation (a slot of the NVMe
        tier's window, a mapping of its swap file; ``state/nvme_tier.py``), each of the
        elements the kind holds (:attr:`master_held`, :attr:`held`). The one way anything
        outside this module rebinds a buffer; :meth:`release` undoes it."""
        for kind, tensor in buffers.items():
            first, last = self._held_by(kind)
            assert tensor.shape == (last - first,), (kind, tuple(tensor.shape), (first, last))
        self.master = buffers.get("master", self.master)
        self.frozen = buffers.get("frozen", self.frozen)
        self.exp_avg = buffers.get("exp_avg", self.exp_avg)
        self.exp_avg_sq = buffers.get("exp_avg_sq", self.exp_avg_sq)

    def release(self, kinds: Iterable[BoundKind]) -> None:
        """The buffers of ``kinds`` now live elsewhere (the NVMe tier) and have no host copy:
        each becomes a placeholder (:func:`absent_on_host`; the frozen weights' of their
        dtype), so a use that skipped fetching it fails instead of reading a buffer the tier
        has taken back."""
        placeholders: dict[BoundKind, torch.Tensor] = {}
        for kind in kinds:
            first, last = self._held_by(kind)
            dtype = self.frozen.dtype if kind == "frozen" and self.frozen is not None else torch.float32
            placeholders[kind] = absent_on_host(last - first, dtype)
        self.bind(placeholders)

    def _held_by(self, kind: BoundKind) -> tuple[int, int]:
        """``[start, end)`` of the elements the buffer of ``kind`` holds."""
        if kind == "frozen":
            return self.frozen_window or (self.layout.trained_numel, self.layout.numel)
        return self.master_held if kind == "master" else self.held

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Re-point the user's parameters at their slots of ``flat`` (the shadow while the
        master is on the NVMe tier, the master again when it comes back: ``state/nvme_tier.py``);
        a frozen weight held in the shadow alone stays there ([Note: frozen weights])."""
        for slot, param in zip(self.layout.slots, self.params):
            frozen = slot.group == FROZEN_GROUP and self.placement.frozen_in in ("shadow", "frozen")
            held = self.weights_of(slot) if frozen else flat
            _repoint(param, self.slot_of(slot, held))

    def park_params(self) -> None:
        """Make the user's parameters meta tensors of their shapes: no host copy of the
        weights exists (the NVMe tier holds them, ``state/nvme_weights.py``), and copying
        one's values out fails instead of returning stale ones, as a ZeRO-3 model's
        partitioned parameters have none. :meth:`point_params_at` gives them values again."""
        for slot, param in zip(self.layout.slots, self.params):
            dtype = self.weights_of(slot).dtype  # a frozen weight held apart: its own
            _repoint(param, torch.empty(slot.shape, dtype=dtype, device="meta"))

    def move_to_device(self, runtime: DeviceRuntime) -> None:
        """Move every buffer to the compute device, where the placement keeps the state whole
        (``state/placement.py``: [Note: the GPU tier]), and re-point the parameters at the
        device weights; the host buffers are unpinned and freed. Once, at build, after the
        migration filled them (the same values, copied exactly)."""
        assert self.placement.on_device and self.span is None and self.frozen is None, self.placement

        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            device = runtime.device_empty(tensor.numel(), tensor.dtype)
            device.copy_(tensor)  # synchronous from pageable or pinned memory: done before it is freed
            runtime.free_host(tensor)
            return device

        master, exp_avg, exp_avg_sq = moved(self.master), moved(self.exp_avg), moved(self.exp_avg_sq)
        assert master is not None and exp_avg is not None and exp_avg_sq is not None
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.shadow, self.grad = moved(self.shadow), moved(self.grad)
        self.point_params_at(self.weights)

    def refresh_shadow(self, start: int | None = None, end: int | None = None) -> None:
        """Round the updated master into the streamed shadow over ``[start, end)`` (state
        elements, default all the master holds; no-op without a shadow)."""
        if self.shadow is None:
            return
        first, last = self.master_held
        start, end = first if start is None else start, last if end is None else end
        assert first <= start <= end <= last, (start, end, self.master_held)
        self.shadow[start:end].copy_(self.master[start - first : end - first])


def _repoint(param: nn.Parameter, value: torch.Tensor) -> None:
    """``param.data = value``, also across the meta device (which ``.data`` refuses): swapping
    keeps the Python object, so the optimizer's groups and tied modules follow."""
    if param.is_meta != value.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value


SpanOf = Callable[[int], "tuple[int, int] | None"]
"""This node's ``[start, end)`` of a state's optimizer state, from the state's size; ``None``:
all of it (``distributed/data_parallel.py``: [Note: sharded host state])."""


def absent_on_host(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The placeholder of a buffer kept elsewhere (a moment or master on the NVMe tier, fp32,
    or frozen weights there, ``state/nvme_tier.py``): right dtype and size, no storage, so
    any use that skipped fetching it fails instead of reading garbage."""
    return torch.empty(numel, dtype=dtype, device="meta")


def flat_numel(named_params: Sequence[tuple[str, nn.Parameter]], group_of: dict[nn.Parameter, int]) -> int:
    """Elements of the flat buffers :func:`migrate_to_host` makes for ``named_params``."""
    return build_flat_layout([(name, p.shape, group_of[p]) for name, p in named_params]).numel


class TensorSource(Protocol):
    """Where parameter values come from instead of the parameters themselves (e.g. the
    safetensors shards of a model built on the meta device)."""

    def copy_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (a master slot, any dtype) with the tensor called ``name``."""


def migrate_to_host(
    named_params: Sequence[tuple[str, nn.Parameter]],
    group_of: dict[nn.Parameter, int],
    runtime: DeviceRuntime,
    master_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    placement: StatePlacement,
    source: TensorSource | None = None,
    shared: NodeSharedMemory | None = None,
    span_of: SpanOf | None = None,
    share: Callable[[torch.Tensor], None] | None = None,
) -> HostFlatState:
    """Move ``named_params`` into a new flat host state that keeps what ``placement`` says
    (``state/placement.py``: [Note: the placement model]), each parameter re-pointed at its
    slot of the whole weights (the master; the shadow where the master is split, below).
    The master is allocated untouched; each
    parameter is copied into its slot and re-pointed at once, its old storage freed (a large
    one's chunk by chunk, :func:`copy_releasing_source`): the peak is the state plus one
    chunk. With ``source`` each slot is filled from ``source.copy_into``; ``meta`` parameters
    then become real ones viewing their slot, keeping their identity.

    With ``shared`` the buffers are node-shared (``runtime/node_shared_memory.py``): only the
    node's writer copies values in; the other ranks just re-point their parameters (their
    values dropped, as DDP drops them for rank 0's) and read nothing before
    :meth:`NodeSharedMemory.written`. ``share(values)``, on the writer, may replace the
    whole values first (data parallel: the first node's initial weights).

    Moments not in host memory are placeholders (:func:`absent_on_host`); a shadow is made
    where the placement has one in host memory. ``span_of``: the moments hold only this
    node's share, ``span_of(numel)`` (:attr:`HostFlatState.span`), and the master too where
    the placement splits it (``StatePlacement.master_split``, :func:`_fill_sharded`); of
    the trained prefix alone: frozen parameters get no moments, gradients or, where they
    can, master ([Note: frozen weights])."""
    dtypes = (master_dtype, compute_dtype)
    layout = build_flat_layout([(name, p.shape, group_of[p]) for name, p in named_params])
    covered = layout.trained_numel
    span = span_of(covered) if span_of is not None else None
    first, last = span if span is not None else (0, covered)
    writes = shared is None or shared.is_writer
    _check_placement(placement, named_params, layout, dtypes, span)
    # A state the placement keeps on the device is filled here too, then moved (``move_to_device``).
    shadow = runtime.host_empty(layout.numel, compute_dtype, shared) if _kept(placement.shadow.where) else None
    frozen_window = _frozen_window(placement, layout, span_of)
    frozen = _frozen_apart(placement, named_params, layout, runtime, dtypes, frozen_window, shared)
    if placement.master_split:
        master = runtime.host_empty(last - first, master_dtype, shared)
        frozen_part = (frozen, frozen_window or (layout.trained_numel, layout.numel)) if frozen is not None else None
        params = _fill_sharded(named_params, layout, master, shadow, (first, last), source, writes, share, frozen_part)
    else:
        frozen_in = shadow if placement.frozen_in == "shadow" else frozen  # frozen weights not in the master
        master = runtime.host_empty(layout.numel if frozen_in is None else layout.trained_numel, master_dtype, shared)
        params = _fill_whole(named_params, layout, master, shadow, frozen_in, source, writes, share)
    held, moments_on_host = last - first, _kept(placement.exp_avg.where)
    state = HostFlatState(
        layout=layout,
        master=master,
        shadow=shadow,
        exp_avg=runtime.host_zeros(held, torch.float32, shared) if moments_on_host else absent_on_host(held),
        exp_avg_sq=runtime.host_zeros(held, torch.float32, shared) if moments_on_host else absent_on_host(held),
        params=params,
        span=span,
        frozen=frozen,
        frozen_window=frozen_window,
        placement=placement,
    )
    if placement.master_split and shadow is None:
        state.park_params()  # no whole weights on this rank: they are gathered when used
    elif placement.master_split and frozen is not None:
        state.point_params_at(state.weights)  # the frozen parameters view their exact values apart
    return state


def _frozen_window(placement: StatePlacement, layout: FlatLayout, span_of: SpanOf | None) -> tuple[int, int] | None:
    """The layout's elements of this rank's window of the frozen weights kept apart, with
    gathered weights (data parallel, the weights on the tier: ``span_of`` gives the rank's
    window of a state); ``None`` where the frozen weights held apart are all of them, or
    none are held apart."""
    if placement.frozen.where is not Where.TIER_WINDOW:
        return None
    window = span_of(layout.numel - layout.trained_numel) if span_of is not None else None
    assert window is not None, "gathered weights: span_of gives this rank's window"
    return (layout.trained_numel + window[0], layout.trained_numel + window[1])


def _kept(where: Where) -> bool:
    """Whether the migration fills a buffer: kept in host memory, or moved to the device after."""
    return where.on_host or where.on_device


def _check_placement(
    placement: StatePlacement,
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    dtypes: tuple[torch.dtype, torch.dtype],
    span: tuple[int, int] | None,
) -> None:
    """Assert that ``placement`` was computed for these parameters and dtypes, and that
    ``span`` is where it splits the state (the builders' contract with ``Placement``)."""
    master_dtype, compute_dtype = dtypes
    assert placement.numel == layout.numel, (placement.numel, layout.numel)
    assert placement.frozen_numel == layout.numel - layout.trained_numel, placement
    streamed_here = placement.streamed in (Where.HOST, Where.DEVICE)
    assert _kept(placement.shadow.where) == (compute_dtype != master_dtype and streamed_here)
    in_compute = _frozen_all_in(named_params, layout, compute_dtype)
    assert placement.frozen_in != "shadow" or in_compute, "frozen weights in the shadow: in the compute dtype"
    if placement.frozen_in == "frozen":
        # All of them in one process; with data parallel (gathered weights) this rank's window.
        assert placement.master_split == (span is not None), "frozen weights apart: a window where the master is"
        assert placement.frozen.itemsize == (compute_dtype if in_compute else master_dtype).itemsize, placement
    assert not placement.master_split or span is not None, "a split master holds this node's span"
    split_frozen = placement.master_split and placement.frozen_numel
    assert not split_frozen or placement.frozen_in in ("shadow", "frozen"), "a split master: frozen weights not in it"


def _frozen_apart(
    placement: StatePlacement,
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    runtime: DeviceRuntime,
    dtypes: tuple[torch.dtype, torch.dtype],
    window: tuple[int, int] | None,
    shared: NodeSharedMemory | None,
) -> torch.Tensor | None:
    """The buffer of a state's frozen weights held apart (:attr:`HostFlatState.frozen`;
    ``None`` where the placement holds them elsewhere), in their own dtype: the compute
    dtype (``dtypes[1]``) where every one arrives in it, else the master's (``dtypes[0]``);
    of all of them, or of the layout's ``window`` of them (a rank's, with data parallel and
    the weights on the tier). In host memory it is the node's copy (node-shared with
    ``shared``); on the tier each rank's own."""
    if placement.frozen_in != "frozen":
        return None
    master, compute = dtypes
    dtype = compute if _frozen_all_in(named_params, layout, compute) else master
    start, end = window or (layout.trained_numel, layout.numel)
    return runtime.host_empty(end - start, dtype, shared if placement.frozen.where.on_host else None)


def _frozen_all_in(named_params: Sequence[tuple[str, nn.Parameter]], layout: FlatLayout, dtype: torch.dtype) -> bool:
    """Whether the layout has frozen parameters and every one arrives in ``dtype``."""
    dtype_of = {name: param.dtype for name, param in named_params}
    frozen = [slot.name for slot in layout.slots if slot.group == FROZEN_GROUP]
    return bool(frozen) and all(dtype_of[name] == dtype for name in frozen)


def _fill_whole(
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    master: torch.Tensor,
    shadow: torch.Tensor | None,
    frozen_in: torch.Tensor | None,
    source: TensorSource | None,
    writes: bool,
    share: Callable[[torch.Tensor], None] | None,
) -> list[nn.Parameter]:
    """Fill a master of every element, or with ``frozen_in`` (the shadow, or the frozen
    weights' own buffer, which starts at the trained prefix) a master of the trained prefix
    and each frozen weight copied straight into its slot there (exact: the same dtype, or
    the master's); then the shadow's copy of the master, rounded. ``writes``: this rank fills
    the (node-shared) buffers; the others only re-point their parameters."""
    values = master if writes else None
    if frozen_in is not None:
        frozen = [index for index, slot in enumerate(layout.slots) if slot.group == FROZEN_GROUP]
        base = 0 if frozen_in is shadow else layout.trained_numel
        params = _fill_slots(named_params, layout, values, master, source, range(frozen[0]))
        params += _fill_slots(named_params, layout, frozen_in if writes else None, frozen_in, source, frozen, base)
    else:
        params = _fill_slots(named_params, layout, values, master, source)
    if writes and share is not None:
        # The first node's weights. Frozen weights in the shadow are on one node here: several
        # nodes with a shadow shard the master (_fill_sharded), which shares them all.
        share(master)
    if writes and shadow is not None:
        shadow[: master.numel()].copy_(master)  # the master's weights' streamed copy, rounded
        if frozen_in is not None and frozen_in is not shadow:  # the frozen weights apart: theirs too
            shadow[master.numel() :].copy_(frozen_in)
    return params


def _fill_sharded(
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    master: torch.Tensor,
    shadow: torch.Tensor | None,
    span: tuple[int, int],
    source: TensorSource | None,
    writes: bool,
    share: Callable[[torch.Tensor], None] | None,
    frozen_part: tuple[torch.Tensor, tuple[int, int]] | None = None,
) -> list[nn.Parameter]:
    """Fill a master that holds only ``span``, this node's share (``StatePlacement.master_split``),
    and ``frozen_part``'s buffer with its window of the frozen weights (gathered weights
    with frozen weights apart: the master is the trained prefix's window).

    Where a shadow is made the master holds only the span (with several nodes an NVMe tier
    is each rank's, of m and v only): the parameters view the whole shadow, and the values
    pass through a whole temporary of the state, freed on return (one state more at the
    peak). So does a state that keeps only its span and no shadow (a placement whose
    weights are gathered when used, with ``span_of`` a rank's window of the block:
    ``distributed/gathered_weights.py``); its parameters view the temporary, and
    :func:`migrate_to_host` parks them (meta tensors)."""
    first, last = span
    whole = torch.empty(layout.numel, dtype=master.dtype) if writes else None
    viewed = shadow if shadow is not None else whole
    assert viewed is not None, "a rank that keeps no whole weights fills its own span (no shared memory)"
    params = _fill_slots(named_params, layout, whole, viewed, source)
    if whole is not None:
        if share is not None:
            share(whole)
        if shadow is not None:
            shadow.copy_(whole)  # every weight, rounded: what the node streams
        master.copy_(whole[first:last])  # this span, exact
        if frozen_part is not None:
            frozen, (start, end) = frozen_part
            frozen.copy_(whole[start:end])  # exact: their own dtype, or the master's they were filled in
    return params


def _fill_slots(
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    values: torch.Tensor | None,
    viewed: torch.Tensor,
    source: TensorSource | None,
    indices: Sequence[int] | None = None,
    base: int = 0,
) -> list[nn.Parameter]:
    """Copy each parameter's value (or ``source``'s) into its slot of ``values`` (``None``:
    not this rank's to write), then re-point the parameter at its slot of ``viewed``: its old
    storage is freed before the next one is copied. Returns the parameters in slot order.
    ``indices``: only these slots (default all; frozen ones may go to another buffer, whose
    element 0 is the layout's element ``base``)."""
    by_name = dict(named_params)
    params = []
    for index in range(len(layout.slots)) if indices is None else indices:
        slot = layout.slots[index]
        param = by_name[slot.name]
        start = slot.offset - base
        if values is not None:
            view = values[start : start + slot.numel].view(slot.shape)
            if source is not None:
                source.copy_into(slot.name, view)
            else:
                copy_releasing_source(view, param)
            # Zero the alignment padding up to the next slot (Adam keeps zeros at zero).
            pad_end = layout.slots[index + 1].offset if index + 1 < len(layout.slots) else layout.numel
            values[start + slot.numel : pad_end - base].zero_()
        _repoint(param, viewed[start : start + slot.numel].view(slot.shape))
        params.append(param)
    return params


RELEASE_CHUNK_BYTES = 16 << 20
"""A parameter from this size up is copied into its slot in chunks of this size, each chunk's
source pages handed back once copied (:func:`copy_releasing_source`)."""


def copy_releasing_source(out: torch.Tensor, param: nn.Parameter) -> None:
    """``out.copy_(param)``, without a second whole copy of ``param`` at any time where it can:
    a parameter of at least :data:`RELEASE_CHUNK_BYTES` that alone uses its host storage is
    copied a chunk at a time, and each chunk's source pages go back to the system as soon as
    it is copied (``runtime/host_heap.py``: :func:`release_pages`). The migration re-points the
    parameter at its slot right after, freeing the rest: its peak is the state plus one
    chunk, not plus the largest parameter (an embedding or lm_head: 0.3 B/param of a 220M
    model). Storage that anything else uses too (a tensor of the user's ``state_dict()``, a
    view, shared or pinned memory) is copied whole and left as it was."""
    alone = _alone_in_its_storage(param)  # asked first: ``values`` below is a second user
    values = param.detach()
    if values.nbytes < RELEASE_CHUNK_BYTES or not alone:
        out.copy_(values)
        return
    source, target = values.reshape(-1), out.reshape(-1)
    step = RELEASE_CHUNK_BYTES // values.element_size()
    for start in range(0, source.numel(), step):
        end = min(start + step, source.numel())
        target[start:end].copy_(source[start:end])
        release_pages(source, start * values.element_size(), end * values.element_size())


def _alone_in_its_storage(param: nn.Parameter) -> bool:
    """Whether ``param`` is a contiguous host tensor that is all of its storage, and no other
    tensor uses that storage (so dropping its pages can change no one else's values)."""
    storage = param.untyped_storage()
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # torch's own check in swap_tensors
    return (
        use_count is not None
        and use_count(storage._cdata) == _use_count_of_a_lone_tensor()
        and param.device.type == "cpu"
        and param.is_contiguous()
        and param.storage_offset() == 0
        and storage.nbytes() == param.numel() * param.element_size()
        and not storage.is_shared()
        and not param.is_pinned()
    )


@functools.cache
def _use_count_of_a_lone_tensor() -> int:
    """The use count a storage shows, seen through its Python object, when one tensor alone
    uses it (2 in torch 2.13: the tensor's and the object's), measured rather than assumed."""
    lone = torch.empty(1)
    return torch._C._storage_Use_Count(lone.untyped_storage()._cdata)
