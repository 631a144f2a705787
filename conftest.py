"""Test environment for tests/ and integration_tests/.

DeepSpeed on a CPU-only machine needs DS_ACCELERATOR=cpu and the torch.distributed
variables even for one process (its C++ ops JIT-compile on first use into torch's
default ~/.cache/torch_extensions, which persists between clones); Triton kernels run on CPU tensors only through its
interpreter. All must be set before deepspeed or triton is first imported.
"""

import os
import socket
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread a worker: the workers already fill the cores, and OpenMP threads
    # spinning against each other's make every test several times slower.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch

# Import this checkout's kernels even when an editable install points at another clone
# (the package root is on sys.path already, through this conftest's directory).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_kernels"))

_HAS_CUDA = torch.cuda.is_available()


def _free_port() -> str:
    """A port nobody listens on now: test sessions running side by side (CI and a
    developer's) must not both bind DeepSpeed's single-process rendezvous to one port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers inherit the controller's environment, which this file set up
    # already: each worker needs a rendezvous port of its own.
    os.environ["MASTER_PORT"] = _free_port()

for key, value in {
    "DS_ACCELERATOR": "cuda" if _HAS_CUDA else "cpu",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": _free_port(),
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}.items():
    os.environ.setdefault(key, value)

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("MEGATRAIN_TEST_CPU_LOG"):
    # Where the suite's time goes (CONTRIBUTING.md, "Test time"): each test's CPU seconds,
    # its own process's and those of the processes it launched and waited for, one JSON line
    # per test appended to this file. CPU, not wall time: on 2 shared cores wall time mostly
    # measures the neighbours.
    import json
    import resource

    import pytest

    def _cpu_seconds() -> tuple[float, float]:
        own, launched = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        # Launches forked by tests/fork_server.py's server are its children, not this process's.
        fork_server = sys.modules.get("fork_server")
        served = fork_server.served_cpu_seconds() if fork_server is not None else 0.0
        return own.ru_utime + own.ru_stime, launched.ru_utime + launched.ru_stime + served

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before = _cpu_seconds()
        yield
        after = _cpu_seconds()
        line = {"test": item.nodeid, "own": after[0] - before[0], "launched": after[1] - before[1]}
        with open(os.environ["MEGATRAIN_TEST_CPU_LOG"], "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


def pytest_unconfigure(config) -> None:
    """The launch servers (``tests/fork_server.py``) stop and are waited for before pytest
    ends, so that their CPU is the pytest process's, as a fresh launch's is."""
    fork_server = sys.modules.get("fork_server")
    if fork_server is not None:
        fork_server.close_servers()
