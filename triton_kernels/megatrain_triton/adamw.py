"""Fused AdamW step in one pass over memory: ``_adamw_kernel`` -> ``adamw_step_``.

Per element, all in fp32 (``g`` is the gradient after the clipping scale)::

    g = float(grad) * grad_scale
    decoupled (AdamW): p = p * (1 - lr * wd)        else (Adam + L2): g = g + wd * p
    m = m + (1 - beta1) * (g - m)                    (torch's lerp form)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    shadow = bf16(p)                                 (optional, round to nearest even)

These are the semantics of the engine's host AdamW (``megatrain_ds.optimizer.host_adamw``), which
mirrors ``torch.optim.AdamW``'s single-tensor path; ``adamw_reference.py`` is the pure-torch
reference. Each element is read once (p, g, m, v) and written once (p, m, v, shadow), so
the kernel is bound by memory bandwidth: 16 B read (14 with a bf16 gradient) + 12 B
written per element, plus 2 B for the shadow.

Numerics. Everything scalar (the decay factor, ``lr / (1 - beta1^t)``, ``sqrt(1 - beta2^t)``)
is computed on the host in Python doubles and rounded once to fp32 when passed, exactly as
torch rounds its Python-scalar arguments. In the kernel every operation is rounded on its
own: the divisions and the square root are the correctly rounded ``div_rn`` / ``sqrt_rn``
(Triton's plain ``/`` and ``sqrt`` compile to the approximate ``div.full.f32`` and
``sqrt.approx.ftz.f32`` on NVIDIA GPUs) and the launch turns
off multiply-add fusion, so the compiled kernel and Triton's CPU interpreter produce the same
bits, and the products are written in torch's association order. torch itself fuses a
few multiply-adds (its vectorised CPU ``lerp``/``addcmul``; nvcc contracts on the GPU) and,
on some CPU builds, rounds ``sqrt`` to within one ulp only; so kernel and torch differ by
an ulp or two of the moments per step, below one ulp of the parameter. The only difference
between compiled and interpreted results is the optional bf16 shadow: the GPU rounds to
nearest even, the interpreter truncates.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

# 1024 fp32 elements per program with 4 warps = 8 elements per thread, two 128-bit
# accesses per stream: the usual sweet spot for a streaming elementwise kernel on
# H100-class GPUs. ``bench/triton_adamw.py`` sweeps the alternatives.
BLOCK_SIZE = 1024
NUM_WARPS = 4

_GRAD_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _adamw_kernel(
    param_ptr,  # fp32 [n], updated in place
    grad_ptr,  # fp32 or bf16 [n], read only
    exp_avg_ptr,  # fp32 [n], updated in place
    exp_avg_sq_ptr,  # fp32 [n], updated in place
    shadow_ptr,  # bf16 [n], written when HAS_SHADOW (otherwise any pointer, never touched)
    n,
    grad_scale,
    decay_factor,  # 1 - lr * wd (decoupled only)
    weight_decay,  # wd (L2 only)
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    neg_step_size,  # -lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    eps,
    DECOUPLED: tl.constexpr,
    HAS_SHADOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # int64 offsets: a flat buffer of a large model can hold more than 2^31 elements.
    block_start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    if block_start + BLOCK_SIZE <= n:
        # Full block, no mask: loads and stores become 128-bit whatever n is. With a mask
        # they vectorise only when Triton can prove n % 16 == 0, and flat ranges have
        # arbitrary lengths.
        _adamw_block(
            param_ptr,
            grad_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            shadow_ptr,
            offsets,
            None,
            grad_scale,
            decay_factor,
            weight_decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            neg_step_size,
            bias_correction2_sqrt,
            eps,
            DECOUPLED,
            HAS_SHADOW,
        )
    else:
        _adamw_block(
            param_ptr,
            grad_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            shadow_ptr,
            offsets,
            offsets < n,
            grad_scale,
            decay_factor,
            weight_decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            neg_step_size,
            bias_correction2_sqrt,
            eps,
            DECOUPLED,
            HAS_SHADOW,
        )


@triton.jit
def _adamw_block(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    shadow_ptr,
    offsets,  # int64 [BLOCK_SIZE]
    mask,  # bool [BLOCK_SIZE], or None for a full block
    grad_scale,
    decay_factor,
    weight_decay,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bias_correction2_sqrt,
    eps,
    DECOUPLED: tl.constexpr,
    HAS_SHADOW: tl.constexpr,
):
    p = tl.load(param_ptr + offsets, mask=mask)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)

    if DECOUPLED:
        p = p * decay_factor
    else:
        g = g + weight_decay * p
    # Same association as torch: lerp(m, g, w) = m + w * (g - m) for w < 0.5, else
    # g - (g - m) * (1 - w) (so beta1 = 0 gives m = g exactly);
    # addcmul(v * b2, g, g, value=1 - b2) = v * b2 + ((1 - b2) * g) * g;
    # addcdiv(p, m, denom, value=-s) = p + (-s * m) / denom.
    if one_minus_beta1 < 0.5:  # noqa: SIM108 (a Triton branch, kept as the reference writes it)
        m = m + one_minus_beta1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - one_minus_beta1)
    v = v * beta2 + (one_minus_beta2 * g) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)

    tl.store(param_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if HAS_SHADOW:
        # cvt.rn.bf16.f32 on the GPU (round to nearest even); the interpreter truncates.
        tl.store(shadow_ptr + offsets, p.to(tl.bfloat16), mask=mask)


# The kernel runs through Triton's interpreter (numpy, CPU tensors) when TRITON_INTERPRET=1
# was set before triton was imported; compiled otherwise.
INTERPRETED: bool = not isinstance(_adamw_kernel, triton.runtime.JITFunction)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
    shadow: torch.Tensor | None = None,
) -> None:
    """One fused AdamW step, in place, on the current stream of ``param``'s device.

    Args:
        param, exp_avg, exp_avg_sq: contiguous 1-D fp32 tensors of the same length ``n``;
            updated in place.
        grad: contiguous 1-D fp32 or bf16 tensor of length ``n``; read only.
        lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        step: the step number ``t`` after incrementing (1 on the first step), used for the
            bias corrections.
        grad_scale: multiplies the gradient before anything else (gradient clipping).
        decoupled: AdamW (True) or Adam with L2 regularisation folded into the gradient.
        shadow: optional contiguous 1-D bf16 tensor of length ``n`` that receives the
            updated ``param`` rounded to bf16.

    Raises:
        ValueError: on a wrong dtype, length, rank, layout, device or step.
    """
    _check_inputs(param, grad, exp_avg, exp_avg_sq, shadow, step)
    n = param.numel()
    if n == 0:
        return
    beta1, beta2 = betas
    # With no weight decay the two modes coincide; multiplying p by exactly 1.0 keeps
    # even non-finite parameters as they are (g + 0 * p would turn inf into nan), like
    # the host optimizer, which skips the decay term altogether.
    if weight_decay == 0.0:
        decoupled = True
    _launch(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        shadow,
        n,
        grad_scale=float(grad_scale),
        decay_factor=1.0 - lr * weight_decay,
        weight_decay=float(weight_decay),
        one_minus_beta1=1.0 - beta1,
        beta2=float(beta2),
        one_minus_beta2=1.0 - beta2,
        neg_step_size=-lr / (1.0 - beta1**step),
        bias_correction2_sqrt=math.sqrt(1.0 - beta2**step),
        eps=float(eps),
        decoupled=bool(decoupled),
    )


def _launch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    shadow: torch.Tensor | None,
    n: int,
    *,
    grad_scale: float,
    decay_factor: float,
    weight_decay: float,
    one_minus_beta1: float,
    beta2: float,
    one_minus_beta2: float,
    neg_step_size: float,
    bias_correction2_sqrt: float,
    eps: float,
    decoupled: bool,
    block_size: int = BLOCK_SIZE,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch ``_adamw_kernel`` on checked inputs; the benchmark sweeps ``block_size``/``num_warps``."""
    grid = (triton.cdiv(n, block_size),)
    # Triton launches on the current device; make it the tensors' one.
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        _adamw_kernel[grid](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            shadow if shadow is not None else param,  # never dereferenced without a shadow
            n,
            grad_scale,
            decay_factor,
            weight_decay,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            neg_step_size,
            bias_correction2_sqrt,
            eps,
            DECOUPLED=decoupled,
            HAS_SHADOW=shadow is not None,
            BLOCK_SIZE=block_size,
            # Launch options: Triton types kernel[grid](...) as the kernel's own signature, without them.
            num_warps=num_warps,  # pyright: ignore[reportCallIssue]
            # Round every operation on its own, as the interpreter does: the compiled
            # kernel then computes bit for bit what the CPU tests check (see the notes at
            # the top), and does not change when Triton's fusion default does (3.10).
            enable_fp_fusion=False,  # pyright: ignore[reportCallIssue]
        )


def _check_inputs(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    shadow: torch.Tensor | None,
    step: int,
) -> None:
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after incrementing), got {step}")
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if shadow is not None:
        named["shadow"] = shadow
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got stride {tensor.stride()}")
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {named[name].dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    if shadow is not None and shadow.dtype != torch.bfloat16:
        raise ValueError(f"shadow must be bfloat16, got {shadow.dtype}")
    n = param.numel()
    for name, tensor in named.items():
        if tensor.numel() != n:
            raise ValueError(f"{name} has {tensor.numel()} elements, param has {n}")
        if tensor.device != param.device:
            raise ValueError(f"{name} is on {tensor.device}, param is on {param.device}")
    if param.device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            "first imported, or pass CUDA tensors"
        )
