"""fp16 loss scaling with DeepSpeed's own loss scalers, and their state for checkpoints.

The scaling rules (when to halve, when to double, hysteresis, the error at the minimum
scale) are DeepSpeed's ``DynamicLossScaler`` and ``LossScaler``
(``deepspeed/runtime/fp16/loss_scaler.py``), built from the ``"fp16"`` block exactly as
DeepSpeed's ZeRO optimizer builds them (``CreateLossScaler`` with
``DeepSpeedFP16Config.dynamic_loss_scale_args()``). What the engine adds around them:

- ``engine.backward`` multiplies the loss (already divided by the accumulation steps) by
  the current scale, as DeepSpeed's ``loss_scaler.backward`` does;
- every gradient chunk is divided by that scale in fp32 as it is added to its held fp32
  gradient buffer on the gradient worker, so the global norm, clipping and the AdamW
  update all see unscaled gradients, and accumulation sums unscaled micro-batches;
- an overflow (any inf/NaN in the gradients) makes the global norm non-finite: the step
  is skipped exactly like any non-finite step (``speculative_step.py``), the speculative
  updates undone, and then :meth:`LossScaling.after_step` tells the scaler. With data
  parallel the norm is summed over the ranks first, so every rank sees the same overflow.

The scale only changes in :meth:`LossScaling.after_step` (on the main thread, after the
gradient worker has drained) and when a checkpoint is loaded, so the worker that reads
:attr:`LossScaling.scale` while it unscales always sees the scale the micro-batch's
backward used.

Without fp16 the scaler is DeepSpeed's static scale of 1 (what DeepSpeed creates for
bf16 and fp32 too), so ``optimizer.loss_scale`` reads 1.0 and nothing is scaled.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from megatrain_ds.config import Fp16Options

if TYPE_CHECKING:
    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase

logger = logging.getLogger(__name__)

# What a dynamic scaler changes as it runs (the rest comes from the config); saved in checkpoints.
_DYNAMIC_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def dynamic_loss_scale_args(fp16: Fp16Options) -> dict[str, Any]:
    """``DeepSpeedFP16Config.dynamic_loss_scale_args()`` for our parsed block: the keyword
    arguments of ``DynamicLossScaler``."""
    # Imported here: DeepSpeed is imported only by engines that build a scaler, not by
    # ``import megatrain_ds`` (the start-up hook stays light).
    import deepspeed.runtime.fp16.loss_scaler as loss_scaler

    return {
        loss_scaler.INITIAL_LOSS_SCALE: 2**fp16.initial_scale_power,
        loss_scaler.SCALE_WINDOW: fp16.loss_scale_window,
        loss_scaler.DELAYED_SHIFT: fp16.hysteresis,
        loss_scaler.CONSECUTIVE_HYSTERESIS: fp16.consecutive_hysteresis,
        loss_scaler.MIN_LOSS_SCALE: fp16.min_loss_scale,
    }


def create_loss_scaler(fp16: Fp16Options | None) -> LossScalerBase:
    """DeepSpeed's scaler for this config, as its ZeRO optimizer creates it."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

    if fp16 is None:  # DeepSpeed's scaler for bf16/fp32: a static scale of 1
        return CreateLossScaler(torch.float32, 1.0, False, None)
    return CreateLossScaler(torch.float16, fp16.loss_scale, fp16.dynamic, dynamic_loss_scale_args(fp16))


class LossScaling:
    """The engine's loss scaler and what it does with it each step (see the module docstring).

    Args:
        fp16: the parsed ``"fp16"`` block, or ``None`` (no scaling: a static scale of 1).
    """

    def __init__(self, fp16: Fp16Options | None) -> None:
        self.enabled = fp16 is not None
        self.scaler: LossScalerBase = create_loss_scaler(fp16)

    @property
    def scale(self) -> float:
        """The current loss scale (DeepSpeed's ``cur_scale``)."""
        return float(self.scaler.cur_scale)

    @property
    def dynamic(self) -> bool:
        return bool(self.scaler.dynamic)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (DeepSpeed's ``scale_loss``); ``loss`` itself without fp16."""
        return self.scaler.scale_loss(loss) if self.enabled else loss

    def unscale_into_(self, accumulated: torch.Tensor, grad: torch.Tensor, *, overwrite: bool = False) -> None:
        """``accumulated += grad / scale``, in ``accumulated``'s dtype (fp32 with fp16);
        with ``overwrite`` ``accumulated = grad / scale`` (the step's first write: no zeroed
        buffer to add to, the same values as adding to zeros).

        Dynamic scales are powers of two, so the division is exact; inf and NaN stay what
        they are, for the overflow check of the global norm."""
        if overwrite:
            accumulated.copy_(grad)  # widened first: multiplying in fp16 could underflow
            if self.enabled:
                accumulated.mul_(1.0 / self.scale)
        elif self.enabled:
            accumulated.add_(grad, alpha=1.0 / self.scale)
        else:
            accumulated.add_(grad)

    def after_step(self, overflow: bool) -> None:
        """Tell the scaler how the step went (DeepSpeed's ``update_scale``): an overflow may
        lower the scale, or raise DeepSpeed's error when it is already at the minimum."""
        if self.enabled:
            # DeepSpeed's scaler asks deepspeed.comm for the rank to log an overflow on rank 0
            # only; integration/compat.py makes that query answer without DeepSpeed's backend.
            self.scaler.update_scale(overflow)

    def state_dict(self) -> dict[str, float | int]:
        """The scaler's running state as plain numbers (for the checkpoint's trainer state);
        empty without fp16."""
        if not self.enabled:
            return {}
        names = _DYNAMIC_STATE if self.dynamic else ("cur_scale",)
        return {name: getattr(self.scaler, name) for name in names}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore :meth:`state_dict`'s numbers. A checkpoint of another kind of scaler (a
        static one, or none) leaves this one as the config built it."""
        names = _DYNAMIC_STATE if self.dynamic else ("cur_scale",)
        if not self.enabled or set(names) != set(state):
            if self.enabled:
                logger.warning(
                    "megatrain: the checkpoint's loss scaler state (%s) does not fit this run's %s "
                    "loss scaling; starting from the configured scale",
                    ", ".join(sorted(state)) or "none",
                    "dynamic" if self.dynamic else "static",
                )
            return
        for name in names:
            setattr(self.scaler, name, state[name])
