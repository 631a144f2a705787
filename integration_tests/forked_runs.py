"""Several runs of one script in one launch, each in a child forked after the script's imports.

python forked_runs.py SCRIPT.py "ARGS OF RUN 1" "ARGS OF RUN 2" ...

Launched where the script itself would be (``accelerate launch --config_file ... forked_runs.py
accelerate_clm.py ...``), so every run sees the launcher's environment. This process imports
``SCRIPT.py`` as a module (its ``main()`` is not run: torch, transformers and Accelerate, most
of a short run's time), then forks a child per run, one after the other. Each child sets
``sys.argv`` to ``SCRIPT.py`` and its run's arguments (split as a shell would), runs
``main()``, and ends as ``trainer_clients.py``'s children do: the exit handlers a process end
runs, then out without tearing the interpreter down (the parent does that once). A child
starts with nothing of a run in it (the parent only imports), so each run is as in a fresh
process. Their output is this process's; a run that fails is named on stderr
(``forked_runs: run N exited with CODE``), and this process then exits with 1.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def _import_script(path: Path) -> ModuleType:
    """``path`` imported as a module (its ``__name__`` is not ``"__main__"``), its directory
    first on ``sys.path`` as when it runs as a script."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"forked_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_forked(body: Callable[[], None]) -> int:
    """``body()`` in a forked child, which ends as the module docstring says; its exit code
    (a ``SystemExit``'s own, 1 for any other exception, whose traceback it prints)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _run(script: ModuleType, argv: list[str]) -> int:
    """One run in a forked child; its exit code."""

    def body() -> None:
        sys.argv = argv
        script.main()

    return run_forked(body)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path = Path(sys.argv[1]).resolve()
    script = _import_script(path)
    failed = 0
    for number, arguments in enumerate(sys.argv[2:], start=1):
        code = _run(script, [str(path), *shlex.split(arguments)])
        if code != 0:
            print(f"forked_runs: run {number} exited with {code}", file=sys.stderr, flush=True)
            failed = 1
    sys.exit(failed)


if __name__ == "__main__":
    main()
