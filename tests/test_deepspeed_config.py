"""DeepSpeed config semantics: what a DeepSpeed JSON means to DeepSpeed, it means here.

Defaults and optimizer choices are checked against DeepSpeed itself (its constants, its
Adam classes' signatures, the optimizer its engine builds), not against restated numbers.
"""

import inspect
import logging

import pytest
import tiny_models
import torch

from megatrain_ds import ConfigError, parse_engine_config

BASE = {
    "engine": "megatrain",
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}

# A zero_optimization block as DeepSpeed's docs and HF's examples write ZeRO-3 CPU offload.
ZERO3_OFFLOAD = {
    "stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
}


def test_gradient_clipping_default_is_deepspeeds():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    config = {key: value for key, value in BASE.items()}
    assert parse_engine_config(config).gradient_clipping == GRADIENT_CLIPPING_DEFAULT


def test_weight_decay_default_is_that_of_deepspeeds_adam_kernels():
    """Without torch_adam DeepSpeed builds FusedAdam (GPU) or DeepSpeedCPUAdam (offload)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    for kernel in (FusedAdam, DeepSpeedCPUAdam):
        default = inspect.signature(kernel.__init__).parameters["weight_decay"].default
        for kind in ("Adam", "AdamW"):
            config = {**BASE, "optimizer": {"type": kind, "params": {"lr": 1e-3}}}
            assert parse_engine_config(config).optimizer.weight_decay == default


@pytest.mark.parametrize(
    "kind, params",
    [
        ("AdamW", {}),
        ("AdamW", {"adam_w_mode": False}),
        ("Adam", {}),
        ("Adam", {"adam_w_mode": False}),
    ],
)
def test_torch_adam_configs_mean_what_deepspeed_builds(kind, params):
    """With torch_adam DeepSpeed builds torch.optim.AdamW or Adam: the engine's decoupling and
    weight decay are those of the optimizer DeepSpeed's own engine builds from the same block."""
    import deepspeed

    block = {"type": kind, "params": {"lr": 1e-3, "torch_adam": True, **params}}
    ours = parse_engine_config({**BASE, "optimizer": block}).optimizer
    ds_config = {"train_micro_batch_size_per_gpu": 2, "optimizer": block}
    engine, optimizer, *_ = deepspeed.initialize(model=tiny_models.llama(num_layers=1), config=ds_config)
    assert type(engine).__name__ == "DeepSpeedEngine"
    assert ours.decoupled == isinstance(optimizer, torch.optim.AdamW)
    assert ours.weight_decay == optimizer.param_groups[0]["weight_decay"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"lr": "auto"}, r'optimizer.params.lr is .auto.: "auto" values are filled in by the HF Trainer'),
        ({"max_grad_norm": 1.0}, r"'max_grad_norm' is not supported as an optimizer parameter"),
        ({"amsgrad": True}, r"optimizer.params.amsgrad must be false"),
        ({"bias_correction": False}, r"optimizer.params.bias_correction must be true"),
    ],
)
def test_optimizer_params_the_engine_cannot_honour(params, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({**BASE, "optimizer": {"type": "AdamW", "params": params}})


def test_adam_options_that_agree_with_the_engine_are_accepted():
    config = parse_engine_config(
        {
            **BASE,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 2e-4,
                    "bias_correction": True,
                    "amsgrad": False,
                    "fp32_optimizer_states": True,
                    "betas": [0.8, 0.9],
                    "eps": 1e-6,
                    "weight_decay": 0.05,
                },
            },
        }
    )
    assert (config.optimizer.lr, config.optimizer.betas, config.optimizer.eps) == (2e-4, (0.8, 0.9), 1e-6)
    assert config.optimizer.weight_decay == 0.05 and config.optimizer.decoupled


@pytest.mark.parametrize(
    "keys, expected",
    [
        # Accelerate's and the Trainer's "auto": the missing value follows DeepSpeed's rules.
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            (8, 4, 2),
        ),
        (
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
            (8, 2, 4),
        ),
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": "auto"},
            (3, 3, 1),
        ),
    ],
)
def test_auto_batch_keys_are_derived(keys, expected):
    config = parse_engine_config({"engine": "megatrain", **keys})
    assert (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    ) == expected


def test_unresolvable_auto_batch_size_says_who_fills_it():
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu is 'auto'.*HF Trainer"):
        parse_engine_config(
            {"engine": "megatrain", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
        )


def test_auto_clipping_and_precision_resolve_as_accelerate_fills_them():
    config = parse_engine_config(
        {**BASE, "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    )
    assert config.gradient_clipping == 1.0 and not config.bf16


def test_bfloat16_is_an_alias_of_bf16():
    assert parse_engine_config({**BASE, "bfloat16": {"enabled": True}}).bf16


@pytest.mark.parametrize("value, expected", [(5, 5), (float("inf"), None), (None, None)])
def test_steps_per_print(value, expected):
    """Accelerate sets inf to silence DeepSpeed; DeepSpeed 0.19's default is no printing."""
    config = {**BASE} if value is None else {**BASE, "steps_per_print": value}
    assert parse_engine_config(config).steps_per_print == expected


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("steps_per_print", 0, r"steps_per_print must be a positive integer, got 0"),
        ("wall_clock_breakdown", "yes", r"wall_clock_breakdown must be true or false, got 'yes'"),
        ("zero_optimization", {"stage": 4}, r"zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
        (
            "zero_optimization",
            {"offload_param": {"pin_memory": "yes"}},
            r"zero_optimization.offload_param.pin_memory must be true or false",
        ),
        (
            "scheduler",
            {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
            r"scheduler.params.warmup_max_lr is 'auto'",
        ),
        ("scheduler", {"params": {}}, r"scheduler.type must name a scheduler"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({**BASE, key: value})


def test_zero3_offload_block_is_accepted_with_one_warning(caplog):
    """pin_memory is honoured; stage, offload devices "cpu" and the 16-bit-save flag agree
    with the engine; every other key is listed, once, in a single warning."""
    with caplog.at_level(logging.WARNING, logger="megatrain_ds.config"):
        config = parse_engine_config({**BASE, "zero_optimization": ZERO3_OFFLOAD, "prescale_gradients": False})
    assert config.options.pin_memory is True
    ignored = ("prescale_gradients",) + tuple(
        f"zero_optimization.{key}"
        for key in (
            "overlap_comm",
            "contiguous_gradients",
            "sub_group_size",
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        )
    )
    assert config.ignored_keys == ignored
    records = [r for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(records) == 1 and ", ".join(ignored[1:]) + " (ZeRO's partitioning" in records[0].getMessage()


@pytest.mark.parametrize(
    "zero, megatrain, expected",
    [
        ({"offload_param": {"device": "cpu", "pin_memory": False}}, {}, False),
        ({"offload_param": {"pin_memory": False}, "offload_optimizer": {"pin_memory": True}}, {}, True),
        ({"offload_param": {"pin_memory": False}}, {"pin_memory": True}, True),  # the megatrain block wins
        ({"stage": 0}, {}, True),  # no pin_memory given: the engine's default
    ],
)
def test_offload_pin_memory_sets_the_engines(zero, megatrain, expected):
    config = parse_engine_config({**BASE, "zero_optimization": zero, "megatrain": megatrain})
    assert config.options.pin_memory is expected


ZERO_INFINITY = {
    "stage": 3,
    "offload_optimizer": {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": True,
        "buffer_count": 5,
        "fast_init": False,
    },
    "offload_param": {
        "device": "nvme",
        "nvme_path": "/other_nvme",
        "pin_memory": True,
        "buffer_count": 5,
        "buffer_size": 1e8,
        "max_in_cpu": 1e9,
    },
}
AIO = {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": False, "overlap_events": True}


def test_zero_infinity_config_turns_the_nvme_tier_on(caplog):
    """offload_optimizer.device "nvme": the optimizer state on the NVMe tier, in its
    nvme_path, buffer_count blocks in the window, the "aio" block's settings; offload_param
    "nvme" puts the weights there too ("all", state/nvme_weights.py), with no warning left
    about it; the rest is listed as ignored."""
    with caplog.at_level(logging.WARNING, logger="megatrain_ds.config"):
        config = parse_engine_config({**BASE, "zero_optimization": ZERO_INFINITY, "aio": AIO})
    options = config.options
    assert (options.nvme_offload, options.nvme_path, options.nvme_window_blocks) == ("all", "/local_nvme", 5)
    only_optimizer = {**ZERO_INFINITY, "offload_param": {"device": "cpu"}}
    assert parse_engine_config({**BASE, "zero_optimization": only_optimizer}).options.nvme_offload == "optimizer"
    assert (
        options.nvme_aio.block_size,
        options.nvme_aio.queue_depth,
        options.nvme_aio.thread_count,
        options.nvme_aio.single_submit,
        options.nvme_aio.overlap_events,
    ) == (262144, 32, 2, False, True)
    assert config.ignored_keys == tuple(
        f"zero_optimization.{key}"
        for key in (
            "offload_optimizer.fast_init",
            "offload_param.buffer_count",
            "offload_param.buffer_size",
            "offload_param.max_in_cpu",
        )
    )
    assert not any('offload_param.device is "nvme"' in r.getMessage() for r in caplog.records)


def test_offload_param_alone_on_nvme_uses_its_path():
    """The weights on NVMe take their optimizer state along (a block's master is both)."""
    config = parse_engine_config(
        {**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}
    )
    assert (config.options.nvme_offload, config.options.nvme_path) == ("all", "/nvme")


def test_the_megatrain_block_overrides_zero_infinity():
    config = parse_engine_config(
        {**BASE, "zero_optimization": ZERO_INFINITY, "megatrain": {"nvme_offload": "none", "nvme_window_blocks": 3}}
    )
    assert (config.options.nvme_offload, config.options.nvme_window_blocks) == ("none", 3)


@pytest.mark.parametrize(
    "zero, aio, message",
    [
        ({"offload_optimizer": {"device": "nvme"}}, None, "no nvme_path"),
        (ZERO_INFINITY, {"block_size": 1000}, "multiple of 4096"),
        (ZERO_INFINITY, {"queue_depth": 0}, "aio.queue_depth"),
        (ZERO_INFINITY, {"use_odirect": True}, "unknown key"),
    ],
)
def test_bad_nvme_settings_are_named(zero, aio, message):
    with pytest.raises(ConfigError, match=message):
        parse_engine_config({**BASE, "zero_optimization": zero, **({"aio": aio} if aio else {})})


def test_config_reads_like_deepspeeds_engine_config_dict():
    """The HF Trainer reads engine.config.get("zero_optimization", {}).get("stage")."""
    config = parse_engine_config({**BASE, "zero_optimization": {"stage": 3}})
    assert config.get("zero_optimization", {}).get("stage") == 3
    assert config.get("missing", "default") == "default"
