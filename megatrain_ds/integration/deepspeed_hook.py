"""Route ``deepspeed.initialize`` to this engine when the config says ``"engine": "megatrain"``.

This is the one place the project patches third-party functions (:func:`patch`, per module):

- :func:`wrap` replaces ``deepspeed.initialize`` with a wrapper that sends configs with
  ``"engine": "megatrain"`` to :func:`megatrain_ds.initialize.initialize` and every other
  call, unchanged, to the original.
- :func:`supply_missing_keys` makes Accelerate's ``HfDeepSpeedConfig`` (the base of the
  HF Trainer's) complete a minimal megatrain config, ``{"engine": "megatrain"}`` plus what
  the user cares about, with ``"zero_optimization": {"stage": 0}`` and ``"auto"`` batch,
  accumulation and clipping keys ([Note: the minimal config]).

Set ``MEGATRAIN_DISABLE_HOOK=1`` to turn both off (checked per call).

Two ways in, one mechanism (``_megatrain_ds_hook.install``, the start-up module installed
beside the package; it imports this module, never the other way round):

- zero-code: ``_megatrain_ds_hook.pth`` registers an import watcher at interpreter
  start-up, so a script that never imports ``megatrain_ds`` (an Accelerate or HF Trainer
  script) is routed as soon as it, or a library, imports ``deepspeed``;
- explicit: ``import megatrain_ds`` calls the same ``install``, which wraps ``deepspeed``
  now if it is imported, or registers the watcher.

Accelerate looks ``deepspeed.initialize`` up when it prepares the model and the HF Trainer
goes through Accelerate, so both see the wrapper.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from megatrain_ds.config import AUTO, is_megatrain_config, load_config_dict

DISABLE_ENV = "MEGATRAIN_DISABLE_HOOK"
"""Also read by ``_megatrain_ds_hook`` at start-up, which must not import this package."""
_MARKER = "__megatrain_original__"


def _config_of(args: tuple, kwargs: dict[str, Any]) -> Any:
    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None:
        cli_args = kwargs.get("args", args[0] if args else None)
        config = getattr(cli_args, "deepspeed_config", None)
    if config is None:
        return None
    try:
        return load_config_dict(config)
    except (OSError, ValueError, TypeError):
        return None  # not ours to judge: DeepSpeed reports its own config errors


def wrap(deepspeed: ModuleType) -> None:
    """Replace ``deepspeed.initialize`` by the routing wrapper (idempotent)."""
    original = deepspeed.initialize
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(DISABLE_ENV) != "1" and is_megatrain_config(_config_of(args, kwargs)):
            from megatrain_ds.integration.initialize import initialize as megatrain_initialize

            return megatrain_initialize(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(initialize, _MARKER, original)
    # ModuleType's stub reads any attribute (__getattr__) but declares none to assign.
    deepspeed.initialize = initialize  # pyright: ignore[reportAttributeAccessIssue]


FILLED_BY_THE_CLIENT: dict[str, Any] = {
    "zero_optimization": {"stage": 0},
    "train_batch_size": AUTO,
    "train_micro_batch_size_per_gpu": AUTO,
    "gradient_accumulation_steps": AUTO,
    "gradient_clipping": AUTO,
}
"""What a megatrain config read by Accelerate or the HF Trainer gets for each of these keys
it leaves out ([Note: the minimal config])."""


def supply_missing_keys(accelerate_deepspeed: ModuleType) -> None:
    """Make ``accelerate.utils.deepspeed.HfDeepSpeedConfig`` give a megatrain config the
    keys of :data:`FILLED_BY_THE_CLIENT` it leaves out (idempotent).

    [Note: the minimal config]
    A user writes ``{"engine": "megatrain", "optimizer": ...}`` and runs it under the HF
    Trainer or Accelerate. Accelerate's ``DeepSpeedPlugin`` (the Trainer goes through it)
    refuses a config without ``zero_optimization`` ("Please specify the ZeRO optimization
    config in the DeepSpeed config.") and indexes that block later; stage 0 is what this
    engine is (its ``zero_optimization_stage()``), so nothing downstream assumes
    partitioning. Both fill only the batch, accumulation and clipping keys that say
    ``"auto"`` and leave missing ones missing (so ``deepspeed.initialize`` would find no
    batch size, and Accelerate would force one accumulation step); a missing key is made
    ``"auto"``, so they come from the DataLoader or ``TrainingArguments`` and
    ``Accelerator(gradient_accumulation_steps=...)`` as with the shipped
    ``configs/ds_megatrain_hf.json`` (Accelerate's ``"auto"`` clipping is 1.0, the Trainer's
    is ``max_grad_norm``). Precision is left to them: Accelerate adds the ``bf16`` block for
    ``mixed_precision="bf16"`` itself. The config edited is the reader's own copy
    (Accelerate deep-copies a dict and parses a file), never the user's object, and
    ``deepspeed.initialize`` called directly is not involved: like DeepSpeed it needs a
    batch size.
    """
    cls = accelerate_deepspeed.HfDeepSpeedConfig
    original = cls.__init__
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if os.environ.get(DISABLE_ENV) == "1" or not is_megatrain_config(config):
            return
        assert isinstance(config, dict)  # HfDeepSpeedConfig parses or deep-copies it into a dict
        for key, value in FILLED_BY_THE_CLIENT.items():
            config.setdefault(key, copy.deepcopy(value))
        self.set_stage_and_offload()  # what __init__ derived from the config, again

    setattr(__init__, _MARKER, original)
    cls.__init__ = __init__


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "deepspeed": wrap,
    "accelerate.utils.deepspeed": supply_missing_keys,
}
"""What each module watched by ``_megatrain_ds_hook`` (its ``WATCHED``) gets once imported."""


def patch(module: ModuleType) -> None:
    """Apply ``module``'s entry of :data:`PATCHES` (idempotent)."""
    PATCHES[module.__name__](module)
