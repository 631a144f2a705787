"""Route ``deepspeed.initialize`` to this engine when the config says ``"engine": "megatrain"``.

This is the one place the project patches a third-party function. :func:`wrap` replaces
``deepspeed.initialize`` with a wrapper that sends configs with ``"engine": "megatrain"``
to :func:`megatrain_ds.initialize.initialize` and every other call, unchanged, to the
original. Set ``MEGATRAIN_DISABLE_HOOK=1`` to turn the routing off (checked per call).

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
from typing import Any

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
