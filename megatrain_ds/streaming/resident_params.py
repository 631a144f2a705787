"""Non-block parameters (embeddings, final norm, lm_head): resident on the device.

Their fp32 master and Adam state live on the host like a block's; the model's
parameters point at a compute-dtype copy on the device, refreshed after every optimizer
step. Their gradients leave the device through the same :class:`GradientSink` as the
blocks', from a post-accumulate-grad hook, and the device gradient is freed at once --
or, for an untied embedding or output projection, in row chunks from the module's own
backward (gradients/row_chunked.py).

[Note: resident updates during backward]
Without clipping the host worker may update a resident parameter's master while
backward is still running. That is safe because the hook fires only after autograd has
accumulated every contribution to that parameter, i.e. after its last use in this
backward (a row-chunked weight's only use is its module, whose backward reads the weight
before it pushes the first chunk); and on a separate device copy the update becomes
visible only at ``refresh_device`` (after the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from megatrain_ds.gradients.row_chunked import PushFn, RowChunkedModule, redirect_row_chunked
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.node_shared_memory import NodeSharedMemory
from megatrain_ds.state.flat_layout import FROZEN_GROUP
from megatrain_ds.state.host_store import HostFlatState, SpanOf, TensorSource, migrate_to_host
from megatrain_ds.state.state_placement import StatePlacement


class ResidentParams:
    """The host state and device copy of every parameter outside the blocks.

    Args:
        named_params: ``(name, param)`` of each distinct non-block parameter.
        group_of: optimizer group of each parameter.
        runtime: device and allocation.
        master_dtype, compute_dtype: as for blocks.
        placement: where the state's buffers live (the engine's ``Placement.resident``):
            what ``migrate_to_host`` keeps of them.
        source: where the values come from instead of the parameters (see ``migrate_to_host``).
        shared: node-shared allocation (data parallel); the device copy is valid only after
            the node's writer has filled the state and :meth:`refresh_device` ran.
        span_of: this node's share of the optimizer state (see ``migrate_to_host``).
        share: data parallel: gives the node writer's values the first node's (``migrate_to_host``).
    """

    def __init__(
        self,
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
    ) -> None:
        self.state: HostFlatState = migrate_to_host(
            named_params,
            group_of,
            runtime,
            master_dtype,
            compute_dtype,
            placement,
            source=source,
            shared=shared,
            span_of=span_of,
            share=share,
        )
        if placement.on_device:  # the GPU tier: the state lives on the device, its shadow is the copy
            self.state.move_to_device(runtime)
        streamed = self.state.streamed
        if runtime.shares_host_memory or placement.on_device:
            # The CPU is its own device: the streamed host buffer is the device copy. A state
            # on the device: its streamed buffer is (``state/placement.py``: [Note: the GPU tier]).
            self.device_flat = streamed
        else:
            self.device_flat = runtime.device_empty(self.state.layout.numel, streamed.dtype)
            self.device_flat.copy_(streamed)
        for slot, param in zip(self.state.layout.slots, self.state.params):
            param.data = self.device_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._redirected: list[RowChunkedModule] = []

    @property
    def aliases_host(self) -> bool:
        return self.device_flat is self.state.streamed

    def hook_gradients(self, push: PushFn, modules: Iterable[nn.Module], chunk_elements: int) -> None:
        """Send each parameter's gradient to ``push`` as soon as backward has finished it.

        The weight of an embedding or output projection among ``modules`` that no other
        module shares goes in chunks of about ``chunk_elements`` from the module's own
        backward (gradients/row_chunked.py): no dense gradient of it ever exists. Any other
        parameter goes whole, from a post-accumulate-grad hook.
        """
        slot_of = {id(param): slot for slot, param in zip(self.state.layout.slots, self.state.params)}
        owners: dict[int, list[nn.Module]] = {}
        for module in modules:
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), []).append(module)
        chunked: dict[int, RowChunkedModule] = {}
        for param_id, users in owners.items():
            is_weight = len(users) == 1 and id(getattr(users[0], "weight", None)) == param_id
            if param_id in slot_of and is_weight and slot_of[param_id].group != FROZEN_GROUP:
                redirected = redirect_row_chunked(users[0], slot_of[param_id].offset, push, chunk_elements)
                if redirected is not None:
                    chunked[param_id] = redirected
        self._redirected = list(chunked.values())

        for slot, param in zip(self.state.layout.slots, self.state.params):
            if param.requires_grad and slot.group == FROZEN_GROUP:
                # In no optimizer group: frozen, though it requires grad. The state holds no
                # gradient for it (the blocks compute none: streaming/streamed_blocks.py);
                # dropped, so none piles up on the device.
                self._hooks.append(param.register_post_accumulate_grad_hook(_drop_gradient))
            elif param.requires_grad:
                hook = _make_gradient_hook(push, slot.offset, slot.name, chunked.get(id(param)))
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def row_chunked(self, module: nn.Module) -> RowChunkedModule | None:
        """The row-chunked redirect of ``module``'s weight gradient, if it has one."""
        return next((r for r in self._redirected if r.module is module), None)

    def unhook_gradients(self) -> None:
        """Give the redirected modules their own ``forward`` back and remove the hooks."""
        for redirected in self._redirected:
            redirected.restore()
        for handle in self._hooks:
            handle.remove()
        self._redirected, self._hooks = [], []

    def refresh_device(self) -> None:
        """Copy the updated weights to the device (queued on the compute stream, so it is
        ordered after the backward that last read them and before the next forward)."""
        if not self.aliases_host:
            self.device_flat.copy_(self.state.streamed, non_blocking=True)


def _make_gradient_hook(
    push: PushFn, offset: int, name: str, redirected: RowChunkedModule | None
) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook that sends a finished gradient to ``push``.

    A row-chunked weight has sent its gradient from its module's backward already; autograd
    still runs this hook, with no gradient, unless the weight was also used elsewhere --
    a gradient the chunks do not include, and which, sent on its own, the optimizer would
    take for a second, separate gradient: that fails instead.
    """

    def hook(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None  # the device copy is freed once the sink's copy is done
        if grad is None:
            return
        if redirected is not None and redirected.chunked:
            raise RuntimeError(
                f"parameter {name!r} received a gradient from outside its own module; megatrain sends this "
                "weight's gradient from the module's backward in row chunks and cannot add one from "
                "elsewhere. Use the weight only through its module (or tie it, as tied embeddings are)"
            )
        push(offset, grad.reshape(-1))

    return hook


def _drop_gradient(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a parameter that is trained by no optimizer group."""
    param.grad = None
