"""Train the engine and a plain-PyTorch reference on the same batches, step for step.

The reference is the model before the engine took it (deep copy), trained with
``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``, the loss divided by the
accumulation steps as DeepSpeed's ``engine.backward`` does.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import tiny_models
import torch

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.runtime import stream_check

# lr 1e-3: attention key biases have an exact gradient of zero (softmax is invariant to
# them), so their computed gradient is pure rounding noise and Adam turns noise into
# updates proportional to lr. At lr 1e-2 that alone moves GPT-2's global relative weight
# error to ~3e-6; at 1e-3 every family is below 2e-7.
LR, WEIGHT_DECAY = 1e-3, 0.1


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Engines built inside run without the race checker, whatever the test's ``stream_mode``:
    for the RAM-only engine a ``[checked]`` variant of an NVMe or placement test compares
    with. Its path (the same settings without the tier) is checked by the tests
    ``tests/conftest.py``'s ``CHECKED_SUITES`` names for it, so only the engine under test
    pays for the checker (several times slower), and the comparison is unchanged: the checker
    only observes the same ops on the same values. Runtimes read ``MEGATRAIN_STREAM_CHECK``
    when they are built, so only the build needs to be inside."""
    switch = os.environ.pop(stream_check.ENV, None)
    try:
        yield
    finally:
        if switch is not None:
            os.environ[stream_check.ENV] = switch


@dataclass
class Trace:
    engine_losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    reference_norms: list[float] = field(default_factory=list)
    engine_norms: list[float] = field(default_factory=list)


def ds_config(
    *, accumulation: int = 1, clipping: float = 1.0, megatrain: dict | None = None, bf16: bool = False
) -> dict[str, Any]:
    return {
        "engine": "megatrain",
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "megatrain": megatrain or {},
    }


def relative_error(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """sqrt(sum ||a-b||^2) / sqrt(sum ||b||^2) over every tensor of two state dicts (the same
    keys; each pair compared on the host, wherever its tensors are)."""
    assert ours.keys() == theirs.keys()
    diff = sum(float(((ours[k].double().cpu() - theirs[k].double().cpu()) ** 2).sum()) for k in theirs)
    norm = sum(float((theirs[k].double().cpu() ** 2).sum()) for k in theirs)
    return (diff / norm) ** 0.5


def relative_weight_error(engine: MegatrainEngine, reference: torch.nn.Module) -> float:
    """:func:`relative_error` of the engine's model's state dict against the reference's."""
    return relative_error(engine.module.state_dict(), reference.state_dict())


def train_side_by_side(
    make_model: Callable[[], torch.nn.Module],
    config: dict[str, Any],
    steps: int = 5,
    make_batch: Callable[[int], dict[str, Any]] = tiny_models.make_batch,
) -> tuple[MegatrainEngine, torch.nn.Module, Trace]:
    """``steps`` optimizer steps of the engine and the reference; micro-batch ``i`` is
    ``make_batch(i)``."""
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    engine = MegatrainEngine(model, parse_engine_config(config))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    accumulation = config["gradient_accumulation_steps"]
    clipping = config["gradient_clipping"]
    engine.train()
    reference.train()
    trace = Trace()
    for step in range(steps):
        for micro in range(accumulation):
            seed = step * accumulation + micro
            batch = make_batch(seed)
            torch.manual_seed(1000 + seed)  # same dropout masks for both
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            trace.engine_losses.append(loss.item())
            torch.manual_seed(1000 + seed)
            reference_loss = reference(**batch).loss
            (reference_loss / accumulation).backward()
            trace.reference_losses.append(reference_loss.item())
        if clipping > 0:
            trace.reference_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clipping)))
            trace.engine_norms.append(float(engine.get_global_grad_norm()))
        optimizer.step()
        optimizer.zero_grad()
    return engine, reference, trace


# -- fp16 with loss scaling --------------------------------------------------------------------


@dataclass
class Fp16Trace:
    """Per optimizer step: whether it was skipped, and the loss scale after it."""

    engine_skipped: list[bool] = field(default_factory=list)
    reference_skipped: list[bool] = field(default_factory=list)
    engine_scales: list[float] = field(default_factory=list)
    reference_scales: list[float] = field(default_factory=list)
    engine_losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)


@contextlib.contextmanager
def _deepspeed_rank_zero() -> Iterator[None]:
    """DeepSpeed's scaler asks ``deepspeed.comm.get_rank()`` (to log on rank 0), which asserts
    before DeepSpeed's backend is initialised: answer 0 for the reference's calls."""
    from deepspeed import comm
    from deepspeed.runtime.fp16 import loss_scaler

    saved = loss_scaler.dist
    if not comm.is_initialized():
        loss_scaler.dist = SimpleNamespace(get_rank=lambda group=None: 0)
    try:
        yield
    finally:
        loss_scaler.dist = saved


class Fp16Reference:
    """Plain PyTorch mixed precision as DeepSpeed's fp16 ZeRO optimizer does it: fp32 master
    weights (the model, deep-copied) trained by ``torch.optim.AdamW``, an fp16 compute copy
    (parameters only: buffers keep their dtype, as in the engine), the loss divided by the
    accumulation steps and multiplied by DeepSpeed's own scaler's scale, gradients summed in
    fp32 divided by the scale, a step with any non-finite gradient skipped, then
    ``update_scale(overflow)``. The scaler is built from DeepSpeed's own config model
    (``DeepSpeedFP16Config(**block).dynamic_loss_scale_args()``), not from the engine's parsing.

    ``adamw``: ``torch.optim.AdamW``'s hyperparameters (default: ``LR`` and ``WEIGHT_DECAY``).
    After :meth:`step`, ``grad_norm`` is the unscaled global norm before clipping (``None``
    without clipping or after a skipped step)."""

    def __init__(self, model: torch.nn.Module, config: dict[str, Any], adamw: dict[str, Any] | None = None) -> None:
        from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
        from deepspeed.runtime.precision_config import DeepSpeedFP16Config

        block = DeepSpeedFP16Config(**config["fp16"])
        self.scaler = CreateLossScaler(
            torch.float16, block.loss_scale, block.loss_scale == 0, block.dynamic_loss_scale_args()
        )
        self.master = copy.deepcopy(model)
        self.compute = copy.deepcopy(model)
        for param in self.compute.parameters():
            param.data = param.data.half()
        hyperparameters = adamw if adamw is not None else {"lr": LR, "weight_decay": WEIGHT_DECAY}
        self.optimizer = torch.optim.AdamW(self.master.parameters(), **hyperparameters)
        self.accumulation = config["gradient_accumulation_steps"]
        self.clipping = config["gradient_clipping"]
        self.sums = [torch.zeros_like(p) for p in self.master.parameters()]
        self.grad_norm: float | None = None

    def micro_step(self, batch: dict[str, Any], *, divide_by_accumulation: bool = True) -> float:
        """Forward and backward of one micro-batch; its loss. ``divide_by_accumulation=False``
        for a loss already normalised over the whole step (the HF Trainer's
        ``num_items_in_batch``, passed with ``engine.backward(loss, scale_wrt_gas=False)``)."""
        loss = self.compute(**batch).loss
        divisor = self.accumulation if divide_by_accumulation else 1
        self.scaler.scale_loss(loss / divisor).backward()
        for total, param in zip(self.sums, self.compute.parameters()):
            if param.grad is not None:
                total += param.grad.float() / self.scaler.loss_scale
            param.grad = None
        return loss.item()

    def step(self) -> bool:
        """The optimizer step; True when it was skipped for an overflow."""
        overflow = not all(bool(torch.isfinite(total).all()) for total in self.sums)
        self.grad_norm = None
        if not overflow:
            for param, total in zip(self.master.parameters(), self.sums):
                param.grad = total.clone()
            if self.clipping > 0:
                self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.clipping))
            self.optimizer.step()
            self.optimizer.zero_grad()
            with torch.no_grad():
                for ours, master in zip(self.compute.parameters(), self.master.parameters()):
                    ours.copy_(master)  # rounded to fp16 (nearest even), as the engine's shadow
        for total in self.sums:
            total.zero_()
        with _deepspeed_rank_zero():
            self.scaler.update_scale(overflow)
        return overflow


def train_fp16_side_by_side(
    make_model: Callable[[], torch.nn.Module],
    config: dict[str, Any],
    steps: int = 6,
    make_batch: Callable[[int], dict[str, Any]] = tiny_models.make_batch,
) -> tuple[MegatrainEngine, Fp16Reference, Fp16Trace]:
    """``steps`` optimizer steps of an fp16 engine and :class:`Fp16Reference` on the same batches."""
    torch.manual_seed(0)
    model = make_model()
    reference = Fp16Reference(model, config)
    engine = MegatrainEngine(model, parse_engine_config(config))
    engine.train()
    reference.compute.train()
    trace = Fp16Trace()
    for step in range(steps):
        for micro in range(reference.accumulation):
            seed = step * reference.accumulation + micro
            batch = make_batch(seed)
            torch.manual_seed(1000 + seed)  # same dropout masks for both
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            trace.engine_losses.append(loss.item())
            torch.manual_seed(1000 + seed)
            trace.reference_losses.append(reference.micro_step(batch))
        trace.engine_skipped.append(not engine.was_step_applied())
        trace.engine_scales.append(engine.optimizer.loss_scale)
        trace.reference_skipped.append(reference.step())
        trace.reference_scales.append(reference.scaler.loss_scale)
    return engine, reference, trace
