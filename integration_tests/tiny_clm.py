"""What the integration scripts share: a tiny byte-level Llama and the shipped corpus.

Imported by ``accelerate_clm.py``, ``hf_trainer_clm.py`` and ``trainer_clients.py``, which
run as scripts (their directory is on ``sys.path``), and by the tests that check their output.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 32


def corpus() -> str:
    return (REPO_ROOT / "data" / "kjv_excerpt.txt").read_text(encoding="utf-8")


def byte_blocks(text: str, count: int, start: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` consecutive ``SEQ_LEN``-byte examples starting at block ``start``."""
    ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    blocks = ids[start * SEQ_LEN : (start + count) * SEQ_LEN].view(count, SEQ_LEN)
    return [{"input_ids": block, "labels": block.clone()} for block in blocks]


def tiny_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="eager",
    )


def tiny_llama(output_dir: Path) -> transformers.LlamaForCausalLM:
    """A fresh tiny Llama (seeded by the caller); its initial weights are saved to
    ``output_dir/initial.safetensors`` so tests can check what training changed."""
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, output_dir / "initial.safetensors"
    )
    return model
