"""``MegatrainDeepSpeedEngine``: the engine as a ``DeepSpeedEngine``, for code written for DeepSpeed.

Accelerate (``extract_model_from_parallel``, ``get_state_dict``) and the HF Trainer decide
what to do with ``isinstance(model, DeepSpeedEngine)`` and then call DeepSpeed's engine API.
``deepspeed.initialize`` therefore returns this subclass of both :class:`MegatrainEngine`
and ``DeepSpeedEngine``. It is the only module that imports ``deepspeed``: the core engine
does not depend on it.

``DeepSpeedEngine.__init__`` never runs (it would build DeepSpeed's own engine), so none of
DeepSpeed's state exists. Every attribute lookup therefore resolves, in this order, to:

1. :class:`MegatrainEngine` (forward, backward, step, the accumulation boundary, ...);
2. the DeepSpeed API defined below, which Accelerate and the HF Trainer call;
3. ``nn.Module`` for ``train``/``eval``, which ``DeepSpeedEngine`` overrides for its state;
4. for any other method or property of ``DeepSpeedEngine``: a stub that raises
   ``NotImplementedError`` naming it, instead of DeepSpeed code failing deep inside on
   state that was never built.

DeepSpeed's ``__getattr__`` (unknown attributes are looked up on ``engine.module``) and
``__del__`` (calls ``destroy``) are kept: both are DeepSpeed behaviour that only needs
what this engine has.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist
from deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer
from torch import nn

from megatrain_ds.config import ConfigError, SchedulerSpec
from megatrain_ds.engine import MegatrainEngine

# DeepSpeed's names for the per-step wall-clock timers (deepspeed/utils/timer.py).
FORWARD_TIMER, BACKWARD_TIMER, STEP_TIMER = "fwd", "bwd", "step"


class _DeepSpeedEngineBase(DeepSpeedEngine):
    """``DeepSpeedEngine`` as a base class only: construction stops at ``nn.Module``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        nn.Module.__init__(self)


class MegatrainDeepSpeedEngine(MegatrainEngine, _DeepSpeedEngineBase):
    """:class:`MegatrainEngine` with DeepSpeed's engine API on top (see the module docstring).

    Adds what DeepSpeed's config gives a meaning to beyond the core engine: a scheduler
    built from the ``"scheduler"`` block (done by :func:`build_lr_scheduler`),
    ``steps_per_print`` progress lines and ``wall_clock_breakdown`` timings, in DeepSpeed's
    own format and with its own timer class.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timers = SynchronizedWallClockTimer() if self.config.wall_clock_breakdown else NoopTimer()
        self._wall_clock_timers: dict[str, float] = {}

    # -- timed training calls ------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self.timers(name).start()
        try:
            yield
        finally:
            self.timers(name).stop()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed(FORWARD_TIMER):
            return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        with self._timed(BACKWARD_TIMER):
            return super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        steps_before = self.global_steps
        with self._timed(STEP_TIMER):
            super().step(lr_kwargs)
        if self.global_steps == steps_before:
            return
        every = self.config.steps_per_print
        if every is not None and self.global_steps % every == 0:
            log_dist(
                f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}",
                ranks=[0],
            )
        if self.config.wall_clock_breakdown:
            names = [FORWARD_TIMER, BACKWARD_TIMER, STEP_TIMER]
            self._wall_clock_timers = {n: self.timers(n).elapsed(reset=False) for n in names}
            self.timers.log(names)  # "time (ms) | fwd: ... | bwd: ... | step: ..."; resets them

    # -- DeepSpeed engine API used by Accelerate, the HF Trainer and DeepSpeed scripts ----------

    def get_mom(self) -> list[Any]:
        return [group["betas"] for group in self.optimizer.param_groups]

    # DeepSpeed's own returns the three bound methods, not the ints its docstring promises.
    def get_batch_info(self) -> tuple[int, int, int]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps())

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds spent in forward, backward and step during the last optimizer step."""
        return dict(self._wall_clock_timers)

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    def fp16_enabled(self) -> bool:
        return self.config.fp16 is not None

    def zero_optimization(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        """0: no ZeRO partitioning; every parameter is whole in host memory."""
        return 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: there is nothing to gather, so a full state dict is always available."""
        return True

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's state dict: fp32 masters (see ``MegatrainEngine``), except the blocks'
        weights while the NVMe tier holds their masters (bf16 compute): those show the bf16
        copy that is trained on, as DeepSpeed's bf16 module does; ``save_checkpoint`` writes
        the fp32 masters (``state/nvme_tier.py``)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> OrderedDict[str, Any]:
        """What Accelerate and the HF Trainer save when the config says ZeRO stage 3: the full
        model, here at full precision (fp32 masters; the blocks' bf16 copy while the NVMe
        tier holds their masters, as with DeepSpeed), copied so that it outlives training."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        return OrderedDict((key, value.detach().clone()) for key, value in state.items())  # DeepSpeed's type

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``: the whole model's state dict in one file,
        ``torch.save`` d by the first rank to ``save_dir/save_filename``; here the state of
        :meth:`_zero3_consolidated_16bit_state_dict` (fp32 masters: the engine holds no
        16-bit copy to save). Always ``True``: nothing needs gathering, whatever
        ``stage3_gather_16bit_weights_on_model_save`` says. Every rank calls it, as with
        DeepSpeed; the others wait until the file is written."""
        path = Path(save_dir) / save_filename
        if self.data_parallel is None or self.data_parallel.rank == 0:
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            path.parent.mkdir(parents=True, exist_ok=True)
            log_dist(f"Saving model weights to {path}", ranks=[0])
            torch.save(state, path)
        if self.data_parallel is not None:
            torch.distributed.barrier(group=self.data_parallel.control_group)
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """One process: there is no gradient reduction to skip."""
        yield

    @property
    def is_compiled(self) -> bool:
        return False

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "megatrain: engine.compile is not supported: blocks run from streamed buffers "
            "through their own autograd function (use torch.compile on parts of the model instead)"
        )


def build_lr_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> Any:
    """The ``"scheduler"`` block as DeepSpeed builds it: a class of
    ``deepspeed.runtime.lr_schedules``, else of ``torch.optim.lr_scheduler``, called with
    the optimizer and the block's ``params``."""
    if spec.type in lr_schedules.VALID_LR_SCHEDULES:
        scheduler_class = getattr(lr_schedules, spec.type)
    else:
        scheduler_class = getattr(torch.optim.lr_scheduler, spec.type, None)
    torch_schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not (
        isinstance(scheduler_class, type)
        and (spec.type in lr_schedules.VALID_LR_SCHEDULES or issubclass(scheduler_class, torch_schedulers))
    ):
        raise ConfigError(
            f"scheduler.type {spec.type!r} is not a DeepSpeed or torch scheduler; DeepSpeed's: "
            f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}, or any class of torch.optim.lr_scheduler"
        )
    try:
        return scheduler_class(optimizer, **spec.params)
    except TypeError as error:
        raise ConfigError(f"scheduler.params do not fit {spec.type}: {error}") from error


# -- everything else DeepSpeedEngine defines: a clear error ------------------------------------


def _not_available(name: str) -> Callable[..., Any]:
    message = f"megatrain: DeepSpeedEngine.{name} is not supported by the megatrain engine"

    def unavailable(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    unavailable.__name__ = name
    unavailable.__qualname__ = f"MegatrainDeepSpeedEngine.{name}"
    unavailable.__doc__ = message
    return unavailable


def _install_stubs() -> None:
    for name, value in vars(DeepSpeedEngine).items():
        if name.startswith("__") or isinstance(value, (staticmethod, classmethod)):
            continue  # __getattr__/__del__ are kept (see above); static helpers need no state
        owner = next(cls for cls in MegatrainDeepSpeedEngine.__mro__ if name in vars(cls))
        if owner is not DeepSpeedEngine:
            continue  # provided by MegatrainEngine or above
        if hasattr(nn.Module, name):  # train, eval: DeepSpeed's versions touch its own state
            setattr(MegatrainDeepSpeedEngine, name, getattr(nn.Module, name))
            continue
        stub = _not_available(name)
        setattr(MegatrainDeepSpeedEngine, name, property(stub) if isinstance(value, property) else stub)


_install_stubs()
