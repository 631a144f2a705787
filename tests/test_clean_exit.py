"""A script that trains and simply returns, without ``engine.destroy()``, exits with 0.

Without the engine's exit handler (``MegatrainEngine.__init__``) such a script with the
NVMe tier aborted in about half of its runs (SIGABRT, "terminate called without an active
exception"): an I/O thread (a daemon) was still writing the last step behind inside
DeepSpeed's async I/O op when the interpreter finalized, and was unwound out of the op's
GIL release. Each run is one child of ``clean_exit_worker.py``, forked after the imports:
``REPEATS`` each of "optimizer" and "all", and once each two data-parallel ranks with
"optimizer" and with "all"; every one must exit with 0. The abort came in some runs only;
what fails every time without the handler is the last check: the swap directory of a run
that died without closing its tier stays on disk (a later run removes those of dead runs,
so the last run's is the one left).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fork_server

WORKER = Path(__file__).resolve().parent / "clean_exit_worker.py"
REPEATS = 2


def test_scripts_that_return_without_destroy_exit_cleanly(tmp_path: Path) -> None:
    # The launcher's variables are the children's to set; one thread each, as on CI.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, str(WORKER), str(tmp_path), str(REPEATS)]
    # The worker's imports once, in tests/fork_server.py's server; its children, forked after
    # them as before, keep the whole interpreter exit this test is about.
    result = fork_server.run(command, env=fork_server.with_this_checkout(env), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [
        line.split()
        for line in result.stdout.splitlines()
        if line.split()[:1] in (["optimizer"], ["all"], ["data_parallel"], ["data_parallel_all"])
    ]
    assert len(runs) == REPEATS * 2 + 4, result.stdout
    assert all(code == "0" for _, code in runs), (runs, result.stderr[-3000:])
    assert list(tmp_path.iterdir()) == [], "every run's swap directory is removed at exit"
