"""Route ``deepspeed.initialize`` to this engine when the config says ``"engine": "megatrain"``.

This is the one place the project patches a third-party function. ``install()`` wraps
``deepspeed.initialize`` as soon as ``deepspeed`` is imported (immediately if it already
is): the wrapper sends configs with ``"engine": "megatrain"`` to
:func:`megatrain_ds.initialize.initialize` and every other call, unchanged, to the
original. Set ``MEGATRAIN_DISABLE_HOOK=1`` to turn the routing off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from megatrain_ds.config import is_megatrain_config, load_config_dict

DISABLE_ENV = "MEGATRAIN_DISABLE_HOOK"
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


def _wrap(deepspeed: ModuleType) -> None:
    original = deepspeed.initialize
    if getattr(original, _MARKER, None) is not None:
        return

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(DISABLE_ENV) != "1" and is_megatrain_config(_config_of(args, kwargs)):
            from megatrain_ds.initialize import initialize as megatrain_initialize

            return megatrain_initialize(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(initialize, _MARKER, original)
    deepspeed.initialize = initialize


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed`` with the normal machinery, then wraps it once it has executed.

    It stays registered until the module really executes: libraries probe for deepspeed
    with ``importlib.util.find_spec`` without importing it.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        finder = self

        class _Loader(importlib.abc.Loader):
            def __getattr__(self, name: str) -> Any:
                return getattr(loader, name)  # resource readers etc. of the real loader

            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _wrap(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Wrap ``deepspeed.initialize`` now, or right after ``deepspeed`` is imported."""
    if "deepspeed" in sys.modules:
        _wrap(sys.modules["deepspeed"])
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
