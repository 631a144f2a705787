"""Train the engine and a plain-PyTorch reference on the same batches, step for step.

The reference is the model before the engine took it (deep copy), trained with
``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``, the loss divided by the
accumulation steps as DeepSpeed's ``engine.backward`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tiny_models
import torch

from megatrain_ds import MegatrainEngine, parse_engine_config

# lr 1e-3: attention key biases have an exact gradient of zero (softmax is invariant to
# them), so their computed gradient is pure rounding noise and Adam turns noise into
# updates proportional to lr. At lr 1e-2 that alone moves GPT-2's global relative weight
# error to ~3e-6; at 1e-3 every family is below 2e-7.
LR, WEIGHT_DECAY = 1e-3, 0.1


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


def relative_weight_error(engine: MegatrainEngine, reference: torch.nn.Module) -> float:
    """sqrt(sum ||a-b||^2) / sqrt(sum ||b||^2) over every tensor of the state dicts."""
    ours, theirs = engine.module.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    diff = sum(((ours[k].double() - theirs[k].double()) ** 2).sum() for k in theirs)
    norm = sum((theirs[k].double() ** 2).sum() for k in theirs)
    return float((diff / norm).sqrt())


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
