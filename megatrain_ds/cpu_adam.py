"""AdamW kernels for flat fp32 host ranges on the CPU, and how the engine picks one.

Every kernel computes, per element (``g`` = the fp32 gradient times the clipping scale)::

    decoupled (AdamW): p <- p * (1 - lr * wd)        else (Adam + L2): g <- g + wd * p
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g * g
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    shadow <- bf16(p)                                 (when the state has a shadow)

Kernels (``CPU_KERNELS``; ``"auto"`` tries them in this order):

- ``deepspeed``: DeepSpeed's CPU Adam kernel (``csrc/adam/cpu_adam_impl.cpp``: AVX2/AVX-512
  + OpenMP), built from DeepSpeed's sources with its own flags but a binding that releases
  the GIL (see [Note: the GIL and DeepSpeed's op]
The engine runs updates on its gradient worker thread while the main thread runs
backward, whose Python code needs the GIL between torch ops. DeepSpeed's own binding of
``adam_update`` (``DeepSpeedCPUAdam``, ``CPUAdamBuilder().load()``) keeps the GIL for the
whole update, so the training thread cannot run a line of Python meanwhile: a main-thread
loop of small torch ops that took 0.04 s alone took 40 s while a worker called
``adam_update`` back to back on 16M elements (``bench/optimizer.py`` measures it for every
kernel). The engine therefore compiles DeepSpeed's kernel source with a three-function
binding of its own (:data:`_GIL_FREE_BINDING`) whose update releases the GIL, as every
ATen op does; the kernel and its numerics are DeepSpeed's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 19
"""Elements per cache-resident chunk (see [Note: bf16 gradients and the shadow]): p, m, v,
scratch and shadow of 512K elements (9 MiB) stay in L3. Measured on a 2-core EPYC VM
(32 MiB L3): 256K-512K chunks ran at 21-24 GB/s, above the whole-range fp32 call
(20 GB/s); 64K and below pay for three thread-pool launches per chunk."""

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
    whole_range_ok = True
    """Whether a range that needs no widening, scaling, shadow or journal may go to the op
    in one call (not where one long call would stall the GIL, or allocate temporaries)."""

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
        plain = grad.dtype == torch.float32 and grad_scale == 1.0 and shadow is None and before_chunk is None
        if plain and self.whole_range_ok:
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
"""Optimizer ids in the op's process-wide table (``DeepSpeedCPUAdam`` counts from 0)."""

# DeepSpeed's kernel (csrc/adam/cpu_adam_impl.cpp) with the entry points the engine uses,
# bound so that the GIL is released while the update runs (DeepSpeed's own binding,
# csrc/adam/cpu_adam.cpp, keeps it: see [Note: the GIL and DeepSpeed's op]). Arguments are
# converted before the release and nothing in the call touches Python objects.
_GIL_FREE_BINDING = """
#include <torch/extension.h>
#include "cpu_adam.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("adam_update", &ds_adam_step, "DeepSpeed CPU Adam update, GIL released",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed CPU Adam create");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed CPU Adam destroy");
}
"""


@functools.lru_cache(maxsize=1)
def load_deepspeed_op() -> Any:
    """DeepSpeed's CPU Adam kernel, built from DeepSpeed's sources with its own flags
    (``-O3 -march=native -fopenmp``, AVX2/AVX-512) and the GIL-releasing binding above;
    JIT-compiled on first use into torch's extension cache (25-110 s), imported from it
    after. The module name carries DeepSpeed's version and the binding's hash, so a new
    DeepSpeed or binding builds afresh (and a cached build loads without recomputing
    DeepSpeed's flags, which probes the CPU for seconds)."""
    from torch.utils import cpp_extension

    digest = hashlib.sha1(_GIL_FREE_BINDING.encode()).hexdigest()[:8]
    name = "megatrain_cpu_adam_" + re.sub(r"\W", "_", importlib.metadata.version("deepspeed")) + "_" + digest
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    if built.exists():
        spec = importlib.util.spec_from_file_location(name, built)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError(f"DeepSpeed's cpu_adam op cannot build here: {builder.error_log}")
    kernel_sources = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.sources()
                      if path.endswith("_impl.cpp")]  # cpu_adam.cpp is only DeepSpeed's binding
    binding = build_dir / "gil_free_binding.cpp"
    binding.write_text(_GIL_FREE_BINDING)
    logger.info("megatrain: building DeepSpeed's CPU Adam kernel (once, 25-110 s) in %s", build_dir)
    return cpp_extension.load(
        name=name, sources=[*kernel_sources, str(binding)],
        extra_include_paths=[os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.include_paths()],
        extra_cflags=[*builder.strip_empty_entries(builder.cxx_args()), "-UC10_USE_GLOG"],
        extra_ldflags=builder.strip_empty_entries(builder.extra_ldflags()),
        build_directory=str(build_dir), verbose=False)


class DeepSpeedKernel(CpuAdamKernel):
    """DeepSpeed's CPU Adam kernel (AVX2/AVX-512 + OpenMP), GIL released (:func:`load_deepspeed_op`)."""

    name = "deepspeed"

    def __init__(self, chunk_numel: int = CHUNK_ELEMENTS) -> None:
        super().__init__(chunk_numel)
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

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        beta1, beta2 = hyper.betas
        self._op.adam_update(self._ids[hyper.decoupled], step, hyper.lr, beta1, beta2, hyper.eps,
                             hyper.weight_decay, True, param, grad, exp_avg, exp_avg_sq)


class TorchKernel(CpuAdamKernel):
    """Op-by-op torch, ``torch.optim.AdamW``'s single-tensor arithmetic exactly."""

    name = "torch"
    whole_range_ok = False  # chunks bound the temporaries it allocates

    def _update(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper) -> None:
        from megatrain_ds.host_adamw import adamw_update_

        adamw_update_(param, grad, exp_avg, exp_avg_sq, step=step, lr=hyper.lr, betas=hyper.betas,
                      eps=hyper.eps, weight_decay=hyper.weight_decay, decoupled=hyper.decoupled)


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
            logger.warning("megatrain: CPU AdamW kernel %r unavailable (%s); using %r",
                           order[0], "; ".join(failures), name)
        else:
            logger.info("megatrain: CPU AdamW kernel %r", name)
        return kernel
    raise RuntimeError("no CPU AdamW kernel could run: " + "; ".join(failures))
