"""The engine's configuration, read from a DeepSpeed JSON with ``"engine": "megatrain"``.

Engine options live in a top-level ``"megatrain"`` block (:class:`MegatrainOptions`);
unknown keys and bad values there are rejected with a message naming the key and the
valid choices. The DeepSpeed keys this engine gives a meaning to are read into
:class:`EngineConfig`; other DeepSpeed keys are reported once as ignored.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

logger = logging.getLogger(__name__)

ENGINE_NAME = "megatrain"

# DeepSpeed keys this engine reads; everything else at the top level is ignored with a warning.
_KNOWN_TOP_LEVEL = {
    "engine", "megatrain", "bf16", "fp16", "gradient_clipping", "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu", "train_batch_size", "optimizer",
}
_OPTIMIZER_TYPES = ("adamw", "adam")


class ConfigError(ValueError):
    """A configuration value the engine cannot use; the message names the key."""


@dataclass(kw_only=True)
class MegatrainOptions:
    """The ``"megatrain"`` block of the DeepSpeed JSON."""

    block_path: str | None = None
    """Dotted path of the ``nn.ModuleList`` of transformer blocks (found automatically if unset)."""
    checkpoint_interval: int = 1
    """Blocks per activation checkpoint (K). 1 keeps every block input; larger keeps fewer
    checkpoints but holds K blocks' weights on the device during backward."""
    offload_checkpoints: bool = True
    """Park activation checkpoints in host memory between forward and backward, so device
    memory does not grow with depth; costs 2*T*hidden bytes of host->device traffic per
    checkpoint. Set false when the checkpoints fit on the device."""
    num_buffers: int = 2
    """Device weight buffers for streaming (2 = double buffering)."""
    master_dtype: str = "fp32"
    """Dtype of the master weights: "fp32" (default) or "bf16" (rounds small updates away)."""
    pin_memory: bool = True
    """Page-lock host buffers when CUDA is used (needed for asynchronous copies)."""
    num_staging_buffers: int = 4
    """Pinned host buffers (4M elements each) for device-to-host gradient copies."""

    def __post_init__(self) -> None:
        if self.block_path is not None and not isinstance(self.block_path, str):
            raise ConfigError(f'megatrain.block_path must be a string, got {self.block_path!r}')
        for name, minimum in (("checkpoint_interval", 1), ("num_buffers", 2), ("num_staging_buffers", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(f"megatrain.{name} must be an integer >= {minimum}, got {value!r}")
        if self.master_dtype not in ("fp32", "bf16"):
            raise ConfigError(f'megatrain.master_dtype must be one of "fp32", "bf16"; got {self.master_dtype!r}')
        for name in ("pin_memory", "offload_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"megatrain.{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> "MegatrainOptions":
        if not isinstance(block, Mapping):
            raise ConfigError(f'"megatrain" must be a JSON object, got {block!r}')
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - valid)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in megatrain config: {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(valid))}"
            )
        return cls(**block)


@dataclass(kw_only=True)
class OptimizerSpec:
    """The ``"optimizer"`` block: AdamW (or Adam with ``adam_w_mode``)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled: bool = True
    """AdamW-style decoupled weight decay (``adam_w_mode``); False is Adam with L2."""

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> "OptimizerSpec":
        kind = str(block.get("type", "")).lower()
        if kind not in _OPTIMIZER_TYPES:
            raise ConfigError(
                f'optimizer.type {block.get("type")!r} is not supported; valid: "AdamW", "Adam"'
            )
        params = dict(block.get("params", {}))
        decoupled = bool(params.pop("adam_w_mode", True))
        params.pop("torch_adam", None)  # the host step is always the engine's own
        allowed = {"lr", "betas", "eps", "weight_decay"}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown optimizer.params key(s): {', '.join(unknown)}; valid: "
                f"{', '.join(sorted(allowed | {'adam_w_mode', 'torch_adam'}))}"
            )
        default_wd = 0.01 if kind == "adamw" else 0.0
        spec = cls(
            lr=float(params.get("lr", 1e-3)),
            betas=tuple(float(b) for b in params.get("betas", (0.9, 0.999))),  # type: ignore[arg-type]
            eps=float(params.get("eps", 1e-8)),
            weight_decay=float(params.get("weight_decay", default_wd)),
            decoupled=decoupled,
        )
        if len(spec.betas) != 2:
            raise ConfigError(f"optimizer.params.betas must have two values, got {spec.betas!r}")
        return spec


@dataclass(kw_only=True)
class EngineConfig:
    """Everything the engine reads from the DeepSpeed JSON."""

    options: MegatrainOptions = field(default_factory=MegatrainOptions)
    bf16: bool = False
    """Compute (and stream) in bf16; master weights and optimizer state stay fp32."""
    gradient_clipping: float = 0.0
    """Global-norm clipping threshold; 0 disables clipping."""
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int = 1
    train_batch_size: int = 1
    optimizer: OptimizerSpec | None = None
    ignored_keys: tuple[str, ...] = ()

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.options.master_dtype == "bf16" else torch.float32

    @property
    def holds_gradients(self) -> bool:
        """Whether gradients must be kept on the host until backward ends."""
        return self.gradient_clipping > 0 or self.gradient_accumulation_steps > 1


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
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
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
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    if micro < 1 or accumulation < 1 or train != micro * accumulation * world_size:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {world_size}"
        )
    return train, micro, accumulation


def parse_engine_config(config: Mapping[str, Any], world_size: int = 1) -> EngineConfig:
    """Read an ``"engine": "megatrain"`` DeepSpeed config; raise :class:`ConfigError` on bad input."""
    if (config.get("fp16") or {}).get("enabled", False):
        raise ConfigError(
            "fp16.enabled is not supported: this engine trains with fp32 master weights; "
            'use "bf16": {"enabled": true} for bf16 compute (no loss scaling needed)'
        )
    train, micro, accumulation = _batch_sizes(config, world_size)
    clipping = config.get("gradient_clipping", 0.0)
    if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
        raise ConfigError(f"gradient_clipping must be a number >= 0, got {clipping!r}")
    bf16 = config.get("bf16") or {}
    if not isinstance(bf16, Mapping):
        raise ConfigError(f'"bf16" must be an object like {{"enabled": true}}, got {bf16!r}')
    optimizer = config.get("optimizer")
    ignored = tuple(sorted(set(config) - _KNOWN_TOP_LEVEL))
    if ignored:
        logger.warning("megatrain: ignoring DeepSpeed config keys without meaning here: %s",
                       ", ".join(ignored))
    return EngineConfig(
        options=MegatrainOptions.from_dict(config.get("megatrain", {})),
        bf16=bool(bf16.get("enabled", False)),
        gradient_clipping=float(clipping),
        gradient_accumulation_steps=accumulation,
        train_micro_batch_size_per_gpu=micro,
        train_batch_size=train,
        optimizer=OptimizerSpec.from_dict(optimizer) if optimizer is not None else None,
        ignored_keys=ignored,
    )
