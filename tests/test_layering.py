"""The package's import graph: no cycles, and no import that goes up the layers.

``megatrain_ds`` is built in layers (``CONTRIBUTING.md``, "Map of the package"); a module
may import modules of its own layer and of the layers below it, never above. This is the
one place the order is written. Imports are read from the source (``ast``), inside
functions and ``TYPE_CHECKING`` blocks too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatrain_ds"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("runtime",),
    ("state",),
    ("gradients",),
    ("distributed",),
    ("optimizer",),
    ("model",),
    ("streaming",),
    ("checkpoint",),
    ("planning",),
    ("engine", "engine_build", "engine_memory", "optimizer_build"),
    ("integration",),
    ("cli", "__init__"),
)
"""Lowest first. Each entry is a subpackage or a top-level module of ``megatrain_ds``."""

MAX_TOP_LEVEL_MODULES = 6


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to (a module, or the package that defines it)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports (``from pkg import name`` counts as importing
    the module ``pkg.name`` where there is one, else ``pkg``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    for index, names in enumerate(LAYERS):
        if part in names:
            return index
    raise AssertionError(f"{module} is in no layer: add {part!r} to LAYERS in {Path(__file__).name}")


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_every_module_is_in_a_layer():
    for module in _modules():
        _layer(module)


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_goes_up_the_layers():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_top_level_stays_small():
    top = sorted(path.name for path in ROOT.glob("*.py"))
    rooms = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert len(rooms) >= 5, rooms


def test_the_checker_sees_cycles_and_upward_imports(tmp_path):
    """The graph reader on a made-up package: a lazy import inside a function counts."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from megatrain_ds.engine import MegatrainEngine\n")
    modules = {"megatrain_ds.engine": Path(), "megatrain_ds.runtime.trace": source}
    assert _imports("megatrain_ds.runtime.trace", source, modules) == {"megatrain_ds.engine"}
    assert _layer("megatrain_ds.engine") > _layer("megatrain_ds.runtime.trace")


@pytest.mark.parametrize("room", [names[0] for names in LAYERS if names[0] not in ("config", "engine", "cli")])
def test_each_room_says_what_it_holds(room):
    """Every subpackage's ``__init__`` docstring says what it holds and what it may import."""
    init = ROOT / room / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert docstring and "May import" in docstring, f"{init} needs a docstring with a 'May import' line"


# DeepSpeed's loss scalers, imported by optimizer/loss_scaling.py (the rank they ask
# ``deepspeed.comm`` for is answered by integration/compat.py, which holds every patch).
_DEEPSPEED_LOSS_SCALERS = ("deepspeed.runtime.fp16.loss_scaler",)
# With its op builders: the record of the ops DeepSpeed was installed with, pre-built
# (runtime/built_ops.py uses one where it exists instead of compiling its own).
_DEEPSPEED_OP_MODULES = ("deepspeed.ops", "deepspeed.git_version_info")


def test_only_the_integration_layer_imports_the_frameworks():
    """The core never imports Accelerate or DeepSpeed's engine (STYLE.md, habit 1): below
    ``integration`` only DeepSpeed's op builders (the CPU Adam kernel, async I/O) with the
    record of its pre-built ops and, in
    the optimizer layer, its loss scalers (``deepspeed.runtime.fp16.loss_scaler``, fp16)
    may be imported."""
    below = _layer(f"{PACKAGE}.integration")
    offending = []
    for module, path in _modules().items():
        if _layer(module) >= below:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                framework = name.split(".")[0] in ("accelerate", "transformers", "trl", "peft")
                deepspeed_allowed = name.startswith(_DEEPSPEED_OP_MODULES) or (
                    name in _DEEPSPEED_LOSS_SCALERS and module.startswith(f"{PACKAGE}.optimizer.")
                )
                if framework or (name.startswith("deepspeed") and not deepspeed_allowed):
                    offending.append(f"{module} imports {name}")
    assert not offending, "\n".join(offending)


CUDA_OWNER = f"{PACKAGE}.runtime.device_runtime"


def _cuda_uses(tree: ast.AST) -> list[int]:
    """Lines of ``torch.cuda`` attribute reads and ``torch.cuda`` imports in ``tree``, in order."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            if isinstance(node.value, ast.Name) and node.value.id == "torch":
                lines.add(node.lineno)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(name.startswith("torch.cuda") for name in imported):
                lines.add(node.lineno)
    return sorted(lines)


def test_only_the_device_runtime_calls_cuda():
    """CUDA belongs to ``runtime/device_runtime.py``: streams, events and buffers through a
    ``DeviceRuntime``, and the stream-free questions (the device, its free memory, RNG
    states) through its functions. Elsewhere a ``torch.cuda`` call would be GPU-only code
    that the CPU path (and the race checker proving its ordering) never runs."""
    offending = [
        f"{module}:{line}"
        for module, path in _modules().items()
        if module != CUDA_OWNER
        for line in _cuda_uses(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not offending, "torch.cuda used outside device_runtime: " + ", ".join(offending)


def test_the_cuda_check_sees_a_call():
    tree = ast.parse("import torch\nx = 1\nif torch.cuda.is_available():\n    pass\nfrom torch.cuda import Stream\n")
    assert _cuda_uses(tree) == [3, 5]
