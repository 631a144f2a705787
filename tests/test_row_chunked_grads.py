"""Row-chunked embedding / output-projection gradients against plain PyTorch autograd.

Each redirected module's weight gradient arrives as ``push(offset, flat_chunk)`` calls;
the chunks, written into a flat buffer at their offsets, must equal the gradient plain
``nn.Embedding`` / ``nn.Linear`` produce, and the module's other gradients (input, bias)
must be untouched.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch
from torch import nn

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.gradients.row_chunked import redirect_row_chunked

OFFSET = 5  # the weight's place in the flat state: pushes must be shifted by it


class PushRecorder:
    """Collects pushed chunks into a flat buffer, as the gradient sink's consumer would."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.flat = torch.zeros(OFFSET + weight.numel(), dtype=weight.dtype)
        self.chunks: list[tuple[int, int]] = []

    def __call__(self, offset: int, grad: torch.Tensor) -> None:
        assert grad.dim() == 1 and grad.dtype == self.flat.dtype
        self.flat[offset : offset + grad.numel()] += grad
        self.chunks.append((offset, grad.numel()))

    def weight_grad(self, weight: torch.Tensor) -> torch.Tensor:
        return self.flat[OFFSET:].view(weight.shape)


def _twins(make: type[nn.Module], *args, **kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = make(*args, **kwargs)
    redirected = make(*args, **kwargs)
    redirected.load_state_dict(reference.state_dict())
    return reference, redirected


@pytest.mark.parametrize("bias", [False, True])
def test_projection_chunks_equal_autograd(bias):
    reference, redirected = _twins(nn.Linear, 6, 10, bias=bias)
    push = PushRecorder(redirected.weight)
    assert redirect_row_chunked(redirected, OFFSET, push, chunk_elements=12)  # 2 rows a chunk
    x = torch.randn(3, 4, 6)
    x_ours = x.clone().requires_grad_(True)
    x_ref = x.clone().requires_grad_(True)
    upstream = torch.randn(3, 4, 10)
    out_ours, out_ref = redirected(x_ours), reference(x_ref)
    # Without a bias both sides are F.linear(x, W): the same op on the same values, bit-equal.
    # With one, the reference is one addmm and ours the matmul, then "+ bias": the bias may
    # join the 6-term sum at another point, a few fp32 roundings of the O(1) terms apart
    # (< 1e-6): torch's fp32 defaults (rtol 1.3e-6, atol 1e-5) bound that.
    torch.testing.assert_close(out_ours, out_ref, **({} if bias else {"rtol": 0, "atol": 0}))
    out_ours.backward(upstream)
    out_ref.backward(upstream)

    assert redirected.weight.grad is None, "autograd must not see the weight's gradient"
    assert push.chunks == [(OFFSET + row * 6, 12) for row in range(0, 10, 2)]
    torch.testing.assert_close(push.weight_grad(redirected.weight), reference.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(redirected.bias.grad, reference.bias.grad, rtol=1e-6, atol=1e-6)


def test_projection_last_chunk_is_short():
    _, redirected = _twins(nn.Linear, 4, 7, bias=False)
    push = PushRecorder(redirected.weight)
    redirect_row_chunked(redirected, OFFSET, push, chunk_elements=12)  # 3 rows a chunk
    redirected(torch.randn(2, 4)).sum().backward()
    assert push.chunks == [(OFFSET, 12), (OFFSET + 12, 12), (OFFSET + 24, 4)]


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_embedding_chunks_equal_autograd(padding_idx):
    reference, redirected = _twins(nn.Embedding, 11, 4, padding_idx=padding_idx)
    push = PushRecorder(redirected.weight)
    assert redirect_row_chunked(redirected, OFFSET, push, chunk_elements=12)  # 3 rows a chunk
    ids = torch.tensor([[0, 3, 3, 10], [7, 10, 3, 2]])  # repeats and the padding row
    upstream = torch.randn(2, 4, 4)
    out_ours, out_ref = redirected(ids), reference(ids)
    torch.testing.assert_close(out_ours, out_ref, rtol=0, atol=0)
    out_ours.backward(upstream)
    out_ref.backward(upstream)

    assert redirected.weight.grad is None
    assert [offset for offset, _ in push.chunks] == [OFFSET + row * 4 for row in range(0, 11, 3)]
    torch.testing.assert_close(push.weight_grad(redirected.weight), reference.weight.grad, rtol=1e-6, atol=1e-6)
    if padding_idx is not None:
        assert push.weight_grad(redirected.weight)[padding_idx].abs().sum() == 0


def test_projection_under_bf16_autocast_matches_plain_linear():
    reference, redirected = _twins(nn.Linear, 8, 6, bias=True)
    push = PushRecorder(redirected.weight)
    redirect_row_chunked(redirected, OFFSET, push, chunk_elements=16)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ours, out_ref = redirected(x), reference(x)
    assert out_ours.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out_ours, out_ref)
    out_ours.float().sum().backward()
    out_ref.float().sum().backward()
    # The reference's weight gradient is bf16 arithmetic cast back to fp32, as ours is.
    torch.testing.assert_close(push.weight_grad(redirected.weight), reference.weight.grad, rtol=1e-2, atol=1e-2)


def test_no_grad_forward_pushes_nothing():
    _, redirected = _twins(nn.Linear, 4, 4)
    push = PushRecorder(redirected.weight)
    redirect_row_chunked(redirected, OFFSET, push, chunk_elements=4)
    with torch.no_grad():
        redirected(torch.randn(2, 4))
    assert push.chunks == []


@pytest.mark.parametrize(
    "module",
    [
        nn.Embedding(8, 4, max_norm=1.0),
        nn.Embedding(8, 4, scale_grad_by_freq=True),
        nn.Embedding(8, 4, sparse=True),
        nn.Bilinear(3, 3, 2),
        nn.LayerNorm(4),
    ],
)
def test_other_modules_are_left_alone(module):
    assert not redirect_row_chunked(module, 0, PushRecorder(torch.zeros(1)), chunk_elements=8)
    assert "forward" not in module.__dict__


def test_restore_gives_autograd_the_gradient_back():
    _, redirected = _twins(nn.Linear, 4, 3)
    push = PushRecorder(redirected.weight)
    redirect_row_chunked(redirected, OFFSET, push, chunk_elements=4).restore()
    redirected(torch.randn(2, 4)).sum().backward()
    assert push.chunks == [] and redirected.weight.grad is not None


def test_weight_with_a_tensor_hook_takes_the_plain_path():
    """A user's gradient hook (here a mask) must see, and shape, the whole gradient."""
    reference, redirected = _twins(nn.Embedding, 6, 3)
    push = PushRecorder(redirected.weight)
    handle = redirect_row_chunked(redirected, OFFSET, push, chunk_elements=3)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]).unsqueeze(1)
    for module in (reference, redirected):
        module.weight.register_hook(lambda grad: grad * mask)
    ids = torch.tensor([0, 1, 3, 5])
    redirected(ids).sum().backward()
    reference(ids).sum().backward()
    assert push.chunks == [] and not handle.chunked
    torch.testing.assert_close(redirected.weight.grad, reference.weight.grad, rtol=0, atol=0)


def _engine(model: nn.Module) -> MegatrainEngine:
    return MegatrainEngine(
        model,
        parse_engine_config(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
        ),
    )


def test_engine_redirects_untied_head_and_embedding_only():
    untied, tied = tiny_models.llama(2), tiny_models.qwen2(2)
    for model, expected in ((untied, {"model.embed_tokens", "lm_head"}), (tied, set())):
        engine = _engine(model)
        try:
            redirected = {name for name, module in model.named_modules() if "forward" in module.__dict__}
            blocks = {f"model.layers.{index}" for index in range(2)}
            assert redirected - blocks == expected
        finally:
            engine.destroy()
        assert not any("forward" in module.__dict__ for module in model.modules()), "destroy must restore"


def test_weight_used_outside_its_module_fails_loudly():
    model = tiny_models.llama(2)
    engine = _engine(model)
    try:
        batch = tiny_models.make_batch(0)
        outputs = engine(**batch)
        # A second use of the row-chunked head weight, outside the head: its gradient
        # would reach ``.grad``, where the engine never looks.
        loss = outputs.loss + model.lm_head.weight.square().sum()
        with pytest.raises(RuntimeError, match="lm_head.weight.*outside its own module"):
            engine.backward(loss)
    finally:
        engine.destroy()
