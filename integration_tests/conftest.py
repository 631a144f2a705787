"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
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
