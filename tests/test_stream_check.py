"""The race checker's rules, one primitive at a time (``megatrain_ds/runtime/stream_check.py``).

Each test builds the pattern the engine uses -- a copy on a side stream into a buffer
another stream computes on, a host thread reading staging a stream wrote, a buffer freed
while another stream still uses it -- once without the synchronisation (the checker must
raise) and once with it (it must not). What the engine as a whole does under the checker
is tested in ``tests/test_stream_ordering.py``.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from megatrain_ds.runtime.device_runtime import DeviceRuntime, NullStream
from megatrain_ds.runtime.stream_check import StreamRaceError, declare_access


@pytest.fixture
def runtime(stream_check: None) -> DeviceRuntime:
    return DeviceRuntime.create(torch.device("cpu"))


def _upload(runtime: DeviceRuntime, host: torch.Tensor, wait: bool) -> torch.Tensor:
    """``host`` copied to a new "device" buffer on the h2d stream, as the weight streamer does."""
    device = runtime.device_empty(host.numel(), host.dtype)
    arrived = runtime.event()
    with runtime.on(runtime.h2d_stream):
        device.copy_(host, non_blocking=True)
        arrived.record(runtime.h2d_stream)
    if wait:
        runtime.compute_stream().wait_event(arrived)
    runtime.used_on(device, runtime.h2d_stream)
    return device


def test_without_the_variable_the_cpu_runtime_hands_out_no_op_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGATRAIN_STREAM_CHECK", raising=False)
    runtime = DeviceRuntime.create(torch.device("cpu"))
    assert runtime.checker is None and isinstance(runtime.h2d_stream, NullStream)
    assert runtime.shares_host_memory


def test_with_it_streams_are_checked_and_device_memory_is_apart(runtime: DeviceRuntime) -> None:
    assert runtime.checker is not None and not runtime.shares_host_memory
    names = {
        stream.agent.name
        for stream in (
            runtime.h2d_stream,
            runtime.d2h_stream,
            runtime.optimizer_stream,
            runtime.comm_stream,
            runtime.compute_stream(),
        )
    }
    assert names == {"h2d", "d2h", "optimizer", "comm", "compute"}


def test_compute_reading_an_upload_without_waiting_is_a_race(runtime: DeviceRuntime) -> None:
    host = runtime.host_empty(64, torch.float32)
    with runtime.observe():
        host.fill_(1.0)
        device = _upload(runtime, host, wait=False)
        with pytest.raises(StreamRaceError) as caught:
            device.sum()
    message = str(caught.value)
    # Both accesses named: op, stream, shape and the call site in this file.
    assert "aten.sum" in message and "stream 'compute'" in message
    assert "aten.copy_" in message and "stream 'h2d'" in message
    assert "float32[64]" in message and "test_stream_check.py" in message


def test_waiting_on_the_upload_event_orders_it(runtime: DeviceRuntime) -> None:
    host = runtime.host_empty(64, torch.float32)
    with runtime.observe():
        host.fill_(1.0)
        device = _upload(runtime, host, wait=True)
        assert float(device.sum()) == 64.0
    assert runtime.checker.races == [] and runtime.checker.num_accesses > 0


def test_wait_stream_orders_everything_issued_so_far(runtime: DeviceRuntime) -> None:
    with runtime.observe():
        device = runtime.device_empty(8, torch.float32)
        with runtime.on(runtime.h2d_stream):
            device.fill_(2.0)
        runtime.compute_stream().wait_stream(runtime.h2d_stream)
        device.mul_(3.0)
        with runtime.on(runtime.d2h_stream), pytest.raises(StreamRaceError):
            device.add_(1.0)  # d2h never waited for the compute stream's mul_


def test_overwriting_a_buffer_another_stream_still_reads_is_a_race(runtime: DeviceRuntime) -> None:
    """The weight streamer's reuse of a slot: the next upload must wait for the last reader."""
    host = runtime.host_empty(32, torch.float32)
    with runtime.observe():
        host.fill_(1.0)
        device = _upload(runtime, host, wait=True)
        device.sum()  # the compute stream reads the slot
        with runtime.on(runtime.h2d_stream), pytest.raises(StreamRaceError) as caught:
            device.copy_(host, non_blocking=True)  # no wait on a "slot free" event
    assert "is not ordered after read by stream 'compute'" in str(caught.value)


def test_reads_never_race_and_disjoint_bytes_of_one_buffer_do_not_either(runtime: DeviceRuntime) -> None:
    with runtime.observe():
        device = runtime.device_empty(16, torch.float32)
        device.fill_(1.0)
        with runtime.on(runtime.h2d_stream), pytest.raises(StreamRaceError):
            device.sum()  # unordered read after the compute stream's write
        runtime.h2d_stream.wait_stream(runtime.compute_stream())
        with runtime.on(runtime.h2d_stream):
            device.sum()
        device.sum()  # two reads, unordered: fine
        runtime.d2h_stream.wait_stream(runtime.compute_stream())
        runtime.d2h_stream.wait_stream(runtime.h2d_stream)  # h2d read it too
        with runtime.on(runtime.d2h_stream):
            device[:8].zero_()
        runtime.compute_stream().wait_stream(runtime.h2d_stream)  # but not for d2h
        device[8:].add_(1.0)  # the other half: no overlap with d2h's write
        with pytest.raises(StreamRaceError):
            device[7:9].add_(1.0)  # overlaps d2h's write by one element


def test_a_host_thread_reading_staging_needs_the_host_to_wait_for_the_copy(runtime: DeviceRuntime) -> None:
    """The gradient sink's pattern: d2h copies into host staging, a worker thread reads it."""
    staging = runtime.host_empty(16, torch.float32)
    errors: list[BaseException] = []

    def read_staging(done: object | None) -> None:
        try:
            if done is not None:
                done.synchronize()  # type: ignore[attr-defined]
            staging.sum()
        except BaseException as error:
            errors.append(error)

    for wait in (False, True):
        errors.clear()
        with runtime.observe():
            device = runtime.device_empty(16, torch.float32)
            device.fill_(1.0)
            copied = runtime.event()
            runtime.d2h_stream.wait_stream(runtime.compute_stream())
            with runtime.on(runtime.d2h_stream):
                staging.copy_(device, non_blocking=True)
                copied.record(runtime.d2h_stream)
            runtime.used_on(device, runtime.d2h_stream)
            worker = runtime.start_thread(lambda: read_staging(copied if wait else None), name="worker")
            worker.join()
        assert [type(error) for error in errors] == ([] if wait else [StreamRaceError]), errors


def test_host_threads_are_ordered_by_the_runtime_queue_and_not_otherwise(runtime: DeviceRuntime) -> None:
    buffer = runtime.host_empty(8, torch.float32)
    handoff = runtime.host_queue()
    outcome: list[str] = []
    unordered = threading.Event()

    def worker() -> None:
        handoff.get()
        buffer.add_(1.0)  # after the main thread's fill_: the queue ordered it
        handoff.task_done()
        unordered.wait()
        try:
            buffer.add_(1.0)  # races with the main thread's mul_ below
            outcome.append("no race")
        except StreamRaceError:
            outcome.append("race")

    with runtime.observe():
        buffer.fill_(1.0)
        thread = runtime.start_thread(worker, name="worker")
        handoff.put("go")
        handoff.join()
        buffer.mul_(2.0)  # after the worker's add_: join waited for its task_done
        unordered.set()
        thread.join()
    assert outcome == ["race"]
    assert buffer.tolist() == [5.0] * 8


def test_freeing_a_buffer_another_stream_used_counts_as_a_write(runtime: DeviceRuntime) -> None:
    host = runtime.host_empty(16, torch.float32)
    for name_the_stream in (False, True):
        runtime.checker.races.clear()
        with runtime.observe():
            device = runtime.device_empty(16, torch.float32)
            device.fill_(1.0)
            runtime.d2h_stream.wait_stream(runtime.compute_stream())
            with runtime.on(runtime.d2h_stream):
                host.copy_(device, non_blocking=True)
            if name_the_stream:
                runtime.used_on(device, runtime.d2h_stream)
            del device  # the caching allocator may hand the memory out again now
            if name_the_stream:
                torch.ones(4).sum()
            else:
                with pytest.raises(StreamRaceError) as caught:
                    torch.ones(4).sum()  # the free is judged at the next access
                assert "the free of its memory" in str(caught.value)
                assert "runtime.used_on" in str(caught.value)
    assert len(runtime.checker.races) == 0


def test_item_makes_the_host_wait_for_its_stream(runtime: DeviceRuntime) -> None:
    staging = runtime.host_empty(4, torch.float32)
    with runtime.observe():
        device = runtime.device_empty(4, torch.float32)
        device.fill_(1.0)
        runtime.d2h_stream.wait_stream(runtime.compute_stream())
        with runtime.on(runtime.d2h_stream):
            staging.copy_(device, non_blocking=True)
            runtime.d2h_stream.synchronize()  # the host waits for the d2h stream
        staging.add_(1.0)
        device.sum().item()  # the host reaches the compute stream's work too
        with runtime.host_work():
            device.add_(1.0)  # host code after .item(): ordered


def test_declared_accesses_of_non_aten_code_are_checked(runtime: DeviceRuntime) -> None:
    with runtime.observe():
        device = runtime.device_empty(8, torch.float32)
        with runtime.on(runtime.optimizer_stream):
            declare_access(writes=(device,), what="a kernel launched outside aten")
        with pytest.raises(StreamRaceError) as caught:
            device.sum()
    assert "a kernel launched outside aten" in str(caught.value)
    declare_access(writes=(device,), what="unobserved: a no-op")  # outside observe()


def test_synchronize_orders_the_host_after_every_stream(runtime: DeviceRuntime) -> None:
    staging = runtime.host_empty(8, torch.float32)
    with runtime.observe():
        for stream in (runtime.h2d_stream, runtime.d2h_stream, runtime.optimizer_stream):
            stream.wait_stream(runtime.compute_stream())  # outside on(): compute_stream() is the current one
            with runtime.on(stream):
                declare_access(writes=(staging,), what=f"a copy on {stream}")
            runtime.synchronize()
            with runtime.host_work():
                staging.zero_()


def test_every_test_named_for_a_checked_variant_exists() -> None:
    """A renamed test must not drop out of the race checker's runs unnoticed
    (``tests/conftest.py``: ``CHECKED_SUITES`` names tests by their function names; the
    collection there fails on a parameter id it names that no test has)."""
    here = Path(__file__).parent
    # Read, not imported: "conftest" is also integration_tests' module of that name.
    suites = next(
        node.value
        for node in ast.parse((here / "conftest.py").read_text()).body
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "CHECKED_SUITES"
    )
    assert isinstance(suites, ast.Dict) and suites.keys
    for module_key, tests in zip(suites.keys, suites.values):
        assert module_key is not None and isinstance(tests, ast.Dict) and tests.keys
        module = ast.literal_eval(module_key)
        names = {ast.literal_eval(key) for key in tests.keys if key is not None}
        tree = ast.parse((here / module).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert names <= defined, (module, names - defined)
