"""DeepSpeed's ``"optimizer"``, ``"scheduler"`` and ``"fp16"`` blocks, read as DeepSpeed reads them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from megatrain_ds.config.values import AUTO, ConfigError, is_integer_at_least, reject_auto

_OPTIMIZER_TYPES = ("adamw", "adam")
_ACCEPTED_ADAM_FLAGS = {"adam_w_mode", "torch_adam", "bias_correction", "amsgrad", "fp32_optimizer_states", "foreach"}
"""optimizer.params keys read as flags (or ignored) besides the hyperparameters."""


@dataclass(kw_only=True)
class OptimizerSpec:
    """The ``"optimizer"`` block: AdamW (or Adam with ``adam_w_mode``), read as DeepSpeed does.

    ``"AdamW"`` is always decoupled; ``"Adam"`` is too unless ``adam_w_mode`` is false
    (then L2). The weight decay defaults to 0 (DeepSpeed's FusedAdam/DeepSpeedCPUAdam),
    or to 0.01 with ``torch_adam`` in decoupled mode (``torch.optim.AdamW``'s default).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled: bool = True
    """AdamW-style decoupled weight decay (``adam_w_mode``); False is Adam with L2."""

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> OptimizerSpec:
        kind = str(block.get("type", "")).lower()
        if kind not in _OPTIMIZER_TYPES:
            raise ConfigError(f'optimizer.type {block.get("type")!r} is not supported; valid: "AdamW", "Adam"')
        params = dict(block.get("params", {}))
        reject_auto(params, "optimizer.params")
        if "max_grad_norm" in params:  # DeepSpeed's own message
            raise ConfigError(
                "'max_grad_norm' is not supported as an optimizer parameter, please switch "
                "to using the deepspeed parameter 'gradient_clipping'"
            )
        adam_w_mode = bool(params.pop("adam_w_mode", True))
        decoupled = kind == "adamw" or adam_w_mode  # DeepSpeed: "AdamW" forces AdamW
        torch_adam = bool(params.pop("torch_adam", False))  # the host step is always the engine's own
        # Options of DeepSpeed's Adam classes that only this value agrees with the engine's Adam.
        for key, required in (("bias_correction", True), ("amsgrad", False), ("fp32_optimizer_states", True)):
            if key in params and bool(params.pop(key)) != required:
                raise ConfigError(f"optimizer.params.{key} must be {str(required).lower()} with this engine")
        params.pop("foreach", None)  # a torch implementation choice, no effect on the result
        allowed = {"lr", "betas", "eps", "weight_decay"}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown optimizer.params key(s): {', '.join(unknown)}; valid: "
                f"{', '.join(sorted(allowed | _ACCEPTED_ADAM_FLAGS))}"
            )
        default_wd = 0.01 if torch_adam and decoupled else 0.0
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
class SchedulerSpec:
    """The ``"scheduler"`` block; built with DeepSpeed's own classes (``deepspeed_adapter``)."""

    type: str
    """A class of ``deepspeed.runtime.lr_schedules`` (``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) or of ``torch.optim.lr_scheduler``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of that class."""

    @classmethod
    def from_dict(cls, block: Any) -> SchedulerSpec:
        if not isinstance(block, Mapping):
            raise ConfigError(f'"scheduler" must be a JSON object, got {block!r}')
        kind = block.get("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f'scheduler.type must name a scheduler such as "WarmupLR", got {kind!r}')
        params = block.get("params", {})
        if not isinstance(params, Mapping):
            raise ConfigError(f"scheduler.params must be a JSON object, got {params!r}")
        reject_auto(params, "scheduler.params")
        return cls(type=kind, params=dict(params))


# DeepSpeed's "fp16" keys and defaults (DeepSpeedFP16Config, deepspeed/runtime/precision_config.py,
# DeepSpeed 0.19; tests/test_fp16.py checks them against it).
_FP16_KEYS = ("enabled", "auto_cast", "fp16_master_weights_and_grads")


@dataclass(frozen=True, kw_only=True)
class Fp16Options:
    """The ``"fp16"`` block when enabled: fp16 compute, fp32 masters, loss scaling.

    The scaling rules are DeepSpeed's own loss scalers' (``optimizer/loss_scaling.py``);
    these are the values they are built from.
    """

    loss_scale: float = 0.0
    """0: dynamic loss scaling; any other value: this static scale."""
    initial_scale_power: int = 16
    """The dynamic scale starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Steps without an overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows (each a skipped step) before the dynamic scale halves (DeepSpeed's delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without an overflow (else only when the scale grows)."""
    min_loss_scale: int = 1
    """The dynamic scale's floor: an overflow there raises DeepSpeed's error."""

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> Fp16Options:
        """Validate an enabled ``"fp16"`` block (DeepSpeed's checks, and hysteresis >= 1)."""
        known = _FP16_KEYS + tuple(f.name for f in fields(cls))
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise ConfigError(f"unknown fp16 key(s) {', '.join(unknown)}; valid: {', '.join(known)}")
        reject_auto({k: v for k, v in block.items() if k != "enabled"}, "fp16")
        for key in ("auto_cast", "fp16_master_weights_and_grads"):
            if block.get(key, False) is not False:
                raise ConfigError(
                    f"fp16.{key} must be false with this engine (its masters are fp32 and the model "
                    f"computes in fp16 already), got {block[key]!r}"
                )
        options = cls(**{k: v for k, v in block.items() if k not in _FP16_KEYS})
        scale = options.loss_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0:
            raise ConfigError(f"fp16.loss_scale must be a finite number >= 0 (0: dynamic loss scaling), got {scale!r}")
        if not isinstance(options.consecutive_hysteresis, bool):
            raise ConfigError(
                f"fp16.consecutive_hysteresis must be true or false, got {options.consecutive_hysteresis!r}"
            )
        # Window and floor only matter with dynamic scaling, and DeepSpeed checks them only then.
        minimum = 1 if options.dynamic else -math.inf
        for key, least in (
            ("initial_scale_power", -math.inf),
            ("loss_scale_window", minimum),
            ("hysteresis", 1),
            ("min_loss_scale", minimum),
        ):
            value = getattr(options, key)
            if not is_integer_at_least(value, least):
                bound = "" if least == -math.inf else f" >= {least}"
                raise ConfigError(f"fp16.{key} must be an integer{bound}, got {value!r}")
        return dataclasses.replace(options, loss_scale=float(scale))


def fp16_options(config: Mapping[str, Any], bf16_enabled: Any) -> Fp16Options | None:
    """The ``"fp16"`` block: ``None`` unless enabled (``"auto"`` counts as off until the HF
    Trainer's ``--fp16`` or Accelerate's ``mixed_precision`` fills it in, as for bf16)."""
    block = config.get("fp16") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f'"fp16" must be an object like {{"enabled": true}}, got {block!r}')
    enabled = block.get("enabled", False)
    if enabled not in (True, False, AUTO):
        raise ConfigError(f'fp16.enabled must be true, false or "auto", got {enabled!r}')
    if enabled is not True:
        return None
    if bf16_enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true: enable one of them (bf16 needs no loss scaling)"
        )
    return Fp16Options.from_dict(block)
