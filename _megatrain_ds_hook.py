"""Zero-code activation: route ``deepspeed.initialize`` without an ``import megatrain_ds``.

The ``megatrain_ds`` distribution installs ``_megatrain_ds_hook.pth`` next to this module
in ``site-packages``; Python runs the ``.pth`` line at start-up::

    import _megatrain_ds_hook; _megatrain_ds_hook.install()

``install`` only registers an import watcher (this module imports nothing heavy: it runs
in every Python process of the environment). When, and only when, a watched module is
imported, the watcher lets it execute normally and then hands it to
:func:`megatrain_ds.integration.compat.patch` (every patch of a third-party module is there):

- ``deepspeed``: ``deepspeed.initialize`` is wrapped; configs with ``"engine": "megatrain"``
  go to this engine, every other call to DeepSpeed unchanged. Because the wrapper replaces
  the module attribute before anyone can read it, callers that look
  ``deepspeed.initialize`` up at call time (Accelerate) or bind it once after importing
  (``from deepspeed import initialize``) are routed alike. ``deepspeed.zero.Init`` given a
  megatrain config builds the model whole (does nothing), and ``deepspeed.comm.get_rank``
  answers rank 0 (or torch.distributed's rank) where it would assert for want of
  DeepSpeed's backend, for DeepSpeed's loss scalers and monitors in the megatrain engine.
- ``accelerate.utils.deepspeed``: its ``HfDeepSpeedConfig`` (which Accelerate's
  ``DeepSpeedPlugin`` and the HF Trainer read the JSON with, before ``deepspeed`` itself
  is imported) completes a megatrain config with ``zero_optimization: {stage: 0}`` and
  ``"auto"`` batch, accumulation and clipping keys where it leaves them out, so the
  minimal config works unchanged ([Note: the minimal config] in that module), and reads a
  megatrain config's ZeRO stage 3 as 0, so transformers builds the model whole rather than
  under ``deepspeed.zero.Init`` ([Note: ZeRO-3 configs]).
- ``transformers.trainer``: the Trainer's ``deepspeed_init`` lets ``evaluate()`` and
  ``predict()`` before ``train()`` build the engine without an optimizer under a megatrain
  config, which transformers refuses below stage 3 ([Note: evaluation before training]).

``MEGATRAIN_DISABLE_HOOK=1`` switches them all off: at start-up nothing is installed, and an
already patched function checks the variable at every call. An installed version that
breaks a patch's third-party contract makes the import of the watched module fail with
``megatrain_ds.integration.compat.IncompatibleVersionError``, which names the contract, the
version and the supported range; nothing is patched then.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

DISABLE_ENV = "MEGATRAIN_DISABLE_HOOK"  # = megatrain_ds.integration.deepspeed_hook.DISABLE_ENV
WATCHED = ("deepspeed", "accelerate.utils.deepspeed", "transformers.trainer")  # = compat.PATCHES' keys


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
    """Finds the ``WATCHED`` modules with the finders after it, and wraps their loaders.

    It stays registered until all of them really execute: libraries probe for
    ``deepspeed`` with ``importlib.util.find_spec`` (Accelerate, transformers) without
    importing it.
    """

    def __init__(self) -> None:
        self.pending = set(WATCHED)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        spec = None
        after_self = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
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
        self.pending.discard(module.__name__)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        _patch(module)


def _patch(module: ModuleType) -> None:
    try:
        from megatrain_ds.integration import compat
    except Exception as error:  # never break `import deepspeed` for a broken megatrain_ds
        import warnings

        warnings.warn(f"megatrain_ds: could not patch {module.__name__} ({error!r})", RuntimeWarning, stacklevel=3)
        return
    # An installed version that breaks a patch's contract stops this import with
    # compat.IncompatibleVersionError (naming the version, the supported range and
    # MEGATRAIN_DISABLE_HOOK=1): unpatched, a megatrain config would train silently on
    # DeepSpeed's own engine.
    compat.patch(module)


def install() -> None:
    """The ``.pth`` entry point (idempotent): patch the ``WATCHED`` modules already imported
    (by an earlier ``.pth``, or before ``import megatrain_ds``), watch for the others;
    nothing unless the hook is enabled."""
    if disabled() or any(isinstance(finder, DeepSpeedImportWatcher) for finder in sys.meta_path):
        return
    watcher = DeepSpeedImportWatcher()
    for name in WATCHED:
        if name in sys.modules:
            watcher.pending.discard(name)
            _patch(sys.modules[name])
    if watcher.pending:
        sys.meta_path.insert(0, watcher)
