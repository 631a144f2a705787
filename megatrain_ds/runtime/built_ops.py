"""The engine's C++ ops, compiled once per machine rather than once per virtualenv.

DeepSpeed JIT-compiles an op into torch's extension cache under the op's bare name
(``async_io``), with the absolute paths of the virtualenv's DeepSpeed and torch on every
compile line, and leaves to ninja whether it is up to date. A new virtualenv, or a reinstall
(which gives the sources new times), therefore rebuilds it: DeepSpeed's async I/O op with
the pinned-memory op it needs takes ~150 s on two cores. Each process that loads an op
through DeepSpeed's builder also probes the CPU for its flags in two child interpreters
(py-cpuinfo), ~1 s of CPU even when nothing is rebuilt.

The ops the engine loads are compiled here instead, from DeepSpeed's sources with its
builder's flags (less debug information: :func:`without_debug_info`), under a name that
says what the build depends on (:func:`build_name`): DeepSpeed's and torch's versions, the
Python ABI and this CPU (DeepSpeed compiles with ``-march=native``). A process finds a
finished build by that name and imports it directly (:func:`load_built`), whatever
virtualenv it runs in; nothing probes the CPU.

- :func:`deepspeed_op`: one of DeepSpeed's ops by its builder class, built under such a name
  (or DeepSpeed's own pre-built op where DeepSpeed was installed with it).
- :func:`build_name`, :func:`load_built`: the naming and the import, also used by the
  engine's own binding (``megatrain_ds/optimizer/cpu_binding.py``).

The contract relied on (DeepSpeed 0.19): ``OpBuilder.jit_load`` gives torch's ``load`` the
builder's ``name`` attribute as the extension's name. :func:`deepspeed_op` checks that the
module it got back has the name it asked for, and fails naming DeepSpeed's version if not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import platform
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


@functools.cache
def _machine_key() -> str:
    """What every build here depends on besides its own sources: the versions it was compiled
    against (torch's ABI, DeepSpeed's sources and flags), the Python ABI, and the CPU, whose
    model and feature flags decide what ``-march=native`` and DeepSpeed's SIMD width emit
    (a cache on a home directory shared by different machines keeps one build for each)."""
    import torch

    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # Linux: the first processor's model and flags
        first = cpuinfo.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[0]
        cpu = "\n".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))
    return "\n".join(
        (importlib.metadata.version("deepspeed"), torch.__version__, sys.implementation.cache_tag or "", cpu)
    )


def build_name(stem: str, *sources: str) -> str:
    """The extension name of ``stem`` built from ``sources`` (texts; DeepSpeed's own sources
    are fixed by its version) on this machine: ``megatrain_<stem>_<digest>``."""
    digest = hashlib.sha1("\0".join((_machine_key(), *sources)).encode()).hexdigest()[:12]
    return "_".join(("megatrain", re.sub(r"\W", "_", stem), digest))


def build_directory(name: str) -> Path:
    """Where torch's extension cache keeps the build ``name`` (``TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions``)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def load_built(name: str) -> ModuleType | None:
    """The finished build ``name``, imported; ``None`` if there is none yet. A build still in
    progress in another process (torch's lock file beside it) counts as none: the caller then
    builds through torch, which waits for that build and imports its result."""
    directory = build_directory(name)
    built = directory / f"{name}.so"
    if not built.exists() or (directory / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def without_debug_info(flags: list[str]) -> list[str]:
    """DeepSpeed's compile flags less ``-g``. The debug information of torch's headers is about
    a quarter of each file's compile time (DeepSpeed's async I/O op: 141 s to 99 s on two
    cores) and three quarters of the built op's size, and nothing reads it but a debugger
    stepping through DeepSpeed's C++, which can build its own."""
    return [flag for flag in flags if flag != "-g"]


def deepspeed_op(builder_class: Any, *, global_symbols: bool = False, requires: str = "") -> ModuleType:
    """DeepSpeed's op ``builder_class`` (e.g. ``AsyncIOBuilder``): DeepSpeed's pre-built op
    where DeepSpeed was installed with it (``DS_BUILD_*``), else this machine's build of it,
    compiled on first use by DeepSpeed's builder with its flags less ``-g``.

    ``global_symbols``: make the op's symbols visible to ops loaded after it, as DeepSpeed
    does for its pinned-memory op, which its async I/O op resolves symbols from.
    ``requires``: what the op needs that a machine may lack, for the error when DeepSpeed's
    builder finds that it cannot build the op here."""
    from deepspeed.git_version_info import installed_ops  # pyright: ignore[reportMissingImports]

    if installed_ops.get(builder_class.NAME, False):
        return builder_class().load(verbose=False)
    name = build_name(builder_class.NAME)
    module = load_built(name)
    if module is None:

        class Build(builder_class):  # DeepSpeed's builder, without debug information
            def cxx_args(self) -> list[str]:
                return without_debug_info(super().cxx_args())

        builder = Build()
        if not builder.is_compatible(verbose=False):
            needs = f" (it needs {requires})" if requires else ""
            raise RuntimeError(
                f"DeepSpeed's {builder_class.NAME} op cannot be built on this machine{needs}: {builder.error_log}"
            )
        builder.name = name  # the extension's name, and so its place in torch's cache
        module = builder.jit_load(verbose=False)
        if module.__name__ != name:
            raise RuntimeError(
                f"DeepSpeed {importlib.metadata.version('deepspeed')} built its {builder_class.NAME} op as "
                f"{module.__name__!r}, not under the name its builder was given ({name!r}): megatrain_ds "
                "relies on OpBuilder.jit_load naming the extension after OpBuilder.name; install a "
                "DeepSpeed version pyproject.toml allows"
            )
    if global_symbols:
        assert module.__file__ is not None
        ctypes.CDLL(module.__file__, mode=ctypes.RTLD_GLOBAL)
    return module
