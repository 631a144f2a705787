"""``MegatrainDeepSpeedEngine``: the engine as a ``DeepSpeedEngine``, for code written for DeepSpeed.

Accelerate (``extract_model_from_parallel``, ``get_state_dict``) and the HF Trainer decide
what to do with ``isinstance(model, DeepSpeedEngine)`` and then call DeepSpeed's engine API.
``deepspeed.initialize`` therefore returns this subclass of both :class:`MegatrainEngine`
and ``DeepSpeedEngine``. It is the only module that imports DeepSpeed's engine classes (the
core engine does not depend on them); the layers below import only DeepSpeed's op
builders and loss scalers, and ``compat.py`` patches ``deepspeed`` itself.

``DeepSpeedEngine.__init__`` never runs (it would build DeepSpeed's own engine), so none of
DeepSpeed's state exists. Every attribute lookup therefore resolves, in this order, to:

1. :class:`MegatrainEngine` (forward, backward, step, the accumulation boundary, ...);
2. the DeepSpeed API defined below, which Accelerate and the HF Trainer call;
3. ``nn.Module`` for ``train``/``eval``, which ``DeepSpeedEngine`` overrides for its state;
4. for any other method or property of ``DeepSpeedEngine``: a stub that raises
   ``UnsupportedEngineAPIError`` (a ``NotImplementedError`` and an ``AttributeError``, so
   ``hasattr`` answers ``False`` for a property) naming it, instead of DeepSpeed code
   failing deep inside on state that was never built.

DeepSpeed's ``__getattr__`` (unknown attributes are looked up on ``engine.module``) and
``__del__`` (calls ``destroy``) are kept: both are DeepSpeed behaviour that only needs
what this engine has.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.engine import DeepSpeedEngine, EngineTimers
from deepspeed.utils import log_dist
from deepspeed.utils.timer import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    FORWARD_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
    NoopTimer,
    SynchronizedWallClockTimer,
)
from pydantic import ValidationError
from torch import nn

from megatrain_ds.checkpoint.whole_masters import join_state_dict_collectives
from megatrain_ds.config import ConfigError, Fp16Options, SchedulerSpec
from megatrain_ds.engine import MegatrainEngine
from megatrain_ds.optimizer.loss_scaling import dynamic_loss_scale_args

logger = logging.getLogger(__name__)


class UnsupportedEngineAPIError(NotImplementedError, AttributeError):
    """DeepSpeed engine API the megatrain engine does not provide (the stubs at the end of
    this module). An ``AttributeError`` too, so ``hasattr(engine, name)`` and
    ``getattr(engine, name, default)`` answer as for a missing attribute, as code written for
    several DeepSpeed versions probes."""


class _DeepSpeedEngineBase(DeepSpeedEngine):
    """``DeepSpeedEngine`` as a base class only: construction stops at ``nn.Module``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs
        nn.Module.__init__(self)


def _process_rank() -> int:
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if distributed else 0


def build_monitor(blocks: dict[str, Any]) -> MonitorMaster:
    """DeepSpeed's ``MonitorMaster`` for the config's monitor blocks (validated by DeepSpeed's model)."""
    try:
        monitor_config = get_monitor_config(blocks)
    except ValidationError as error:
        raise ConfigError(f"monitor config ({', '.join(blocks) or 'none'}) rejected by DeepSpeed: {error}") from error
    return MonitorMaster(monitor_config)  # asks deepspeed.comm for the rank: compat.py answers it


class MegatrainDeepSpeedEngine(MegatrainEngine, _DeepSpeedEngineBase):
    """:class:`MegatrainEngine` with DeepSpeed's engine API on top (see the module docstring).

    Adds what DeepSpeed's config gives a meaning to beyond the core engine: a scheduler
    built from the ``"scheduler"`` block (done by :func:`build_lr_scheduler`),
    ``steps_per_print`` progress lines, ``wall_clock_breakdown`` timings with DeepSpeed's
    timer names and classes, and the monitor events (TensorBoard, W&B, CSV, Comet) DeepSpeed's
    engine writes, through its ``MonitorMaster``, at the same global sample counts.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        breakdown = self.config.wall_clock_breakdown
        self.timers = SynchronizedWallClockTimer() if breakdown else NoopTimer()
        # DeepSpeed's own lists of which timers run and which are logged when.
        self.engine_timers = EngineTimers(enable_micro_timers=breakdown, enable_global_timers=breakdown)
        self._wall_clock_timers: dict[str, float] = {}
        self.global_samples = 0
        """Samples trained on by every rank together: DeepSpeed's x axis for monitor events."""
        self.monitor = build_monitor(self.config.monitor)
        self._window_loss: torch.Tensor | None = None
        """The accumulation window's loss so far, for the monitor's train_loss event."""
        self._inside_no_sync = False
        self._no_sync_warned = False

    # -- timed training calls ------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, names: list[str]) -> Iterator[None]:
        for name in names:
            self.timers(name).start()
        try:
            yield
        finally:
            for name in names:
                self.timers(name).stop()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._timed(self.engine_timers.forward_timers):
            return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if self.monitor.enabled:
            self._monitor_loss(loss, scale_wrt_gas)
        timers = self.engine_timers
        with self._timed(timers.backward_timers):
            with self._timed(timers.backward_inner_timers):
                loss = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            # The gradient reduction runs behind backward, block by block (inside the inner
            # time); DeepSpeed's reduce timers are kept, spanning nothing more, so its reports match.
            with self._timed(timers.backward_reduce_timers):
                pass
        return loss

    def _monitor_loss(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        """``Train/Samples/train_loss``, as DeepSpeed's engine wrote it (through 0.14; 0.19's
        pipeline engine still does, its plain engine no longer): the window's micro-batch
        losses, each divided by the accumulation steps, summed, written at the boundary's
        backward at the samples counted before its step. Dashboards built on it keep it."""
        value = loss.detach().float().mean()
        if scale_wrt_gas:
            value = value / self.gradient_accumulation_steps()
        self._window_loss = value if self._window_loss is None else self._window_loss + value
        if self.is_gradient_accumulation_boundary():
            total, self._window_loss = self._window_loss, None
            if _process_rank() == 0:  # .item() waits for the loss: only with a monitor on
                self._write_events([("Train/Samples/train_loss", total.item(), self.global_samples)])

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        if self._inside_no_sync:
            raise RuntimeError("It is illegal to call Engine.step() inside no_sync context manager")  # DeepSpeed's
        boundary = self.is_gradient_accumulation_boundary()
        steps_before = self.global_steps
        with self._timed(self.engine_timers.step_timers):
            super().step(lr_kwargs)
        if self.global_steps != steps_before:
            self.global_samples += self.train_batch_size()  # DeepSpeed's count, skipped steps included
            every = self.config.steps_per_print
            if every is not None and self.global_steps % every == 0:
                log_dist(
                    f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}",
                    ranks=[0],
                )
        self._report_step(boundary)

    def _report_step(self, boundary: bool) -> None:
        """Monitor events and timer logs after ``step()``, in DeepSpeed's order and format
        (``DeepSpeedEngine.step``): lr (and fp16's loss scale) at each boundary (the window's
        train_loss was written by its last ``backward``); with
        ``wall_clock_breakdown`` the micro-step timers every call, the global timers (and
        their monitor events) at each boundary."""
        rank_zero = _process_rank() == 0
        if self.monitor.enabled and boundary and rank_zero:
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.fp16_enabled():
                events.append(("Train/Samples/loss_scale", self.optimizer.loss_scale, self.global_samples))
            self._write_events(events)
        if not self.config.wall_clock_breakdown:
            return
        timers = self.engine_timers
        self._wall_clock_timers = {n: self.timers(n).elapsed(reset=False) for n in timers.active_timers()}
        self.timers.log(names=timers.micro_timers)  # "time (ms) | fwd_microstep: ... "; resets them
        if boundary:
            if self.monitor.enabled and rank_zero:
                self._write_events(
                    [
                        (
                            f"Train/Samples/elapsed_time_ms_{label}",
                            self.timers(name).elapsed(reset=False),
                            self.global_samples,
                        )
                        for label, name in _MONITORED_TIMERS
                    ]
                )
            self.timers.log(timers.global_timers)

    def _write_events(self, events: list[tuple[str, Any, int]]) -> None:
        self.monitor.write_events(events)  # asks deepspeed.comm for the rank: compat.py answers it

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

    # DeepSpeed's fp16 config getters; without fp16, DeepSpeed's defaults (as its own answer).
    def _fp16(self) -> Fp16Options:
        return self.config.fp16 if self.config.fp16 is not None else Fp16Options()

    def loss_scale(self) -> float:
        """The configured ``fp16.loss_scale`` (0: dynamic); the running scale is the optimizer's."""
        return self._fp16().loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self._fp16().dynamic

    def initial_dynamic_scale(self) -> int:
        return 2 ** self._fp16().initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        return dynamic_loss_scale_args(self._fp16())

    def zero_optimization(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        """0: no ZeRO partitioning; every parameter is whole in host memory."""
        return 0

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: a full state dict is always available (where no process holds the masters
        whole, :meth:`_zero3_consolidated_16bit_state_dict` gathers them)."""
        return True

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's state dict: every parameter's master, the weights the optimizer
        updates, for every placement (``checkpoint/whole_masters.py``: [Note: one answer from
        state_dict]). Collective where :attr:`state_dict_is_collective` (the weights on the
        NVMe tier with data parallel, or the masters sharded across nodes): every rank calls it."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> OrderedDict[str, Any]:
        """What Accelerate's ``get_state_dict`` and the HF Trainer's ``save_model`` take when the
        config says ZeRO stage 3: the whole model at the masters' precision (fp32; DeepSpeed's
        gives its 16-bit copies), the same values as ``state_dict()``, copied so that they
        outlive training. Every rank gets the whole dict (DeepSpeed's ranks but the first get
        ``None``). Collective where :attr:`state_dict_is_collective`: every rank must call it,
        as with DeepSpeed (Accelerate and the Trainer do)."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        return OrderedDict((key, value.detach().clone()) for key, value in state.items())  # DeepSpeed's type

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_16bit_model``: the whole model's state dict in one file,
        ``torch.save`` d by the first rank to ``save_dir/save_filename``. It holds the state of
        :meth:`_zero3_consolidated_16bit_state_dict`: the masters (fp32), not a 16-bit copy,
        whatever the compute dtype -- the same values as ``state_dict()``, ``save_pretrained``
        and Accelerate's ``get_state_dict`` (docs/checkpoints.md). Always ``True``, whatever
        ``stage3_gather_16bit_weights_on_model_save`` says.

        Every rank must call it, as with DeepSpeed: where :attr:`state_dict_is_collective` the
        other ranks join each gather of the first rank's state dict (keeping nothing), and
        every rank returns once the file is written, raising if the write failed."""
        path = Path(save_dir) / save_filename
        dp = self.data_parallel
        state = None
        if dp is None or dp.rank == 0:
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        else:  # the same collectives, in the same order, as rank 0's state dict
            join_state_dict_collectives(self)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            log_dist(f"Saving model weights to {path}", ranks=[0])
            torch.save(state, path)

        if dp is None:
            write()
        else:  # Sync: every rank returns once rank 0 has written the file (or raises with it)
            dp.on_rank0(f"saving the model to {path}", write)
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's ``no_sync`` (which Accelerate enters for the micro-batches before an
        accumulation boundary at ZeRO stage 0 and 1): the gradients of the micro-batches
        inside are accumulated and the optimizer step sees their average over the ranks,
        as DeepSpeed's. DeepSpeed's rules hold: no re-entry, no ``step()`` inside.

        With several ranks the reduction is not skipped: each rank holds only its window of
        the gradients (like ZeRO stage 2, for which DeepSpeed refuses ``no_sync``), so every
        micro-batch's gradients are reduced as backward makes them; the sum of the averages
        is the average of the sums, so the step is the same. One warning says so.
        """
        if self._inside_no_sync:
            raise RuntimeError("no_sync context manager reentry is unsupported")  # DeepSpeed's message
        if self.data_parallel is not None and not self._no_sync_warned:
            self._no_sync_warned = True
            logger.warning(
                "megatrain: no_sync() does not skip the gradient reduction: each rank keeps only its share "
                "of the gradients, so every micro-batch is reduced behind its backward; the accumulated "
                "gradients, and the step, are the same as with DeepSpeed's no_sync"
            )
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's (``nn.Module``'s, then the model's attributes), except for a stubbed
        property: its :class:`UnsupportedEngineAPIError` is an ``AttributeError``, which makes
        Python try ``__getattr__`` next; raised again here, so the message names it."""
        if name in _STUBBED_PROPERTIES:
            raise UnsupportedEngineAPIError(_not_available_message(name))
        return super().__getattr__(name)

    @property
    def is_compiled(self) -> bool:
        return False

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "megatrain: engine.compile is not supported: blocks run from streamed buffers "
            "through their own autograd function (use torch.compile on parts of the model instead)"
        )


# The timers DeepSpeed's engine writes as monitor events (DeepSpeedEngine._write_monitor).
_MONITORED_TIMERS = (
    ("forward", FORWARD_GLOBAL_TIMER),
    ("backward", BACKWARD_GLOBAL_TIMER),
    ("backward_inner", BACKWARD_INNER_GLOBAL_TIMER),
    ("backward_allreduce", BACKWARD_REDUCE_GLOBAL_TIMER),
    ("step", STEP_GLOBAL_TIMER),
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


def _not_available_message(name: str) -> str:
    return f"megatrain: DeepSpeedEngine.{name} is not supported by the megatrain engine"


def _not_available(name: str) -> Callable[..., Any]:
    message = _not_available_message(name)

    def unavailable(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedEngineAPIError(message)

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
        if isinstance(value, property):
            _STUBBED_PROPERTIES.add(name)
        setattr(MegatrainDeepSpeedEngine, name, property(stub) if isinstance(value, property) else stub)


_STUBBED_PROPERTIES: set[str] = set()
"""DeepSpeedEngine properties stubbed above (``MegatrainDeepSpeedEngine.__getattr__``)."""


_install_stubs()
