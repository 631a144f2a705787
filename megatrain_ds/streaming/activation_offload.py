"""Activation checkpoints parked in host memory between forward and backward.

With ``offload_checkpoints`` each segment's checkpoint (the block input that carries
gradient, ``T x hidden`` values) is copied to the host on the d2h stream during forward
-- a direction otherwise idle in forward -- and copied back on the h2d stream, together
with the segment's first weights, just before its backward. The device then holds only
the checkpoints in flight, so device memory does not grow with depth. The price is
``2 * T * hidden`` bytes more host->device traffic per segment in backward; keep
checkpoints on the device (``offload_checkpoints: false``) when they fit.

[Note: checkpoint ordering]
- offload: the d2h stream waits for the compute that produced the tensor; the device
  tensor is marked used by the d2h stream (``runtime.used_on``: ``record_stream``) so the
  caching allocator cannot reuse its memory before the copy has read it.
- prefetch: the h2d stream waits for the offload copy (``copied``), copies into a tensor
  allocated on the h2d stream, and records ``ready``; ``take`` makes the compute stream
  wait on ``ready`` and marks the tensor used by the compute stream (it was allocated on
  the h2d stream, which would otherwise reuse it as soon as backward drops it: a model
  that checkpoints its own layers drops it before the h2d stream has waited for that
  compute).
- pinned host tensors come from PyTorch's caching host allocator
  (``runtime.pinned_empty``), which itself keeps a block alive until the copies that use
  it have completed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime, Event


@dataclass
class HostCheckpoint:
    """One activation checkpoint, on the host, possibly on its way back to the device."""

    host: torch.Tensor
    copied: Event
    device: torch.Tensor | None = None
    ready: Event | None = None

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class ActivationOffloader:
    """Moves activation checkpoints device->host in forward and back in backward."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self.device_bytes_in_flight = 0

    def offload(self, tensor: torch.Tensor) -> HostCheckpoint:
        runtime = self.runtime
        produced = runtime.event()
        produced.record(runtime.compute_stream())
        host = runtime.pinned_empty(tensor.shape, tensor.dtype)
        copied = runtime.event()
        with runtime.on(runtime.d2h_stream):
            runtime.d2h_stream.wait_event(produced)  # read the finished activation
            host.copy_(tensor, non_blocking=True)
            copied.record(runtime.d2h_stream)
        runtime.used_on(tensor, runtime.d2h_stream)  # forward drops it before the copy has run
        return HostCheckpoint(host, copied)

    def prefetch(self, checkpoint: HostCheckpoint) -> None:
        """Start copying ``checkpoint`` back to the device (idempotent)."""
        if checkpoint.device is not None:
            return
        runtime = self.runtime
        checkpoint.ready = runtime.event()
        with runtime.on(runtime.h2d_stream):
            runtime.h2d_stream.wait_event(checkpoint.copied)  # the host copy is complete
            checkpoint.device = torch.empty(checkpoint.host.shape, dtype=checkpoint.host.dtype, device=runtime.device)
            checkpoint.device.copy_(checkpoint.host, non_blocking=True)
            checkpoint.ready.record(runtime.h2d_stream)
        self.device_bytes_in_flight += checkpoint.nbytes

    def take(self, checkpoint: HostCheckpoint) -> torch.Tensor:
        """The checkpoint on the device, ready for the compute stream; frees the host copy."""
        self.prefetch(checkpoint)
        runtime = self.runtime
        compute = runtime.compute_stream()
        compute.wait_event(checkpoint.ready)  # the device copy has landed
        tensor = checkpoint.device
        assert tensor is not None
        runtime.used_on(tensor, compute)  # allocated on the h2d stream, used and freed on this one
        self.device_bytes_in_flight -= checkpoint.nbytes
        checkpoint.device = None
        return tensor
