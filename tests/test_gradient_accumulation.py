"""The fused accumulation pass (``optimizer/gradient_accumulation.py``) against torch's ops.

What is checked, each against an independent reference:

- **Held values, bit for bit.** Several micro-batches of bf16, fp32 and fp16 chunks written
  (the first) and added (the rest) into fp32 held gradients equal what
  ``LossScaling.unscale_into_`` leaves (torch's ``copy_``/``add_``/``mul_``): the same fp32
  operations on the same values (widening is exact; fp16's ``1/scale`` is a power of two,
  so ``g * s`` is exact and a fused multiply-add rounds as a multiply then an add).
  Lengths are not multiples of any SIMD width or of the pass's 16K-element blocks.
- **The sum of squares.** The pass sums ``held**2`` in fp64 (each square exact) in a fixed
  order; recursive fp64 summation of ``n`` non-negative terms errs by at most
  ``(n - 1) * 2**-53`` relative, so it must lie within ``n * 2**-53`` of ``math.fsum``'s
  correctly rounded sum. An fp32 accumulation (``2**-24`` per addition) would not.
- **Determinism.** The same bits for 1, 2 and 3 OpenMP threads (fixed blocks and lanes).
- **Fallbacks.** A scale that is not a power of two, a bf16 held buffer or a strided chunk
  takes the torch ops and returns no sum (the caller then sums the norm as before).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatrain_ds.config.deepspeed_blocks import fp16_options
from megatrain_ds.optimizer.cpu_binding import load_deepspeed_op
from megatrain_ds.optimizer.gradient_accumulation import HostAccumulation
from megatrain_ds.optimizer.loss_scaling import LossScaling

LENGTHS = (1, 17, (1 << 14) + 37, 3 * (1 << 14) - 5)
"""Chunk lengths: one element, a partial SIMD pass, one block and a bit, three blocks short."""


@pytest.fixture(scope="module")
def fused() -> HostAccumulation:
    return HostAccumulation(load_deepspeed_op())


def _scaling(dtype: torch.dtype, scale: float = 1024.0) -> LossScaling:
    """fp16 chunks come with a loss scale to divide by (static here: a fixed ``scale``)."""
    return LossScaling(_static_fp16(scale) if dtype == torch.float16 else None)


def _static_fp16(scale: float):
    return fp16_options({"fp16": {"enabled": True, "loss_scale": scale}}, False)


def _micro_batches(numel: int, dtype: torch.dtype, count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(numel)
    chunks = [torch.randn(numel, generator=generator) * 10.0 ** (k - 1) for k in range(count)]
    if dtype == torch.float16:
        chunks = [chunk * 1024.0 for chunk in chunks]  # a loss-scaled gradient
    chunks = [chunk.to(dtype) for chunk in chunks]
    chunks[0][0] = -0.0  # the first write must keep a negative zero's sign, as copy_ does
    return chunks


def _exact_squares(values: torch.Tensor) -> float:
    return math.fsum((values.double() ** 2).tolist())


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_fused_pass_equals_torch_ops_and_sums_squares_within_fp64_rounding(fused, dtype, numel):
    scaling = _scaling(dtype)
    ours = torch.full((numel,), math.nan)  # whatever the buffer held before is written over
    theirs = ours.clone()
    chunks = _micro_batches(numel, dtype)
    for micro, chunk in enumerate(chunks):
        first, final = micro == 0, micro == len(chunks) - 1
        squares = fused.accumulate_(ours, chunk, scaling, overwrite=first, squares=final)
        scaling.unscale_into_(theirs, chunk, overwrite=first)
        # The bits: a negative zero written first keeps its sign, as copy_ keeps it.
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (micro, (ours - theirs).abs().max())
        assert (squares is None) != final
    exact = _exact_squares(theirs)
    assert squares is not None and abs(squares - exact) <= numel * 2.0**-53 * exact


def test_the_sum_is_the_same_bits_for_any_team_size():
    op = load_deepspeed_op()
    chunk = torch.randn(5 * (1 << 14) + 3).to(torch.bfloat16)
    sums, results = [], []
    for threads in (1, 2, 3):
        held = torch.zeros(chunk.numel())
        sums.append(op.accumulate_grad(held, chunk, 1.0, True, True, threads))
        results.append(held)
    assert sums[0] == sums[1] == sums[2]
    assert all(torch.equal(results[0], held) for held in results[1:])


def test_what_the_pass_cannot_do_exactly_takes_the_torch_ops(fused):
    chunk = torch.randn(100)
    odd_scale = LossScaling(_static_fp16(1000.0))  # 1/1000 is not a power of two
    held, expected = torch.ones(100), torch.ones(100)
    assert fused.accumulate_(held, chunk.half(), odd_scale, overwrite=False, squares=True) is None
    odd_scale.unscale_into_(expected, chunk.half())
    assert torch.equal(held, expected)
    bf16_held = torch.ones(100, dtype=torch.bfloat16)
    assert (
        fused.accumulate_(bf16_held, chunk.bfloat16(), _scaling(torch.bfloat16), overwrite=False, squares=True) is None
    )
    assert torch.equal(bf16_held, torch.ones(100, dtype=torch.bfloat16) + chunk.bfloat16())
    strided, held = torch.randn(200)[::2], torch.zeros(100)
    assert fused.accumulate_(held, strided, _scaling(torch.float32), overwrite=True, squares=True) is None
    assert torch.equal(held, strided)
    assert (
        HostAccumulation(None).accumulate_(held, chunk, _scaling(torch.float32), overwrite=False, squares=True) is None
    )
