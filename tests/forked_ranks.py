"""Start the ranks of a data-parallel run as children forked after the imports, each given the
variables ``torchrun`` gives its ranks.

python forked_ranks.py --nodes N --per-node M --port PORT WORKER.py [WORKER ARGS...]

``torchrun`` and every rank it starts are fresh interpreters: the launcher imports torch and
each rank torch, ``megatrain_ds``, DeepSpeed and transformers, 3-5 s of CPU per process,
most of what a short data-parallel test costs (a 2-node run of 2 ranks each is six of them).
Here one process imports ``WORKER.py`` (as a module: its ``main()`` is not run) and forks the
``N * M`` ranks from it; each rank sets its variables, then runs the worker's ``main()`` with
``WORKER ARGS`` as its command line, and ends as a script does (``SystemExit``: the exit
handlers and finalization run). Nothing of the engine exists before the fork: the parent only
imports. The ranks meet over gloo at ``127.0.0.1:PORT`` exactly as ``torchrun``'s do.

What a rank sees of its launch is torchrun's environment: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node ``r // M``), ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``. The launchers
themselves are tested where they are the subject: ``tests/test_data_parallel.py`` runs the
2-rank parity under ``torchrun`` and the ``deepspeed`` launcher, and 2 nodes from two
``torchrun --nnodes 2`` launches.

Like ``torchrun``, a rank that fails stops the others (killed), and this process exits with
1; each rank dies with this process too (``PR_SET_PDEATHSIG``), so a test's timeout that
kills it leaves no rank behind waiting in a collective.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import signal
import sys
import traceback
from pathlib import Path
from types import ModuleType

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _import_worker(path: Path) -> ModuleType:
    """``path`` imported as a module (its ``__name__`` is not ``"__main__"``)."""
    spec = importlib.util.spec_from_file_location(f"forked_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _torchrun_variables(rank: int, nodes: int, per_node: int, port: int) -> dict[str, str]:
    world = nodes * per_node
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(rank // per_node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _run_rank(worker: ModuleType, argv: list[str], variables: dict[str, str]) -> int:
    """The rank's whole run in the child: 0, or 1 with the traceback printed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.update(variables)
        sys.argv = argv
        worker.main()
        return 0
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def _fork_rank(worker: ModuleType, argv: list[str], variables: dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        # The child never returns into the parent's loop: it ends here, as a script would.
        code = _run_rank(worker, argv, variables)
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)
        raise SystemExit(0)
    return pid


def _wait_all(ranks: dict[int, int]) -> int:
    """Wait for every rank (pid -> rank); the first that fails has the others killed."""
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = 1
            print(f"forked_ranks: rank {rank} exited with {code}; stopping the others", file=sys.stderr, flush=True)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--per-node", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("worker", type=Path)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    worker = _import_worker(args.worker.resolve())
    argv = [str(args.worker), *args.worker_args]
    ranks = {}
    for rank in range(args.nodes * args.per_node):
        variables = _torchrun_variables(rank, args.nodes, args.per_node, args.port)
        ranks[_fork_rank(worker, argv, variables)] = rank
    sys.exit(_wait_all(ranks))


if __name__ == "__main__":
    main()
