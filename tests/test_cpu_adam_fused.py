"""The fused DeepSpeed pass (``optimizer/cpu_adam.py``, [Note: one pass over DeepSpeed's kernel]).

One call widens and scales the gradient, runs DeepSpeed's kernel and rounds the shadow,
block by block on every thread. Each is checked bit for bit against the unfused
composition: torch for the widening (``grad.float() * scale``) and the shadow
(``master.to(torch.bfloat16)``), and the kernel's unblocked fp32 path (one ``Step_8`` per
thread, DeepSpeed's own split), which itself is checked against DeepSpeed's own build of
the op (``DeepSpeedCPUAdam``; ``scripts/setup.sh`` builds it, and the test fails where it
cannot be loaded on a machine that should build it). Bit for bit,
not a tolerance: the pass only moves where each operation runs, never what it computes.
Sizes are odd (not multiples of a block or a SIMD width) so the padded tail runs.

Two things are meant to differ from DeepSpeed's own op, and are checked here too: a range's
last elements (length mod SIMD width) go through the SIMD loop in a padded buffer, not
DeepSpeed's scalar loop, and the bias-correction powers come from ``pow`` at every step,
not by multiplying the last ones. DeepSpeed's choices made an element's update depend on
where its call's range ended and on the steps the op had seen before (a resumed run was an
ulp off on the GPU, where chunking varies from run to run).
"""

from __future__ import annotations

import os
import platform
import shutil
import threading

import pytest
import torch

from megatrain_ds.optimizer import cpu_adam
from megatrain_ds.optimizer.adamw_math import AdamHyper
from megatrain_ds.optimizer.cpu_adam import DeepSpeedKernel

BLOCK = 256  # small blocks: many per call, so every thread takes several in any order
N = 7 * BLOCK + 77
SIMD_N = 7 * BLOCK
"""A length of whole SIMD passes (128 elements: 8-way unroll x 16 AVX-512 lanes)."""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Compare NaNs too: as integers of the same width."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "p": torch.randn(n, generator=gen),
        "m": 0.1 * torch.randn(n, generator=gen),
        "v": 0.01 * torch.rand(n, generator=gen),
    }


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    for name in ours:
        assert torch.equal(_bits(ours[name]), _bits(theirs[name])), name


@pytest.fixture(scope="module")
def kernel() -> DeepSpeedKernel:
    return DeepSpeedKernel(block_numel=BLOCK)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize(
    "grad_dtype, scale, with_shadow",
    [
        (torch.float32, 1.0, False),
        (torch.float32, 0.37, False),
        (torch.float32, 0.37, True),
        (torch.bfloat16, 1.0, True),
        (torch.bfloat16, 0.37, True),
        (torch.bfloat16, 0.37, False),
    ],
    ids=["fp32", "fp32-scaled", "fp32-scaled+shadow", "bf16+shadow", "bf16-scaled+shadow", "bf16-scaled"],
)
def test_fused_pass_is_the_unfused_composition_bit_for_bit(kernel, grad_dtype, scale, with_shadow, decoupled):
    ours, theirs = _state(N, 1), _state(N, 1)
    ours["p"][5], ours["p"][6] = float("nan"), float("inf")  # the shadow's NaN and Inf bits
    theirs["p"][5], theirs["p"][6] = float("nan"), float("inf")
    shadow = torch.empty(N, dtype=torch.bfloat16) if with_shadow else None
    hyper = AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    gen = torch.Generator().manual_seed(2)
    for step in (1, 2, 3):
        grad = torch.randn(N, generator=gen).to(grad_dtype)
        kernel.step_(ours["p"], grad, ours["m"], ours["v"], shadow, step=step, hyper=hyper, grad_scale=scale)
        reference_grad = grad.float() * scale if scale != 1.0 else grad.float()
        # fp32, scale 1, no shadow: one unblocked Step_8 per thread, DeepSpeed's own split
        kernel.step_(theirs["p"], reference_grad, theirs["m"], theirs["v"], None, step=step, hyper=hyper)
    _assert_same(ours, theirs)
    if with_shadow:
        assert torch.equal(_bits(shadow), _bits(theirs["p"].to(torch.bfloat16))), "the shadow is torch's rounding"


def test_results_do_not_depend_on_the_thread_count(kernel):
    """Threads take blocks in whatever order they come; one thread must give the same bits."""
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, max(2, previous)):
            torch.set_num_threads(threads)  # the OpenMP team of this thread, as for DeepSpeed's op
            state = _state(N, 3)
            shadow = torch.empty(N, dtype=torch.bfloat16)
            grad = torch.randn(N, generator=torch.Generator().manual_seed(4)).bfloat16()
            kernel.step_(
                state["p"],
                grad,
                state["m"],
                state["v"],
                shadow,
                step=1,
                hyper=AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.01, True),
                grad_scale=0.5,
            )
            results.append({**state, "shadow": shadow})
    finally:
        torch.set_num_threads(previous)
    _assert_same(results[0], results[1])


def test_journaled_update_steps_chunk_by_chunk_after_each_callback(kernel):
    """``before_chunk`` sees every chunk's values as they were before the update."""
    n, chunk = 3 * 1000 + 7, 1000
    kernel = DeepSpeedKernel(chunk_numel=chunk, block_numel=BLOCK)
    state, before = _state(n, 5), _state(n, 5)
    seen = []

    def journal(start: int, end: int) -> None:
        assert torch.equal(state["p"][start:end], before["p"][start:end]), "overwritten before its callback"
        seen.append((start, end))

    grad = torch.randn(n, generator=torch.Generator().manual_seed(6))
    kernel.step_(
        state["p"],
        grad,
        state["m"],
        state["v"],
        None,
        step=1,
        hyper=AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.01, True),
        before_chunk=journal,
    )
    assert seen == [(0, 1000), (1000, 2000), (2000, 3000), (3000, n)]
    assert not torch.equal(state["p"], before["p"])


def test_bad_arguments_are_refused(kernel):
    p, m, v = torch.zeros(300), torch.zeros(300), torch.zeros(300)
    hyper = AdamHyper(1e-3, (0.9, 0.999), 1e-8, 0.0, True)
    with pytest.raises(RuntimeError, match="grads"):
        kernel.step_(p, torch.zeros(300, dtype=torch.float16), m, v, None, step=1, hyper=hyper)
    with pytest.raises(RuntimeError, match="exp_avg_sq"):
        kernel.step_(p, torch.zeros(300), m, torch.zeros(600)[::2], None, step=1, hyper=hyper)


def _deepspeed_op_cannot_build_here() -> str | None:
    """Why DeepSpeed's ``cpu_adam`` op cannot be built on this machine, or None where it can.

    DeepSpeed's CPU Adam builds for x86-64 (AVX2/AVX-512) and aarch64 (NEON) with a C++
    compiler; ``scripts/setup.sh`` builds it once into torch's extension cache. Anywhere
    else the comparison is skipped; where it should build, a failure to load is a failure.
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"DeepSpeed's cpu_adam op has no kernel for {machine}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) to build DeepSpeed's cpu_adam op"
    return None


CANNOT_BUILD_DEEPSPEED_OP = _deepspeed_op_cannot_build_here()


@pytest.mark.skipif(CANNOT_BUILD_DEEPSPEED_OP is not None, reason=str(CANNOT_BUILD_DEEPSPEED_OP))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_fp32_update_is_deepspeeds_op_bit_for_bit(kernel, decoupled):
    """The engine's blocks give exactly what one call of DeepSpeed's own op gives, where
    DeepSpeed's op takes its SIMD loop for every element and its powers are pow's (a
    length of whole SIMD passes; steps 1 and 2).

    ``DeepSpeedCPUAdam`` loads the op from the extension cache (``scripts/setup.sh`` built
    it), or builds it here; an error doing so fails the test.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    ours = _state(SIMD_N, 7)
    param = torch.nn.Parameter(ours["p"].clone())
    optimizer = DeepSpeedCPUAdam([param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw_mode=decoupled)
    optimizer.state[param] = {"step": 0, "exp_avg": ours["m"].clone(), "exp_avg_sq": ours["v"].clone()}
    hyper = AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    gen = torch.Generator().manual_seed(8)
    for step in (1, 2):  # from step 3 DeepSpeed's 0.999 * 0.999 * 0.999 is not pow's
        grad = torch.randn(SIMD_N, generator=gen)
        kernel.step_(ours["p"], grad, ours["m"], ours["v"], None, step=step, hyper=hyper)
        param.grad = grad.clone()
        optimizer.step()
    state = optimizer.state[param]
    _assert_same(ours, {"p": param.detach(), "m": state["exp_avg"], "v": state["exp_avg_sq"]})


@pytest.mark.parametrize(
    "grad_dtype, scale, with_shadow",
    [(torch.float32, 1.0, False), (torch.bfloat16, 0.37, True)],
    ids=["fp32", "bf16-scaled+shadow"],
)
def test_an_update_does_not_depend_on_how_the_range_is_split(kernel, grad_dtype, scale, with_shadow):
    """One call for the whole range, or calls for pieces ending anywhere (as gradient chunks,
    speculation and the journal split a step): the same bits. DeepSpeed's scalar tail
    rounded m and v differently from its SIMD loop."""
    hyper = AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)
    grad = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(grad_dtype)
    whole, pieces = _state(N, 11), _state(N, 11)
    shadows = [torch.zeros(N, dtype=torch.bfloat16) if with_shadow else None for _ in range(2)]
    kernel.step_(whole["p"], grad, whole["m"], whole["v"], shadows[0], step=5, hyper=hyper, grad_scale=scale)
    for start, end in ((0, 1001), (1001, 1003), (1003, 1500), (1500, N)):
        piece = {name: tensor[start:end] for name, tensor in pieces.items()}
        shadow = shadows[1][start:end] if shadows[1] is not None else None
        kernel.step_(piece["p"], grad[start:end], piece["m"], piece["v"], shadow, step=5, hyper=hyper, grad_scale=scale)
    _assert_same(whole, pieces)
    if with_shadow:
        assert torch.equal(_bits(shadows[0]), _bits(shadows[1]))


def test_an_update_does_not_depend_on_the_steps_before_it():
    """Step s of a kernel that did steps 1..s-1 before (an uninterrupted run) is step s of a
    fresh kernel (a resumed run): DeepSpeed's op multiplied its bias-correction powers along,
    which differed from its pow after a load from step 3 on (betas 0.9, 0.999)."""
    hyper = AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)
    grad = torch.randn(N, generator=torch.Generator().manual_seed(4))
    running = DeepSpeedKernel(block_numel=BLOCK)
    for step in range(1, 21):
        uninterrupted, resumed = _state(N, step), _state(N, step)
        running.step_(uninterrupted["p"], grad, uninterrupted["m"], uninterrupted["v"], None, step=step, hyper=hyper)
        fresh = DeepSpeedKernel(block_numel=BLOCK)
        fresh.step_(resumed["p"], grad, resumed["m"], resumed["v"], None, step=step, hyper=hyper)
        _assert_same(uninterrupted, resumed)


def test_block_size_is_a_multiple_of_every_simd_unroll():
    """Blocks start where one whole-range call would be in its 8-way unrolled SIMD loop."""
    assert cpu_adam.BLOCK_ELEMENTS % 128 == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in Linux's /proc")
def test_a_thread_that_openmp_did_not_start_steps_with_torchs_thread_count(kernel, monkeypatch):
    """OpenMP keeps ``torch.set_num_threads`` per thread: a thread it did not start (the
    pipelined finish's worker, the gradient worker) would open every region with the
    process default, every CPU. The kernel passes torch's count instead. Seen in the
    OS threads a fresh thread's first region adds: its team's helpers, none for a team of
    one; a team of two (also asked here) adds one, which shows the count sees teams."""
    hyper = AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)
    grad = torch.randn(N, generator=torch.Generator().manual_seed(5))
    added = {}

    def step_on_a_fresh_thread(threads: int) -> None:
        def work() -> None:
            # The threads that appear, not how many there are: a thread joined a moment ago
            # (the previous call's) may still be leaving /proc when ``before`` is read.
            before = set(os.listdir("/proc/self/task"))
            state = _state(N, 7)
            kernel.step_(state["p"], grad, state["m"], state["v"], None, step=1, hyper=hyper, grad_scale=0.5)
            added[threads] = len(set(os.listdir("/proc/self/task")) - before)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        step_on_a_fresh_thread(threads)
    assert added == {1: 0, 2: 1}
