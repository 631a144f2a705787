"""Bad input gets an error that names what is wrong, through the user's entry point
(``initialize``, as ``deepspeed.initialize`` routes it) and the engine's forward."""

import pytest
import tiny_models
import torch
from side_by_side import ds_config
from torch import nn

from megatrain_ds import ConfigError, initialize
from megatrain_ds.model.block_discovery import BlockDiscoveryError
from megatrain_ds.runtime.device_runtime import canonical_device

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def _initialize(config, model=None, **kwargs):
    engine, *_ = initialize(model=model if model is not None else tiny_models.llama(), config=config, **kwargs)
    return engine


@pytest.mark.parametrize(
    "megatrain, message",
    [
        ({"num_bufers": 2}, r"unknown key\(s\) in megatrain config: num_bufers; valid keys: .*num_buffers"),
        ({"load_form": "/x"}, r"unknown key\(s\) in megatrain config: load_form; valid keys: .*load_from"),
    ],
)
def test_unknown_or_mistyped_megatrain_key(megatrain, message):
    with pytest.raises(ConfigError, match=message):
        _initialize(ds_config(megatrain=megatrain))


def test_invalid_choice_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r'megatrain.master_dtype must be one of "fp32", "bf16"; got \'fp16\''):
        _initialize(ds_config(megatrain={"master_dtype": "fp16"}))


def test_fp16_and_bf16_together_are_rejected():
    with pytest.raises(ConfigError, match=r"fp16.enabled and bf16.enabled are both true"):
        _initialize({**ds_config(bf16=True), "fp16": {"enabled": True}})


def test_unsupported_optimizers_are_named():
    with pytest.raises(ConfigError, match=r"optimizer.type 'Lamb' is not supported; valid: \"AdamW\", \"Adam\""):
        _initialize({**ds_config(), "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    model = tiny_models.llama()
    config = ds_config()
    del config["optimizer"]
    with pytest.raises(ConfigError, match="client optimizer SGD is not supported"):
        _initialize(config, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_inconsistent_batch_sizes():
    with pytest.raises(
        ConfigError,
        match=r"train_batch_size is not equal to micro_batch_per_gpu \* "
        r"gradient_acc_step \* world_size 7 != 2 \* 2 \* 1",
    ):
        _initialize({**ds_config(accumulation=2), "train_batch_size": 7})


def test_model_without_repeated_blocks():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    with pytest.raises(BlockDiscoveryError, match=r"Sequential has no repeated blocks.*block_path"):
        _initialize(ds_config(), model=model)


@pytest.fixture
def engine():
    engine = _initialize(ds_config())
    yield engine
    engine.destroy()


def test_batch_of_the_wrong_dtype(engine):
    batch = tiny_models.make_batch(0)
    with pytest.raises(
        ValueError,
        match=r"batch tensor 'input_ids' has dtype torch.float32; it holds token "
        r"indices and must be an integer tensor",
    ):
        engine(input_ids=batch["input_ids"].float(), labels=batch["labels"])


def test_batch_on_the_wrong_device(engine):
    batch = tiny_models.make_batch(0)
    with pytest.raises(
        ValueError,
        match=r"batch tensor 'attention_mask' is on meta, but the engine computes "
        r"on cpu: move the batch there first",
    ):
        engine(**{**batch, "attention_mask": batch["attention_mask"].to("meta")})


def test_plain_cuda_names_the_device_its_tensors_are_on(monkeypatch):
    """``device=torch.device("cuda")`` used to refuse every batch made with ``.cuda()``:
    those are on ``cuda:0``, and torch.device("cuda") != torch.device("cuda:0"). Found on
    the first GPU run (bench/timeline.py --device cuda)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert canonical_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert canonical_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert canonical_device(torch.device("cpu")) == torch.device("cpu")


def test_sequence_longer_than_the_models_positions(engine):
    batch = tiny_models.make_batch(0, length=65)
    with pytest.raises(ValueError, match=r"sequences of 65 tokens, more than the 64 positions the model has"):
        engine(**batch)
    engine(**tiny_models.make_batch(0, length=64))  # the limit itself is fine
