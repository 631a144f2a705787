"""The DeepSpeed JSON read whole: :class:`EngineConfig`, built by :func:`parse_engine_config`.

The batch sizes (DeepSpeed's rule), precision, clipping and the other top-level keys are read
here; each block is read by its own module, and this one puts them together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain_ds.config.deepspeed_blocks import Fp16Options, OptimizerSpec, SchedulerSpec, fp16_options
from megatrain_ds.config.deepspeed_keys import MONITOR_KEYS, refuse_unsupported, warn_ignored, zero_optimization
from megatrain_ds.config.megatrain_options import AioSettings, MegatrainOptions
from megatrain_ds.config.values import AUTO, AUTO_HELP, ConfigError, is_integer_at_least, reject_auto

logger = logging.getLogger(__name__)

ENGINE_NAME = "megatrain"
"""The ``"engine"`` value that routes ``deepspeed.initialize`` to this engine."""

# DeepSpeed's defaults for keys it reads (deepspeed/runtime/constants.py, DeepSpeed 0.19).
GRADIENT_CLIPPING_DEFAULT = 1.0


@dataclass(kw_only=True)
class EngineConfig:
    """Everything the engine reads from the DeepSpeed JSON."""

    options: MegatrainOptions = field(default_factory=MegatrainOptions)
    bf16: bool = False
    """Compute (and stream) in bf16; master weights and optimizer state stay fp32."""
    fp16: Fp16Options | None = None
    """Compute (and stream) in fp16 with loss scaling; master weights and optimizer state stay fp32."""
    gradient_clipping: float = 0.0
    """Global-norm clipping threshold; 0 disables clipping."""
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int = 1
    train_batch_size: int = 1
    optimizer: OptimizerSpec | None = None
    ignored_keys: tuple[str, ...] = ()
    scheduler: SchedulerSpec | None = None
    """Built on the engine's optimizer unless ``deepspeed.initialize`` gets ``lr_scheduler=``
    (DeepSpeed's precedence)."""
    steps_per_print: int | None = None
    """Log ``step=, lr=, mom=`` every this many optimizer steps (None: never, DeepSpeed's default)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step, and log them at every optimizer step."""
    monitor: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """DeepSpeed's monitor blocks as given (``tensorboard``, ``wandb``, ``csv_monitor``,
    ``comet``): written to through DeepSpeed's own ``MonitorMaster``, which validates them."""
    dataloader_drop_last: bool = False
    """The ``training_data`` loader drops a last partial micro-batch (DeepSpeed's key)."""
    source: Mapping[str, Any] = field(default_factory=dict)
    """The DeepSpeed JSON as given (its "auto" values filled by Accelerate/the HF Trainer)."""

    def get(self, key: str, default: Any = None) -> Any:
        """``dict.get`` on the DeepSpeed JSON: DeepSpeed's ``engine.config`` is that dict, and
        code written for DeepSpeed (the HF Trainer) reads it so."""
        return self.source.get(key, default)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16 is not None:
            return torch.float16
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.options.master_dtype == "bf16" else torch.float32

    @property
    def holds_gradients(self) -> bool:
        """Whether gradients must be kept on the host until backward ends."""
        return (
            self.gradient_clipping > 0
            or self.gradient_accumulation_steps > 1
            or self.options.non_finite_steps == "skip"
            or self.fp16 is not None  # an overflow skips the step: nothing may be applied before
        )

    @property
    def held_gradient_dtype(self) -> torch.dtype:
        """Dtype of the held gradients: fp32 to accumulate micro-batches, and with fp16, where
        gradients are unscaled as they arrive (an unscaled fp16 gradient would underflow);
        else the compute dtype."""
        if self.gradient_accumulation_steps > 1 or self.fp16 is not None:
            return torch.float32
        return self.compute_dtype

    @property
    def skips_non_finite(self) -> bool:
        """Whether a non-finite step is skipped (else it raises); see ``non_finite_steps``."""
        return self.options.non_finite_steps == "skip" or (
            self.options.non_finite_steps == "auto" and self.holds_gradients
        )


def load_config_dict(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON file path, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    with open(config, encoding="utf-8") as handle:
        return json.load(handle)


def is_megatrain_config(config: Mapping[str, Any] | None) -> bool:
    return isinstance(config, Mapping) and config.get("engine") == ENGINE_NAME


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None or value == AUTO:  # "auto": derived from the other two, as Accelerate does
        return None
    if not is_integer_at_least(value, 1):
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _batch_sizes(config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rules: any two of the three batch keys determine the third."""
    train = _positive_int(config, "train_batch_size")
    micro = _positive_int(config, "train_micro_batch_size_per_gpu")
    accumulation = _positive_int(config, "gradient_accumulation_steps")
    if train is not None and micro is not None and accumulation is not None:
        pass
    elif train is not None and micro is not None:
        accumulation = train // micro // world_size
    elif train is not None and accumulation is not None:
        micro = train // world_size // accumulation
    elif micro is not None and accumulation is not None:
        train = micro * accumulation * world_size
    elif train is not None:
        accumulation, micro = 1, train // world_size
    elif micro is not None:
        accumulation, train = 1, micro * world_size
    else:
        autos = [key for key in ("train_batch_size", "train_micro_batch_size_per_gpu") if config.get(key) == AUTO]
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
            + (
                f" ({', '.join(autos)} is {AUTO!r}: {AUTO_HELP})"
                if autos
                else " (the HF Trainer and Accelerate fill both in when the config leaves them out; "
                "called directly, deepspeed.initialize needs train_micro_batch_size_per_gpu)"
            )
        )
    if micro < 1 or accumulation < 1 or train != micro * accumulation * world_size:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {world_size}"
            + (
                f" (world_size: the {world_size} ranks of torch.distributed; without a GPU, `accelerate launch` "
                'runs DeepSpeed\'s ranks as if each were alone, filling "auto" for one rank and not sharding '
                "the data, so DeepSpeed itself fails here too: launch the ranks with torchrun instead)"
                if world_size > 1
                else ""
            )
        )
    return train, micro, accumulation


def launcher_world_size() -> int:
    """The number of data-parallel ranks: the process group's, else the launcher's ``WORLD_SIZE``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_engine_config(config: Mapping[str, Any], world_size: int | None = None) -> EngineConfig:
    """Read an ``"engine": "megatrain"`` DeepSpeed config; raise :class:`ConfigError` on bad input.

    ``world_size`` (default: :func:`launcher_world_size`) enters DeepSpeed's batch rule
    ``train_batch_size = micro_batch * gradient_accumulation_steps * world_size``.
    """
    if world_size is None:
        world_size = launcher_world_size()
    train, micro, accumulation = _batch_sizes(config, world_size)
    clipping = config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if clipping == AUTO:  # what Accelerate fills in, and the HF Trainer's max_grad_norm default
        clipping = GRADIENT_CLIPPING_DEFAULT
    if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
        raise ConfigError(f"gradient_clipping must be a number >= 0, got {clipping!r}")
    bf16 = config.get("bf16", config.get("bfloat16")) or {}  # DeepSpeed's old name is an alias
    if not isinstance(bf16, Mapping):
        raise ConfigError(f'"bf16" must be an object like {{"enabled": true}}, got {bf16!r}')
    bf16_enabled = bf16.get("enabled", False)
    if bf16_enabled == AUTO:  # Accelerate's and the HF Trainer's default: no mixed precision
        bf16_enabled = False
    fp16 = fp16_options(config, bf16_enabled)
    optimizer = config.get("optimizer")
    steps_per_print = config.get("steps_per_print")
    if steps_per_print == float("inf"):  # what Accelerate sets to silence DeepSpeed
        steps_per_print = None
    if steps_per_print is not None:
        steps_per_print = _positive_int(config, "steps_per_print")
    drop_last = config.get("dataloader_drop_last", False)
    if not isinstance(drop_last, bool):
        raise ConfigError(f"dataloader_drop_last must be true or false, got {drop_last!r}")
    wall_clock_breakdown = config.get("wall_clock_breakdown", False)
    if not isinstance(wall_clock_breakdown, bool):
        raise ConfigError(f"wall_clock_breakdown must be true or false, got {wall_clock_breakdown!r}")
    options = config.get("megatrain", {})
    zero = zero_optimization(config.get("zero_optimization", {}))
    from_ratio = zero.device_state is not None and not (isinstance(options, Mapping) and "device_state" in options)
    if isinstance(options, Mapping):  # the megatrain block has the last word
        implied: dict[str, Any] = dict(zero.nvme)
        if zero.pin_memory is not None:
            implied["pin_memory"] = zero.pin_memory
        if zero.device_state is not None:
            implied["device_state"] = zero.device_state
        if config.get("aio") is not None:
            implied["nvme_aio"] = AioSettings.from_dict(config["aio"], "aio")
        options = {**implied, **options}
    refuse_unsupported(config)
    ignored = warn_ignored(config, zero.ignored)
    engine_options = MegatrainOptions.from_dict(options)
    if fp16 is not None:
        _check_fp16_options(engine_options)
    engine_options = _device_state_checked(engine_options, fp16 is not None, from_ratio, world_size > 1)
    return EngineConfig(
        options=engine_options,
        bf16=bool(bf16_enabled),
        fp16=fp16,
        gradient_clipping=float(clipping),
        gradient_accumulation_steps=accumulation,
        train_micro_batch_size_per_gpu=micro,
        train_batch_size=train,
        optimizer=OptimizerSpec.from_dict(optimizer) if optimizer is not None else None,
        ignored_keys=ignored,
        scheduler=SchedulerSpec.from_dict(config["scheduler"]) if config.get("scheduler") is not None else None,
        steps_per_print=steps_per_print,
        wall_clock_breakdown=wall_clock_breakdown,
        monitor=_monitor_blocks(config),
        dataloader_drop_last=drop_last,
        source=config,
    )


def _monitor_blocks(config: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """DeepSpeed's monitor blocks present in ``config``; their keys are checked by DeepSpeed's
    own config model when the monitors are built (``integration/deepspeed_adapter.py``)."""
    blocks: dict[str, Mapping[str, Any]] = {}
    for key in MONITOR_KEYS:
        block = config.get(key)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ConfigError(f'"{key}" must be a JSON object like {{"enabled": true, ...}}, got {block!r}')
        reject_auto(block, key)
        blocks[key] = dict(block)
    return blocks


def _check_fp16_options(options: MegatrainOptions) -> None:
    """Engine options that cannot go with fp16 compute."""
    if options.non_finite_steps == "raise":
        raise ConfigError(
            'megatrain.non_finite_steps "raise" cannot go with fp16: an overflow of the loss scale is '
            'a skipped step by design; use "auto" or "skip"'
        )
    if options.optimizer_device == "gpu":
        raise ConfigError(
            'megatrain.optimizer_device "gpu" does not support fp16 yet (its kernel writes bf16 copies); '
            'use "cpu" or "auto"'
        )
    if options.master_dtype != "fp32":
        raise ConfigError('megatrain.master_dtype must be "fp32" with fp16 compute')


def _device_state_checked(
    options: MegatrainOptions, fp16: bool, from_ratio: bool, data_parallel: bool
) -> MegatrainOptions:
    """``options``, or with ``device_state`` "none" where the GPU tier cannot run here and
    the setting allows it: ``"auto"`` (the default) then keeps every state in host memory,
    the reason logged at INFO; DeepSpeed's ``offload_optimizer.ratio`` (``from_ratio``) is
    ignored with a warning, as it was before the tier existed, so a JSON that trained before
    still trains. A fraction in ``megatrain.device_state`` it cannot run is refused (data
    parallel at the build, ``engine_build.py``, which knows the ranks and resolves "auto")."""
    why = _device_state_refusal(options, fp16)
    if why is None and from_ratio and data_parallel and options.wants_device_state:
        why = "the GPU tier does not support data parallel yet"
    if why is None:
        return options
    if options.device_state == "auto":
        logger.info('megatrain: device_state "auto": every optimizer state stays in host memory: %s', why)
    elif from_ratio:
        logger.warning("megatrain: ignoring zero_optimization.offload_optimizer.ratio here: %s", why)
    else:
        raise ConfigError(why)
    return dataclasses.replace(options, device_state="none")


def _device_state_refusal(options: MegatrainOptions, fp16: bool) -> str | None:
    """Why ``megatrain.device_state`` (the GPU tier) cannot run with these options, naming the
    fix; ``None`` where it can (or is off)."""
    if not options.wants_device_state:
        return None
    fix = 'or set megatrain.device_state to "none" (zero_optimization.offload_optimizer.ratio 1.0)'
    if fp16:
        return (
            f"megatrain.device_state {options.device_state!r} does not support fp16 (loss scaling) yet: "
            f"its device update has no unscaling; use bf16 {fix}"
        )
    if options.master_dtype != "fp32":
        return (
            f'megatrain.device_state {options.device_state!r} needs megatrain.master_dtype "fp32" (the '
            f"device kernel updates fp32 masters); set it {fix}"
        )
    if options.nvme_offload != "none":
        return (
            f"megatrain.device_state {options.device_state!r} cannot go with megatrain.nvme_offload "
            f'{options.nvme_offload!r} yet: set nvme_offload "none" {fix}'
        )
    return None
