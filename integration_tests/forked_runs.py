"""Several runs of one script in one launch, each in a child forked after the script's imports.

python forked_runs.py SCRIPT.py "ARGS OF RUN 1" "ARGS OF RUN 2" ...

Launched where the script itself would be (``accelerate launch --config_file ... forked_runs.py
accelerate_clm.py ...``), so every run sees the launcher's environment. This process imports
``SCRIPT.py`` as a module (its ``main()`` is not run: torch, transformers and Accelerate, most
of a short run's time), then forks a child per run, one after the other. Each child sets
``sys.argv`` to ``SCRIPT.py`` and its run's arguments (split as a shell would), runs
``main()``, and ends as ``tests/forked_children.py`` says: the exit handlers a process end
runs, then out without tearing the interpreter down (the parent does that once). A child
starts with nothing of a run in it (the parent only imports), so each run is as in a fresh
process. Their output is this process's; a run that fails is named on stderr
(``forked_runs: run N exited with CODE``), and this process then exits with 1.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import ModuleType

# tests/forked_children.py: the import and the fork this shares with tests/forked_ranks.py (a
# launched script's directory, not the repository root, is first on sys.path).
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from forked_children import import_script  # pyright: ignore[reportMissingImports]
from forked_children import run as run_forked  # pyright: ignore[reportMissingImports]


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
    script = import_script(path)
    failed = 0
    for number, arguments in enumerate(sys.argv[2:], start=1):
        code = _run(script, [str(path), *shlex.split(arguments)])
        if code != 0:
            print(f"forked_runs: run {number} exited with {code}", file=sys.stderr, flush=True)
            failed = 1
    sys.exit(failed)


if __name__ == "__main__":
    main()
