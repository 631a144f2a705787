"""The fused Triton AdamW kernel against its pure-torch reference, the engine's host AdamW
and ``torch.optim.AdamW``.

Without CUDA the kernel runs through Triton's interpreter on CPU tensors (the repo-root
conftest sets TRITON_INTERPRET=1 before triton is imported); with CUDA it runs compiled.

Tolerances (fp32 state; bf16 gradients are widened to fp32 exactly, so both gradient
dtypes share them). The kernel rounds every operation on its own (multiply-add fusion is
off), so compiled and interpreted runs give the same bits, and both are checked bit for bit
against a numpy emulation of the intended operation order. Against torch they differ by
rounding only:
- torch's CPU ``lerp`` and ``addcmul`` are vectorised with fused multiply-adds, and its fp32
  ``sqrt`` is not correctly rounded on this CPU build (1 ulp off on ~15% of inputs); on the GPU nvcc
  contracts multiply-adds and torch divides by a scalar through its reciprocal.
- these are 1-2 ulps in the moments per step and less than one ulp of ``param``. So
  ``param``, ``exp_avg``: rtol 1e-6 (~8 ulps) plus atol 1e-7 where ``m + w * (g - m)`` or
  ``p + update`` cancels towards zero (the error is then an ulp of the O(1) operands, not
  of the small result); ``exp_avg_sq`` is a sum of non-negative terms and never cancels:
  rtol 1e-6, atol 0. Measured worst case over the matrix below and two more seeds: 0.36,
  0.50 and 0.31 of these bounds.
- ``shadow``: on the GPU exactly ``param.to(bfloat16)`` (both round to nearest even); the
  interpreter truncates fp32 -> bf16, so there it must equal the kernel's own ``param``
  truncated, and lie within one bf16 ulp of the reference's rounded ``param``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatrain_triton import INTERPRETED, adamw_step_, adamw_step_reference_
from megatrain_triton import adamw as adamw_module

HAS_CUDA = torch.cuda.is_available()
# CPU tensors only run under the interpreter, which is what the conftest selects without
# CUDA; with CUDA the kernel is compiled and needs device tensors.
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
if DEVICE == "cpu" and not INTERPRETED:  # pragma: no cover - misconfigured environment
    pytest.skip("no CUDA and TRITON_INTERPRET unset: the kernel cannot run", allow_module_level=True)

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")

TOLERANCES = {  # (rtol, atol) per fp32 state tensor; see the module docstring
    "param": (1e-6, 1e-7),
    "exp_avg": (1e-6, 1e-7),
    "exp_avg_sq": (1e-6, 0.0),
}
SIZES = [1, 7, 1023, 1025, 4097, 100003]  # none a multiple of BLOCK_SIZE=1024 but 1023+1
STEPS = [1, 2, 10]  # stepped in sequence on the same state: bias corrections far from 1 and near
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
# (decoupled, weight_decay, grad_scale, with_shadow): each flag seen both ways.
CONFIGS = [
    pytest.param(True, 0.1, 1.0, True, id="adamw-wd-shadow"),
    pytest.param(True, 0.0, 0.37, False, id="adamw-scaled"),
    pytest.param(False, 0.1, 0.37, True, id="adam_l2-wd-scaled-shadow"),
    pytest.param(False, 0.0, 1.0, False, id="adam_l2"),
]


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Parameters O(1), moments as after some training (m signed, v >= 0)."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "param": torch.randn(n, generator=gen),
        "exp_avg": 0.1 * torch.randn(n, generator=gen),
        "exp_avg_sq": 0.01 * torch.rand(n, generator=gen),
    }
    return {name: t.to(DEVICE) for name, t in state.items()}


def _grads(n: int, dtype: torch.dtype, num_steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype).to(DEVICE) for _ in range(num_steps)]


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in state.items()}


def _assert_state_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], context: str) -> None:
    for name, (rtol, atol) in TOLERANCES.items():
        torch.testing.assert_close(
            ours[name], theirs[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name} {context}: {m}"
        )


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits, as Triton's interpreter converts."""
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _assert_shadow(shadow: torch.Tensor, param: torch.Tensor, reference_param: torch.Tensor) -> None:
    if INTERPRETED:
        assert torch.equal(shadow, _truncate_to_bf16(param))
        # One bf16 ulp of the reference's rounded value: truncation vs rounding.
        expected = reference_param.to(torch.bfloat16).float()
        ulp = torch.finfo(torch.bfloat16).eps * expected.abs()
        assert bool(((shadow.float() - expected).abs() <= ulp).all())
    else:
        assert torch.equal(shadow, param.to(torch.bfloat16))


@pytest.mark.parametrize("decoupled, weight_decay, grad_scale, with_shadow", CONFIGS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(n, grad_dtype, decoupled, weight_decay, grad_scale, with_shadow):
    ours = _state(n, seed=n)
    theirs = _clone(ours)
    if with_shadow:
        ours["shadow"] = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
        theirs["shadow"] = ours["shadow"].clone()
    grads = _grads(n, grad_dtype, len(STEPS), seed=n + 1)
    for step, grad in zip(STEPS, grads):
        grad_before = grad.clone()
        kwargs = dict(HYPER, weight_decay=weight_decay, step=step, grad_scale=grad_scale, decoupled=decoupled)
        adamw_step_(ours["param"], grad, ours["exp_avg"], ours["exp_avg_sq"], shadow=ours.get("shadow"), **kwargs)
        adamw_step_reference_(
            theirs["param"], grad, theirs["exp_avg"], theirs["exp_avg_sq"], shadow=theirs.get("shadow"), **kwargs
        )
        assert torch.equal(grad, grad_before), "the gradient must be read only"
        _assert_state_close(ours, theirs, f"after step {step}")
        if with_shadow:
            _assert_shadow(ours["shadow"], ours["param"], theirs["param"])


def _emulate_numpy(state, grad, *, lr, betas, eps, weight_decay, step, grad_scale, decoupled):
    """The kernel's operation order in numpy fp32, every operation rounded on its own."""
    f32 = np.float32
    beta1, beta2 = betas
    p, m, v = (state[name].cpu().numpy() for name in ("param", "exp_avg", "exp_avg_sq"))
    g = grad.float().cpu().numpy() * f32(grad_scale)
    if decoupled:
        p = p * f32(1.0 - lr * weight_decay)
    else:
        g = g + f32(weight_decay) * p
    weight = f32(1.0 - beta1)
    m = m + weight * (g - m) if weight < 0.5 else g - (g - m) * (f32(1.0) - weight)  # torch's lerp
    v = v * f32(beta2) + (f32(1.0 - beta2) * g) * g
    denom = np.sqrt(v) / f32(math.sqrt(1.0 - beta2**step)) + f32(eps)
    p = p + (f32(-lr / (1.0 - beta1**step)) * m) / denom
    return {"param": p, "exp_avg": m, "exp_avg_sq": v}


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize(
    "n, betas",
    [
        pytest.param(2048, (0.9, 0.999), id="2048-full_blocks"),
        pytest.param(4097, (0.9, 0.999), id="4097-masked_tail"),
        pytest.param(4097, (0.3, 0.99), id="4097-beta1_0.3"),  # lerp weight >= 0.5: torch's other formula
    ],
)
def test_bit_exact_operation_order(n, betas, decoupled, grad_dtype):
    """Kernel == numpy, bit for bit, compiled or interpreted: the order of operations is pinned."""
    state = _state(n, seed=3)
    grads = _grads(n, grad_dtype, len(STEPS), seed=4)
    for step, grad in zip(STEPS, grads):
        kwargs = dict(HYPER, betas=betas, weight_decay=0.1, step=step, grad_scale=0.37, decoupled=decoupled)
        expected = _emulate_numpy(state, grad, **kwargs)
        adamw_step_(state["param"], grad, state["exp_avg"], state["exp_avg_sq"], **kwargs)
        for name, values in expected.items():
            np.testing.assert_array_equal(state[name].cpu().numpy(), values, err_msg=f"{name} at step {step}")


def test_beta1_zero_keeps_the_gradient():
    """beta1 = 0 makes m the (scaled) gradient exactly, as torch's lerp with weight 1 does."""
    n = 1025
    state = _state(n, seed=11)
    reference = _clone(state)
    grad = _grads(n, torch.float32, 1, seed=12)[0]
    kwargs = dict(HYPER, betas=(0.0, 0.99), weight_decay=0.0, step=3, grad_scale=0.37)
    adamw_step_(state["param"], grad, state["exp_avg"], state["exp_avg_sq"], **kwargs)
    adamw_step_reference_(reference["param"], grad, reference["exp_avg"], reference["exp_avg_sq"], **kwargs)
    assert torch.equal(state["exp_avg"], grad * 0.37)
    assert torch.equal(reference["exp_avg"], grad * 0.37)
    _assert_state_close(state, reference, "with beta1 = 0")


def test_reference_is_the_host_adamw():
    """Same torch ops as the engine's host optimizer: bitwise equal."""
    from megatrain_ds.optimizer.adamw_math import adamw_update_

    for decoupled in (True, False):
        ours = _state(1025, seed=5)
        ours = {name: t.cpu() for name, t in ours.items()}
        theirs = _clone(ours)
        for step, grad in zip(STEPS, _grads(1025, torch.bfloat16, len(STEPS), seed=6)):
            grad = grad.cpu()
            kwargs = dict(HYPER, weight_decay=0.1, step=step, grad_scale=0.37, decoupled=decoupled)
            adamw_step_reference_(ours["param"], grad, ours["exp_avg"], ours["exp_avg_sq"], **kwargs)
            adamw_update_(theirs["param"], grad, theirs["exp_avg"], theirs["exp_avg_sq"], **kwargs)
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_reference_is_torch_adamw(decoupled):
    """The reference against torch.optim.AdamW / Adam (single-tensor path) on the CPU: bitwise."""
    n = 1025
    state = {name: t.cpu() for name, t in _state(n, seed=7).items()}
    param = torch.nn.Parameter(state["param"].clone())
    optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_cls([param], **HYPER, weight_decay=0.1, foreach=False)
    state["exp_avg"].zero_()
    state["exp_avg_sq"].zero_()
    for step, grad in enumerate(_grads(n, torch.float32, 5, seed=8), start=1):
        grad = grad.cpu()
        param.grad = grad * 0.37
        optimizer.step()
        adamw_step_reference_(
            state["param"],
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            **HYPER,
            weight_decay=0.1,
            step=step,
            grad_scale=0.37,
            decoupled=decoupled,
        )
    torch_state = optimizer.state[param]
    assert torch.equal(state["param"], param.detach())
    assert torch.equal(state["exp_avg"], torch_state["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], torch_state["exp_avg_sq"])


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("n", [1, 1025, 100003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@requires_cuda
def test_gpu_matches_torch_optim(grad_dtype, n, decoupled):
    """Compiled kernel vs torch.optim.AdamW(fused=False) stepping a real parameter.

    torch's CUDA path (foreach) groups and rounds a little differently again (reciprocal
    for scalar division, its own FMA contraction): rtol 1e-5, atol 1e-6 after 5 steps.
    """
    state = _state(n, seed=9)
    state["exp_avg"].zero_()
    state["exp_avg_sq"].zero_()
    shadow = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    param = torch.nn.Parameter(state["param"].clone())
    optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_cls([param], **HYPER, weight_decay=0.1, fused=False)
    for step, grad in enumerate(_grads(n, grad_dtype, 5, seed=10), start=1):
        param.grad = grad.float() * 0.37
        optimizer.step()
        adamw_step_(
            state["param"],
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            **HYPER,
            weight_decay=0.1,
            step=step,
            grad_scale=0.37,
            decoupled=decoupled,
            shadow=shadow,
        )
    torch_state = optimizer.state[param]
    torch.testing.assert_close(state["param"], param.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"], torch_state["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg_sq"], torch_state["exp_avg_sq"], rtol=1e-5, atol=0.0)
    assert torch.equal(shadow, state["param"].to(torch.bfloat16)), "round to nearest even on the GPU"


def test_empty_is_a_no_op(monkeypatch):
    """A zero-length step launches nothing and writes nothing; its neighbours still step.

    The empty tensors are zero-length views in the middle of real buffers, so a launch that
    ignored ``n`` (or a grid rounded up to one block) would overwrite the elements around
    them: every buffer must stay bit for bit as it was. A spy on ``_launch`` proves the
    shortcut is taken, and a non-empty step over the elements right after the empty range,
    on the same buffers, must then match the reference and leave the rest untouched.
    """
    launches: list[int] = []  # the ``n`` of every kernel launch
    real_launch = adamw_module._launch

    def spy(*args, **kwargs):
        launches.append(args[5])
        real_launch(*args, **kwargs)

    monkeypatch.setattr(adamw_module, "_launch", spy)
    n, cut, width = 64, 17, 9
    state = _state(n, seed=3)
    state["shadow"] = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    grad = _grads(n, torch.float32, 1, seed=4)[0]
    before = {name: t.clone() for name, t in state.items()}
    empty = {name: t[cut:cut] for name, t in state.items()}
    # A view into the buffer (an empty tensor's data_ptr() reads 0, its storage does not).
    assert empty["param"]._base is state["param"] and empty["param"].storage_offset() == cut
    adamw_step_(
        empty["param"],
        grad[cut:cut],
        empty["exp_avg"],
        empty["exp_avg_sq"],
        shadow=empty["shadow"],
        **HYPER,
        weight_decay=0.1,
        step=1,
    )
    assert launches == [], "an empty step must not launch the kernel"
    for name, tensor in state.items():
        assert torch.equal(tensor, before[name]), f"{name} changed by an empty step"

    window = slice(cut, cut + width)
    reference = {name: t[window].clone() for name, t in state.items()}
    adamw_step_(
        state["param"][window],
        grad[window],
        state["exp_avg"][window],
        state["exp_avg_sq"][window],
        shadow=state["shadow"][window],
        **HYPER,
        weight_decay=0.1,
        step=1,
    )
    adamw_step_reference_(
        reference["param"],
        grad[window],
        reference["exp_avg"],
        reference["exp_avg_sq"],
        shadow=reference["shadow"],
        **HYPER,
        weight_decay=0.1,
        step=1,
    )
    assert launches == [width]
    _assert_state_close({name: t[window] for name, t in state.items()}, reference, "next to an empty step")
    outside = torch.ones(n, dtype=torch.bool)
    outside[window] = False
    for name, tensor in state.items():
        assert torch.equal(tensor[outside.to(DEVICE)], before[name][outside.to(DEVICE)]), f"{name} outside the window"


def test_empty_is_still_checked():
    """The empty shortcut comes after the input checks: a wrong dtype is an error at any length."""
    empty = torch.empty(0, device=DEVICE)
    with pytest.raises(ValueError, match="param must be float32"):
        adamw_step_(empty.double(), empty, empty.clone(), empty.clone(), **HYPER, weight_decay=0.1, step=1)


def _valid(n: int = 8) -> dict:
    return dict(
        param=torch.zeros(n, device=DEVICE),
        grad=torch.zeros(n, device=DEVICE),
        exp_avg=torch.zeros(n, device=DEVICE),
        exp_avg_sq=torch.zeros(n, device=DEVICE),
        shadow=torch.zeros(n, dtype=torch.bfloat16, device=DEVICE),
    )


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("param", torch.zeros(8, dtype=torch.float64), "param must be float32"),
        ("exp_avg_sq", torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq must be float32"),
        ("grad", torch.zeros(8, dtype=torch.float16), "grad must be float32 or bfloat16"),
        ("shadow", torch.zeros(8), "shadow must be bfloat16"),
        ("grad", torch.zeros(9), "grad has 9 elements, param has 8"),
        ("exp_avg", torch.zeros(2, 4), "exp_avg must be 1-D"),
        ("grad", torch.zeros(16).as_strided((8,), (2,)), "grad must be contiguous"),
        ("shadow", torch.zeros(7, dtype=torch.bfloat16), "shadow has 7 elements"),
    ],
)
def test_rejects_bad_inputs(name, bad, match):
    tensors = _valid()
    # Strides kept: a plain .to() makes a contiguous copy on CUDA, hiding the strided case.
    tensors[name] = torch.empty_strided(bad.shape, bad.stride(), dtype=bad.dtype, device=DEVICE).copy_(bad)
    with pytest.raises(ValueError, match=match):
        adamw_step_(
            tensors.pop("param"),
            tensors.pop("grad"),
            tensors.pop("exp_avg"),
            tensors.pop("exp_avg_sq"),
            **HYPER,
            weight_decay=0.0,
            step=1,
            **tensors,
        )


def test_rejects_step_zero():
    tensors = _valid()
    with pytest.raises(ValueError, match="step must be >= 1"):
        adamw_step_(
            tensors["param"],
            tensors["grad"],
            tensors["exp_avg"],
            tensors["exp_avg_sq"],
            **HYPER,
            weight_decay=0.0,
            step=0,
        )


def test_rejects_mixed_devices():
    tensors = _valid()
    with pytest.raises(ValueError, match="exp_avg is on meta"):
        adamw_step_(
            tensors["param"],
            tensors["grad"],
            tensors["exp_avg"].to("meta"),
            tensors["exp_avg_sq"],
            **HYPER,
            weight_decay=0.0,
            step=1,
        )
