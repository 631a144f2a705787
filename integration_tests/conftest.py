"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from accelerate.state import AcceleratorState
from tiny_clm import tiny_llama_config
from trainer_clients import byte_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A "pretrained" tiny byte-level Llama (seed 0) with its tokenizer, as ``save_pretrained`` writes it."""
    directory = tmp_path_factory.mktemp("pretrained")
    transformers.set_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """What a test here sets up in this process (``TrainingArguments`` and Accelerate's plugin
    join a one-rank process group and fill Accelerate's shared state) ends with it: the unit
    tests that run after it on the same pytest-xdist worker (the slowest tests go first, and
    an idle worker steals whatever is left) must see a process without a group, as
    ``tests/test_deepspeed_adapter.py``'s batch-rule test requires."""
    had_group = torch.distributed.is_initialized()
    yield
    if not had_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
