"""A micro-batch's gradient chunk into the held fp32 gradients: one GIL-free pass on the worker.

With gradient accumulation (or fp16) the held gradients are fp32 and each chunk of a
micro-batch reaches the gradient worker staged (``gradients/sink.py``): the first write of
the step widens it into place, a later one adds it, fp16 divides by the loss scale, and
on the final micro-batch the step's squared norm takes the chunk's sum of squares. As torch
ops that was ``copy_``/``add_`` and then ``vector_norm`` and ``float()``: two OpenMP
regions and several GIL re-acquisitions per chunk, while backward's autograd thread runs
the blocks' recompute in Python (``bench/gradient_worker.py``: the worker fell to a
quarter of its rate beside a busy Python thread).

[Note: the fused accumulation pass]
:meth:`HostAccumulation.accumulate_` makes that one call of the engine's C++ binding
(``accumulate_grad`` in ``cpu_binding.py``'s ``_BINDING``, the module DeepSpeed's CPU Adam
kernel is built into: one build, its name carrying the binding's hash). Arguments are
checked with the GIL held; the pass runs without it, in one OpenMP region of torch's
thread count, each thread on fixed 16K-element blocks.

- **The held values, bit for bit torch's.** Each element is ``held + widen(g) * s`` (or
  ``widen(g) * s`` on the step's first write) in fp32, one rounding, as ``add_``/``copy_``
  compute it: widening bf16 and fp16 is exact, and the scale ``s`` (1, or fp16's ``1 /
  loss scale``) is taken only when it is a power of two, so ``widen(g) * s`` is exact and
  a fused multiply-add rounds as a multiply then an add. Any other scale, a held dtype
  other than fp32, or a non-contiguous chunk takes the torch ops.
- **The sum of squares, in fp64 in a fixed order.** On the final micro-batch the pass
  also returns ``sum(held**2)`` over the chunk: each square exact in fp64, summed in 16
  lanes per block (element ``i`` in lane ``i mod 16``), the lanes and then the blocks
  added in order -- so the bits depend on the values alone, not on the team size. The
  torch path instead squares an fp32 ``vector_norm`` (``SquaredNorm.add_on_host``), whose
  relative error is about ``log2(n) * 2**-24``; this sum's is below ``n * 2**-53``. The
  step's norm therefore moves by less than an fp32 norm's own error, and stays
  deterministic: chunks still add to ``SquaredNorm`` in push order.
- **Accumulating on the device instead** (the alternative issue 42 names) would keep an
  fp32 accumulator of every held gradient on the device across the micro-batches and copy
  it once, on the final one, straight into the held gradients with its norm on the device
  (the path without accumulation): no host pass at all, 4 B/param of device memory. It
  needs a placement decision (device memory against the largest model that fits), the
  first-write ledger (``gradients/held_writes.py``) moved to the device buffers, a flush of
  them before a checkpoint taken inside an accumulation window, and the data-parallel
  reducer's buckets adding there; on the CPU the "device" is the host, so only a GPU run
  could measure what it saves. The host pass is what this CPU machine can measure, and it
  is what every configuration falls back to when the accumulators do not fit.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatrain_ds.optimizer.cpu_adam import CpuAdamKernel, DeepSpeedKernel
from megatrain_ds.optimizer.cpu_binding import load_deepspeed_op
from megatrain_ds.optimizer.loss_scaling import LossScaling
from megatrain_ds.runtime.stream_check import declare_access

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Gradient chunk dtypes the fused pass widens."""


class HostAccumulation:
    """Writes or adds a staged chunk into held fp32 gradients (on the gradient worker).

    Args:
        op: the engine's C++ binding (:func:`~megatrain_ds.optimizer.cpu_binding.load_deepspeed_op`);
            ``None``: torch ops (``LossScaling.unscale_into_``), the step's norm then summed
            by ``SquaredNorm.add_on_host`` as before.
    """

    def __init__(self, op: Any | None) -> None:
        self._op = op

    @classmethod
    def for_kernel(cls, kernel: CpuAdamKernel) -> HostAccumulation:
        """Fused where the engine's CPU AdamW kernel is DeepSpeed's (its binding is loaded
        already); torch ops where the user chose another kernel or the op could not build."""
        return cls(load_deepspeed_op() if isinstance(kernel, DeepSpeedKernel) else None)

    @property
    def fused(self) -> bool:
        return self._op is not None

    def accumulate_(
        self, held: torch.Tensor, grad: torch.Tensor, scaling: LossScaling, *, overwrite: bool, squares: bool
    ) -> float | None:
        """``held = grad / scale`` (``overwrite``: the step's first write of these elements)
        or ``held += grad / scale`` ([Note: the fused accumulation pass]).

        Returns the sum of the new ``held``'s squares when ``squares`` and the pass was
        fused; ``None`` when the caller must still sum the norm (``squares`` false, or the
        torch ops ran)."""
        scale = 1.0 / scaling.scale if scaling.enabled else 1.0
        op = self._op
        if op is None or not self._fusable(held, grad, scale):
            scaling.unscale_into_(held, grad, overwrite=overwrite)
            return None
        # The binding reads and writes through raw pointers, unseen by aten: tell the race checker.
        if overwrite:
            declare_access(reads=(grad,), writes=(held,), what="the fused gradient accumulation")
        else:
            declare_access(reads=(grad,), updates=(held,), what="the fused gradient accumulation")
        # torch's intra-op thread count, read on this thread (torch sets its OpenMP team from it).
        total = op.accumulate_grad(held, grad, scale, overwrite, squares, torch.get_num_threads())
        return float(total) if squares else None

    @staticmethod
    def _fusable(held: torch.Tensor, grad: torch.Tensor, scale: float) -> bool:
        return (
            held.dtype == torch.float32
            and grad.dtype in FUSED_DTYPES
            and held.device.type == "cpu"
            and grad.device.type == "cpu"
            and held.is_contiguous()
            and grad.is_contiguous()
            and held.numel() == grad.numel()
            and math.frexp(scale)[0] == 0.5  # a power of two: the product is exact
        )
