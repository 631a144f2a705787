"""What the integration scripts share: a tiny byte-level Llama and the shipped corpus.

Imported by ``accelerate_clm.py``, ``hf_trainer_clm.py`` and ``trainer_clients.py``, which
run as scripts (their directory is on ``sys.path``), and by the tests that check their output.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
import transformers
from packaging.version import Version

# Named at import, as a script names what it uses: transformers loads a model's module on
# first use (with the first one much of torch._dynamo, 4.5 s of CPU), and a launch that runs
# these scripts in children forked after their imports (forked_runs.py) then loads it once.
from transformers import LlamaConfig, LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
TRAINER_LOSS_FRACTION = 1.0 if Version(transformers.__version__) >= Version("5.10.1") else (SEQ_LEN - 1) / SEQ_LEN
"""The Trainer's loss of full ``SEQ_LEN`` rows over their mean token loss. It divides the
summed token losses by the label tokens it counts (``num_items_in_batch``), in training and,
through ``prediction_step``, in ``evaluate()``. Since transformers 5.10.1 it counts the shifted
labels, the ``SEQ_LEN - 1`` per row that carry a loss; before, all ``SEQ_LEN`` (checked in the
wheels: 5.2.0, 5.8.0 and 5.9.0 count ``labels.ne(-100)``, 5.10.1 ``labels[..., 1:]``). The
Trainer's normalisation, not the engine's: plain transformers on the saved model gives the
mean token loss."""


def corpus() -> str:
    return (REPO_ROOT / "data" / "kjv_excerpt.txt").read_text(encoding="utf-8")


def byte_blocks(text: str, count: int, start: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` consecutive ``SEQ_LEN``-byte examples starting at block ``start``."""
    ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    blocks = ids[start * SEQ_LEN : (start + count) * SEQ_LEN].view(count, SEQ_LEN)
    return [{"input_ids": block, "labels": block.clone()} for block in blocks]


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        attn_implementation="eager",
    )


def tiny_llama(output_dir: Path) -> LlamaForCausalLM:
    """A fresh tiny Llama (seeded by the caller); its initial weights are saved to
    ``output_dir/initial.safetensors`` so tests can check what training changed."""
    model = LlamaForCausalLM(tiny_llama_config())
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, output_dir / "initial.safetensors"
    )
    return model
