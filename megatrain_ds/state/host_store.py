"""Host-resident training state: one flat fp32 master buffer per block, Adam m/v beside it.

The host is the home of every persistent tensor. Each block (and the set of resident
non-block parameters) owns a :class:`HostFlatState`: page-aligned flat buffers laid out
by :mod:`megatrain_ds.state.flat_layout`. The user's parameters are re-pointed at views of
the whole weights the node holds (the master; the bf16 shadow where the master is sharded
across nodes), so the model has the trained weights without a second copy; its
``state_dict()`` reports the masters wherever they are (``checkpoint/whole_masters.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.state.flat_layout import FlatLayout, build_flat_layout


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
        span: ``[start, end)``, the elements that ``exp_avg``, ``exp_avg_sq`` and ``grad``
            hold: all of them on one node, with data parallel over several nodes this
            node's share (``distributed/data_parallel.py``: [Note: sharded host state]).
        master_sharded: whether ``master`` too holds only the ``span`` (several nodes with a
            shadow: the whole weights a node streams are the shadow, :attr:`weights_kind`).
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
    """``None``: the optimizer state covers every element (``[0, layout.numel)``)."""
    master_sharded: bool = False

    @property
    def held(self) -> tuple[int, int]:
        """``[start, end)`` of the elements the optimizer state (moments, gradients) holds."""
        return self.span if self.span is not None else (0, self.layout.numel)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state holds only part of the elements."""
        return self.held != (0, self.layout.numel)

    @property
    def master_held(self) -> tuple[int, int]:
        """``[start, end)`` of the elements ``master`` holds (:attr:`held` where it is sharded)."""
        return self.held if self.master_sharded else (0, self.layout.numel)

    @property
    def gathered(self) -> bool:
        """Whether this process keeps only its span of the weights and no whole copy: they
        are gathered from every rank's window when used (``distributed/gathered_weights.py``)."""
        return self.master_sharded and self.shadow is None

    @property
    def weights_kind(self) -> str:
        """The buffer that holds every weight on this node: ``"master"``, or ``"shadow"``
        where the master is sharded (checkpoints write the model files from it)."""
        return "shadow" if self.master_sharded else "master"

    @property
    def weights(self) -> torch.Tensor:
        """Every weight of the state (:attr:`weights_kind`): what the user's parameters view."""
        return self.shadow if self.master_sharded and self.shadow is not None else self.master

    @property
    def streamed(self) -> torch.Tensor:
        """The buffer whose bytes go to the device."""
        return self.shadow if self.shadow is not None else self.master

    def weight_view(self, slot_index: int) -> torch.Tensor:
        """Slot ``slot_index`` of :attr:`weights` (the fp32 master unless it is sharded)."""
        slot = self.layout.slots[slot_index]
        return self.weights[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Host bytes held, by kind (for memory accounting and tests)."""
        tensors = {
            "master": self.master,
            "shadow": self.shadow,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "grad": self.grad,
        }
        return {
            kind: t.numel() * t.element_size() for kind, t in tensors.items() if t is not None and not t.is_meta
        }  # meta: a moment on the NVMe tier

    def window(self, start: int, end: int) -> HostFlatState:
        """Views of elements ``[start, end)`` of every buffer, with the matching layout
        (:meth:`FlatLayout.window`): the part of this state one data-parallel rank steps,
        inside the part this node holds (:attr:`held`)."""
        first, last = self.held
        assert first <= start <= end <= last, (start, end, self.held)

        def part(tensor: torch.Tensor | None, base: int = 0) -> torch.Tensor | None:
            return None if tensor is None else tensor[start - base : end - base]

        master_first = self.master_held[0]  # a sharded master starts at the span, as the moments do
        return HostFlatState(
            layout=self.layout.window(start, end),
            master=self.master[start - master_first : end - master_first],
            shadow=part(self.shadow),
            exp_avg=self.exp_avg[start - first : end - first],
            exp_avg_sq=self.exp_avg_sq[start - first : end - first],
            grad=part(self.grad, first),
        )

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Re-point the user's parameters at their slots of ``flat`` (the shadow while the
        master is on the NVMe tier, the master again when it comes back: ``state/nvme_tier.py``)."""
        for slot, param in zip(self.layout.slots, self.params):
            _repoint(param, flat[slot.offset : slot.offset + slot.numel].view(slot.shape))

    def park_params(self) -> None:
        """Make the user's parameters meta tensors of their shapes: no host copy of the
        weights exists (the NVMe tier holds them, ``state/nvme_weights.py``), and copying
        one's values out fails instead of returning stale ones, as a ZeRO-3 model's
        partitioned parameters have none. :meth:`point_params_at` gives them values again."""
        for slot, param in zip(self.layout.slots, self.params):
            _repoint(param, torch.empty(slot.shape, dtype=self.master.dtype, device="meta"))

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


def absent_on_host(numel: int) -> torch.Tensor:
    """The placeholder of an fp32 buffer kept elsewhere (a moment or master on the NVMe tier,
    ``state/nvme_tier.py``): right dtype and size, no storage, so any use that skipped
    fetching it fails instead of reading garbage."""
    return torch.empty(numel, dtype=torch.float32, device="meta")


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
    source: TensorSource | None = None,
    shared: NodeSharedMemory | None = None,
    moments_on_host: bool = True,
    shadow_on_host: bool = True,
    span_of: SpanOf | None = None,
    share: Callable[[torch.Tensor], None] | None = None,
) -> HostFlatState:
    """Move ``named_params`` into a new flat host state, re-pointing each at its slot of the
    whole weights (the master; the shadow where the master is sharded, below).

    The master buffer is allocated untouched (no resident pages); each parameter is copied
    into its slot and re-pointed at once, which frees its old storage before the next is
    copied. So the model never exists twice in memory: the peak is the final state plus
    one parameter.

    With ``source`` each slot is filled from ``source.copy_into(name, slot)`` instead of
    the parameter's own value; parameters on the ``meta`` device (no storage) then become
    real parameters viewing their slot, keeping their identity (optimizer groups hold them).

    With ``shared`` the buffers are node-shared (``runtime/node_shared_memory.py``): only the
    node's writer copies values in; the other ranks just re-point their parameters (their
    own values are dropped, as DDP drops them for rank 0's) and must not read the state
    before :meth:`NodeSharedMemory.written`. ``share(values)``, on the writer, may replace
    the state's whole values before anything is derived from them (data parallel: the
    first node's initial weights).

    With ``moments_on_host=False`` Adam's m and v get placeholders (:func:`absent_on_host`):
    the NVMe tier holds them. With ``shadow_on_host=False`` no shadow is made: the weights
    are streamed from the tier, rounded as they are read (``state/nvme_weights.py``).

    With ``span_of`` the moments hold only the elements ``span_of(numel)`` of the state
    (this node's share, :attr:`HostFlatState.span`). Where a shadow is made the master holds
    only the span too (:attr:`HostFlatState.master_sharded`; with several nodes an NVMe tier
    is each rank's, of m and v only): the parameters view the whole shadow, and the values
    pass through a whole temporary of the state (one state more at the peak). So does a
    state that keeps only its span and no shadow (``shadow_on_host=False`` with ``span_of``:
    a rank's window of a block whose weights are gathered when used,
    ``distributed/gathered_weights.py``); its parameters are then parked (meta tensors).
    """
    layout = build_flat_layout([(name, p.shape, group_of[p]) for name, p in named_params])
    span = span_of(layout.numel) if span_of is not None else None
    first, last = span if span is not None else (0, layout.numel)
    writes = shared is None or shared.is_writer
    with_shadow = compute_dtype != master_dtype and shadow_on_host
    shadow = runtime.host_empty(layout.numel, compute_dtype, shared) if with_shadow else None
    sharded = span is not None and (shadow is not None or not shadow_on_host)
    if sharded:
        master = runtime.host_empty(last - first, master_dtype, shared)
        whole = torch.empty(layout.numel, dtype=master_dtype) if writes else None  # freed on return
        viewed = shadow if shadow is not None else whole
        assert viewed is not None, "a rank that keeps no whole weights fills its own span (no shared memory)"
        params = _fill_slots(named_params, layout, whole, viewed, source)
        if whole is not None:
            if share is not None:
                share(whole)
            if shadow is not None:
                shadow.copy_(whole)  # every weight, rounded: what the node streams
            master.copy_(whole[first:last])  # this span, exact
    else:
        master = runtime.host_empty(layout.numel, master_dtype, shared)
        params = _fill_slots(named_params, layout, master if writes else None, master, source)
        if writes and share is not None:
            share(master)
        if writes and shadow is not None:
            shadow.copy_(master)
    held = last - first
    state = HostFlatState(
        layout=layout,
        master=master,
        shadow=shadow,
        exp_avg=runtime.host_zeros(held, torch.float32, shared) if moments_on_host else absent_on_host(held),
        exp_avg_sq=runtime.host_zeros(held, torch.float32, shared) if moments_on_host else absent_on_host(held),
        params=params,
        span=span,
        master_sharded=sharded,
    )
    if sharded and shadow is None:
        state.park_params()  # no whole weights on this rank: they are gathered when used
    return state


def _fill_slots(
    named_params: Sequence[tuple[str, nn.Parameter]],
    layout: FlatLayout,
    values: torch.Tensor | None,
    viewed: torch.Tensor,
    source: TensorSource | None,
) -> list[nn.Parameter]:
    """Copy each parameter's value (or ``source``'s) into its slot of ``values`` (``None``:
    not this rank's to write), then re-point the parameter at its slot of ``viewed``: its old
    storage is freed before the next one is copied. Returns the parameters in slot order."""
    by_name = dict(named_params)
    params = []
    for index, slot in enumerate(layout.slots):
        param = by_name[slot.name]
        if values is not None:
            view = values[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if source is not None:
                source.copy_into(slot.name, view)
            else:
                view.copy_(param.detach())
            # Zero the alignment padding up to the next slot (Adam keeps zeros at zero).
            pad_end = layout.slots[index + 1].offset if index + 1 < len(layout.slots) else layout.numel
            values[slot.offset + slot.numel : pad_end].zero_()
        _repoint(param, viewed[slot.offset : slot.offset + slot.numel].view(slot.shape))
        params.append(param)
    return params
