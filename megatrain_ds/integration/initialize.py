"""``initialize``: DeepSpeed's entry point, for configs with ``"engine": "megatrain"``.

``deepspeed.initialize`` lands here through the wrapper :mod:`megatrain_ds.integration.compat`
installs (the routing decided by :mod:`megatrain_ds.integration.deepspeed_hook`), with the
arguments DeepSpeed takes, as scripts, Accelerate (``model``, ``config_params``,
``optimizer`` or ``model_parameters``, ``lr_scheduler``) and the HF Trainer (through
Accelerate) pass them.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatrain_ds.config import ConfigError, load_config_dict, parse_engine_config

if TYPE_CHECKING:  # imported when called: `import megatrain_ds` does not import deepspeed
    from megatrain_ds.integration.deepspeed_adapter import MegatrainDeepSpeedEngine


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: Mapping[str, Any] | None = None,
    **unused: Any,
) -> tuple[MegatrainDeepSpeedEngine, torch.optim.Optimizer | None, Any, Any]:
    """Build the engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``
    like ``deepspeed.initialize``.

    The scheduler follows DeepSpeed's precedence: ``lr_scheduler`` (a scheduler, or a
    callable taking the engine's optimizer) if given, else the config's ``"scheduler"``
    block built on the engine's optimizer, else none. The engine steps it after every
    optimizer step. Given no optimizer, no ``"optimizer"`` block and no ``model_parameters``,
    the engine is for evaluation only and the optimizer and scheduler returned are ``None``
    (optimizer/facade.py: [Note: evaluation-only engines]). With several ranks (``torchrun``,
    ``accelerate launch``) the engine trains data parallel
    (``distributed/data_parallel.py``), on the launcher's process group or one made from its environment;
    model parallelism (``mpu``, ``mesh_param``) is rejected.
    """
    del distributed_port, dist_init_required, unused
    from megatrain_ds.integration.deepspeed_adapter import MegatrainDeepSpeedEngine

    if model is None:
        raise ConfigError("deepspeed.initialize needs model=")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("model parallelism (mpu=, mesh_param=) is not supported by the megatrain engine")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError("deepspeed.initialize needs config= (a dict or a JSON path)")
    engine_config = parse_engine_config(load_config_dict(config))  # batch rules count every rank
    warn_if_unlaunched_under_accelerate()
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        # A megatrain config makes zero.Init and transformers' ZeRO-3 detection build the
        # model whole ([Note: ZeRO-3 configs] in deepspeed_hook.py); this one was built
        # under a zero.Init that was not given it, so its parameters are empty placeholders.
        raise ConfigError(
            "the model's parameters were partitioned by deepspeed.zero.Init called without "
            'this "engine": "megatrain" config: pass the config to it '
            "(deepspeed.zero.Init(config_dict_or_path=config), which then builds the model "
            "whole), or build the model outside zero.Init"
        )
    engine = MegatrainDeepSpeedEngine(model, engine_config, model_parameters=model_parameters, optimizer=optimizer)
    try:
        engine.lr_scheduler = engine_scheduler(engine, lr_scheduler)
    except BaseException:
        engine.destroy()  # the gradient worker and pinned memory of a half-built engine
        raise
    dataloader = training_dataloader(engine, training_data, collate_fn) if training_data is not None else None
    # An engine for evaluation only returns no optimizer, as DeepSpeed's inference engine.
    returned_optimizer = None if engine.optimizer.evaluation_only else engine.optimizer
    return engine, returned_optimizer, dataloader, engine.lr_scheduler


def engine_scheduler(engine: MegatrainDeepSpeedEngine, lr_scheduler: Any) -> Any:
    """DeepSpeed's precedence: ``lr_scheduler`` given (a scheduler, or a callable taking the
    engine's optimizer), else the config's ``"scheduler"`` block, else none; none at all for
    an engine without an optimizer, whose scheduler DeepSpeed never builds
    (optimizer/facade.py: [Note: evaluation-only engines])."""
    from megatrain_ds.integration.deepspeed_adapter import build_lr_scheduler

    if engine.optimizer.evaluation_only:
        return None
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(engine.optimizer)
        return lr_scheduler
    if engine.config.scheduler is not None:
        return build_lr_scheduler(engine.config.scheduler, engine.optimizer)
    return None


def training_dataloader(engine: MegatrainDeepSpeedEngine, dataset: Any, collate_fn: Any) -> Any:
    """DeepSpeed's own loader for ``training_data=``, built as ``DeepSpeedEngine.deepspeed_io``
    builds it: micro-batches of ``train_micro_batch_size_per_gpu`` drawn by a
    ``DistributedSampler`` over the data-parallel ranks (this rank's shard, shuffled with
    the sampler's seed), ``dataloader_drop_last``, pinned memory and DeepSpeed's worker count."""
    from deepspeed.runtime.dataloader import DeepSpeedDataLoader

    # DeepSpeed's check (DeepSpeedEngine.is_map_style_dataset/is_iterable_style_dataset).
    map_style = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if not (map_style or isinstance(dataset, torch.utils.data.IterableDataset)):
        raise ConfigError("deepspeed.initialize's training_data must be a torch Dataset (or a sequence)")
    dp = engine.data_parallel
    return DeepSpeedDataLoader(
        dataset=dataset,
        batch_size=engine.train_micro_batch_size_per_gpu(),
        pin_memory=True,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        tput_timer=None,
        collate_fn=collate_fn,
        data_parallel_world_size=dp.world_size if dp is not None else 1,
        data_parallel_rank=dp.rank if dp is not None else 0,
        dataloader_drop_last=engine.config.dataloader_drop_last,
    )


UNLAUNCHED_WARNING = (
    "Accelerate treats this run as a distributed DeepSpeed run, but no launcher made a process "
    "group: the megatrain engine trains without one, but the HF Trainer's logging and checkpoint "
    "saving (and Accelerate's gather()) will stop with 'Default process group has not been initialized'. "
    "Launch the script, even for one process: torchrun --nproc_per_node 1 train.py ..."
)


def warn_if_unlaunched_under_accelerate() -> None:
    """Warn at start-up where a script run as plain ``python`` will fail later.

    With a DeepSpeed config, Accelerate's ``PartialState`` (which the HF Trainer's
    ``TrainingArguments`` builds) says ``DistributedType.DEEPSPEED`` whether or not a launcher
    ran; without the launcher's ``LOCAL_RANK`` it makes no process group, and this engine
    needs none for one process. The Trainer then gathers its logged loss over the default
    group (``nested_gather``), and a checkpoint's FLOP count (``store_flos``), so a plain
    ``python train.py --deepspeed ...`` trains until its first logging step or checkpoint and
    stops there. DeepSpeed's own engine fails at once in that case
    (looking for an MPI launcher); a warning here says so before any step, and leaves
    Accelerate scripts that never gather running as they do. Reads Accelerate's state only
    where the script imported Accelerate (``_shared_state`` is empty until a state is built,
    the test ``PartialState.initialized`` and transformers use).
    """
    state = sys.modules.get("accelerate.state")
    if state is None or not torch.distributed.is_available() or torch.distributed.is_initialized():
        return
    # Private, and read only to warn: an Accelerate release without it is warned of nothing,
    # never stopped (transformers sets ACCELERATE_USE_DEEPSPEED only while it builds the state).
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None)
    if isinstance(shared, dict) and shared.get("distributed_type") == "DEEPSPEED":
        warnings.warn(UNLAUNCHED_WARNING, stacklevel=2)
