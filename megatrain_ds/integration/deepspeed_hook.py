"""Route ``deepspeed.initialize`` to this engine when the config says ``"engine": "megatrain"``.

This is the one place the project patches third-party functions (:func:`patch`, per module):

- :func:`wrap` replaces ``deepspeed.initialize`` with a wrapper that sends configs with
  ``"engine": "megatrain"`` to :func:`megatrain_ds.initialize.initialize` and every other
  call, unchanged, to the original.
- :func:`supply_zero_block` makes Accelerate's ``HfDeepSpeedConfig`` (the base of the HF
  Trainer's) add ``"zero_optimization": {"stage": 0}`` to a megatrain config that has no
  ZeRO block: Accelerate's ``DeepSpeedPlugin`` refuses a config without one ("Please
  specify the ZeRO optimization config in the DeepSpeed config.") and indexes it later,
  while this engine has no use for it. Stage 0 is what the engine is (its
  ``zero_optimization_stage()``), so nothing downstream assumes partitioning.

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

import functools
import os
from types import ModuleType
from typing import Any, Callable

from megatrain_ds.config import is_megatrain_config, load_config_dict

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
    deepspeed.initialize = initialize


def supply_zero_block(accelerate_deepspeed: ModuleType) -> None:
    """Make ``accelerate.utils.deepspeed.HfDeepSpeedConfig`` give a megatrain config without
    ``zero_optimization`` the block ``{"stage": 0}`` (idempotent). The config it reads is its
    own copy (Accelerate deep-copies a dict and parses a file), never the user's object."""
    cls = accelerate_deepspeed.HfDeepSpeedConfig
    original = cls.__init__
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if (os.environ.get(DISABLE_ENV) != "1" and is_megatrain_config(config)
                and "zero_optimization" not in config):
            config["zero_optimization"] = {"stage": 0}
            self.set_stage_and_offload()  # what __init__ derived from the config, again

    setattr(__init__, _MARKER, original)
    cls.__init__ = __init__


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "deepspeed": wrap,
    "accelerate.utils.deepspeed": supply_zero_block,
}
"""What each module watched by ``_megatrain_ds_hook`` (its ``WATCHED``) gets once imported."""


def patch(module: ModuleType) -> None:
    """Apply ``module``'s entry of :data:`PATCHES` (idempotent)."""
    PATCHES[module.__name__](module)
