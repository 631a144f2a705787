"""Start the ranks of a data-parallel run as children forked after the imports, each given the
variables ``torchrun`` gives its ranks.

python forked_ranks.py [--nodes N] --per-node M --port PORT [--no-kill] [--bare-env] WORKER.py [WORKER ARGS...]

``torchrun`` and every rank it starts are fresh interpreters: the launcher imports torch and
each rank torch, ``megatrain_ds``, DeepSpeed and transformers, 3-5 s of CPU per process,
most of what a short data-parallel test costs (a 2-node run of 2 ranks each is six of them).
Here one process imports ``WORKER.py`` (as a module: its ``main()`` is not run) and forks the
``N * M`` ranks from it; each rank sets its variables, then runs the worker's ``main()`` with
``WORKER ARGS`` as its command line. Nothing of the engine exists before the fork: the parent
only imports. The ranks meet over gloo at ``127.0.0.1:PORT`` exactly as ``torchrun``'s do.

A rank ends as ``forked_children.py``'s children do: the exit handlers a process end runs
(process groups, DeepSpeed's, the engine's), then out with its code, without tearing the
interpreter down (the teardown, most of a forked rank's CPU, is ``tests/test_clean_exit.py``'s
subject, whose children keep it).

What a rank sees of its launch is torchrun's environment: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node ``r // M``), ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; with ``--bare-env``
only what a launch by hand sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: no variable names the node). The
launchers themselves are tested where they are the subject: ``tests/test_data_parallel.py``
runs a 2-rank parity under the ``deepspeed`` launcher, and 2 nodes from two ``torchrun
--nnodes 2`` launches.

Like ``torchrun``, a rank that fails stops the others (killed), and this process exits with
1; with ``--no-kill`` the others run on (a rank killed on purpose, whose peers must notice
by themselves), and this process waits for every rank. Each rank that fails is named on
stderr, ``forked_ranks: rank R exited with CODE`` (a signal: minus its number). Each rank
dies with this process too (``PR_SET_PDEATHSIG``), so a test's timeout that kills it leaves
no rank behind waiting in a collective.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

import forked_children  # beside this file

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _torchrun_variables(rank: int, nodes: int, per_node: int, port: int, bare: bool) -> dict[str, str]:
    world = nodes * per_node
    by_hand = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if bare:
        return by_hand
    return by_hand | {
        "GROUP_RANK": str(rank // per_node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
    }


def _fork_rank(worker: ModuleType, argv: list[str], variables: dict[str, str]) -> int:
    """The rank's whole run in a forked child (``forked_children.start``); its pid."""

    def body() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.update(variables)
        sys.argv = argv
        worker.main()

    return forked_children.start(body)


def _wait_all(ranks: dict[int, int], kill_on_failure: bool) -> int:
    """Wait for every rank (pid -> rank): 1 if any failed. Unless ``kill_on_failure`` is off,
    the first that fails has the others killed."""
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code == 0:
            continue
        print(f"forked_ranks: rank {rank} exited with {code}", file=sys.stderr, flush=True)
        if kill_on_failure and not failed:
            print("forked_ranks: stopping the others", file=sys.stderr, flush=True)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
        failed = 1
    return failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--per-node", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-kill", action="store_true", help="a rank that fails leaves the others running")
    parser.add_argument("--bare-env", action="store_true", help="only the variables a launch by hand sets")
    parser.add_argument("worker", type=Path)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    worker = forked_children.import_script(args.worker.resolve())
    argv = [str(args.worker), *args.worker_args]
    ranks = {}
    for rank in range(args.nodes * args.per_node):
        variables = _torchrun_variables(rank, args.nodes, args.per_node, args.port, args.bare_env)
        ranks[_fork_rank(worker, argv, variables)] = rank
    sys.exit(_wait_all(ranks, kill_on_failure=not args.no_kill))


if __name__ == "__main__":
    main()
