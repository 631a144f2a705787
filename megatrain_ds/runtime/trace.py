"""Chrome/Perfetto traces of the copy streams, compute and the optimizer worker.

``"megatrain": {"trace": "PATH.json", "trace_steps": N}`` traces N optimizer steps after
one warm-up step and writes them as Chrome trace-event JSON (``{"traceEvents": [...]}``,
one complete ("X") event per span, one thread id per track) that https://ui.perfetto.dev
and chrome://tracing open; ``bench/timeline.py`` draws one step of it. Tracks (:data:`TRACKS`):

- ``step``: each traced optimizer step, from its first forward to ``engine.step()`` (host);
  with the race checker on (``MEGATRAIN_STREAM_CHECK=1``) its args carry the step's
  ``host_ledger``: host bytes read and written by host threads, host bytes the copies
  move, host ops, and each per parameter (``runtime/host_ledger.py``);
- ``compute``: each block's forward, recompute and backward (compute stream);
- ``h2d``: each block's weight copy (host-to-device stream);
- ``d2h``: gradient copies (device-to-host stream);
- ``stash``: stashed blocks' activations going to the host after their forward
  (``stash i``, d2h stream) and coming back before their backward (``unstash i``, h2d
  stream), with their ``bytes`` (``streaming/activation_stash.py``; on the CPU nothing
  is copied and the spans are the bookkeeping alone);
- ``comm``: data-parallel collectives;
- ``optimizer worker``: the gradient worker consuming each chunk (accumulate, norm,
  speculative AdamW), each AdamW range, and the step finish (main thread, worker drained);
- ``nvme read``, ``nvme write``: the NVMe tier's swap transfers on its I/O threads (a
  block's m and v, and fp32 master with bf16 compute, with the bytes and the I/O engine);
  ``nvme wait``: a training thread waiting for one (``state/nvme_window.py``).

Every span's args carry the ``step`` it belongs to, so a step's device work that runs on
after the host has moved on is still found.

[Note: trace clocks]
Host spans (:meth:`Tracer.span`) read ``time.perf_counter_ns`` when they open and close.
Device spans (:meth:`Tracer.device_span`) record a timing event on the stream the work is
issued to before and after it; the device stamps them when it gets there, so a copy's
span is when the copy ran, not when the host queued it (a span therefore starts only once
the stream's earlier waits are satisfied). :meth:`Tracer.spans` synchronizes and reads
each event relative to the *anchor*, an event recorded on an idle device at a known host
time (``DeviceRuntime.clock_anchor``), giving host-clock times for every span. On the CPU
the events are host clocks read at ``record``: CPU work is done when issued.

New work is traced where it is issued, from any thread (e.g. the data-parallel reduction)::

    with runtime.tracer.span(f"reduce {block}", "comm", block=block):  # host time
        ...
    with runtime.tracer.device_span(f"reduce {block}", "comm", runtime.comm_stream, block=block):
        ...  # work queued on comm_stream, timed by the device

(pass the stream from threads other than the compute thread: the default is the calling
thread's current stream).

Tracing off costs nothing on the hot path: ``DeviceRuntime.tracer`` is then
:data:`NULL_TRACER`, whose methods return one shared no-op context. :class:`TraceSchedule`
installs a :class:`Tracer` on the runtime for the traced steps only, and writes the file
(temporary file, then rename) when they are done or at ``engine.destroy()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatrain_ds.config import EngineConfig

logger = logging.getLogger(__name__)

TRACKS = ("step", "compute", "h2d", "d2h", "stash", "comm", "optimizer worker", "nvme read", "nvme write", "nvme wait")
"""Known tracks, in display order; a span may name any other track (shown after these)."""

DEFAULT_TRACE_STEPS = 3
WARMUP_STEPS = 1
"""Untraced steps first: the first step pays one-off costs (allocator growth, JIT builds)."""

_PID = 1
_NO_SPAN: AbstractContextManager[None] = contextlib.nullcontext()


class Anchor(Protocol):
    """An event whose host-clock time is known (``ClockAnchor`` of the runtime)."""

    @property
    def host_ns(self) -> int: ...  # read only: the runtime's anchor is frozen


class ClockEvent(Protocol):
    """A timing event that can say when the device reached it, in host-clock nanoseconds."""

    def record(self, stream: object = None) -> None: ...

    def host_ns(self, anchor: Any) -> int: ...


class TracedDevice(Protocol):
    """What tracing needs of the device (``DeviceRuntime`` is one; this module sits below
    the runtime, which installs a tracer on itself)."""

    tracer: NullTracer | Tracer

    @property
    def device_name(self) -> str: ...

    def compute_stream(self) -> object: ...

    def clock_event(self) -> ClockEvent: ...

    def clock_anchor(self) -> Anchor: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Span:
    """One traced interval; times are host-clock ``perf_counter_ns``."""

    name: str
    track: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]


class NullTracer:
    """Tracing off: every method does nothing."""

    enabled = False
    step: int | None = None

    def span(self, name: str, track: str, **args: Any) -> AbstractContextManager[None]:
        return _NO_SPAN

    def device_span(self, name: str, track: str, stream: object = None, **args: Any) -> AbstractContextManager[None]:
        return _NO_SPAN


NULL_TRACER = NullTracer()


class Tracer:
    """Records spans of host and device work (see [Note: trace clocks]).

    Safe to call from several threads (the main thread, autograd's, the gradient worker,
    a communication thread): spans are appended to lists, which the GIL keeps whole.

    Args:
        runtime: where device timing events and the clock anchor come from.
    """

    enabled = True

    def __init__(self, runtime: TracedDevice) -> None:
        self._runtime = runtime
        self._anchor = runtime.clock_anchor()
        self._host: list[Span] = []
        self._device: list[tuple[str, str, Any, Any, dict[str, Any]]] = []
        self.step: int | None = None
        """The optimizer step spans are attributed to (``None`` outside steps)."""
        self._step_start_ns = 0

    @property
    def origin_ns(self) -> int:
        """Host time of the anchor: time 0 of the written trace."""
        return self._anchor.host_ns

    def _args(self, args: dict[str, Any]) -> dict[str, Any]:
        # A span that names its step (work queued during a step, run by a thread after the
        # step has ended) keeps it.
        return args if self.step is None or "step" in args else {**args, "step": self.step}

    @contextlib.contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        """Time the enclosed host work on ``track``."""
        args = self._args(args)
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self._host.append(Span(name, track, start, time.perf_counter_ns(), args))

    @contextlib.contextmanager
    def device_span(self, name: str, track: str, stream: object = None, **args: Any) -> Iterator[None]:
        """Time the device work the enclosed code issues on ``stream`` (default: the
        compute stream); resolved when the trace is read (see [Note: trace clocks])."""
        args = self._args(args)
        stream = self._runtime.compute_stream() if stream is None else stream
        start = self._runtime.clock_event()
        start.record(stream)
        try:
            yield
        finally:
            end = self._runtime.clock_event()
            end.record(stream)
            self._device.append((name, track, start, end, args))

    def add(self, name: str, track: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Record a span measured elsewhere (host-clock ``perf_counter_ns``)."""
        self._host.append(Span(name, track, start_ns, end_ns, self._args(args)))

    def begin_step(self, step: int) -> None:
        """Spans from now on belong to optimizer step ``step`` (repeat calls are no-ops)."""
        if self.step != step:
            self.step = step
            self._step_start_ns = time.perf_counter_ns()

    def end_step(self, **args: Any) -> None:
        """The step's host work is done: record its span on the ``step`` track, with ``args``."""
        if self.step is not None:
            self._host.append(
                Span(
                    f"step {self.step}",
                    "step",
                    self._step_start_ns,
                    time.perf_counter_ns(),
                    {"step": self.step, **args},
                )
            )
        self.step = None

    def spans(self) -> list[Span]:
        """Every span so far, by start time (synchronizes the device to read its events)."""
        self._runtime.synchronize()
        device = [
            Span(name, track, start.host_ns(self._anchor), end.host_ns(self._anchor), args)
            for name, track, start, end, args in self._device
        ]
        return sorted(self._host + device, key=lambda span: (span.start_ns, -span.end_ns))

    def chrome_trace(self, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Chrome trace-event document: microseconds since the anchor, one tid per track."""
        spans = self.spans()
        tracks = list(TRACKS) + sorted({s.track for s in spans} - set(TRACKS))
        tid = {track: index + 1 for index, track in enumerate(tracks)}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": _PID, "tid": 0, "args": {"name": "megatrain"}}
        ]
        for track in tracks:
            events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid[track], "args": {"name": track}})
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": _PID,
                    "tid": tid[track],
                    "args": {"sort_index": tid[track]},
                }
            )
        for span in spans:
            events.append(
                {
                    "name": span.name,
                    "cat": span.track,
                    "ph": "X",
                    "pid": _PID,
                    "tid": tid[span.track],
                    "ts": (span.start_ns - self.origin_ns) / 1e3,
                    "dur": max(span.end_ns - span.start_ns, 0) / 1e3,
                    "args": span.args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}

    def write(self, path: str | os.PathLike[str], metadata: dict[str, Any] | None = None) -> Path:
        """Write :meth:`chrome_trace` to ``path`` atomically (a reader never sees half a file)."""
        path = Path(path)
        document = self.chrome_trace(metadata)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps(document, separators=(",", ":")) + "\n", encoding="utf-8")
            temp.replace(path)
        finally:
            temp.unlink(missing_ok=True)
        return path


class TraceSchedule:
    """Which optimizer steps are traced, and writing the trace when they are done.

    The engine calls :meth:`before_forward` with the number of optimizer steps finished so
    far, :meth:`after_step` with the step it just finished, and :meth:`close` when it is
    destroyed. ``num_steps`` steps are traced after ``WARMUP_STEPS`` steps counted from the
    first forward (a run resumed from a checkpoint starts at its restored step).

    Args:
        runtime: whose ``tracer`` is swapped in for the traced steps and out afterwards.
        path: the JSON file; ``None`` traces nothing.
        num_steps: optimizer steps to trace.
        metadata: written as the trace's ``otherData`` (model, device, settings).
    """

    def __init__(
        self,
        runtime: TracedDevice,
        path: str | os.PathLike[str] | None,
        num_steps: int,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._runtime = runtime
        self.path = Path(path) if path is not None else None
        self.num_steps = num_steps
        self.metadata = dict(metadata or {})
        self.tracer: Tracer | None = None
        self.written = False
        self._first_step: int | None = None
        self.before_write: Callable[[], None] | None = None
        """Called before the trace is written (the engine lets an update running behind
        ``engine.step()`` land first, so that its spans are in the file)."""

    @classmethod
    def for_run(cls, runtime: TracedDevice, config: EngineConfig, model: str, rank: int | None) -> TraceSchedule:
        """``"megatrain": {"trace": ...}`` of a run of ``model`` (a class name); with data
        parallel (``rank`` given) one file per rank: ``NAME.rankR.json``."""
        path = config.options.trace
        if path is not None and rank is not None:
            path = Path(path).with_name(f"{Path(path).stem}.rank{rank}{Path(path).suffix}")
        metadata = {
            "model": model,
            "bf16": config.bf16,
            "micro_batch": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "rank": rank or 0,
        }
        return cls(runtime, path, config.options.trace_steps, metadata)

    def _traced(self, step: int) -> bool:
        first = (self._first_step or 0) + WARMUP_STEPS
        return first <= step < first + self.num_steps

    def before_forward(self, step: int) -> None:
        if self._first_step is None:
            self._first_step = step
        if self.path is None or self.written or not self._traced(step):
            return
        if self.tracer is None:
            self.tracer = Tracer(self._runtime)
        self._runtime.tracer = self.tracer
        self.tracer.begin_step(step)

    def after_step(self, step: int, **step_args: Any) -> None:
        """Step ``step`` is finished; ``step_args`` go on its span (its host ledger)."""
        if self.tracer is None or self.written or self.tracer.step != step:
            return
        self.tracer.end_step(**step_args)
        if not self._traced(step + 1):
            self.close()

    def close(self) -> None:
        """Stop tracing and write what was traced (once; nothing if no step was traced)."""
        if self.tracer is None or self.written or self.path is None:
            return
        if self.before_write is not None:
            self.before_write()
        self._runtime.tracer = NULL_TRACER
        self.written = True
        metadata = {
            **self.metadata,
            "device": self._runtime.device_name,
            "warmup_steps": WARMUP_STEPS,
            "trace_steps": self.num_steps,
        }
        self.tracer.write(self.path, metadata)
        logger.info(
            "megatrain: wrote a trace of %d step(s) to %s (open it at https://ui.perfetto.dev "
            "or draw a step with bench/timeline.py)",
            self.num_steps,
            self.path,
        )
