"""The engine's C++ ops are compiled once per machine and found again by name
(``megatrain_ds/runtime/built_ops.py``): a finished build is imported without DeepSpeed's
builder, a build in progress is waited for through torch, and a builder that does not name
the extension as told is a clear error."""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from megatrain_ds.runtime import built_ops
from megatrain_ds.state import swap_io


class FakeBuilder:
    """A DeepSpeed op builder that records what it was asked for, without compiling."""

    NAME = "megatrain_test_op"
    compatible = True
    error_log = "no libfake.so"
    built_as: str | None = None
    built_with: list[str] | None = None

    def __init__(self) -> None:
        self.name = self.NAME

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.compatible

    def cxx_args(self) -> list[str]:
        return ["-O3", "-g", "-fopenmp"]

    def jit_load(self, verbose: bool = False) -> types.ModuleType:
        FakeBuilder.built_as = self.name
        FakeBuilder.built_with = self.cxx_args()
        return types.ModuleType(self.name)

    def load(self, verbose: bool = False) -> types.ModuleType:
        return types.ModuleType("deepspeed.ops.prebuilt")


@pytest.fixture
def extension_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty torch extension cache for the test."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    FakeBuilder.built_as = FakeBuilder.built_with = None
    return tmp_path


def test_the_name_depends_on_what_the_build_depends_on_and_not_on_the_virtualenv(monkeypatch):
    name = built_ops.build_name("cpu_adam", "binding source")
    assert name == built_ops.build_name("cpu_adam", "binding source")
    assert name.startswith("megatrain_cpu_adam_")
    assert name != built_ops.build_name("cpu_adam", "another binding source")
    assert name != built_ops.build_name("async_io", "binding source")
    key = built_ops._machine_key()
    assert importlib.metadata.version("deepspeed") in key and torch.__version__ in key
    # Nothing of where this interpreter, torch or DeepSpeed is installed: a new virtualenv
    # with the same versions finds the same build.
    deepspeed_files = importlib.metadata.distribution("deepspeed").locate_file("")
    for path in (sys.prefix, Path(torch.__file__).parent, deepspeed_files):
        assert str(path) not in key
    monkeypatch.setattr(built_ops, "_machine_key", lambda: key.replace(torch.__version__, "2.0.0"))
    assert built_ops.build_name("cpu_adam", "binding source") != name


def test_an_op_is_built_under_its_name_with_its_builders_flags_less_debug_information(extension_cache):
    module = built_ops.deepspeed_op(FakeBuilder)
    name = built_ops.build_name(FakeBuilder.NAME)
    assert module.__name__ == name and FakeBuilder.built_as == name
    assert FakeBuilder.built_with == ["-O3", "-fopenmp"]


def test_a_builder_that_ignores_the_name_is_a_clear_error(extension_cache, monkeypatch):
    monkeypatch.setattr(FakeBuilder, "jit_load", lambda self, verbose=False: types.ModuleType(self.NAME))
    with pytest.raises(RuntimeError, match=r"DeepSpeed .* built its megatrain_test_op op as .*OpBuilder\.name"):
        built_ops.deepspeed_op(FakeBuilder)


def test_an_op_that_cannot_build_here_says_what_it_needs(extension_cache, monkeypatch):
    monkeypatch.setattr(FakeBuilder, "compatible", False)
    with pytest.raises(RuntimeError, match=r"cannot be built on this machine \(it needs libfake\): no libfake\.so"):
        built_ops.deepspeed_op(FakeBuilder, requires="libfake")
    assert FakeBuilder.built_as is None


def test_deepspeeds_prebuilt_op_is_used_where_deepspeed_was_installed_with_it(extension_cache, monkeypatch):
    import deepspeed.git_version_info as version_info  # pyright: ignore[reportMissingImports]

    monkeypatch.setitem(version_info.installed_ops, FakeBuilder.NAME, True)
    assert built_ops.deepspeed_op(FakeBuilder).__name__ == "deepspeed.ops.prebuilt"
    assert FakeBuilder.built_as is None


def _aio_op() -> types.ModuleType:
    try:
        return swap_io.deepspeed_aio_op()
    except RuntimeError as error:  # no libaio or no compiler: the tier's fallback is tested elsewhere
        pytest.skip(str(error))


def test_a_finished_build_is_imported_without_deepspeeds_builder(monkeypatch):
    """The async I/O op, built by set-up: found again in a process that has not loaded it,
    with DeepSpeed's builders unable to compile or probe anything."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder  # pyright: ignore[reportAttributeAccessIssue]

    module = _aio_op()
    assert module.__name__ == built_ops.build_name("async_io")

    def refuse(self, verbose=False):
        raise AssertionError(f"DeepSpeed's builder ran for {self.NAME}")

    for builder in (AsyncIOBuilder, PinMemoryBuilder):
        monkeypatch.setattr(builder, "jit_load", refuse)
        monkeypatch.setattr(builder, "is_compatible", refuse)
    monkeypatch.setattr(swap_io, "deepspeed_aio_op", swap_io.deepspeed_aio_op.__wrapped__)
    again = swap_io.deepspeed_aio_op()
    assert again.__file__ == module.__file__
    assert hasattr(again, "aio_handle")


def test_a_build_in_progress_is_not_imported(tmp_path, monkeypatch):
    """Torch's lock file beside a build means another process is still writing it: the
    caller goes through torch, which waits for it."""
    module = _aio_op()  # from the machine's cache (or this process), before the cache moves
    assert module.__file__ is not None
    name = module.__name__
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = built_ops.build_directory(name)
    assert directory.is_relative_to(tmp_path)
    shutil.copy(module.__file__, directory / f"{name}.so")
    (directory / "lock").touch()
    assert built_ops.load_built(name) is None
    (directory / "lock").unlink()
    copy = built_ops.load_built(name)  # (this process has it already: Python hands back that module)
    assert copy is not None and copy.__name__ == name and hasattr(copy, "aio_handle")
