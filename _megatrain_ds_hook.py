"""Zero-code activation: route ``deepspeed.initialize`` without an ``import megatrain_ds``.

The ``megatrain_ds`` distribution installs ``_megatrain_ds_hook.pth`` next to this module
in ``site-packages``; Python runs the ``.pth`` line at start-up::

    import _megatrain_ds_hook; _megatrain_ds_hook.install()

``install`` only registers an import watcher (this module imports nothing heavy: it runs
in every Python process of the environment). When, and only when, ``deepspeed`` is
imported, the watcher lets it execute normally and then imports
:mod:`megatrain_ds.integration.deepspeed_hook`, which wraps ``deepspeed.initialize``: configs with
``"engine": "megatrain"`` go to this engine, every other call to DeepSpeed unchanged.
Because the wrapper replaces the module attribute before anyone can read it, callers
that look ``deepspeed.initialize`` up at call time (Accelerate) or bind it once after
importing (``from deepspeed import initialize``) are routed alike.

``MEGATRAIN_DISABLE_HOOK=1`` switches the routing off: at start-up nothing is installed,
and an already wrapped ``initialize`` checks the variable at every call.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from types import ModuleType
from typing import Any, Callable

DISABLE_ENV = "MEGATRAIN_DISABLE_HOOK"  # = megatrain_ds.integration.deepspeed_hook.DISABLE_ENV
WATCHED = "deepspeed"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV) == "1"


class _AfterImportLoader(importlib.abc.Loader):
    """The real loader of ``deepspeed``, plus a callback once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, on_loaded: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._on_loaded = on_loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)  # resource readers etc. of the real loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._on_loaded(module)


class DeepSpeedImportWatcher(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` with the finders after it, and wraps its loader.

    It stays registered until ``deepspeed`` really executes: libraries probe for it with
    ``importlib.util.find_spec`` (Accelerate, transformers) without importing it.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != WATCHED:
            return None
        spec = None
        after_self = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in after_self:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AfterImportLoader(spec.loader, self._loaded)
        return spec

    def _loaded(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from megatrain_ds.integration import deepspeed_hook
        except Exception as error:  # never break `import deepspeed` for a broken megatrain_ds
            import warnings

            warnings.warn(f"megatrain_ds: could not route deepspeed.initialize ({error!r})",
                          RuntimeWarning, stacklevel=2)
            return
        deepspeed_hook.wrap(module)


def watch() -> None:
    """Register the watcher once (idempotent); nothing happens until ``deepspeed`` is imported."""
    if not any(isinstance(finder, DeepSpeedImportWatcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedImportWatcher())


def install() -> None:
    """The ``.pth`` entry point: watch for ``deepspeed`` unless the hook is disabled."""
    if disabled():
        return
    if WATCHED in sys.modules:  # imported by an earlier .pth: wrap it now
        from megatrain_ds.integration import deepspeed_hook

        deepspeed_hook.wrap(sys.modules[WATCHED])
        return
    watch()
