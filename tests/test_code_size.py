"""Module and function sizes: no module of ``megatrain_ds`` over 700 lines, no function over 70.

CONTRIBUTING.md, "Writing code here": one concept per file, and functions a reader can hold
at once. Read from the source (``ast``), so the check is fast and imports nothing. A
function's length is its ``def`` line (decorators included) to its last line, docstring
and comments too; a nested function counts within its parent and on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatrain_ds"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 70

EXEMPT: dict[str, str] = {}
"""Modules (by path) and functions (``path::qualified name``) allowed over the limits for now,
each with the reason; an entry that no longer applies fails the test (remove it)."""


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _functions(tree: ast.Module) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, last line)`` of every function and method in ``tree``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((name, first, child.end_lineno or child.lineno))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _oversized() -> dict[str, str]:
    """``module path`` or ``path::function`` -> what is over its limit, for the whole package."""
    over: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            over[_relative(path)] = f"{lines} lines (at most {MAX_MODULE_LINES})"
        for name, first, last in _functions(ast.parse(text, filename=str(path))):
            if last - first + 1 > MAX_FUNCTION_LINES:
                over[f"{_relative(path)}::{name}"] = f"{last - first + 1} lines (at most {MAX_FUNCTION_LINES})"
    return over


def test_functions_are_measured_from_decorator_to_last_line() -> None:
    """The measure itself, on a known source: a method, a nested function and a decorator."""
    source = "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n        return g\n"
    assert _functions(ast.parse(source)) == [("A.f", 2, 6), ("A.f.g", 4, 5)]


def test_no_module_or_function_is_over_the_size_limits() -> None:
    over = _oversized()
    new = {name: size for name, size in over.items() if name not in EXEMPT}
    assert not new, (
        f"over the size limits (modules <= {MAX_MODULE_LINES} lines, functions <= {MAX_FUNCTION_LINES}; "
        "split by concern, see CONTRIBUTING.md 'Writing code here'):\n"
        + "\n".join(f"  {name}: {size}" for name, size in sorted(new.items()))
    )
    stale = sorted(set(EXEMPT) - set(over))
    assert not stale, f"EXEMPT entries now within the limits: remove them from {Path(__file__).name}: {stale}"
