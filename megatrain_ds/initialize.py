"""``initialize``: DeepSpeed's entry point, for configs with ``"engine": "megatrain"``."""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from megatrain_ds.config import ConfigError, load_config_dict, parse_engine_config
from megatrain_ds.engine import MegatrainEngine


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    config_params: Mapping[str, Any] | None = None,
    collate_fn: Any = None,
    **unused: Any,
) -> tuple[MegatrainEngine, torch.optim.Optimizer, Any, Any]:
    """Build the engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``
    like ``deepspeed.initialize``.

    ``lr_scheduler`` may be a scheduler or a callable taking the optimizer (DeepSpeed's
    two forms).
    """
    del unused
    if model is None:
        raise ConfigError("deepspeed.initialize needs model=")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError("deepspeed.initialize needs config= (a dict or a JSON path)")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    engine_config = parse_engine_config(load_config_dict(config), world_size=world_size)
    engine = MegatrainEngine(model, engine_config, model_parameters=model_parameters,
                             optimizer=optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(engine.optimizer)
    engine.lr_scheduler = lr_scheduler
    dataloader = None
    if training_data is not None:
        dataloader = torch.utils.data.DataLoader(
            training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
            shuffle=True, collate_fn=collate_fn,
        )
    return engine, engine.optimizer, dataloader, lr_scheduler
