"""The host ledger (``megatrain_ds/runtime/host_ledger.py``): what it counts, and the engine's budget.

The unit tests run known op sequences under the race checker and compare the ledger with
byte counts written out by hand from the ops' definitions ([Note: what the host ledger
counts]): they are exact, since every op touches whole tensors of known sizes.

The engine test measures a tiny Llama's step (bf16 compute, clipping 1.0, no
accumulation) and holds it to the host-traffic budget of issue 42, derived in
:func:`test_bf16_clipped_step_within_host_budget`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.optimizer.pipelined_finish import PipelinedFinish
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.runtime.host_ledger import HostLedger, LedgerCounts
from megatrain_ds.runtime.stream_check import declare_access

N = 1000
"""Elements of the test buffers."""


@pytest.fixture
def runtime(stream_check, cpu_single_thread) -> DeviceRuntime:
    """A CPU runtime under the race checker (the ledger comes with it)."""
    return DeviceRuntime.create(torch.device("cpu"))


def _counted(runtime: DeviceRuntime, work) -> LedgerCounts:
    """What the ledger counts of ``work()`` run on the calling thread under the checker."""
    ledger = runtime.host_ledger
    assert ledger is not None
    before = ledger.totals
    with runtime.observe():
        work()
    return ledger.totals - before


def test_host_ops_count_inputs_read_outputs_written_updates_both(runtime):
    """``a += b`` reads a and b and writes a; ``copy_`` from bf16 reads 2 B and writes 4 B
    per element; a norm reads its input and writes its 4-byte result."""
    a, b = runtime.host_empty(N, torch.float32), runtime.host_empty(N, torch.float32)
    half = runtime.host_empty(N, torch.bfloat16)

    def work():
        with runtime.host_work():
            a.fill_(1.0)  # overwrites: written only
            b.fill_(2.0)
            half.fill_(0.5)
            a.add_(b)
            a.copy_(half)
            torch.linalg.vector_norm(a, dtype=torch.float32)

    counts = _counted(runtime, work)
    assert counts.host_written_bytes == 4 * N + 4 * N + 2 * N + 4 * N + 4 * N + 4
    assert counts.host_read_bytes == 8 * N + 2 * N + 4 * N
    assert counts.host_ops == 6
    assert counts.copy_bytes == 0


def test_broadcast_input_counts_its_bytes_once(runtime):
    a, scalar = runtime.host_empty(N, torch.float32), runtime.host_empty(1, torch.float32)

    def work():
        with runtime.host_work():
            a.mul_(scalar.expand(N))

    counts = _counted(runtime, work)
    assert (counts.host_read_bytes, counts.host_written_bytes) == (4 * N + 4, 4 * N)


def test_copies_on_streams_count_their_host_side_and_device_work_nothing(runtime):
    """A device-to-host copy writes its host bytes, a host-to-device copy reads them,
    and compute on device buffers (the model standing for the GPU) is not counted."""
    host = runtime.host_empty(N, torch.bfloat16)
    device = runtime.device_empty(N, torch.bfloat16)

    def work():
        device.fill_(1.0)  # compute stream, device memory
        device.mul_(3.0)
        computed, copied = runtime.event(), runtime.event()
        computed.record(runtime.compute_stream())
        with runtime.on(runtime.d2h_stream):
            runtime.d2h_stream.wait_event(computed)  # the copy reads finished values
            host.copy_(device)
            copied.record(runtime.d2h_stream)
        with runtime.on(runtime.h2d_stream):
            runtime.h2d_stream.wait_event(copied)  # both copies touch both buffers
            device.copy_(host)

    counts = _counted(runtime, work)
    assert counts == LedgerCounts(copy_written_bytes=2 * N, copy_read_bytes=2 * N)


def test_fused_adamw_reads_its_gradient_only(runtime):
    """ATen's fused AdamW updates param, m and v (read and written) and reads the gradient,
    though its schema marks the gradients mutable."""
    param, grad, m, v = (runtime.host_empty(N, torch.float32) for _ in range(4))
    step = torch.tensor(1.0)  # not host state (made outside the checker): not counted

    def work():
        with runtime.host_work():
            for tensor in (param, grad, m, v):
                tensor.zero_()
            torch._fused_adamw_(  # pyright: ignore[reportPrivateImportUsage]
                [param],
                [grad],
                [m],
                [v],
                [],
                [step],
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.0,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            )

    counts = _counted(runtime, work)
    assert counts.host_read_bytes == 16 * N
    assert counts.host_written_bytes == 4 * 4 * N + 12 * N
    assert counts.host_ops == 5


def test_declared_kernel_counts_updates_as_read_and_written(runtime):
    """DeepSpeed's kernel as ``cpu_adam.py`` declares it: 28 B per element with bf16
    gradients and shadow (master, m, v: 4 B read + 4 B written each; gradient 2 read; shadow 2 written)."""
    master, m, v = (runtime.host_empty(N, torch.float32) for _ in range(3))
    grad, shadow = runtime.host_empty(N, torch.bfloat16), runtime.host_empty(N, torch.bfloat16)

    def work():
        with runtime.host_work():
            declare_access(reads=(grad,), writes=(shadow,), updates=(master, m, v), what="a kernel")

    counts = _counted(runtime, work)
    assert counts.host_bytes == 28 * N
    assert counts.host_ops == 1


def test_close_step_returns_each_steps_own_counts():
    ledger = HostLedger()
    tensor = torch.zeros(N)

    def host(_tensor: torch.Tensor) -> int:
        return 4 * N

    ledger.count([tensor], [tensor], on_stream=False, host_extent=host)
    first = ledger.close_step()
    ledger.count([tensor], [], on_stream=True, host_extent=host)
    ledger.count([tensor], [], on_stream=False, host_extent=lambda _t: None)  # device memory: nothing
    second = ledger.close_step()
    assert first == LedgerCounts(host_read_bytes=4 * N, host_written_bytes=4 * N, host_ops=1)
    assert second == LedgerCounts(copy_read_bytes=4 * N)
    assert ledger.steps == [first, second]
    assert second.per_param(N)["copy_bytes"] == 4.0


def test_bf16_clipped_step_within_host_budget(stream_check, cpu_single_thread, tmp_path):
    """Issue 42's budget: a bf16 step with clipping and no accumulation costs the host at
    most 36 bytes per parameter.

    Derivation, from the code: AdamW is one pass of DeepSpeed's kernel over each state
    (``optimizer/cpu_adam.py``): fp32 master, m and v read and written (24 B), the held bf16
    gradient read (2 B), the bf16 shadow written (2 B): 28 B. The copies: each block's
    bf16 weights cross twice (forward, and backward's recompute): 4 B read; each bf16
    gradient crosses once, written straight into the held gradients: 2 B. That is 34 B;
    the 2 B left cover what scales with the tokens or the resident parameters (activation
    checkpoints parked on the host, the resident weights' refresh: 0.5 B on this model).
    Anything more per gradient -- a staging buffer summed into the held gradients
    (6 B), their zeroing (2 B), a host norm (2 B) -- breaks it. On the code of
    2026-11-27 (staged copies, host norms, zeroing) it measured 44.3 B/param.

    The same run checks that the trace carries each step's ledger, equal to the engine's.
    Steps 3 and 4 are the steady ones: the first step speculates on the journal (the last
    block's trailing elements, ``optimizer/journal.py``), clipping refutes it, and its restore
    is counted with the second step; after a clipped step the predictor waits for the norm.
    """
    trace = tmp_path / "trace.json"
    torch.manual_seed(0)
    config = ds_config(bf16=True, clipping=1.0, megatrain={"trace": str(trace), "trace_steps": 3})
    engine = MegatrainEngine(tiny_models.llama(num_layers=4), parse_engine_config(config), device=torch.device("cpu"))
    try:
        for step in range(4):
            engine.backward(engine(**tiny_models.make_batch(step)).loss)
            engine.step()
        ledger = engine.runtime.host_ledger
        assert ledger is not None and len(ledger.steps) == 4
        steady = ledger.steps[-1]
        assert engine.last_host_ledger == steady
        assert ledger.steps[2] == steady  # the same work every steady step
        trained = sum(slot.numel for state in engine.states[: engine._resident_index] for slot in state.layout.slots)
    finally:
        engine.destroy()
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "step"]
    assert [span["args"]["host_ledger"]["traffic_bytes"] for span in spans] == [
        step.traffic_bytes for step in ledger.steps[1:]
    ]
    assert steady.host_bytes >= 28 * trained  # the AdamW pass over every block
    assert steady.copy_written_bytes >= 2 * trained  # every block's gradient crossed
    per_param = steady.traffic_bytes / engine.num_params
    assert per_param <= 36, f"host traffic {per_param:.1f} B/param per step: {steady.per_param(engine.num_params)}"


SMALL_BENCH = "--hidden 64 --intermediate 128 --layers 3 --vocab 64 --block-ms 5 --steps 2 --no-ledger"
"""``bench/host_pipeline.py`` on a Llama of 3 blocks (4 states with the resident one)."""


def _host_pipeline_bench(monkeypatch):
    """``bench/host_pipeline.py`` imported as a module (its ``main`` takes the arguments)."""
    bench = Path(__file__).parents[1] / "bench"
    spec = importlib.util.spec_from_file_location("host_pipeline", bench / "host_pipeline.py")
    assert spec is not None and spec.loader is not None
    host_pipeline = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "host_pipeline", host_pipeline)  # its dataclasses look it up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the bench puts bench/ first: not for later tests
    spec.loader.exec_module(host_pipeline)
    return host_pipeline


def test_host_pipeline_bench_runs(cpu_single_thread, tmp_path, monkeypatch):
    """``bench/host_pipeline.py`` on a small Llama: its figures add up (the step holds the
    busy loops of every block, the critical path is what is left of it) and the JSON
    records the settings it ran with."""
    host_pipeline = _host_pipeline_bench(monkeypatch)
    out = tmp_path / "result.json"
    result = host_pipeline.main([*SMALL_BENCH.split(), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["settings"]["layers"] == 3 and result["settings"]["block_ms"] == 5.0
    for step in result["steps"]:
        assert step["compute_s"] >= 3 * 5e-3  # every block's busy loop ran
        assert step["step_s"] >= step["compute_s"] + step["push_blocked_s"] + step["finish_s"]
    assert result["host_critical_path_s"] == pytest.approx(result["step_s"] - result["compute_s"])
    assert 0 <= result["push_blocked_fraction"] < 1
    assert result["worker_elements_per_s"]["alone"] > 0 and result["plain_copy_elements_per_s"] > 0


def test_host_pipeline_bench_does_not_count_the_update_behind_step_as_backward(
    cpu_single_thread, tmp_path, monkeypatch
):
    """With clipping the step's update runs behind ``engine.step()`` and the next forward
    waits for it (``optimizer/pipelined_finish.py``); the bench runs no forward, so it waits
    for the update before each step's backward and reports that wait apart. Made slow here
    (``SLOW`` per state, 4 states), the update must show in ``update_wait_s`` and not in the
    time backward is blocked in ``push``, whose pushes of this tiny model take milliseconds:
    before the bench waited, the first push of each step waited for the whole update
    (``engine._land_gradient`` settles it), 4 * SLOW less the 5 ms busy loop before it."""
    slow = 0.05
    original_start = PipelinedFinish.start

    def slow_start(self, order, update):
        def slowed(index: int) -> None:
            time.sleep(slow)  # on the finish worker
            update(index)

        original_start(self, order, slowed)

    monkeypatch.setattr(PipelinedFinish, "start", slow_start)
    host_pipeline = _host_pipeline_bench(monkeypatch)
    result = host_pipeline.main([*SMALL_BENCH.split(), "--out", str(tmp_path / "result.json")])
    for step in result["steps"]:
        assert step["push_blocked_s"] < 2 * slow, step  # backward never waited for the update
        assert step["update_wait_s"] >= 3 * slow  # which ran behind step(): 4 states, less slack
