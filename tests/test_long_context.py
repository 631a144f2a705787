"""Long context: the chunked loss and the tiled MLP, against plain PyTorch.

Parity (fp32 on the CPU) uses test_parity.py's tolerances: 1e-5 relative per-step loss,
2e-6 global relative weight error after 5 steps. The chunked loss sums per-chunk losses
and accumulates the lm_head gradient over chunks; the tiled MLP sums its parameter
gradients over tiles: both reorder fp32 additions only (observed ~1e-7). Tiles and
chunks are made deliberately small and odd (4 and 5 tokens of 24) so every batch is
split many times, with a ragged last piece.
"""

from __future__ import annotations

import math

import pytest
import tiny_models
import torch
import torch.nn.functional as F
import transformers
from side_by_side import ds_config, train_side_by_side
from test_parity import assert_parity
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_ds import ConfigError, MegatrainEngine, parse_engine_config
from megatrain_ds.model.causal_lm_loss import unsupported_reason
from megatrain_ds.model.chunked_loss import chunked_linear_cross_entropy

CHUNK, TILE = 5, 4


def _features(family: str) -> dict:
    supported = unsupported_reason(tiny_models.FAMILIES[family](num_layers=1)) is None
    return {"loss_chunk_tokens": CHUNK if supported else "auto", "mlp_tile_tokens": TILE}


@pytest.mark.parametrize(
    "family, accumulation", [(family, 1 + index % 2) for index, family in enumerate(sorted(tiny_models.FAMILIES))]
)
def test_parity_chunked_loss_and_tiled_mlp(family, accumulation):
    """Padding and ignore_index (make_batch left-pads a row with label -100), GA 1 and 2:
    each family once, the sorted families alternating between them (what a family decides,
    whether its loss chunks and its MLP tiles, does not depend on accumulation; the chunks'
    and tiles' gradients summed over micro-batches do not depend on the family, and each
    accumulation runs on five families, dense and MoE, chunked or not, tiled or not)."""
    config = ds_config(accumulation=accumulation, megatrain=_features(family))
    engine, reference, trace = train_side_by_side(tiny_models.FAMILIES[family], config)
    try:
        # Every family but Gemma 2 (logit softcapping) chunks its loss; every MLP without
        # dropout is tiled (GPT-2's has dropout).
        assert (engine.causal_loss is not None) == (family != "gemma2")
        assert engine.mlp_tile_tokens == (0 if family == "gpt2" else TILE)
        assert_parity(engine, reference, trace)
    finally:
        engine.destroy()


@pytest.mark.parametrize("recompute", ["none", 1])
@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_parity_tiled_in_stashed_blocks(family, recompute):
    """Stashed blocks (``"recompute"``) keep their forward's graph: the tiled MLP's saved
    tiles are stashed with it instead of being recomputed."""
    config = ds_config(accumulation=2, megatrain={**_features(family), "recompute": recompute})
    engine, reference, trace = train_side_by_side(tiny_models.FAMILIES[family], config)
    try:
        assert engine.stashed_blocks > 0 and engine.mlp_tile_tokens == TILE
        assert_parity(engine, reference, trace)
    finally:
        engine.destroy()


def _packed_batch(seed: int) -> dict:
    """Two rows, each packing sequences whose position_ids restart at 0 and whose first
    label is -100; the HF Trainer's num_items_in_batch (here: over both micro-batches)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, tiny_models.VOCAB, (2, 12), generator=generator)
    lengths = [[5, 7], [3, 4, 5]]
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": labels,
        "num_items_in_batch": torch.tensor(2 * int((labels[:, 1:] != -100).sum())),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parity_packed_sequences_with_num_items_in_batch(family):
    config = ds_config(accumulation=2, megatrain=_features(family))
    engine, reference, trace = train_side_by_side(tiny_models.FAMILIES[family], config, make_batch=_packed_batch)
    try:
        assert engine.causal_loss is not None
        assert_parity(engine, reference, trace)
    finally:
        engine.destroy()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_items", [None, 37])
def test_chunked_linear_cross_entropy_matches_whole_logits(dtype, tolerance, num_items):
    """Loss and gradients of hidden, weight and bias against F.cross_entropy on whole
    logits (Hugging Face's fixed_cross_entropy), odd sizes, ignored rows. bf16: the
    reference's single bf16 weight-gradient product vs per-chunk products summed in fp32
    differ by bf16 rounding (2^-8 relative)."""
    torch.manual_seed(0)
    hidden = torch.randn(53, 24, dtype=dtype, requires_grad=True)
    weight = (torch.randn(71, 24) * 0.2).to(dtype).requires_grad_()
    bias = torch.randn(71).to(dtype).requires_grad_()
    targets = torch.randint(0, 71, (53,))
    targets[::4] = -100
    copies = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = F.linear(*copies).float()
    if num_items is None:
        expected = F.cross_entropy(logits, targets, ignore_index=-100)
    else:
        expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items
    (expected * 0.5).backward()
    denominator = (targets != -100).sum() if num_items is None else num_items
    loss = chunked_linear_cross_entropy(hidden, weight, bias, targets, denominator, chunk_tokens=8)
    (loss * 0.5).backward()
    assert loss.dtype == torch.float32
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6)
    for ours, theirs in zip((hidden, weight, bias), copies):
        error = (ours.grad.double() - theirs.grad.double()).norm() / theirs.grad.double().norm()
        assert error < tolerance, (ours.shape, float(error))


@pytest.mark.parametrize("num_items", [1000, 40000])
@pytest.mark.parametrize("incoming", [2.0**16, 3 * 2.0**10])
def test_chunked_loss_in_fp16_keeps_what_loss_scaling_keeps(num_items, incoming):
    """fp16 with a loss scale (the incoming gradient): every gradient finite and within fp16
    rounding of the float64 truth, as Hugging Face's whole-logits loss gives them
    ([Note: low-precision gradients of the chunked loss]). 2^16, DeepSpeed's default initial
    scale, is itself no fp16 number (multiplied in fp16 it made every hidden gradient inf);
    with a large ``num_items_in_batch`` the unscaled ``d loss / d logits`` falls below fp16's
    normal range (rounded there, the error was 6e-3). Bound: two fp16 roundings (of ``g`` and
    of the product), 1e-3 relative; measured <= 4.2e-4, Hugging Face's own 3.4e-4."""
    torch.manual_seed(0)
    hidden = torch.randn(53, 24).half().requires_grad_()
    weight = (torch.randn(71, 24) * 0.2).half().requires_grad_()
    bias = torch.randn(71).half().requires_grad_()
    targets = torch.randint(0, 71, (53,))
    targets[::4] = -100
    truth = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    expected = F.cross_entropy(F.linear(*truth), targets, ignore_index=-100, reduction="sum") / num_items
    (expected * incoming).backward()
    loss = chunked_linear_cross_entropy(hidden, weight, bias, targets, num_items, chunk_tokens=8)
    (loss * incoming).backward()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-3)
    for ours, exact in zip((hidden, weight, bias), truth):
        assert ours.grad.dtype == torch.float16 and bool(torch.isfinite(ours.grad).all()), ours.shape
        error = (ours.grad.double() - exact.grad).norm() / exact.grad.norm()
        assert error <= 1e-3, (ours.shape, float(error))


class _LargestRows(TorchDispatchMode):
    """Records, for each width of interest, the most rows any op's new tensor had (views,
    such as a weight's transpose inside F.linear, allocate nothing and are skipped)."""

    def __init__(self, widths: dict[str, int]) -> None:
        super().__init__()
        self.widths = widths
        self.rows = {name: 0 for name in widths}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                for name, width in self.widths.items():
                    if tensor.shape[-1] == width:
                        self.rows[name] = max(self.rows[name], tensor.numel() // width)
        return out


def _sdpa_llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("features", [True, False])
def test_no_tokens_by_vocab_or_tokens_by_ffn_tensor(features):
    """With the features on, no tensor of a step has more than a chunk of rows of logits
    (width = vocab 96) or a tile of rows of MLP intermediate (width = FFN 48); off, the
    whole 2 x 64 tokens of each appear (the check can fail)."""
    torch.manual_seed(0)
    chunk, tile = 16, 32  # tile >= hidden: the down projection's weight gradient is 32 x 48
    options = (
        {"loss_chunk_tokens": chunk, "mlp_tile_tokens": tile}
        if features
        else {"loss_chunk_tokens": 0, "mlp_tile_tokens": 0}
    )
    engine = MegatrainEngine(_sdpa_llama(), parse_engine_config(ds_config(megatrain=options)))
    try:
        engine.train()
        ids = torch.randint(0, 96, (2, 64))
        with _LargestRows({"logits": 96, "mlp": 48}) as seen:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if features:
            assert seen.rows["logits"] <= chunk and seen.rows["mlp"] <= tile, seen.rows
        else:
            assert seen.rows["logits"] >= 128 and seen.rows["mlp"] >= 128, seen.rows
    finally:
        engine.destroy()


def test_outputs_keep_logits_without_labels_or_in_eval():
    """Without labels the output has the logits; in eval mode (the Trainer's metrics) the
    model computes logits and loss itself; with labels in training the loss comes without
    logits, also as a tuple (return_dict=False), loss first."""
    torch.manual_seed(0)
    model = tiny_models.llama()
    reference = tiny_models.llama()
    reference.load_state_dict(model.state_dict())
    engine = MegatrainEngine(model, parse_engine_config(ds_config(megatrain={"loss_chunk_tokens": CHUNK})))
    try:
        batch = tiny_models.make_batch(0)
        expected = reference(**batch)
        engine.train()
        plain = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        torch.testing.assert_close(plain.logits, expected.logits, rtol=1e-5, atol=1e-6)
        chunked = engine(**batch)
        assert chunked.logits is None and math.isclose(chunked.loss.item(), expected.loss.item(), rel_tol=1e-6)
        as_tuple = engine(**batch, return_dict=False)
        assert math.isclose(as_tuple[0].item(), expected.loss.item(), rel_tol=1e-6)
        assert not any(isinstance(v, torch.Tensor) and v.shape[-1:] == (0,) for v in as_tuple)
        engine.eval()
        evaluated = engine(**batch)
        torch.testing.assert_close(evaluated.logits, expected.logits, rtol=1e-5, atol=1e-6)
        assert math.isclose(evaluated.loss.item(), expected.loss.item(), rel_tol=1e-6)
    finally:
        engine.destroy()


def test_a_forward_replaced_by_another_library_gets_its_labels():
    """TRL's SFTTrainer puts a fused-LM-head forward on the model instance; it computes its
    own loss from the labels, so the engine hands them over instead of chunking."""
    torch.manual_seed(0)
    model = tiny_models.llama()
    reference = tiny_models.llama()
    reference.load_state_dict(model.state_dict())
    seen = []
    original = model.forward

    def client_forward(*args, **kwargs):
        seen.append(kwargs.get("labels"))
        return original(*args, **kwargs)

    model.forward = client_forward
    engine = MegatrainEngine(model, parse_engine_config(ds_config(megatrain={"loss_chunk_tokens": CHUNK})))
    try:
        assert engine.causal_loss is not None
        batch = tiny_models.make_batch(0)
        engine.train()
        output = engine(**batch)
        assert seen and seen[-1] is batch["labels"]
        assert output.logits is not None
        assert math.isclose(output.loss.item(), reference(**batch).loss.item(), rel_tol=1e-6)
    finally:
        engine.destroy()


def test_model_that_transforms_its_logits_is_refused_when_asked_for():
    """Gemma 2 softcaps its logits after lm_head: "auto" leaves its loss to the model, an
    explicit chunk size is an error naming the setting."""
    with pytest.raises(ValueError, match="loss_chunk_tokens.*final_logit_softcapping"):
        MegatrainEngine(tiny_models.gemma2(), parse_engine_config(ds_config(megatrain={"loss_chunk_tokens": 8})))


@pytest.mark.parametrize("key", ["loss_chunk_tokens", "mlp_tile_tokens"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "big"])
def test_bad_tile_sizes_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=key):
        parse_engine_config(ds_config(megatrain={key: value}))


def _bench_shape(**changes):
    """The 117M Llama of bench/long_context.py, as ``megatrain plan`` reads it."""
    from megatrain_ds.cli import shape_of

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        return shape_of(transformers.LlamaForCausalLM(config))


def test_planner_max_sequence_length_is_where_the_step_stops_fitting():
    from megatrain_ds.planning.planner import Hardware, RunSettings, _fits, _with, max_sequence_length, plan

    shape = _bench_shape()
    assert shape.intermediate == 2816
    memory = 24 << 30
    cpu = Hardware("cpu", 1e11, 1e10, 1e10, 1e10, memory, shares_host_memory=True)
    settings = RunSettings(seq_len=16384, bf16=False)
    longest = max_sequence_length(shape, settings, cpu, memory)
    assert _fits(shape, _with(settings, seq_len=longest), cpu, memory)
    assert not _fits(shape, _with(settings, seq_len=longest + 1), cpu, memory)
    whole = _with(settings, chunked_loss=False, tiled_mlp=False)
    # Without the chunked loss each token costs its logits (3 x 4 x 32000 bytes) and more.
    on, off = plan(shape, settings, cpu, memory), plan(shape, whole, cpu, memory)
    assert off.bytes_per_token > 3 * 4 * 32000 > 2 * on.bytes_per_token
    assert on.max_seq_len == longest > 3 * off.max_seq_len
    # The memory the plan counts grows by bytes_per_token per token (it is linear in T).
    grown = plan(shape, _with(settings, seq_len=2 * 16384), cpu, memory)
    assert grown.predicted_peak_host_bytes - on.predicted_peak_host_bytes == pytest.approx(
        16384 * on.bytes_per_token, rel=1e-3
    )


def test_cli_prints_the_max_sequence_length(capsys):
    from megatrain_ds import cli

    cli.main(["plan", "--model", "configs/models/tiny_llama.json", "--gpu", "h100", "--seq-len", "4096"])
    out = capsys.readouterr().out
    assert "max sequence length:" in out and "memory per token of sequence:" in out
    longest = int(out.split("max sequence length:")[1].split("tokens")[0].replace(",", ""))
    assert longest > 4096
    # A limit of memory beyond the model's own (tiny_llama.json: 256 positions) names that too.
    assert "the model's max_position_embeddings is 256" in out
