"""Tiny random-init Hugging Face models of each supported family, and batches with padding."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

VOCAB = 96


def _common(num_layers: int) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )


def llama(num_layers: int = 4) -> transformers.PreTrainedModel:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common(num_layers)))


def qwen2(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Tied embeddings and qkv bias."""
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_common(num_layers), tie_word_embeddings=True))


def mistral(num_layers: int = 4) -> transformers.PreTrainedModel:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_common(num_layers), sliding_window=8))


def gpt2(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Conv1D projections, learned positions, dropout on (replayed exactly in recompute)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=num_layers,
        n_head=4,
        n_positions=64,
        attn_implementation="eager",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return transformers.GPT2LMHeadModel(config)


def mixtral(num_layers: int = 4) -> transformers.PreTrainedModel:
    config = transformers.MixtralConfig(**_common(num_layers), num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


FAMILIES: dict[str, Callable[..., transformers.PreTrainedModel]] = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "gpt2": gpt2,
    "mixtral": mixtral,
}


def load_eagerly(*names: str) -> None:
    """Import these transformers classes now (``"LlamaForCausalLM"``). transformers imports a
    model's module on first use, and the first one brings much of ``torch._dynamo`` with it:
    a process that forks after its imports (``forked_ranks.py``, ``clean_exit_worker.py``)
    loads what its children build here, so they share one import instead of each paying it
    (two thirds of a short forked rank's CPU)."""
    for name in names:
        getattr(transformers, name)


def load_engine_imports_eagerly() -> None:
    """Import now what an engine imports when it is first built: DeepSpeed (for its loss
    scaler; ``import deepspeed`` brings some 600 modules), its op builders and torch's
    extension loader (the CPU Adam binding, the async I/O op). A process that forks after its
    imports (as for ``load_eagerly``) then loads them once instead of in every child: about
    0.7 s of CPU per forked rank. Only modules: nothing of an engine exists before the fork."""
    import deepspeed.ops.op_builder
    import deepspeed.runtime.fp16.loss_scaler  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401


def make_batch(seed: int, batch: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    """Random tokens; the second row is left-padded (mask 0, label -100) by a seed-dependent amount."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    pad = 2 + seed % 3
    attention_mask[-1, :pad] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def gemma(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Scaled embeddings, tied head, (1 + w) RMSNorm."""
    config = transformers.GemmaConfig(**_common(num_layers), head_dim=8)
    return transformers.GemmaForCausalLM(config)


def gemma2(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Alternating sliding/global attention: a per-block attribute the template must take."""
    config = transformers.Gemma2Config(**_common(num_layers), head_dim=8, sliding_window=4)
    return transformers.Gemma2ForCausalLM(config)


def phi(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Parallel attention/MLP with biases and partial rotary embeddings."""
    common = _common(num_layers)
    common.pop("num_key_value_heads")
    return transformers.PhiForCausalLM(transformers.PhiConfig(**common, partial_rotary_factor=0.5))


def qwen3(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Per-head q/k RMSNorm."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_common(num_layers), head_dim=8))


def qwen2_moe(num_layers: int = 4) -> transformers.PreTrainedModel:
    """Routed experts plus a gated shared expert."""
    config = transformers.Qwen2MoeConfig(
        **_common(num_layers),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
    )
    return transformers.Qwen2MoeForCausalLM(config)


FAMILIES.update({"gemma": gemma, "gemma2": gemma2, "phi": phi, "qwen3": qwen3, "qwen2_moe": qwen2_moe})
