"""A happens-before race checker over virtual streams: the GPU's ordering, proved on the CPU.

With ``MEGATRAIN_STREAM_CHECK=1`` a CPU :class:`~megatrain_ds.runtime.device_runtime.DeviceRuntime`
hands out :class:`CheckedStream` and :class:`CheckedEvent` instead of its no-op streams
and events, keeps device memory apart from host memory (as a GPU would), and observes
every tensor access of the engine's threads. An access that two agents make to the same
bytes, at least one of them a write, with neither ordered before the other by the
synchronisation the engine declared, raises :class:`StreamRaceError` naming both. It is
the algorithm of PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``), run on virtual
streams so that CI, which has no GPU, catches a missing wait.

[Note: what the checker models]
Agents are the streams (compute, h2d, d2h, optimizer, comm) and the host threads that
touch engine buffers (the caller's, the gradient worker, the data-parallel reducer).
Each has a vector clock. Work is attributed as a GPU would run it:

- a thread inside ``runtime.on(stream)`` issues its ops to that stream; the main thread
  (and autograd on it) issues to the compute stream otherwise. An op issued to a stream
  is ordered after the stream's earlier work and after everything the issuing thread has
  seen, and before nothing the thread does next;
- a host thread (``runtime.start_thread``; or any thread inside ``runtime.host_work()``)
  runs its ops itself, as host code on host memory does; so does an op on the compute
  thread whose tensors are all host buffers (``runtime.host_empty``), which no kernel
  could run;
- ``event.record(s)`` takes stream ``s``'s clock; ``s2.wait_event(e)`` and
  ``s2.wait_stream(s)`` order ``s2``'s later work after it; ``event.synchronize()``,
  ``stream.synchronize()`` and ``runtime.synchronize()`` order the calling thread's
  later work after it (host waits);
- host threads order each other only where the engine hands work over:
  ``runtime.host_queue()`` (put -> get, task_done -> join) and ``start_thread``
  (start -> the thread's first op, its last op -> join);
- a device tensor freed while another stream's access to it is pending is a write of
  the freeing point on its allocating stream (the caching allocator would hand the memory
  out again), unless ``runtime.used_on(tensor, stream)`` named that stream; host
  buffers are never freed in a step, and pinned ones from PyTorch's host allocator wait
  for their copies by themselves.

Accesses are read from aten ops through a per-thread ``TorchDispatchMode`` (inputs are
reads; outputs and arguments the schema marks mutable are writes; view ops access
nothing: ``runtime/aten_access.py``, which reads each op's schema once), at byte
granularity within each storage. The same accesses, with who made
them, feed the checker's :class:`~megatrain_ds.runtime.host_ledger.HostLedger` (``ledger``):
the host traffic of each step. What bypasses aten is declared with
:func:`declare_access` where it happens: DeepSpeed's CPU Adam binding, the Triton
interpreter, checkpoint files read into or written from host buffers.

What it cannot see: the work is executed on the CPU at issue, so it judges the order the
engine *declared*, not a timing; accesses outside the observed calls (user code between
``engine(...)`` and ``engine.backward``) and undeclared non-aten accesses are invisible;
a host read of pinned memory by code that is not an aten op must be declared.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_ds.runtime import aten_access
from megatrain_ds.runtime.aten_access import Extent
from megatrain_ds.runtime.aten_access import extent as _extent
from megatrain_ds.runtime.host_ledger import HostLedger

ENV = "MEGATRAIN_STREAM_CHECK"


def requested() -> bool:
    """Whether ``MEGATRAIN_STREAM_CHECK=1`` asks CPU runtimes to check stream ordering."""
    return os.environ.get(ENV) == "1"


class StreamRaceError(RuntimeError):
    """Two unordered accesses to the same bytes, at least one a write."""


Clock = dict[int, int]
"""Vector clock: agent id -> the last of that agent's operations known to be done."""


def _join(into: Clock, other: Clock) -> None:
    for agent, tick in other.items():
        if into.get(agent, 0) < tick:
            into[agent] = tick


class _Agent:
    """A stream or a host thread: it issues operations in program order."""

    def __init__(self, agent_id: int, name: str, is_stream: bool) -> None:
        self.id = agent_id
        self.name = name
        self.is_stream = is_stream
        self.clock: Clock = {agent_id: 0}

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def describe(self) -> str:
        return f"stream {self.name!r}" if self.is_stream else f"host thread {self.name!r}"


@dataclass
class _Access:
    start: int
    end: int
    is_write: bool
    agent: _Agent
    tick: int
    what: str
    on: tuple[torch.dtype, torch.Size] | None = None
    """The accessed tensor's dtype and shape (formatted only for a race's message)."""

    def describe(self) -> str:
        what = self.what if self.on is None else f"{self.what} on {aten_access.shape(*self.on)}"
        return f"{'write' if self.is_write else 'read'} by {self.agent.describe()} in {what}"


@dataclass
class _Storage:
    accesses: list[_Access] = field(default_factory=list)
    allocated_by: _Agent | None = None
    """The stream that allocated it (device memory); ``None``: host memory or unknown."""
    used_on: set[int] = field(default_factory=set)
    """Streams named by ``used_on`` (``record_stream``): a free waits for their work."""
    host: bool = False


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.checker: StreamChecker | None = None
        self.agent: _Agent | None = None
        self.stream: CheckedStream | None = None
        """The stream ``runtime.on`` made current; ``None``: the thread's default."""
        self.host = False
        """Ops run on the host (a host thread, or inside ``host_work``)."""


_thread = _ThreadState()


class CheckedStream:
    """A virtual stream (``torch.cuda.Stream``'s interface, as the engine uses it)."""

    def __init__(self, checker: StreamChecker, name: str) -> None:
        self._checker = checker
        self.agent = checker._new_agent(name, is_stream=True)

    def wait_event(self, event: CheckedEvent) -> None:
        """Later work on this stream happens after the work ``event`` captured."""
        self._checker._stream_waits(self, event.clock)

    def wait_stream(self, stream: CheckedStream) -> None:
        """Later work on this stream happens after the work issued to ``stream`` so far."""
        event = CheckedEvent(self._checker)
        event.record(stream)
        self.wait_event(event)

    def synchronize(self) -> None:
        """The calling thread waits for everything issued to this stream."""
        self._checker._host_waits(self.agent.clock)

    def __repr__(self) -> str:
        return f"CheckedStream({self.agent.name!r})"


class CheckedEvent:
    """A virtual event (``torch.cuda.Event``'s interface, as the engine uses it)."""

    def __init__(self, checker: StreamChecker) -> None:
        self._checker = checker
        self.clock: Clock = {}
        """The work captured by the last ``record`` (none: the event is complete)."""

    def record(self, stream: CheckedStream | None = None) -> None:
        self.clock = self._checker._record(stream)

    def synchronize(self) -> None:
        self._checker._host_waits(self.clock)

    def wait(self, stream: CheckedStream | None = None) -> None:
        self._checker._stream_waits(stream or self._checker.current_stream(), self.clock)


class _AccessMode(TorchDispatchMode):
    """Reports every aten op of one thread to the checker."""

    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self._checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._checker._on_op(func, args, kwargs, out)
        return out


class CheckedQueue(queue.Queue):
    """A ``queue.Queue`` that carries happens-before between host threads: ``get`` is
    ordered after its ``put``, ``join`` after every ``task_done``."""

    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self._checker = checker
        self._done: Clock = {}

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put((self._checker._thread_clock(), item), block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        clock, item = super().get(block, timeout)
        self._checker._host_waits(clock)
        return item

    def task_done(self) -> None:
        with self._checker._lock:
            _join(self._done, self._checker._thread_clock())
        super().task_done()

    def join(self) -> None:
        super().join()
        self._checker._host_waits(self._done)


class _ObservedThread(threading.Thread):
    """A daemon host thread whose accesses the checker observes (``start_thread``)."""

    def __init__(self, checker: StreamChecker, target: Callable[[], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._checker = checker
        self._work = target
        self._started_after = checker._thread_clock()  # what the starting thread had done
        self._finished: Clock = {}

    def run(self) -> None:
        self._checker._host_waits(self._started_after)
        try:
            with self._checker.observe(host=True):
                self._work()
        finally:
            self._finished = self._checker._thread_clock()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if not self.is_alive():
            self._checker._host_waits(self._finished)


class StreamChecker:
    """Vector clocks of the streams and host threads of one runtime, and every access."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._agents: list[_Agent] = []
        self._threads: dict[int, _Agent] = {}
        self._storages: dict[int, _Storage] = {}
        self._freed: list[tuple[int, Clock, _Agent | None]] = []
        self.compute = CheckedStream(self, "compute")
        self.races: list[str] = []
        """Every race found (the first also raised)."""
        self.num_accesses = 0
        """Accesses checked so far (tests: the checker saw the engine's work)."""
        self.ledger = HostLedger()
        """The host traffic of the accesses seen (``runtime/host_ledger.py``)."""

    # -- agents ----------------------------------------------------------------------

    def _new_agent(self, name: str, is_stream: bool) -> _Agent:
        with self._lock:
            agent = _Agent(len(self._agents) + 1, name, is_stream)
            self._agents.append(agent)
            return agent

    def stream(self, name: str) -> CheckedStream:
        return CheckedStream(self, name)

    def event(self) -> CheckedEvent:
        return CheckedEvent(self)

    def _thread_agent(self) -> _Agent:
        if _thread.agent is not None and _thread.checker is self:
            return _thread.agent
        ident = threading.get_ident()
        with self._lock:
            agent = self._threads.get(ident)
            if agent is None:
                agent = self._new_agent(threading.current_thread().name, is_stream=False)
                self._threads[ident] = agent
        return agent

    def _thread_clock(self) -> Clock:
        agent = self._thread_agent()
        with self._lock:
            agent.tick()
            return dict(agent.clock)

    def current_stream(self) -> CheckedStream:
        """The stream the calling thread issues device work to."""
        return _thread.stream if _thread.checker is self and _thread.stream is not None else self.compute

    # -- synchronisation -----------------------------------------------------------------

    def _record(self, stream: CheckedStream | None) -> Clock:
        stream = stream or self.current_stream()
        thread = self._thread_agent()
        with self._lock:
            _join(stream.agent.clock, thread.clock)  # issued after the thread's earlier work
            return dict(stream.agent.clock)

    def _stream_waits(self, stream: CheckedStream, clock: Clock) -> None:
        thread = self._thread_agent()
        with self._lock:
            _join(stream.agent.clock, thread.clock)
            _join(stream.agent.clock, clock)

    def _host_waits(self, clock: Clock) -> None:
        thread = self._thread_agent()
        with self._lock:
            _join(thread.clock, clock)

    def synchronize(self) -> None:
        """The calling thread waits for every stream (``torch.cuda.synchronize``)."""
        with self._lock:
            clocks = [dict(agent.clock) for agent in self._agents if agent.is_stream]
        for clock in clocks:
            self._host_waits(clock)

    def used_on(self, tensor: torch.Tensor, stream: CheckedStream) -> None:
        """``tensor.record_stream(stream)``: its memory is not reused before ``stream``'s
        work issued up to its free is done."""
        extent = _extent(tensor)
        if extent is not None:
            with self._lock:
                self._storage(tensor, extent[0]).used_on.add(stream.agent.id)

    # -- threads ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def observe(self, host: bool | None = None) -> Iterator[None]:
        """Observe the calling thread's tensor accesses in the enclosed code (re-entrant)."""
        if _thread.checker is self:
            with self._host_mode(host) if host is not None else contextlib.nullcontext():
                yield
            return
        saved = (_thread.checker, _thread.agent, _thread.stream, _thread.host)
        _thread.checker, _thread.stream = self, None
        _thread.agent = self._thread_agent()
        _thread.host = bool(host)
        try:
            with _AccessMode(self):
                yield
        finally:
            _thread.checker, _thread.agent, _thread.stream, _thread.host = saved

    @contextlib.contextmanager
    def _host_mode(self, host: bool) -> Iterator[None]:
        saved = _thread.host
        _thread.host = host
        try:
            yield
        finally:
            _thread.host = saved

    @contextlib.contextmanager
    def use_stream(self, stream: CheckedStream) -> Iterator[None]:
        """``runtime.on(stream)``: the calling thread issues device work to ``stream``."""
        if _thread.checker is not self:
            yield
            return
        saved = (_thread.stream, _thread.host)
        _thread.stream, _thread.host = stream, False
        try:
            yield
        finally:
            _thread.stream, _thread.host = saved

    def host_work(self) -> contextlib.AbstractContextManager[None]:
        """The enclosed ops are host code on host memory (the optimizer at the step's end)."""
        return self._host_mode(True) if _thread.checker is self else contextlib.nullcontext()

    def start_thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A started host thread whose accesses are observed; its start is ordered before
        its first op, and its last op before a ``join`` of it."""
        thread = _ObservedThread(self, target, name)
        thread.start()
        return thread

    def queue(self) -> CheckedQueue:
        return CheckedQueue(self)

    # -- accesses ---------------------------------------------------------------------------

    def tag_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is host memory (``runtime.host_empty``, pinned buffers)."""
        extent = _extent(tensor)
        if extent is not None:
            with self._lock:
                self._storage(tensor, extent[0]).host = True

    def _storage(self, tensor: torch.Tensor, key: int) -> _Storage:
        record = self._storages.get(key)
        if record is None:
            record = self._storages[key] = _Storage()
            weakref.finalize(tensor.untyped_storage(), self._freed_now, key)
        return record

    def _freed_now(self, key: int) -> None:
        """A storage's last reference died (in whichever thread, possibly inside this
        checker): note who freed it and what every stream named by ``used_on`` had been
        given by then; :meth:`_judge_frees` judges it at the next access."""
        with self._lock:
            record = self._storages.get(key)
            if record is None or record.host or record.allocated_by is None:
                self._freed.append((key, {}, None))
                return
            clock = dict(record.allocated_by.clock)  # stream-ordered: after its own work
            agent = _thread.agent if _thread.checker is self else None
            if agent is not None:
                _join(clock, agent.clock)
            for other in self._agents:
                if other.id in record.used_on:
                    _join(clock, other.clock)  # the allocator waits for these streams' work
            self._freed.append((key, clock, agent))

    def _agent_for(
        self, inputs: Sequence[torch.Tensor], extent_of: Callable[[torch.Tensor], Extent | None] = _extent
    ) -> _Agent:
        """Who runs an op on ``inputs`` issued by the calling thread (see [Note: what the
        checker models]); a stream's clock is brought up to what the thread has seen."""
        thread = self._thread_agent()
        if _thread.host:
            return thread
        keys = [extent[0] for extent in map(extent_of, inputs) if extent is not None]
        if keys and all(key in self._storages and self._storages[key].host for key in keys):
            return thread  # no kernel runs on host buffers alone: host code
        stream = self.current_stream().agent
        _join(stream.clock, thread.clock)
        return stream

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        plan = aten_access.op_plan(func)
        if plan.is_view:
            return  # a view: no data is touched
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        # What the host ledger counts as read and as written (an update in place is both).
        counted: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for position, name, role in plan.arguments:
            tensors = aten_access.tensors(args[position] if position < len(args) else kwargs.get(name))
            if role == aten_access.READ:
                reads += tensors
                counted[0].extend(tensors)
                continue
            writes += tensors
            if role != aten_access.OVERWRITTEN:  # read-only mutables, and updates: the old values are read
                counted[0].extend(tensors)
            if role != aten_access.READ_ONLY_MUTABLE:
                counted[1].extend(tensors)
        if plan.returns_alias and not writes:
            return  # a view: no data is touched
        outputs = out if plan.many_returns else (out,)
        fresh = [t for index in plan.fresh_returns for t in aten_access.tensors(outputs[index])]
        if plan.allocates:
            self._allocated(fresh)  # uninitialised memory: nothing is read or written yet
            return
        agent = self._access(reads, writes, fresh, plan.name, (counted[0], counted[1] + fresh))
        if func is torch.ops.aten._local_scalar_dense.default and agent.is_stream:
            self._host_waits(agent.clock)  # .item(): the host waits for the stream to get there

    def declare(
        self,
        reads: Iterable[torch.Tensor],
        writes: Iterable[torch.Tensor],
        what: str,
        updates: Iterable[torch.Tensor] = (),
    ) -> None:
        """Accesses that bypass aten (see :func:`declare_access`)."""
        reads, writes, updates = list(reads), list(writes), list(updates)
        self._access(reads, writes + updates, [], what, (reads + updates, writes + updates))

    def _allocated(self, fresh: list[torch.Tensor]) -> None:
        with self._lock:
            self._judge_frees()
            self._new_memory(fresh, self._agent_for([]))

    def _new_memory(
        self, fresh: list[torch.Tensor], agent: _Agent, extent_of: Callable[[torch.Tensor], Extent | None] = _extent
    ) -> None:
        """``fresh`` was allocated by ``agent``: on a stream (device memory), or host memory."""
        for tensor in fresh:
            extent = extent_of(tensor)
            if extent is not None:
                record = self._storage(tensor, extent[0])
                if not record.accesses:
                    record.host, record.allocated_by = not agent.is_stream, agent if agent.is_stream else None

    def _access(
        self,
        reads: list[torch.Tensor],
        writes: list[torch.Tensor],
        fresh: list[torch.Tensor],
        what: str,
        counted: tuple[list[torch.Tensor], list[torch.Tensor]],
    ) -> _Agent:
        """Check one op's accesses, and count ``counted`` (read, written) in the ledger."""
        with self._lock:
            self._judge_frees()
            known: dict[int, Extent | None] = {}  # each tensor's extent, taken once

            def extent_of(tensor: torch.Tensor) -> Extent | None:
                if id(tensor) not in known:  # every tensor of the op is alive: ids are unique
                    known[id(tensor)] = _extent(tensor)
                return known[id(tensor)]

            agent = self._agent_for(reads + writes, extent_of)
            tick = agent.tick()
            self._new_memory(fresh, agent, extent_of)
            where = None
            for tensors, is_write in ((reads, False), (writes + fresh, True)):
                for tensor in tensors:
                    extent = extent_of(tensor)
                    if extent is None:
                        continue
                    where = where or f"{what} at {aten_access.call_site(1)}"
                    access = _Access(extent[1], extent[2], is_write, agent, tick, where, (tensor.dtype, tensor.shape))
                    self._check(self._storage(tensor, extent[0]), access, agent.clock)
            self.ledger.count(
                *counted, on_stream=agent.is_stream, host_extent=lambda t: self._host_extent(t, extent_of)
            )
            return agent

    def _host_extent(
        self, tensor: torch.Tensor, extent_of: Callable[[torch.Tensor], Extent | None] = _extent
    ) -> int | None:
        """The bytes ``tensor`` spans if its storage is host memory, else ``None``."""
        extent = extent_of(tensor)
        if extent is None:
            return None
        record = self._storages.get(extent[0])
        return extent[2] - extent[1] if record is not None and record.host else None

    def _check(self, record: _Storage, access: _Access, clock: Clock) -> None:
        self.num_accesses += 1
        kept: list[_Access] = []
        for earlier in record.accesses:
            overlaps = earlier.start < access.end and access.start < earlier.end
            if (
                overlaps
                and earlier.agent is not access.agent
                and (earlier.is_write or access.is_write)
                and clock.get(earlier.agent.id, 0) < earlier.tick
            ):
                self._race(earlier, access)
            superseded = overlaps and access.is_write and access.start <= earlier.start and earlier.end <= access.end
            same = (
                earlier.agent is access.agent
                and earlier.is_write == access.is_write
                and (earlier.start, earlier.end) == (access.start, access.end)
            )
            if not (superseded or same):
                kept.append(earlier)
        kept.append(access)
        record.accesses = kept

    def _judge_frees(self) -> None:
        """A freed device storage is a write, at the freeing point, on its allocating stream."""
        while self._freed:
            key, clock, thread = self._freed.pop(0)
            record = self._storages.pop(key, None)
            if record is None or record.host or record.allocated_by is None:
                continue
            stream = record.allocated_by
            by = thread.describe() if thread is not None else "an unobserved thread"
            free = _Access(
                0,
                1 << 62,
                True,
                stream,
                clock.get(stream.id, 0),
                f"the free of its memory (last reference dropped by {by})",
            )
            for earlier in record.accesses:
                if earlier.agent is not stream and clock.get(earlier.agent.id, 0) < earlier.tick:
                    self._race(
                        earlier,
                        free,
                        hint="name the stream with runtime.used_on(tensor, stream) "
                        "(record_stream) before the last reference goes",
                    )

    def _race(self, earlier: _Access, later: _Access, hint: str | None = None) -> None:
        message = (
            f"stream race: {later.describe()}\n  is not ordered after {earlier.describe()}\n"
            f"  ({hint or 'add the wait that orders them: stream.wait_event(event), event.synchronize() or a handoff'})"
        )
        self.races.append(message)
        raise StreamRaceError(message)


def active() -> StreamChecker | None:
    """The checker observing the calling thread, if any."""
    return _thread.checker


def declare_access(
    reads: Iterable[torch.Tensor] = (),
    writes: Iterable[torch.Tensor] = (),
    *,
    what: str,
    updates: Iterable[torch.Tensor] = (),
) -> None:
    """Tell the checker observing this thread (if any) of accesses no aten op performs:
    a C++ kernel reading or writing tensors through raw pointers, file I/O into host
    buffers. ``updates`` are read and written in place (writes for the checker; both for
    the host ledger). A no-op when nothing is checked."""
    checker = _thread.checker
    if checker is not None:
        checker.declare(reads, writes, what, updates)
