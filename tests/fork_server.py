"""Python launches of the tests forked from one process that imported torch, DeepSpeed,
transformers and ``megatrain_ds`` once: :func:`run` in place of ``subprocess.run``.

A test that launches ``python WORKER.py ...`` (or ``python -m MODULE``, ``python -c CODE``)
pays for a fresh interpreter's imports, 5-7 s of CPU before the worker does anything; the
suite makes dozens of such launches. Here the first launch of a pytest process starts a
server, ``python fork_server.py SOCKET``, which imports what every launched worker imports
(:data:`PRELOADED`) and then forks a child per launch. The child takes the launch's
standard streams (passed over the socket), working directory, environment and command
line, runs the script as ``__main__`` as the interpreter would, and ends as a process ends
but for the interpreter's teardown: non-daemon threads joined, exit handlers run, output
flushed, ``os._exit`` (the teardown frees every object the server imported, each page
touched copied from the server's: ``tests/forked_children.py``'s docstring; the children of
``tests/clean_exit_worker.py``, whose subject the teardown is, keep theirs).

What a child sees is what a fresh interpreter would, but for modules that were imported
before it started. So a launch is served only where those imports are the ones it would
have made itself: its environment equals the server's but for :data:`READ_AT_RUN_TIME`,
variables nothing reads at import (the rendezvous, the race checker's switch, which
runtimes read when they are built). Any other difference (``OMP_NUM_THREADS``, which
OpenMP reads when it is loaded; ``DS_ACCELERATOR``, which DeepSpeed reads at import;
``PYTHONPATH``) is a server of its own, started by the first launch that needs it: a
server's imports cost about what two fresh launches' do, and the tests' launches share one
environment (:func:`with_this_checkout`), so a pytest worker starts one. A launch with
``MEGATRAIN_DISABLE_HOOK=1`` (DeepSpeed's own engine, the reference) goes fresh: the
start-up hook reads it at interpreter start, the server has imported ``megatrain_ds`` (so
DeepSpeed's and Accelerate's functions are the patched ones, which check the variable at
each call), and the reference must run DeepSpeed as it is. A *launcher* is served whatever
the variable says (``popen(..., launcher=True)``): a process that trains nothing itself but
starts the processes that do as new interpreters (``accelerate launch``; TRL's CLI, which
calls it), so those read the variable at their start, and the reference runs fresh as before.
``MEGATRAIN_FRESH_LAUNCHES=1`` launches every process fresh, as before this module.

The server is a child of the pytest process and its children the server's, waited by it;
a child's CPU seconds (``os.wait4``, its own and its waited children's) are sent back with
its exit code and added up in :func:`served_cpu_seconds` for ``conftest.py``'s CPU log.
The server ends when the pytest process closes its standard input (at exit, or when it
dies), and a child dies with the server (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import forked_children  # beside this file

PRELOADED = ("torch", "torch.distributed", "transformers", "deepspeed", "megatrain_ds", "safetensors.torch")
"""What the server imports (with the model classes and engine modules of ``tiny_models``'s
``load_eagerly`` and ``load_engine_imports_eagerly``, and DeepSpeed's async I/O op): what
the workers of the tests import. Only modules and a loaded library: nothing of an engine
exists before a fork."""

READ_AT_RUN_TIME = frozenset(
    {
        # The rendezvous and the rank, read when a process group or an engine is built.
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        # megatrain_ds.runtime.stream_check.requested(), asked when a runtime is built;
        # megatrain_ds.runtime.measurement_cache.cache_dir(), when a measurement is cached.
        "MEGATRAIN_STREAM_CHECK",
        "MEGATRAIN_CACHE_DIR",
        # pytest's name of the test that launches (no launched code reads it).
        "PYTEST_CURRENT_TEST",
    }
)
"""Variables a launch may set otherwise than its server: nothing reads them at import."""

SET_BY_IMPORTS = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""What importing a :data:`PRELOADED` module puts in ``os.environ`` where it is unset
(DeepSpeed, with ``setdefault``, so that its import never creates a CUDA context; torch reads
it at each ``torch.cuda.is_available()``). The server has it; a fresh interpreter has it once
it imports DeepSpeed. A served launch's environment gets it as the launch's own import would
have set it, so one server serves the launches of a pytest process before and after that
process imported DeepSpeed itself (which set it there: a second server, 10 s of imports, for
every launch after)."""

FRESH_ENV = "MEGATRAIN_FRESH_LAUNCHES"
HOOK_OFF_ENV = "MEGATRAIN_DISABLE_HOOK"  # = megatrain_ds.integration.deepspeed_hook.DISABLE_ENV
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MESSAGE_BYTES = 1 << 20


# -- the server -------------------------------------------------------------------------------


def _preload() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    import tiny_models  # beside this file: the model classes and engine modules a worker builds

    tiny_models.load_eagerly("LlamaConfig", "LlamaForCausalLM")
    tiny_models.load_engine_imports_eagerly()
    # DeepSpeed's async I/O op, which every process with the NVMe tier loads once: its builder
    # probes the CPU in two child interpreters each time (2.3 s of CPU). Loaded here, the
    # children share it. Without libaio it cannot load; each child then finds that out itself.
    from megatrain_ds.state import swap_io

    with contextlib.suppress(RuntimeError):
        swap_io.deepspeed_aio_op()


def _run_as_main(command: list[str]) -> int:
    """``python COMMAND...`` (a script, ``-m MODULE`` or ``-c CODE``) in this process; its exit code."""

    def body() -> None:
        if command[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *command[2:]], ""
            exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif command[0] == "-m":
            sys.argv, sys.path[0] = [command[1], *command[2:]], os.getcwd()
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = command, str(Path(command[0]).resolve().parent)
            runpy.run_path(command[0], run_name="__main__")

    return forked_children.exit_code_of(body)


def _child(request: dict, streams: list[int], inherited: list[int]) -> None:
    """The forked child: the launch's streams, directory, environment and command; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in inherited:  # the server's socket and other launches' connections
        os.close(fd)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = _run_as_main(request["command"])
    # A process's end but the teardown: threads joined, exit handlers, output flushed.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _tell(connection: socket.socket, message: dict) -> None:
    """``message`` to a launch's client; a client gone (its test failed before it waited, or
    it died) is no reason for the server to stop serving the others."""
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps(message).encode())


def _accept(listener: socket.socket, waiting: dict[int, socket.socket]) -> None:
    connection, _ = listener.accept()
    try:
        message, streams, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 3)
    except OSError:
        connection.close()
        return
    if len(streams) != 3:  # a client that died while sending
        for fd in streams:
            os.close(fd)
        connection.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        inherited = [listener.fileno(), connection.fileno(), *(other.fileno() for other in waiting.values())]
        _child(json.loads(message), streams, inherited)
    for fd in streams:
        os.close(fd)
    _tell(connection, {"pid": pid})
    waiting[pid] = connection


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Every child that has ended: its exit code and CPU seconds to its launch."""
    while waiting:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = waiting.pop(pid)
        cpu = usage.ru_utime + usage.ru_stime
        _tell(connection, {"code": os.waitstatus_to_exitcode(status), "cpu": cpu})
        connection.close()


def serve(path: str) -> None:
    """Import, listen at ``path``, say "ready" on standard output, and fork a child per
    launch until standard input closes."""
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd is written
    selector = selectors.DefaultSelector()
    for fd in (listener.fileno(), wake_read, sys.stdin.fileno()):
        selector.register(fd, selectors.EVENT_READ)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select():
            if key.fd == listener.fileno():
                _accept(listener, waiting)
            elif key.fd == wake_read:
                os.read(wake_read, 4096)
                _reap(waiting)
            elif not os.read(sys.stdin.fileno(), 4096):
                return  # the pytest process has closed its end: at its exit, or it died


# -- the client (the pytest process) ----------------------------------------------------------


def with_this_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on ``PYTHONPATH``: a launched worker imports this
    checkout's ``megatrain_ds`` and Triton kernels (``triton_kernels/megatrain_triton``) even
    where an editable install points at another clone (as the test process does, from
    pytest's root directory and the root ``conftest.py``). The tests' launches that use it
    share one environment, so one server."""
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), str(root / "triton_kernels"), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path}


class _Server:
    """One server process, for launches with one environment (but for ``READ_AT_RUN_TIME``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        # A test's forked child (tests/forked_children.py) runs this process's exit handlers
        # too; only the process that started the server may stop it and remove its socket,
        # or the launches that come after would find it gone.
        self.owner = os.getpid()
        self.directory = tempfile.mkdtemp(prefix="fork_server_")
        self.path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.path],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        # What the imports print comes first; "ready" once it listens (EOF: it failed).
        self.ready = any(line.strip() == "ready" for line in iter(self.process.stdout.readline, ""))

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)
        # The socket, and whatever else a launch left beside it: the directory is the server's.
        shutil.rmtree(self.directory, ignore_errors=True)


_servers: dict[frozenset[tuple[str, str]], _Server] = {}
_served_cpu = [0.0]


def served_cpu_seconds() -> float:
    """CPU seconds of every served launch waited for so far (theirs and their children's)."""
    return _served_cpu[0]


@atexit.register
def close_servers() -> None:
    """Stop every server and wait for it (``conftest.py`` at the end of the session; at exit too)."""
    while _servers:  # each taken out first: one that fails to close is not closed again at exit
        _, server = _servers.popitem()
        server.close()


def _server_for(command: Sequence[str], env: Mapping[str, str], launcher: bool) -> _Server | None:
    """The server for this launch, started if it is the first; None where it is launched fresh.
    A launcher's ``MEGATRAIN_DISABLE_HOOK`` is for the processes it starts: no reason for a
    server of its own."""
    plain = len(command) >= 2 and command[0] == sys.executable and not command[1].startswith("-")
    flagged = len(command) >= 3 and command[0] == sys.executable and command[1] in ("-c", "-m")
    hook_off = env.get(HOOK_OFF_ENV) == "1"
    if os.environ.get(FRESH_ENV) == "1" or (hook_off and not launcher) or not (plain or flagged):
        return None
    ignored = (READ_AT_RUN_TIME | {HOOK_OFF_ENV}) if launcher else READ_AT_RUN_TIME
    common = {**SET_BY_IMPORTS, **{name: value for name, value in env.items() if name not in ignored}}
    key = frozenset(common.items())
    if key not in _servers:
        _servers[key] = _Server(common)
    server = _servers[key]
    return server if server.ready else None


class ServedProcess:
    """A launch run by a server's forked child: what the tests use of ``subprocess.Popen``
    (``pid``, ``stdout`` and ``stderr`` where piped, ``wait``, ``send_signal``, ``kill``,
    ``returncode``). The child is the server's: its end comes as a message on the connection."""

    def __init__(self, server: _Server, command: Sequence[str], request: dict, streams: list[int]) -> None:
        self.args = list(command)
        self.returncode: int | None = None
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._connection.connect(server.path)
        socket.send_fds(self._connection, [json.dumps(request).encode()], streams)
        self.pid: int = json.loads(self._connection.recv(_MESSAGE_BYTES))["pid"]

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                message = self._connection.recv(_MESSAGE_BYTES)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            if not message:
                raise RuntimeError(f"tests/fork_server.py's server ended while {self.args} ran")
            ended = json.loads(message)
            self._connection.close()
            self.returncode = ended["code"]
            _served_cpu[0] += ended["cpu"]
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both piped streams read to their end (side by side: a child blocked writing one
        while this reads the other would never end), then :meth:`wait`."""
        outputs = {"stdout": "", "stderr": ""}

        def read(name: str, stream: IO[str]) -> None:
            outputs[name] = stream.read()

        readers = [
            threading.Thread(target=read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)  # past the timeout: TimeoutExpired, the child left running, as Popen's
        for reader in readers:
            reader.join()
        return outputs["stdout"], outputs["stderr"]

    def send_signal(self, signal_number: int) -> None:
        if self.returncode is None:  # not yet waited for: the server has not reaped it
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stream(target: int | IO | None, default: int, pipes: list[int]) -> int:
    """The fd a child's stream is given: ``target``'s (``subprocess.PIPE``: a new pipe's
    write end, its read end appended to ``pipes``), or ``default`` (this process's)."""
    if target is None:
        return default
    if target == subprocess.PIPE:
        read, write = os.pipe()
        pipes.append(read)
        return write
    return target if isinstance(target, int) else target.fileno()


def popen(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout: int | IO | None = None,
    stderr: int | IO | None = None,
    launcher: bool = False,
) -> ServedProcess | subprocess.Popen[str]:
    """``subprocess.Popen(command, env=env, cwd=cwd, stdin=DEVNULL, stdout=stdout,
    stderr=stderr, text=True)``, served by a forked child where the module docstring says it
    may be, else a fresh process. ``stdout``, ``stderr``: None, ``subprocess.PIPE``, an fd or
    a file (``stderr``: ``subprocess.STDOUT`` too). ``launcher``: the command only starts
    the processes that do the work, each a new interpreter (the module docstring)."""
    env = dict(os.environ if env is None else env)
    server = _server_for(command, env, launcher)
    if server is not None:
        pipes: list[int] = []
        out = _stream(stdout, sys.stdout.fileno(), pipes)
        err = out if stderr == subprocess.STDOUT else _stream(stderr, sys.stderr.fileno(), pipes)
        request = {"command": list(command[1:]), "env": {**SET_BY_IMPORTS, **env}, "cwd": os.fspath(cwd or os.getcwd())}
        try:
            with open(os.devnull, "rb") as stdin:
                process = ServedProcess(server, command, request, [stdin.fileno(), out, err])
        except OSError:  # the server is gone: this launch and the next go fresh
            server.ready = False
            for fd in {*pipes, *(fd for target, fd in ((stdout, out), (stderr, err)) if target == subprocess.PIPE)}:
                os.close(fd)
        else:
            return _with_pipes(process, stdout, stderr, out, err, pipes)
    return subprocess.Popen(
        list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True
    )


def _with_pipes(
    process: ServedProcess, stdout: int | IO | None, stderr: int | IO | None, out: int, err: int, pipes: list[int]
) -> ServedProcess:
    """``process`` given the read ends of its piped streams; the write ends, the child's
    now, closed here (so that reading ends when the child's output does)."""
    for target, fd in ((stdout, out), (stderr, err)):
        if target == subprocess.PIPE:
            os.close(fd)  # the child has its own: end of file when it ends
    # The read ends are the process's, as subprocess.Popen's are (closed with them, or at exit).
    readers = iter(open(fd, encoding="utf-8", errors="replace") for fd in pipes)  # noqa: SIM115
    process.stdout = next(readers) if stdout == subprocess.PIPE else None
    process.stderr = next(readers) if stderr == subprocess.PIPE else None
    return process


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, env=env, cwd=cwd, stdin=DEVNULL, capture_output=True,
    text=True, timeout=timeout, check=check)``, served as :func:`popen` is."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = popen(command, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        out.seek(0)
        err.seek(0)
        stdout, stderr = (stream.read().decode(errors="replace") for stream in (out, err))
    result = subprocess.CompletedProcess(list(command), code, stdout, stderr)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    serve(sys.argv[1])
