"""AdamW kernels for flat fp32 host ranges on the CPU, and how the engine picks one.

Every kernel computes, per element (``g`` = the fp32 gradient times the clipping scale)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    shadow <- bf16(p)                                 (when the state has a shadow)

Kernels (``CPU_KERNELS``; ``"auto"`` tries them in this order):

- ``deepspeed``: DeepSpeed's CPU Adam kernel (``csrc/adam/cpu_adam_impl.cpp``: AVX2/AVX-512),
  compiled from DeepSpeed's sources with its own flags into a module of ours
  (``cpu_binding.py``'s ``_BINDING``) that runs it with the GIL released, widening,
  scaling and the shadow fused into its pass over cache-sized blocks (see the two notes
  below).
- ``torch_fused``: ATen's fused CPU Adam(W), on chunks (widening, scaling and the shadow
  are separate torch ops on each cache-resident chunk).
- ``torch``: op by op, ``torch.optim.AdamW``'s single-tensor arithmetic exactly (the
  reference, and the fallback).

[Note: the GIL and DeepSpeed's op]
The engine runs updates on its gradient worker thread while the main thread runs
backward, whose Python code needs the GIL between torch ops. DeepSpeed's own binding of
``adam_update`` (``DeepSpeedCPUAdam``, ``CPUAdamBuilder().load()``) keeps the GIL for the
whole update, so the training thread cannot run a line of Python meanwhile: a main-thread
loop of small torch ops that took 0.04 s alone took 40 s while a worker called
``adam_update`` back to back on 16M elements (``bench/optimizer.py`` measures it for every
kernel). The engine therefore compiles DeepSpeed's kernel source with a binding of its own
(``cpu_binding.py``'s ``_BINDING``) whose update releases the GIL, as every ATen op does; the arithmetic is
DeepSpeed's SIMD loop (its ``Adam_Optimizer::Step_8``), bit for bit, with two differences
that make an update independent of how a step is split into calls and of the steps before
it: a range's last elements take the SIMD loop too (in a padded buffer) instead of its
scalar loop, and the bias-correction powers come from ``pow`` at every step.

[Note: one pass over DeepSpeed's kernel]
For an fp32 gradient at scale 1 and no shadow, the engine's update is one call of
DeepSpeed's op on the range (up to the two differences above): the same split (one
contiguous share per OpenMP thread), so the same speed as ``DeepSpeedCPUAdam``
(``bench/optimizer.py``).
The engine's usual update has more to do: a bf16 gradient to widen, a clipping scale, a
bf16 shadow to write. It used to run as a Python loop over ``CHUNK_ELEMENTS`` chunks of
four thread-team launches each (widen, scale, DeepSpeed's op, shadow copy): 20-25% slower
than the fp32 call on a quiet 2-core VM, and 0.1-2.8 s instead of 0.04-0.06 s for 30M
elements once other processes shared the cores, since each of the ~230 barriers per update
waited for a descheduled thread. ``cpu_binding.py``'s ``adam_step`` does it in one OpenMP
region (8-16% slower than the fp32 call, quiet: it writes the shadow and makes two more
passes in cache): each thread takes one contiguous share (DeepSpeed's split; handing out
blocks dynamically measured 10-20% slower when both cores were shared with other
processes, and no better when quiet) and walks it in ``BLOCK_ELEMENTS`` blocks: widen and
scale the gradient into a thread-local scratch, run DeepSpeed's serial ``Step_8``, round
the fresh master into the shadow while the block is still in cache. Shares and blocks
start on multiples of every SIMD width times the kernel's unroll, so each element takes the
code path (hence gets the bits) of one whole-range call of DeepSpeed's op. The team size
is ``torch.get_num_threads()``, passed in: OpenMP keeps ``torch.set_num_threads`` per
thread, and a thread it did not start (the finish worker of
``optimizer/pipelined_finish.py``, the gradient worker) has the process default, every
CPU, instead (on the H200 the pipelined finish's AdamW ran at 2.9 G elements/s against
3.9 for the same pass on the main thread; whether the team size was the cause is unmeasured
there). ``Step_8`` opens its own
``omp parallel for if (parallel)``: called per block with ``parallel=false`` it still opens
a one-thread team, 0.7 us per block.
"""

from __future__ import annotations

import itertools
import logging

import torch

from megatrain_ds.optimizer.adamw_math import AdamHyper, BeforeChunk, adamw_update_
from megatrain_ds.optimizer.cpu_binding import load_deepspeed_op
from megatrain_ds.runtime.stream_check import declare_access

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 19
"""Elements per cache-resident chunk of the chunked kernels (and of a journaled update, whose
journal copies run between chunks): p, m, v, scratch and shadow of 512K elements (9 MiB)
stay in L3. Measured on a 2-core EPYC VM (32 MiB L3): 256K-512K chunks ran at 21-24 GB/s,
above the whole-range fp32 call (20 GB/s); 64K and below pay for three thread-pool
launches per chunk."""

BLOCK_ELEMENTS = 1 << 14
"""Elements per block of the DeepSpeed pass when it widens, scales or writes a shadow
([Note: one pass over DeepSpeed's kernel]): p, m, v, the gradient, the fp32 scratch and
the shadow of 16K elements (352 KiB) stay in one core's L2 (512 KiB on EPYC) from one
step to the next. On a quiet 2-core EPYC VM bf16+shadow ran 4% faster with 16K blocks
than with 32K and 8% faster than with 64K; the per-block team (0.7 us) is 3% of a block."""


class CpuAdamKernel:
    """AdamW on a contiguous 1-D fp32 range; subclasses supply :meth:`_update`.

    Not thread-safe (one fp32 scratch per kernel): the engine calls it from one thread at
    a time (the gradient worker during backward, the main thread at ``engine.step()``
    after the worker has drained).
    """

    name = ""
    whole_range_ok = True
    """Whether a range that needs no widening, scaling, shadow or journal may go to the op
    in one call (not where one long call would stall the GIL, or allocate temporaries)."""

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        self.chunk_numel = chunk_numel
        self._scratch = torch.empty(0)

    def step_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        shadow: torch.Tensor | None,
        *,
        step: int,
        hyper: AdamHyper,
        grad_scale: float = 1.0,
        before_chunk: BeforeChunk | None = None,
    ) -> None:
        """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (fp32) and ``shadow`` in place.

        ``grad`` (fp32 or bf16) is read only. ``step`` is the step count after incrementing.
        """
        n = param.numel()
        if n == 0:
            return
        plain = grad.dtype == torch.float32 and grad_scale == 1.0 and shadow is None and before_chunk is None
        if plain and self.whole_range_ok:
            self._update(param, grad, exp_avg, exp_avg_sq, step, hyper)
            return
        for start in range(0, n, self.chunk_numel):
            end = min(start + self.chunk_numel, n)
            if before_chunk is not None:
                before_chunk(start, end)
            chunk = param[start:end]
            self._update(
                chunk, self._fp32(grad[start:end], grad_scale), exp_avg[start:end], exp_avg_sq[start:end], step, hyper
            )
            if shadow is not None:
                shadow[start:end].copy_(chunk)  # round to nearest even, from cache

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

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        hyper: AdamHyper,
    ) -> None:
        raise NotImplementedError


class TorchFusedKernel(CpuAdamKernel):
    """ATen's fused CPU Adam(W): ``torch._fused_adamw_`` / ``torch._fused_adam_``."""

    name = "torch_fused"

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        super().__init__(chunk_numel)
        self._steps: dict[int, torch.Tensor] = {}
        # A private op (torch.optim's fused path calls it): check it runs on CPU tensors here.
        param, grad, exp_avg, exp_avg_sq = (torch.zeros(8) for _ in range(4))
        self._update(param, grad, exp_avg, exp_avg_sq, 1, AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.0, True))
        if not bool(torch.isfinite(param).all()):
            raise RuntimeError("torch._fused_adamw_ gave non-finite results on zeros")

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        hyper: AdamHyper,
    ) -> None:
        if step not in self._steps:  # the op reads the count from a tensor (it does not increment it)
            self._steps = {step: torch.tensor(float(step))}
        # Private ops (see __init__), not in torch's public names.
        op = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_  # pyright: ignore[reportPrivateImportUsage]
        beta1, beta2 = hyper.betas
        op(
            [param],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [self._steps[step]],
            lr=hyper.lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            amsgrad=False,
            maximize=False,
        )


_DEEPSPEED_IDS = itertools.count(1 << 20)
"""Optimizer ids in the module's table of DeepSpeed ``Adam_Optimizer`` objects."""


class DeepSpeedKernel(CpuAdamKernel):
    """DeepSpeed's CPU Adam kernel as one fused, GIL-free pass (:func:`load_deepspeed_op`,
    [Note: one pass over DeepSpeed's kernel])."""

    name = "deepspeed"

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS, block_numel: int = BLOCK_ELEMENTS) -> None:
        super().__init__(chunk_numel)
        self.block_numel = block_numel
        self._op = load_deepspeed_op()
        # The op fixes AdamW/Adam per id; lr, betas, eps and wd are passed at every call.
        self._ids = {mode: next(_DEEPSPEED_IDS) for mode in (True, False)}
        for mode, opt_id in self._ids.items():
            self._op.create_adam(opt_id, 1e-3, 0.9, 0.999, 1e-8, 0.0, mode, False)

    def __del__(self) -> None:
        op = getattr(self, "_op", None)
        if op is not None:
            for opt_id in self._ids.values():
                op.destroy_adam(opt_id)

    def step_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        shadow: torch.Tensor | None,
        *,
        step: int,
        hyper: AdamHyper,
        grad_scale: float = 1.0,
        before_chunk: BeforeChunk | None = None,
    ) -> None:
        """Same contract as :meth:`CpuAdamKernel.step_`: one call of the op for the range, or
        one per ``chunk_numel`` chunk when ``before_chunk`` must run in between (the journal's
        copies then leave the chunk in cache for the update)."""
        n = param.numel()
        if n == 0:
            return
        # The binding rounds shadows to bf16 only; an fp16 shadow (fp16 compute) is rounded by
        # aten after each chunk's update, while the chunk is still in cache.
        half_shadow = shadow is not None and shadow.dtype != torch.bfloat16
        if before_chunk is None and not half_shadow:
            self._fused(param, grad, exp_avg, exp_avg_sq, shadow, step, hyper, grad_scale)
            return
        for start in range(0, n, self.chunk_numel):
            end = min(start + self.chunk_numel, n)
            if before_chunk is not None:
                before_chunk(start, end)
            if half_shadow:
                assert shadow is not None
                self._fused(
                    param[start:end],
                    grad[start:end],
                    exp_avg[start:end],
                    exp_avg_sq[start:end],
                    None,
                    step,
                    hyper,
                    grad_scale,
                )
                shadow[start:end].copy_(param[start:end])  # round to nearest even
                continue
            self._fused(
                param[start:end],
                grad[start:end],
                exp_avg[start:end],
                exp_avg_sq[start:end],
                None if shadow is None else shadow[start:end],
                step,
                hyper,
                grad_scale,
            )

    def _fused(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        shadow: torch.Tensor | None,
        step: int,
        hyper: AdamHyper,
        grad_scale: float,
    ) -> None:
        beta1, beta2 = hyper.betas
        # The C++ kernel reads and writes through raw pointers, unseen by aten: tell the race checker.
        declare_access(
            reads=(grad,),
            writes=() if shadow is None else (shadow,),
            updates=(param, exp_avg, exp_avg_sq),
            what="DeepSpeed's CPU Adam kernel",
        )
        self._op.adam_step(
            self._ids[hyper.decoupled],
            step,
            hyper.lr,
            beta1,
            beta2,
            hyper.eps,
            hyper.weight_decay,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            shadow,
            grad_scale,
            self.block_numel,
            # torch's setting, also on the finish and gradient workers ([Note: one pass over
            # DeepSpeed's kernel]): OpenMP gives a thread it did not start the process default.
            torch.get_num_threads(),
        )

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        hyper: AdamHyper,
    ) -> None:
        self._fused(param, grad, exp_avg, exp_avg_sq, None, step, hyper, 1.0)


class TorchKernel(CpuAdamKernel):
    """Op-by-op torch, ``torch.optim.AdamW``'s single-tensor arithmetic exactly."""

    name = "torch"
    whole_range_ok = False  # chunks bound the temporaries it allocates

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        hyper: AdamHyper,
    ) -> None:
        adamw_update_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=hyper.lr,
            betas=hyper.betas,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            decoupled=hyper.decoupled,
        )


CPU_KERNELS: dict[str, type[CpuAdamKernel]] = {
    "deepspeed": DeepSpeedKernel,
    "torch_fused": TorchFusedKernel,
    "torch": TorchKernel,
}
AUTO_ORDER = ("deepspeed", "torch_fused", "torch")


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
            logger.warning(
                "megatrain: CPU AdamW kernel %r unavailable (%s); using %r", order[0], "; ".join(failures), name
            )
        else:
            logger.info("megatrain: CPU AdamW kernel %r", name)
        return kernel
    raise RuntimeError("no CPU AdamW kernel could run: " + "; ".join(failures))
