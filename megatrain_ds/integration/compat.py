"""Every patch this project applies to DeepSpeed, transformers and Accelerate, each with the
contract it relies on and a start-up check of that contract.

``_megatrain_ds_hook`` hands each module of :data:`PATCHES` to :func:`patch` as soon as it
is imported (in every process of the environment; ``import megatrain_ds`` does the same for
modules already imported). What the patches decide (which configs are megatrain's, the keys
filled in, stage 3 read as 0) is written in ``deepspeed_hook.py``, with its Notes; this
module only changes the third-party objects. The patches, each named at its code too:

1. ``deepspeed.initialize`` becomes a wrapper that sends a megatrain config to
   :func:`megatrain_ds.integration.initialize.initialize` and every other call, unchanged,
   to DeepSpeed (:func:`route_initialize`). Contract: ``deepspeed.initialize`` is a
   function taking ``args``, ``model``, ``config`` and ``config_params`` (the config comes as
   one of the last three), and callers look it up on the module after importing it
   (Accelerate at ``prepare`` time, ``from deepspeed import initialize`` after the import).
2. ``deepspeed.zero.Init`` becomes a subclass whose construction returns a context that does
   nothing when it is given a megatrain config (:func:`build_models_whole`). Contract:
   ``deepspeed.zero.Init`` is a class, subclassable, whose ``__init__`` takes
   ``config_dict_or_path`` (or the older ``config``) and ``enabled``, and which partitions
   every model built under it whatever stage its config names (so reading the stage as 0 is
   not enough: a script's own ``zero.Init(config_dict_or_path=...)`` call needs this patch);
   DeepSpeed marks a parameter it partitioned with ``ds_id`` (``initialize.py`` refuses those).
3. ``deepspeed.comm.get_rank`` answers where DeepSpeed's would assert, that is while
   DeepSpeed's communication backend is not initialised: torch.distributed's rank, else 0
   (:func:`answer_rank_without_backend`). Contract: ``deepspeed.comm`` has ``get_rank(group=None)``
   and ``is_initialized()``, and DeepSpeed's loss scalers (``LossScaler.update_scale``, on an
   overflow and with ``consecutive_hysteresis``) and ``MonitorMaster`` (``__init__`` and
   ``write_events``) call ``get_rank`` through that module (``from deepspeed import comm as
   dist``), so the module attribute is what they reach. An engine built without
   ``deepspeed.initialize`` (or by it, on one process without a launcher) has no process
   group; ``deepspeed.comm.init_distributed(dist_init_required=False)`` wires DeepSpeed to an
   existing group but asserts when there is none, and making one would be a side effect.
4. ``accelerate.utils.deepspeed.HfDeepSpeedConfig.__init__`` completes a megatrain config
   (``deepspeed_hook.complete_minimal_config``: [Note: the minimal config], [Note: ZeRO-3
   configs]) in the reader's copy (:func:`complete_megatrain_configs`). Contract: the class
   has ``__init__(self, config_file_or_dict)``, which leaves the parsed config as a dict in
   ``self.config``, and ``set_stage_and_offload()``, which derives the stage and offload from
   ``self.config``; Accelerate's ``DeepSpeedPlugin`` reads the JSON with it, and transformers'
   ``HfDeepSpeedConfig`` (``is_deepspeed_zero3_enabled``) subclasses it, which is how this
   patch reaches transformers (which patch 6 alone changes).
5. ``deepspeed.zero.GatheredParameters`` becomes a subclass whose ``__enter__`` first waits
   for every engine's optimizer update still running behind ``engine.step()``
   (:func:`settle_before_gathering`; ``optimizer/pipelined_finish.py``). The engine's
   parameters view its host masters, which that update writes; code that reads a ZeRO-3
   model's weights between steps (TRL sending them to vLLM, transformers' embedding
   resize) enters this context first. Contract: ``GatheredParameters`` is a class, used as
   a context manager, looked up on ``deepspeed.zero`` when called.
6. ``transformers.trainer.deepspeed_init`` (the module global the Trainer calls) becomes a
   wrapper that, for a megatrain config and ``inference=True`` (``evaluate()`` or
   ``predict()`` before ``train()``), readies the config for an engine without an optimizer
   instead of refusing every stage but 3 (``deepspeed_hook.prepare_evaluation_config``:
   [Note: evaluation before training]; :func:`evaluate_before_training`); every other call
   is transformers' own. Contract: ``Trainer.evaluation_loop`` calls its module's global
   ``deepspeed_init(trainer, num_training_steps, inference=...)``, which reads the config
   from ``trainer.accelerator.state.deepspeed_plugin.hf_ds_config`` (Accelerate's
   ``DeepSpeedPlugin.hf_ds_config``: the config object of patch 4, its dict in ``config``),
   and transformers' ``HfTrainerDeepSpeedConfig`` has ``trainer_config_finalize(args, model,
   num_training_steps)``.

Each patch checks its contract (``check_*`` beside it) before changing anything and raises
:class:`IncompatibleVersionError`, naming the installed version and the supported range
(:data:`SUPPORTED`, the bounds of ``pyproject.toml``), when the contract is broken. The
start-up hook lets that error stop the import of ``deepspeed`` or Accelerate, since a
megatrain config would otherwise train silently on DeepSpeed's own engine; the message says
how to leave them unpatched (``MEGATRAIN_DISABLE_HOOK=1``). With that variable set nothing
is patched, patch 3 included: the megatrain engine then needs DeepSpeed's backend
initialised (``deepspeed.init_distributed()``) for fp16 overflows and monitors.

Not patches: DeepSpeed's async I/O op warns once per process about SSD wear from inside the
first write, taking the GIL on an I/O thread; ``state/swap_io.py`` lets the first write of
the process run alone instead of setting the op's private "already warned" marker.
``MegatrainDeepSpeedEngine``'s stubs for DeepSpeed engine API it does not provide live on
its own subclass, not on DeepSpeed's class; they raise ``UnsupportedEngineAPIError``, an
``AttributeError`` too (``deepspeed_adapter.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from megatrain_ds.config import is_megatrain_config
from megatrain_ds.integration.deepspeed_hook import (
    DISABLE_ENV,
    complete_minimal_config,
    initialize_config,
    prepare_evaluation_config,
    zero_init_config,
)
from megatrain_ds.optimizer.pipelined_finish import settle_every_update

_MARKER = "__megatrain_original__"
"""Set on every replacement, holding what it replaced: a patch is applied once."""

SUPPORTED: dict[str, tuple[str, str]] = {
    "deepspeed": ("0.19.8", "0.20"),
    "accelerate": ("1.10", "2.0"),
    "transformers": ("5.2", "6.0"),
}
"""``package: (lowest, first unsupported)``, the same bounds as ``pyproject.toml``
(``tests/test_compat.py`` checks that they agree). ``scripts/test_lowest.sh`` runs the suite
at the lower bounds; its result, and the third-party incompatibilities inside the ranges
that its tests skip, are in CONTRIBUTING.md, "Supported versions"."""


class IncompatibleVersionError(RuntimeError):
    """A third-party contract a patch relies on is broken by the installed version."""


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _require(holds: bool, package: str, contract: str) -> None:
    """Raise :class:`IncompatibleVersionError` unless ``contract`` ``holds``."""
    if holds:
        return
    low, high = SUPPORTED[package]
    raise IncompatibleVersionError(
        f"megatrain_ds relies on this contract of {package}: {contract}; the installed {package} "
        f"{installed_version(package)} breaks it (supported: {package}>={low},<{high}). Install a "
        f"supported version (pip install '{package}>={low},<{high}'), or set {DISABLE_ENV}=1 to "
        f"leave {package} unpatched (and the megatrain engine unreachable through it)"
    )


def _parameters(function: Any) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


# -- 1. deepspeed.initialize ----------------------------------------------------------------


def check_initialize(deepspeed: ModuleType) -> None:
    wanted = {"args", "model", "config", "config_params"}
    initialize = getattr(deepspeed, "initialize", None)
    _require(
        inspect.isfunction(getattr(initialize, _MARKER, initialize)) and wanted <= _parameters(initialize),
        "deepspeed",
        "deepspeed.initialize is a function taking args=, model=, config= and config_params=",
    )


def route_initialize(deepspeed: ModuleType) -> None:
    """Patch 1: replace ``deepspeed.initialize`` by the routing wrapper (idempotent)."""
    check_initialize(deepspeed)
    original = deepspeed.initialize
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(DISABLE_ENV) != "1" and is_megatrain_config(initialize_config(args, kwargs)):
            from megatrain_ds.integration.initialize import initialize as megatrain_initialize

            return megatrain_initialize(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(initialize, _MARKER, original)
    # ModuleType's stub reads any attribute (__getattr__) but declares none to assign.
    deepspeed.initialize = initialize  # pyright: ignore[reportAttributeAccessIssue]


# -- 2. deepspeed.zero.Init -----------------------------------------------------------------


def check_zero_init(deepspeed: ModuleType) -> None:
    init = getattr(getattr(deepspeed, "zero", None), "Init", None)
    init = getattr(init, _MARKER, init)
    _require(
        isinstance(init, type) and {"config_dict_or_path", "enabled"} <= _parameters(init.__init__),
        "deepspeed",
        "deepspeed.zero.Init is a class whose __init__ takes config_dict_or_path= and enabled=",
    )


def build_models_whole(deepspeed: ModuleType) -> None:
    """Patch 2: make ``deepspeed.zero.Init`` do nothing for a megatrain config (idempotent;
    [Note: ZeRO-3 configs] in ``deepspeed_hook.py``).

    ``deepspeed.zero.Init`` becomes a subclass whose construction returns
    ``contextlib.nullcontext()`` when the call names a megatrain config (and the hook is on),
    and DeepSpeed's own context otherwise; ``isinstance`` checks and class attributes are kept.
    """
    check_zero_init(deepspeed)
    original = deepspeed.zero.Init
    if getattr(original, _MARKER, None) is not None:
        return
    signature = inspect.signature(original.__init__)

    class Init(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            config = zero_init_config(signature, args, kwargs)
            if os.environ.get(DISABLE_ENV) != "1" and is_megatrain_config(config):
                return contextlib.nullcontext()  # not an Init: Python skips __init__
            return super().__new__(cls)

    Init.__module__, Init.__qualname__ = original.__module__, original.__qualname__
    setattr(Init, _MARKER, original)
    deepspeed.zero.Init = Init


# -- 3. deepspeed.comm.get_rank -------------------------------------------------------------

_RANK_CALLERS = ("deepspeed.runtime.fp16.loss_scaler", "deepspeed.monitor.monitor")
"""DeepSpeed modules that call ``dist.get_rank()`` with ``dist`` = ``deepspeed.comm``."""


def check_rank_query(deepspeed: ModuleType) -> None:
    comm = getattr(deepspeed, "comm", None)
    callers = [sys.modules.get(name) or importlib.import_module(name) for name in _RANK_CALLERS]
    _require(
        callable(getattr(comm, "get_rank", None))
        and callable(getattr(comm, "is_initialized", None))
        and "group" in _parameters(getattr(comm, "get_rank", None))
        and all(getattr(caller, "dist", None) is comm for caller in callers),
        "deepspeed",
        "deepspeed.comm has get_rank(group=None) and is_initialized(), and the loss scalers "
        f"and MonitorMaster ({', '.join(_RANK_CALLERS)}) call it as their module global `dist`",
    )


def answer_rank_without_backend(deepspeed: ModuleType) -> None:
    """Patch 3: ``deepspeed.comm.get_rank`` answers instead of asserting while DeepSpeed's
    communication backend is not initialised (idempotent).

    DeepSpeed's loss scalers and monitors ask for the rank to log or write on rank 0 only;
    ``deepspeed.initialize`` and Accelerate initialise DeepSpeed's backend, a megatrain engine
    built directly need not (and a single process has no process group to initialise it on).
    Once DeepSpeed's backend is initialised, its own ``get_rank`` answers, as before.
    """
    check_rank_query(deepspeed)
    comm = deepspeed.comm
    original = comm.get_rank
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def get_rank(group: Any = None) -> int:
        if comm.is_initialized():
            return original(group)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(group)
        return 0  # one process, no process group: the only rank

    setattr(get_rank, _MARKER, original)
    comm.get_rank = get_rank


# -- 4. accelerate.utils.deepspeed.HfDeepSpeedConfig ------------------------------------------


def check_hf_deepspeed_config(accelerate_deepspeed: ModuleType) -> None:
    cls = getattr(accelerate_deepspeed, "HfDeepSpeedConfig", None)
    init = getattr(getattr(cls, "__init__", None), _MARKER, getattr(cls, "__init__", None))
    _require(
        isinstance(cls, type)
        and callable(getattr(cls, "set_stage_and_offload", None))
        and "config_file_or_dict" in _parameters(init),
        "accelerate",
        "accelerate.utils.deepspeed.HfDeepSpeedConfig has __init__(config_file_or_dict), which "
        "keeps the parsed config in self.config, and set_stage_and_offload()",
    )


def complete_megatrain_configs(accelerate_deepspeed: ModuleType) -> None:
    """Patch 4: ``HfDeepSpeedConfig`` completes a megatrain config in its own copy
    (``deepspeed_hook.complete_minimal_config``; idempotent)."""
    check_hf_deepspeed_config(accelerate_deepspeed)
    cls = accelerate_deepspeed.HfDeepSpeedConfig
    original = cls.__init__
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if os.environ.get(DISABLE_ENV) == "1" or not isinstance(config, dict) or not is_megatrain_config(config):
            return
        complete_minimal_config(config)  # HfDeepSpeedConfig parsed or deep-copied it: the reader's copy
        self.set_stage_and_offload()  # what __init__ derived from the config, again

    setattr(__init__, _MARKER, original)
    cls.__init__ = __init__


# -- 5. deepspeed.zero.GatheredParameters ------------------------------------------------------


def check_gathered_parameters(deepspeed: ModuleType) -> None:
    gathered = getattr(getattr(deepspeed, "zero", None), "GatheredParameters", None)
    gathered = getattr(gathered, _MARKER, gathered)
    _require(
        isinstance(gathered, type) and callable(getattr(gathered, "__enter__", None)),
        "deepspeed",
        "deepspeed.zero.GatheredParameters is a class used as a context manager",
    )


def settle_before_gathering(deepspeed: ModuleType) -> None:
    """Patch 5: entering ``deepspeed.zero.GatheredParameters`` first settles the updates in
    flight (:func:`~megatrain_ds.optimizer.pipelined_finish.settle_every_update`; idempotent).
    Outside a megatrain run there is none, and the context is DeepSpeed's unchanged."""
    check_gathered_parameters(deepspeed)
    original = deepspeed.zero.GatheredParameters
    if getattr(original, _MARKER, None) is not None:
        return

    class GatheredParameters(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__

        def __enter__(self) -> Any:
            settle_every_update()  # the parameters view masters the update may be writing
            return super().__enter__()

    GatheredParameters.__module__ = original.__module__
    GatheredParameters.__qualname__ = original.__qualname__
    setattr(GatheredParameters, _MARKER, original)
    deepspeed.zero.GatheredParameters = GatheredParameters


# -- 6. transformers.trainer.deepspeed_init ------------------------------------------------------


def check_evaluation_init(trainer_module: ModuleType) -> None:
    init = getattr(trainer_module, "deepspeed_init", None)
    init = getattr(init, _MARKER, init)
    loop = getattr(getattr(trainer_module, "Trainer", None), "evaluation_loop", None)
    loop_code = getattr(inspect.unwrap(loop), "__code__", None) if callable(loop) else None
    integration = sys.modules.get("transformers.integrations.deepspeed")
    finalize = getattr(getattr(integration, "HfTrainerDeepSpeedConfig", None), "trainer_config_finalize", None)
    plugin = getattr(sys.modules.get("accelerate.utils"), "DeepSpeedPlugin", None)
    _require(
        inspect.isfunction(init)
        and {"trainer", "num_training_steps", "inference"} <= _parameters(init)
        and "deepspeed_init" in getattr(loop_code, "co_names", ())  # the global it calls
        and {"args", "model", "num_training_steps"} <= _parameters(finalize)
        and "hf_ds_config" in getattr(plugin, "__dataclass_fields__", {}),
        "transformers",
        "transformers.trainer.deepspeed_init(trainer, num_training_steps, inference) is the module global "
        "Trainer.evaluation_loop calls, HfTrainerDeepSpeedConfig has trainer_config_finalize(args, model, "
        "num_training_steps), and Accelerate's DeepSpeedPlugin keeps that config in hf_ds_config",
    )


def evaluate_before_training(trainer_module: ModuleType) -> None:
    """Patch 6: the Trainer's ``deepspeed_init(inference=True)`` readies a megatrain config
    for an engine without an optimizer, at any stage (idempotent; [Note: evaluation before
    training] in ``deepspeed_hook.py``). Other calls, and other configs, are transformers' own."""
    check_evaluation_init(trainer_module)
    original = trainer_module.deepspeed_init
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def deepspeed_init(trainer: Any, num_training_steps: int, inference: bool = False) -> Any:
        if inference and os.environ.get(DISABLE_ENV) != "1":
            hf_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
            if is_megatrain_config(hf_config.config):
                prepare_evaluation_config(hf_config, trainer.args, trainer.model, num_training_steps)
                return None, None  # transformers' inference branch: no optimizer, no scheduler
        return original(trainer, num_training_steps, inference=inference)

    setattr(deepspeed_init, _MARKER, original)
    # ModuleType's stub reads any attribute (__getattr__) but declares none to assign.
    trainer_module.deepspeed_init = deepspeed_init  # pyright: ignore[reportAttributeAccessIssue]


# -- applying them ------------------------------------------------------------------------------


def patch_deepspeed(deepspeed: ModuleType) -> None:
    """Everything ``deepspeed`` gets: patches 1, 2, 3 and 5, each contract checked before any
    is applied (a release that broke the last one must not be left with the first ones)."""
    for check in (check_initialize, check_zero_init, check_rank_query, check_gathered_parameters):
        check(deepspeed)
    route_initialize(deepspeed)
    build_models_whole(deepspeed)
    answer_rank_without_backend(deepspeed)
    settle_before_gathering(deepspeed)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "deepspeed": patch_deepspeed,
    "accelerate.utils.deepspeed": complete_megatrain_configs,
    "transformers.trainer": evaluate_before_training,
}
"""What each module watched by ``_megatrain_ds_hook`` (its ``WATCHED``) gets once imported."""


def patch(module: ModuleType) -> None:
    """Apply ``module``'s entry of :data:`PATCHES` (idempotent); raises
    :class:`IncompatibleVersionError`, before changing anything, if a contract is broken."""
    PATCHES[module.__name__](module)
