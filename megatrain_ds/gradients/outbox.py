"""Collects one block's parameter gradients, as backward finishes them, into buckets.

A block's backward finishes its parameters' gradients one at a time (last layer first).
Handing each to the :class:`~megatrain_ds.gradients.sink.GradientPort` as soon as it is
complete lets the host consume it while backward goes on, so at most about one bucket of
the block's gradients waits on the device instead of the whole block's. Buckets of at
least ``bucket_elements`` keep the data-parallel reducer's collectives large: a bucket is
one ``push_block``, i.e. one reduce per owner of its windows there.

[Note: complete gradients]
A parameter's gradient is handed over from its leaf's post-accumulate-grad hook, which
autograd runs only after every node that used the leaf in forward has run its backward:
no queued or later backward computation reads that parameter's weights again in this
step. Without clipping the host worker may therefore update the parameter (on the CPU:
the very buffer the block computes from) while backward goes on with the rest of the
block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain_ds.gradients.sink import GradientPort


class GradientOutbox:
    """Gradients of block ``state_index`` on their way to ``port``, for one backward."""

    def __init__(self, port: GradientPort, state_index: int, final: bool, bucket_elements: int) -> None:
        self._port = port
        self._state_index = state_index
        self._final = final
        self._bucket_elements = bucket_elements
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._pending_elements = 0
        self.sent: set[int] = set()
        """State offsets of the parameters handed over so far (pending included)."""

    def add(self, offset: int, grad: torch.Tensor) -> None:
        """Queue the flat gradient of the parameter at state ``offset``; sends the bucket
        once it holds ``bucket_elements``."""
        self._pending.append((offset, grad))
        self._pending_elements += grad.numel()
        self.sent.add(offset)
        if self._pending_elements >= self._bucket_elements:
            self.flush()

    def flush(self) -> None:
        """Send whatever is pending (call once backward is done with the block)."""
        if self._pending:
            pieces, self._pending, self._pending_elements = self._pending, [], 0
            self._port.push_block(self._state_index, pieces, self._final)

    def hook(self, offset: int) -> Callable[[torch.Tensor], None]:
        """A post-accumulate-grad hook for the parameter leaf at state ``offset``."""

        def take_gradient(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None  # the outbox holds the only reference now
            assert grad is not None
            self.add(offset, grad.reshape(-1))

        return take_gradient
