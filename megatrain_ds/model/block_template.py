"""Stateless block templates: one weightless module per distinct block structure.

A template is a copy of a block whose parameters live on the ``meta`` device (no memory
anywhere). To run block ``i`` the engine *binds* views of the streamed device buffer to
the template with ``torch.func.functional_call``: no device-to-device copy, no
per-block device module. Per-block scalar attributes that differ between blocks of one
structure (``layer_idx``, a sliding-window flag) are set on the template before each call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from megatrain_ds.model import layer_checkpointing
from megatrain_ds.model.block_discovery import BlockDiscoveryError
from megatrain_ds.state.flat_layout import FlatLayout

_SCALAR_TYPES = (bool, int, float, str, type(None))


def structure_key(block: nn.Module) -> tuple:
    """Blocks with equal keys can share a template: same module classes, shapes, dtypes."""
    modules = tuple((name, type(module)) for name, module in block.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers())
    return modules, params, buffers


def _scalar_attributes(block: nn.Module) -> dict[tuple[str, str], Any]:
    found = {}
    for path, module in block.named_modules():
        for attr, value in vars(module).items():
            # ``training`` is set from the live block on every call (see ``run``); the
            # checkpointing flag stays off ([Note: layer checkpointing]).
            if (
                not attr.startswith("_")
                and attr not in ("training", layer_checkpointing.FLAG)
                and isinstance(value, _SCALAR_TYPES)
            ):
                found[(path, attr)] = value
    return found


class BlockTemplate:
    """A weightless copy of one block structure that runs any block of that structure.

    Args:
        block: the first block of this structure (its buffers are copied to ``device``).
        device: where the template's buffers live and the block computes.
    """

    def __init__(self, block: nn.Module, device: torch.device) -> None:
        # The memo makes deepcopy reuse a meta tensor for every parameter instead of
        # copying its data: the template costs no memory for weights.
        memo = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in block.parameters()
        }
        self.module = copy.deepcopy(block, memo)
        # The engine checkpoints and recomputes blocks itself ([Note: layer checkpointing]).
        layer_checkpointing.switch_off(self.module)
        for sub in self.module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[name] = buffer.to(device)
        self._reference_buffers = dict(block.named_buffers())
        self._reference_scalars = _scalar_attributes(block)
        self._varying: set[tuple[str, str]] = set()
        self._part_modules = _part_modules(self.module)
        self._before_part: Callable[[int], None] | None = None
        self._fired: list[int] = []
        """Parts whose hook fired in the current run, in the order they first did."""
        self.part_order: list[int] = []
        """Parts in the order the first run with ``before_part`` used them (then the others)."""
        self._unhooked: set[int] | None = None
        """Parts not called on the first run with ``before_part``; ``None`` before it."""
        for index, module in enumerate(self._part_modules, start=1):
            module.register_forward_pre_hook(lambda *_, index=index: self._enter_part(index))

    def admit(self, block: nn.Module, index: int) -> None:
        """Check that ``block`` can run on this template and note what differs."""
        for name, buffer in block.named_buffers():
            if not torch.equal(buffer, self._reference_buffers[name]):
                raise BlockDiscoveryError(
                    f"buffer {name} of block {index} differs from the other blocks of its "
                    "structure; the engine shares buffers between blocks of one structure"
                )
        for key, value in _scalar_attributes(block).items():
            if self._reference_scalars.get(key) != value:
                self._varying.add(key)

    def scalar_overrides(self, block: nn.Module) -> dict[tuple[str, str], Any]:
        """The values ``block`` needs set on the template (all varying attributes)."""
        own = _scalar_attributes(block)
        return {key: own[key] for key in self._varying}

    def parts(self) -> list[list[str]] | None:
        """Parameter names by *part*: 0, the block module's own; then each direct submodule's
        (a container's items one by one), waited on when it is called
        (``streaming/weight_fragments.py``). A submodule the first run with ``before_part``
        did not call is part 0. ``None`` before that run: which are called is not known."""
        if self._unhooked is None:
            return None
        own = [name for name, _ in self.module.named_parameters(recurse=False)]
        parts: list[list[str]] = [own]
        prefixes = {id(module): name for name, module in self.module.named_modules()}
        for index, module in enumerate(self._part_modules, start=1):
            names = [f"{prefixes[id(module)]}.{name}" for name, _ in module.named_parameters()]
            if index in self._unhooked:
                own.extend(names)
                names = []
            parts.append(names)
        return parts

    def parts_in_use(self) -> tuple[list[list[str]], list[int]] | None:
        """:meth:`parts` and :attr:`part_order` together; ``None`` before the first run."""
        parts = self.parts()
        return None if parts is None else (parts, self.part_order)

    def _enter_part(self, index: int) -> None:
        if self._before_part is not None:
            if index not in self._fired:
                self._fired.append(index)
            self._before_part(index)

    @staticmethod
    def bind(flat_weights: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
        """Views of ``flat_weights`` (1-D, ``layout.numel`` long), one per slot, in slot order."""
        chunks = flat_weights.split(layout.split_sizes)  # what torch.split runs; typed for tuples too
        return [chunks[slot.split_index].view(slot.shape) for slot in layout.slots]

    def run(
        self,
        params: Sequence[torch.Tensor],
        layout: FlatLayout,
        overrides: dict[tuple[str, str], Any],
        training: bool,
        args: tuple,
        kwargs: dict[str, Any],
        before_part: Callable[[int], None] | None = None,
    ) -> Any:
        """Run a block whose parameters are ``params`` (from :meth:`bind`, slot order);
        ``before_part(i)`` is called before part ``i`` of :meth:`parts` computes."""
        named = {slot.name: param for slot, param in zip(layout.slots, params)}
        for (path, attr), value in overrides.items():
            setattr(self.module.get_submodule(path), attr, value)
        if self.module.training != training:
            self.module.train(training)
        if before_part is None:
            return functional_call(self.module, named, args, kwargs, tie_weights=False)
        self._before_part, self._fired = before_part, []
        try:
            before_part(0)
            return functional_call(self.module, named, args, kwargs, tie_weights=False)
        finally:
            self._before_part = None
            if self._unhooked is None:  # the first run: learn which parts are called, and when
                self._unhooked = set(range(1, len(self._part_modules) + 1)) - set(self._fired)
                self.part_order = [0, *self._fired, *sorted(self._unhooked)]


def _part_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules whose forward pre-hooks mark a part: the direct children, with the
    items of containers (never called themselves) in their place."""
    found = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found.extend(_part_modules(child))
        elif any(True for _ in child.parameters()):
            found.append(child)
    return found
