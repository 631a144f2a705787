"""Non-block parameters (embeddings, final norm, lm_head): resident on the device.

Their fp32 master and Adam state live on the host like a block's; the model's
parameters point at a compute-dtype copy on the device, refreshed after every optimizer
step. Their gradients leave the device through the same :class:`GradientSink` as the
blocks', from a post-accumulate-grad hook, and the device gradient is freed at once.

[Note: resident updates during backward]
Without clipping the host worker may update a resident parameter's master while
backward is still running. That is safe because the hook fires only after autograd has
accumulated every contribution to that parameter, i.e. after its last use in this
backward; and on a separate device copy the update becomes visible only at
``refresh_device`` (after the optimizer step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from megatrain_ds.device_runtime import DeviceRuntime
from megatrain_ds.host_store import HostFlatState, TensorSource, migrate_to_host
from megatrain_ds.node_shared_memory import NodeSharedMemory

PushFn = Callable[[int, torch.Tensor], None]
"""``push(offset, flat_device_grad)``: hand a gradient to the sink."""


class ResidentParams:
    """The host state and device copy of every parameter outside the blocks.

    Args:
        named_params: ``(name, param)`` of each distinct non-block parameter.
        group_of: optimizer group of each parameter.
        runtime: device and allocation.
        master_dtype, compute_dtype: as for blocks.
        source: where the values come from instead of the parameters (see ``migrate_to_host``).
        shared: node-shared allocation (data parallel); the device copy is valid only after
            the node's writer has filled the state and :meth:`refresh_device` ran.
    """

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]],
                 group_of: dict[nn.Parameter, int], runtime: DeviceRuntime,
                 master_dtype: torch.dtype, compute_dtype: torch.dtype,
                 source: TensorSource | None = None, shared: NodeSharedMemory | None = None) -> None:
        self.state: HostFlatState = migrate_to_host(named_params, group_of, runtime, master_dtype,
                                                    compute_dtype, source=source, shared=shared)
        streamed = self.state.streamed
        if runtime.device.type == "cpu":
            # The CPU is its own device: the streamed host buffer is the device copy.
            self.device_flat = streamed
        else:
            self.device_flat = runtime.device_empty(self.state.layout.numel, streamed.dtype)
            self.device_flat.copy_(streamed)
        for slot, param in zip(self.state.layout.slots, self.state.params):
            param.data = self.device_flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def aliases_host(self) -> bool:
        return self.device_flat is self.state.streamed

    def hook_gradients(self, push: PushFn) -> None:
        """Send each parameter's gradient to ``push`` as soon as backward has finished it."""
        for slot, param in zip(self.state.layout.slots, self.state.params):
            if not param.requires_grad:
                continue

            def hook(p: torch.Tensor, offset: int = slot.offset) -> None:
                grad = p.grad
                p.grad = None  # the device copy is freed once the sink's copy is done
                push(offset, grad.reshape(-1))

            self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def refresh_device(self) -> None:
        """Copy the updated weights to the device (queued on the compute stream, so it is
        ordered after the backward that last read them and before the next forward)."""
        if not self.aliases_host:
            self.device_flat.copy_(self.state.streamed, non_blocking=True)

    def master_by_param(self) -> dict[int, torch.Tensor]:
        """``id(param) -> fp32 master view`` for ``state_dict``."""
        return {id(p): self.state.master_view(i) for i, p in enumerate(self.state.params)}
