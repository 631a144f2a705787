"""AdamW kernels for flat fp32 host ranges on the CPU, and how the engine picks one.

Every kernel computes, per element (``g`` = the fp32 gradient times the clipping scale)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    shadow <- bf16(p)                                 (when the state has a shadow)

Kernels (``CPU_KERNELS``; ``"auto"`` tries them in this order):

- ``torch_fused``: ATen's fused CPU Adam(W) (``torch._fused_adamw_``, what
  ``torch.optim.AdamW(fused=True)`` runs on the CPU): one vectorised, multi-threaded pass
  over p, g, m, v, and the GIL is released while it runs. Ships with torch: no build.
- ``deepspeed``: DeepSpeed's ``cpu_adam`` op (AVX2/AVX-512 + OpenMP), JIT-compiled on
  first use (25-110 s, then cached in ``~/.cache/torch_extensions``). As fast as
  ``torch_fused`` in ``bench/optimizer.py``, but it holds the GIL: see
  ``[Note: the GIL and DeepSpeed's op]``.
- ``torch``: op-by-op torch (:func:`megatrain_ds.host_adamw.adamw_update_`), exactly
  ``torch.optim.AdamW``'s single-tensor arithmetic; several passes and temporaries, the
  slowest. The fallback when neither op can run.

Numerics against ``torch.optim.AdamW`` (single-tensor path), all fp32: ``torch_fused``
uses the same formula with multiply-adds fused; after 5 steps 1.7% of parameters differ
by one ulp, m is bitwise equal (AdamW). ``deepspeed`` rounds its bias corrections in fp32
(``beta^t`` accumulated in float, ``1 / sqrt(1 - b2^t)`` multiplied rather than divided)
and fuses multiply-adds: a few ulps per step. Both are far inside the engine's parity
tolerance (2e-6 relative weight error after 5 steps; ``tests/test_optimizer_placement.py``).

[Note: bf16 gradients and the shadow]
Neither op reads a bf16 gradient next to an fp32 master, nor writes a bf16 copy of the
result (DeepSpeed 0.19's ``adam_update`` has no such output; its old ``adam_update_copy``
is gone). So a kernel walks its range in chunks of ``CHUNK_ELEMENTS``: the gradient chunk
is widened (and multiplied by the clipping scale) into an fp32 scratch, the op updates the
chunk, and the shadow chunk is rounded from the master while that is still in cache. A
chunk of p, m, v, the scratch and the shadow is 4.5 MiB: it stays in L2/L3, so the extra
passes cost almost no DRAM traffic (28 bytes per element in all: read p, g, m, v, write
p, m, v, shadow). Only when the gradient is fp32, the scale 1 and there is no shadow or
journal (fp32 compute, no clipping) does the op get the whole range in one call.

[Note: the GIL and DeepSpeed's op]
The engine runs updates on its gradient worker thread while the main thread runs
backward, whose Python code needs the GIL between torch ops. ``torch_fused`` releases the
GIL like every ATen op. DeepSpeed's pybind binding of ``adam_update`` does not: while it
runs, the training thread cannot execute a line of Python. ``bench/optimizer.py``
measures the effect: a main-thread loop of small torch ops that takes 0.04 s alone took
40 s with a worker calling ``adam_update`` back to back on 16M elements. The ``deepspeed``
kernel therefore calls the op one chunk at a time and sleeps for zero seconds between
chunks (which releases the GIL), bounding each stall of the training thread to one chunk
(~0.1-0.5 ms); ``torch_fused`` is preferred by ``"auto"`` for this reason.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 18
"""Elements per cache-resident chunk (see [Note: bf16 gradients and the shadow]); 256K
fp32 elements keep p, m, v, scratch and shadow (4.5 MiB) within L2 + a slice of L3."""

BeforeChunk = Callable[[int, int], None]
"""``before_chunk(start, end)``: called before elements ``[start, end)`` of the range are
overwritten (the speculative step journals them; ``speculative_step.py``)."""


@dataclass(frozen=True)
class AdamHyper:
    """One optimizer group's hyperparameters for one update."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool
    """AdamW (True) or Adam with L2 regularisation folded into the gradient (False)."""


class CpuAdamKernel:
    """AdamW on a contiguous 1-D fp32 range; subclasses supply :meth:`_update`.

    Not thread-safe (one fp32 scratch per kernel): the engine calls it from one thread at
    a time (the gradient worker during backward, the main thread at ``engine.step()``
    after the worker has drained).
    """

    name = ""

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        self.chunk_numel = chunk_numel
        self._scratch = torch.empty(0)

    def step_(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, shadow: torch.Tensor | None, *, step: int, hyper: AdamHyper,
              grad_scale: float = 1.0, before_chunk: BeforeChunk | None = None,
              inputs_persist: bool = True) -> None:
        """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (fp32) and ``shadow`` in place.

        ``grad`` (fp32 or bf16) is read only. ``step`` is the step count after incrementing.
        ``inputs_persist`` concerns the device placement only (same signature).
        """
        del inputs_persist  # CPU work is done when this returns
        n = param.numel()
        if n == 0:
            return
        if grad.dtype == torch.float32 and grad_scale == 1.0 and shadow is None and before_chunk is None \
                and self._whole_range_ok:
            self._update(param, grad, exp_avg, exp_avg_sq, step, hyper)
            return
        for start in range(0, n, self.chunk_numel):
            end = min(start + self.chunk_numel, n)
            if before_chunk is not None:
                before_chunk(start, end)
            chunk = param[start:end]
            self._update(chunk, self._fp32(grad[start:end], grad_scale), exp_avg[start:end],
                         exp_avg_sq[start:end], step, hyper)
            if shadow is not None:
                shadow[start:end].copy_(chunk)  # round to nearest even, from cache
            self._between_chunks()

    _whole_range_ok = True
    """Whether a range may go to the op in one call (False where that would stall the GIL)."""

    def _fp32(self, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """``grad`` as fp32 times ``scale``: the gradient itself when nothing changes."""
        if grad.dtype == torch.float32 and scale == 1.0:
            return grad
        if self._scratch.numel() < grad.numel():
            self._scratch = torch.empty(self.chunk_numel)
        scratch = self._scratch[: grad.numel()]
        scratch.copy_(grad)
        if scale != 1.0:
            # The same rounding as ``grad * scale`` in the reference (scale rounded to fp32).
            scratch.mul_(scale)
        return scratch

    def _between_chunks(self) -> None:
        pass

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        raise NotImplementedError


class TorchFusedKernel(CpuAdamKernel):
    """ATen's fused CPU Adam(W): ``torch._fused_adamw_`` / ``torch._fused_adam_``."""

    name = "torch_fused"

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        super().__init__(chunk_numel)
        self._steps: dict[int, torch.Tensor] = {}
        # A private op (torch.optim's fused path calls it): check it runs on CPU tensors here.
        probe = [torch.zeros(8) for _ in range(4)]
        self._update(*probe, 1, AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.0, True))
        if not bool(torch.isfinite(probe[0]).all()):
            raise RuntimeError("torch._fused_adamw_ gave non-finite results on zeros")

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        if step not in self._steps:  # the op reads the count from a tensor (it does not increment it)
            self._steps = {step: torch.tensor(float(step))}
        op = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
        beta1, beta2 = hyper.betas
        op([param], [grad], [exp_avg], [exp_avg_sq], [], [self._steps[step]], lr=hyper.lr, beta1=beta1,
           beta2=beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False, maximize=False)


_DEEPSPEED_IDS = itertools.count(1 << 20)
"""Optimizer ids in DeepSpeed's process-wide table, far from ``DeepSpeedCPUAdam``'s (from 0)."""


class DeepSpeedKernel(CpuAdamKernel):
    """DeepSpeed's ``cpu_adam`` op, one chunk at a time (see [Note: the GIL and DeepSpeed's op])."""

    name = "deepspeed"
    _whole_range_ok = False

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        super().__init__(chunk_numel)
        from deepspeed.ops.op_builder import CPUAdamBuilder  # JIT build on first use

        self._op = CPUAdamBuilder().load()
        # The op fixes AdamW/Adam per id; lr, betas, eps and wd are passed at every call.
        self._ids = {mode: next(_DEEPSPEED_IDS) for mode in (True, False)}
        for mode, opt_id in self._ids.items():
            self._op.create_adam(opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, mode, False)

    def __del__(self) -> None:
        op = getattr(self, "_op", None)
        if op is not None:
            for opt_id in self._ids.values():
                op.destroy_adam(opt_id)

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        beta1, beta2 = hyper.betas
        self._op.adam_update(self._ids[hyper.decoupled], step, hyper.lr, beta1, beta2, hyper.eps,
                             hyper.weight_decay, True, param, grad, exp_avg, exp_avg_sq)

    def _between_chunks(self) -> None:
        time.sleep(0)  # releases the GIL the op held: the training thread may run a line


class TorchKernel(CpuAdamKernel):
    """Op-by-op torch, ``torch.optim.AdamW``'s single-tensor arithmetic exactly."""

    name = "torch"
    _whole_range_ok = False  # chunks bound the temporaries it allocates

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        from megatrain_ds.host_adamw import adamw_update_

        adamw_update_(param, grad, exp_avg, exp_avg_sq, step=step, lr=hyper.lr, betas=hyper.betas,
                      eps=hyper.eps, weight_decay=hyper.weight_decay, decoupled=hyper.decoupled)


CPU_KERNELS: dict[str, type[CpuAdamKernel]] = {
    "torch_fused": TorchFusedKernel,
    "deepspeed": DeepSpeedKernel,
    "torch": TorchKernel,
}
AUTO_ORDER = ("torch_fused", "deepspeed", "torch")


def make_cpu_kernel(choice: str = "auto") -> CpuAdamKernel:
    """The kernel named ``choice`` (or the first of ``AUTO_ORDER`` that works), falling back
    along ``AUTO_ORDER`` with a logged reason when it cannot run here."""
    order = AUTO_ORDER if choice == "auto" else (choice, *(n for n in AUTO_ORDER if n != choice))
    failures = []
    for name in order:
        try:
            kernel = CPU_KERNELS[name]()
        except Exception as error:  # a failed JIT build, a torch without the op, ...
            failures.append(f"{name}: {type(error).__name__}: {error}")
            continue
        if failures:
            logger.warning("megatrain: CPU AdamW kernel %r unavailable (%s); using %r",
                           order[0], "; ".join(failures), name)
        else:
            logger.info("megatrain: CPU AdamW kernel %r", name)
        return kernel
    raise RuntimeError("no CPU AdamW kernel could run: " + "; ".join(failures))
