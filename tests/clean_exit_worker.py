"""The subprocess side of ``test_clean_exit.py``: scripts that train with the NVMe tier and
simply return, without ``engine.destroy()``.

python clean_exit_worker.py SWAP_DIR REPEATS

Imports once, then forks a child per run, each a script's whole life after its imports:
build an engine with the tier, train 2 steps, return, and let the interpreter exit as it
would (atexit handlers, then finalization with whatever threads are left). Runs: REPEATS
times each of ``nvme_offload`` "optimizer" and "all", then once each two ranks of data
parallel (one tier per rank, over gloo), both ranks forked here: "optimizer", and "all"
(each rank's windows of the weights on its tier, gathered when used). Prints one line per
child, ``<case> <exit code>`` (a signal is a negative code: SIGABRT is -6).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data_parallel_worker
import tiny_models

from megatrain_ds import MegatrainEngine, parse_engine_config

STEPS = 2


def _train_and_return(swap_dir: str, level: str, world_size: int) -> None:
    """A user's script after its imports: no destroy(), no cleanup of any kind."""
    megatrain = {"nvme_offload": level, "nvme_path": swap_dir, "nvme_window_blocks": 2}
    config = data_parallel_worker.config(accumulation=1, world_size=world_size, **megatrain)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    engine.train()
    for step in range(STEPS):
        loss = engine(**tiny_models.make_batch(step)).loss
        engine.backward(loss)
        engine.step()


def _fork(swap_dir: str, level: str, world_size: int, rank: int, port: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        _train_and_return(swap_dir, level, world_size)
        # The child's own end, as a script's: SystemExit unwinds to the interpreter, which
        # runs the exit handlers and finalizes (no os._exit: that skips what is tested).
        raise SystemExit(0)
    return pid


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(swap_dir: str, repeats: int) -> None:
    runs = [("optimizer", "optimizer", 1), ("all", "all", 1)] * repeats
    runs += [("data_parallel", "optimizer", 2), ("data_parallel_all", "all", 2)]
    for case, level, world_size in runs:
        port = _free_port()
        pids = [_fork(swap_dir, level, world_size, r, port) for r in range(world_size)]
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            print(f"{case} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
