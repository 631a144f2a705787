"""A script imported as a module, then bodies run in children forked after its imports:
what ``forked_ranks.py`` (the ranks of a data-parallel run) and
``integration_tests/forked_runs.py`` (several runs of one script, and
``trainer_clients.py``'s clients) share.

The parent only imports (torch, DeepSpeed, transformers: most of a short run's CPU), so
each child starts with nothing of a run in it, as a fresh process would. A child ends as a
process ends but for the interpreter's teardown: the exit handlers a process end runs
(process groups, DeepSpeed's, the engine's), flushed output, then ``os._exit`` with its
code. The teardown is what a forked child pays most for: it frees every object the parent
imported, and each page it touches is copied from the parent's (about 2 s of a forked
rank's 2.5 s of CPU). What a script's teardown does with the engine's threads is
``tests/test_clean_exit.py``'s subject, whose children keep it.

Only the standard library here: the launched scripts import this before anything else.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def import_script(path: Path) -> ModuleType:
    """``path`` imported as a module named ``forked_<stem>`` (so its ``__name__`` is not
    ``"__main__"`` and its ``main()`` does not run), its directory first on ``sys.path`` as
    when it runs as a script."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"forked_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def exit_code_of(body: Callable[[], None]) -> int:
    """Run ``body()``: 0, a ``SystemExit``'s code (its message printed to stderr, 1, where it
    is no integer, as the interpreter does), or 1 for any other exception, whose traceback
    is printed."""
    try:
        body()
        return 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def start(body: Callable[[], None]) -> int:
    """``body()`` in a forked child, which ends as the module docstring says; the child's pid.
    The child never returns into the caller."""
    sys.stdout.flush()  # or what the parent buffered would be written twice
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = exit_code_of(body)
        atexit._run_exitfuncs()  # pyright: ignore[reportAttributeAccessIssue]
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid


def run(body: Callable[[], None]) -> int:
    """``body()`` in a forked child (:func:`start`), waited for; its exit code (a signal's:
    minus its number)."""
    _, status = os.waitpid(start(body), 0)
    return os.waitstatus_to_exitcode(status)
