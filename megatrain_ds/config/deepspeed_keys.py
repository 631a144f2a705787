"""Which DeepSpeed keys the engine reads, ignores (with a warning) or refuses, and the ``zero_optimization`` block.

docs/configuration.md ("Every DeepSpeed key") says the same per key; ``tests/test_deepspeed_keys.py``
checks every key DeepSpeed knows is in one of these lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatrain_ds.config.values import ConfigError

logger = logging.getLogger(__name__)

# DeepSpeed keys this engine reads; everything else at the top level is ignored with a warning.
_KNOWN_TOP_LEVEL = {
    "engine",
    "megatrain",
    "bf16",
    "fp16",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "optimizer",
    # DeepSpeed semantics added for Accelerate and the HF Trainer (see README):
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_optimization",
    "bfloat16",
    # Accelerate and the HF Trainer add these to every config they prepare; they concern
    # which client optimizers DeepSpeed lets through (this engine checks the class itself).
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    # ZeRO-Infinity's async I/O settings, read for the NVMe tier (AioSettings).
    "aio",
    # DeepSpeed's monitors, written through its own MonitorMaster (integration/deepspeed_adapter.py).
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    # DeepSpeed's training_data loader (integration/initialize.py).
    "dataloader_drop_last",
}
MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")
"""DeepSpeed's monitor blocks (``deepspeed/monitor/config.py``), each a top-level key."""

# DeepSpeed keys read by DeepSpeed's engine that mean nothing to this one: each is ignored with
# a warning saying what the engine does instead (docs/configuration.md, "Every DeepSpeed key").
_IGNORED_TOP_LEVEL = {
    "activation_checkpointing": "the engine checkpoints and recomputes every streamed block itself "
    "(megatrain.checkpoint_interval, offload_checkpoints, recompute)",
    "autotuning": "not run; `megatrain plan` and the preflight size a run",
    "checkpoint": "checkpoints are the engine's own safetensors format (docs/checkpoints.md)",
    "datastates_ckpt": "checkpoints are the engine's own safetensors format (docs/checkpoints.md)",
    "comms_logger": "collectives are not logged; megatrain.trace records the gradient reductions",
    "communication_data_type": "gradients are reduced in the compute dtype, as autograd made them",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "compile": "engine.compile is not supported; torch.compile parts of the model instead",
    "data_efficiency": "the training_data loader is DeepSpeed's plain distributed sampler (no data routing)",
    "data_types": "held gradients are fp32 when accumulating or with fp16, else the compute dtype",
    "disable_allgather": "there is no ZeRO all-gather: every rank holds whole parameters",
    "disable_python_gc": "Python's garbage collector is left as it is",
    "dump_state": "the DeepSpeed state is not printed",
    "flops_profiler": "not run (its module hooks do not see the streamed blocks); megatrain.trace "
    "times each block's compute and `megatrain plan` predicts a step",
    "gradient_predivide_factor": "gradients are summed in full and divided by the world size once",
    "prescale_gradients": "gradients are summed in full and divided by the world size once",
    "hybrid_engine": "there is no inference (generation) engine; call engine.module under torch.no_grad()",
    "log_level": "DeepSpeed's logger level is left as it is",
    "memory_breakdown": "memory is not logged per step; the preflight reports what a run needs",
    "pipeline": "pipeline settings apply to DeepSpeed's PipelineModule only, which this engine does not run",
    "timers": "the throughput timer is not run; wall_clock_breakdown times forward, backward and step",
    "use_data_before_expert_parallelism": "there is no expert parallelism",
    "vocabulary_size": "the vocabulary is the model's",
    "weight_quantization": "weights are not quantized: the masters are fp32 and compute is fp32, bf16 or fp16",
}
_REMOVED_FROM_DEEPSPEED = (
    "amp",
    "compression_training",
    "curriculum_learning",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
)
"""Keys DeepSpeed 0.19 itself refuses (its ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``): refused here too."""


def _block_value(value: Any, key: str, default: Any) -> Any:
    return value.get(key, default) if isinstance(value, Mapping) else default


# DeepSpeed keys whose non-default values ask for what this engine cannot do: refused then,
# each with what to do instead (their default values say what the engine does anyway).
_REFUSED_WHEN: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel": (
        lambda v: _block_value(v, "autotp_size", 0) not in (0, 1),
        "tensor parallelism (autotp_size > 1) is not supported: the engine trains data parallel "
        "with whole blocks streamed through each device; remove the block",
    ),
    "sequence_parallel_size": (
        lambda v: v not in (None, 1),
        "sequence parallelism is not supported; remove the key (long sequences: megatrain.loss_chunk_tokens "
        "and mlp_tile_tokens, docs/long-context.md)",
    ),
    "expert_parallel": (
        lambda v: bool(_block_value(v, "enabled", False)),
        "expert parallelism is not supported: experts train data parallel like every other weight; set enabled: false",
    ),
    "torch_autocast": (
        lambda v: bool(_block_value(v, "enabled", False)),
        'torch.autocast is not used: set "bf16": {"enabled": true} (or fp16) instead, which computes in that '
        "dtype with fp32 masters",
    ),
    "managed_gradient_accumulation": (
        lambda v: v is not True,
        "the engine counts micro-batches itself (gradient_accumulation_steps); set it true, and use "
        "engine.set_gradient_accumulation_boundary() to end an accumulation early",
    ),
    "gradient_allreduce_op": (
        lambda v: str(v).lower() != "mean",
        'gradients are averaged over the ranks; only "mean" (DeepSpeed\'s default) is supported',
    ),
}


def refuse_unsupported(config: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for a DeepSpeed key this engine can neither honour nor ignore."""
    for key in _REMOVED_FROM_DEEPSPEED:
        if key in config:
            raise ConfigError(
                f'"{key}" was removed from DeepSpeed (DeepSpeed 0.19 refuses it too) and has no meaning here: remove it'
            )
    for key, (refused, fix) in _REFUSED_WHEN.items():
        if key in config and refused(config[key]):
            raise ConfigError(f"{key} = {config[key]!r}: {fix}")


def warn_ignored(config: Mapping[str, Any], zero_ignored: tuple[str, ...]) -> tuple[str, ...]:
    """Warn once about the DeepSpeed keys ignored here, each with what the engine does instead;
    returns them (top-level keys first, then the ``zero_optimization`` ones)."""
    understood = _KNOWN_TOP_LEVEL | _REFUSED_WHEN.keys()
    top_level = tuple(sorted(set(config) - understood))
    reasons = [f"{key} ({_IGNORED_TOP_LEVEL.get(key, 'not a DeepSpeed key this engine knows')})" for key in top_level]
    if zero_ignored:
        reasons.append(f"{', '.join(zero_ignored)} ({ZERO_IGNORED_REASON})")
    if reasons:
        logger.warning("megatrain: ignoring DeepSpeed config keys without meaning here: %s", "; ".join(reasons))
    return top_level + zero_ignored


ZERO_IGNORED_REASON = (
    "ZeRO's partitioning, bucketing and prefetch tuning: the engine keeps whole parameters and their "
    "optimizer state in host memory and streams each block's weights to the device just in time, so there "
    "is nothing to partition, bucket or prefetch"
)
"""What the engine does instead of the ``zero_optimization`` keys it ignores."""


# A "zero_optimization" block copied from a ZeRO-3 offload config: this engine's host-resident
# layout replaces every ZeRO stage, so only these keys mean something here; the others are
# listed in the one warning about ignored keys.
_ZERO_UNDERSTOOD = {"stage", "stage3_gather_16bit_weights_on_model_save"}
_ZERO_OFFLOAD_BLOCKS = ("offload_param", "offload_optimizer")
_OFFLOAD_HOST_DEVICES = ("cpu", "none", None)  # host memory is where this engine keeps both
_NVME = "nvme"


@dataclass(frozen=True)
class ZeroOffload:
    """What a ``zero_optimization`` block says that this engine reads."""

    pin_memory: bool | None = None
    nvme: dict[str, Any] = field(default_factory=dict)
    """``megatrain`` options implied by ``offload_*.device: "nvme"`` (the NVMe tier)."""
    device_state: float | None = None
    """``1 - offload_optimizer.ratio`` (the share DeepSpeed keeps on the GPU): ``megatrain.device_state``."""
    ignored: tuple[str, ...] = ()


def zero_optimization(block: Any) -> ZeroOffload:
    """Read a ``zero_optimization`` block.

    ``offload_param.pin_memory``/``offload_optimizer.pin_memory`` set ``megatrain.pin_memory``
    (unless the ``megatrain`` block sets it; pinned if either says so); offload devices
    ``cpu``/``none`` agree with the engine; any ``stage`` 0-3 is accepted. ZeRO-Infinity's
    ``offload_optimizer.device: "nvme"`` puts the optimizer state on the NVMe tier
    (``nvme_offload: "optimizer"``, its ``nvme_path`` and ``buffer_count``);
    ``offload_param.device: "nvme"`` puts the blocks' weights there too (``nvme_offload: "all"``).
    ``offload_optimizer.ratio`` (the share of the optimizer state on the CPU) keeps the rest on
    the GPU: ``device_state = 1 - ratio`` (``state/placement.py``: [Note: the GPU tier]).
    """
    if not isinstance(block, Mapping):
        raise ConfigError(f'"zero_optimization" must be a JSON object, got {block!r}')
    stage = block.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    pins: list[bool] = []
    ignored: list[str] = []
    nvme: dict[str, Any] = {}
    device_state: float | None = None
    for key, value in block.items():
        if key in _ZERO_UNDERSTOOD:
            continue
        if key not in _ZERO_OFFLOAD_BLOCKS or not isinstance(value, Mapping):
            ignored.append(f"zero_optimization.{key}")
            continue
        on_nvme = value.get("device") == _NVME
        for sub, sub_value in value.items():
            name = f"zero_optimization.{key}.{sub}"
            if sub == "pin_memory":
                if not isinstance(sub_value, bool):
                    raise ConfigError(f"{name} must be true or false, got {sub_value!r}")
                pins.append(sub_value)
            elif sub == "device" and (sub_value in _OFFLOAD_HOST_DEVICES or sub_value == _NVME):
                continue
            elif on_nvme and sub == "nvme_path":
                nvme.setdefault("nvme_path", sub_value)  # offload_optimizer's, when both say one
            elif on_nvme and sub == "buffer_count" and key == "offload_optimizer":
                nvme["nvme_window_blocks"] = sub_value
            elif sub == "ratio" and key == "offload_optimizer":
                if isinstance(sub_value, bool) or not isinstance(sub_value, (int, float)) or not 0 <= sub_value <= 1:
                    raise ConfigError(f"{name} must be a number from 0 to 1 (the share offloaded), got {sub_value!r}")
                device_state = 1.0 - float(sub_value)
            else:
                ignored.append(name)
        if on_nvme:
            # Weights on NVMe take their optimizer state along: a block's master is both.
            level = "all" if key == "offload_param" else "optimizer"
            nvme["nvme_offload"] = "all" if nvme.get("nvme_offload") == "all" else level
    if nvme.get("nvme_offload") and "nvme_path" not in nvme:
        device = "offload_param" if nvme["nvme_offload"] == "all" else "offload_optimizer"
        raise ConfigError(
            f'zero_optimization.{device}.device is "nvme" but no nvme_path is given: '
            'add "nvme_path": "/local_nvme/..." (a directory on a local disk)'
        )
    return ZeroOffload(
        pin_memory=(any(pins) if pins else None), nvme=nvme, device_state=device_state, ignored=tuple(ignored)
    )
