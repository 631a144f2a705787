"""Config parsing: DeepSpeed batch rules, and clear errors naming the bad key."""

import logging

import pytest

from megatrain_ds import ConfigError, parse_engine_config

BASE = {
    "engine": "megatrain",
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def test_defaults():
    config = parse_engine_config(BASE)
    assert config.options.checkpoint_interval == 1 and config.options.num_buffers == 2
    assert config.options.master_dtype == "fp32" and config.options.offload_checkpoints
    assert config.gradient_accumulation_steps == 1 and config.train_batch_size == 2
    # DeepSpeed 0.19's defaults: clipping at 1.0; FusedAdam's weight decay 0 (tests/test_deepspeed_config.py)
    assert not config.bf16 and config.gradient_clipping == 1.0
    assert config.optimizer.decoupled and config.optimizer.weight_decay == 0.0


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, (8, 2, 4)),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, (8, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (6, 3, 2)),
        ({"train_batch_size": 5}, (5, 5, 1)),
    ],
)
def test_batch_rules_follow_deepspeed(keys, expected):
    config = parse_engine_config({"optimizer": BASE["optimizer"], **keys})
    assert (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    ) == expected


def test_inconsistent_batch_sizes_are_rejected_with_deepspeeds_message():
    with pytest.raises(ConfigError, match="train_batch_size is not equal to micro_batch_per_gpu"):
        parse_engine_config({**BASE, "train_batch_size": 7, "gradient_accumulation_steps": 2})


def test_missing_batch_size_is_rejected():
    with pytest.raises(
        ConfigError,
        match="train_batch_size or train_micro_batch_size_per_gpu needs to be provided "
        r"\(the HF Trainer and Accelerate fill both in",
    ):
        parse_engine_config({"optimizer": BASE["optimizer"]})


@pytest.mark.parametrize(
    "megatrain, message",
    [
        ({"num_bufers": 2}, r"unknown key\(s\) in megatrain config: num_bufers; valid keys: .*num_buffers"),
        ({"num_buffers": 1}, r"megatrain.num_buffers must be an integer >= 2, got 1"),
        ({"checkpoint_interval": 0}, r"megatrain.checkpoint_interval must be an integer >= 1"),
        ({"master_dtype": "fp16"}, r'megatrain.master_dtype must be one of "fp32", "bf16"'),
        ({"offload_checkpoints": "yes"}, r"megatrain.offload_checkpoints must be true or false"),
        ({"block_path": 3}, r"megatrain.block_path must be a string"),
        ({"recompute": "partial"}, r'megatrain.recompute must be "full" .* got \'partial\''),
        ({"recompute": -1}, r"megatrain.recompute must be .*integer >= 0.* got -1"),
        ({"recompute": True}, r"megatrain.recompute must be .* got True"),
        ({"recompute": 1.5}, r"megatrain.recompute must be .* got 1.5"),
        ({"frozen_weights": "bf16"}, r"megatrain.frozen_weights must be one of 'exact', 'compute_dtype'; got 'bf16'"),
    ],
)
def test_bad_megatrain_options_name_the_key(megatrain, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({**BASE, "megatrain": megatrain})


def test_fp16_with_bf16_is_rejected():
    with pytest.raises(ConfigError, match=r"fp16.enabled and bf16.enabled are both true"):
        parse_engine_config({**BASE, "bf16": {"enabled": True}, "fp16": {"enabled": True}})


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"type": "SGD"}, r"optimizer.type 'SGD' is not supported"),
        ({"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}, r"unknown optimizer.params key\(s\): momentum"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, r"betas must have two values"),
    ],
)
def test_bad_optimizer_blocks(optimizer, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({**BASE, "optimizer": optimizer})


def test_adam_without_w_mode_is_l2_adam():
    config = parse_engine_config({**BASE, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not config.optimizer.decoupled and config.optimizer.weight_decay == 0.0


def test_keys_without_meaning_are_reported_once(caplog):
    with caplog.at_level(logging.WARNING):
        config = parse_engine_config(
            {**BASE, "prescale_gradients": True, "zero_optimization": {"stage": 3, "overlap_comm": True}}
        )
    assert config.ignored_keys == ("prescale_gradients", "zero_optimization.overlap_comm")
    assert len(caplog.records) == 1  # one warning, each key with what the engine does instead
    assert "prescale_gradients (gradients are summed in full and divided by the world size once)" in caplog.text
    assert "zero_optimization.overlap_comm (ZeRO's partitioning" in caplog.text
