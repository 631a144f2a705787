"""Tracing (``"megatrain": {"trace": ...}``) and the batch-too-small-to-hide-transfers warning.

The trace is checked against facts the engine and the model state independently of the
tracer: the blocks the model has, the parameters each block trains, the weight copies
the streamer counted, and the order the schedule guarantees (a block's weights arrive
before it computes, its gradients leave after its backward, the worker consumes a
chunk after its copy). The warning is checked against the planner's formula
``T >= w * F / (4 * B)`` on hardware figures the test chooses.
"""

import importlib.util
import json
import logging
import math
from collections import defaultdict
from pathlib import Path

import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.config import ConfigError
from megatrain_ds.planning import transfer_hiding
from megatrain_ds.planning.planner import Hardware
from megatrain_ds.runtime import trace as trace_module
from megatrain_ds.runtime.device_runtime import ClockAnchor, CudaClockEvent, DeviceRuntime
from megatrain_ds.runtime.trace import NULL_TRACER, WARMUP_STEPS, Tracer

NUM_BLOCKS = 4
TRACED = 2

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def _train(engine, steps, batch_size=2):
    for step in range(steps):
        loss = engine(**tiny_models.make_batch(step, batch=batch_size)).loss
        engine.backward(loss)
        engine.step()


def _spans(path):
    """X events by track, with the track names the metadata gives each tid."""
    document = json.loads(Path(path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e.get("name") == "thread_name"}
    spans = defaultdict(list)
    for event in document["traceEvents"]:
        if event["ph"] == "X":
            spans[names[event["tid"]]].append(event)
    return document, spans


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """A tiny Llama trained WARMUP + TRACED + 1 steps with tracing on; the trace and what
    the engine itself counted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("trace") / "run.json"
    torch.manual_seed(0)
    model = tiny_models.llama(num_layers=NUM_BLOCKS)
    trained = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in model.model.layers]
    engine = MegatrainEngine(
        model,
        parse_engine_config(ds_config(megatrain={"trace": str(path), "trace_steps": TRACED})),
        device=torch.device("cpu"),
    )
    try:
        steps = WARMUP_STEPS + TRACED + 1
        _train(engine, steps)
        written_before_destroy = path.exists()
        transfers = dict(engine.streamer.transfers)
        tracer_after = engine.runtime.tracer
    finally:
        engine.destroy()
        torch.set_num_threads(threads)
    return dict(
        path=path,
        trained=trained,
        transfers=transfers,
        steps=steps,
        written_before_destroy=written_before_destroy,
        tracer_after=tracer_after,
    )


def test_trace_is_chrome_json_with_one_named_thread_per_track(traced_run):
    document, spans = _spans(traced_run["path"])
    events = document["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert len(set(names.values())) == len(names)  # one tid per track
    for event in events:
        if event["ph"] == "X":
            assert event["tid"] in names and event["dur"] >= 0 and event["ts"] >= 0
            assert isinstance(event["name"], str) and isinstance(event["args"], dict)
    assert {"compute", "h2d", "d2h", "optimizer worker", "comm"} <= set(names.values())
    assert document["otherData"]["model"] == "LlamaForCausalLM"
    # Written when the last traced step ended, and tracing was off again afterwards.
    assert traced_run["written_before_destroy"]
    assert traced_run["tracer_after"] is NULL_TRACER


def test_only_the_traced_steps_are_recorded(traced_run):
    _, spans = _spans(traced_run["path"])
    expected = set(range(WARMUP_STEPS, WARMUP_STEPS + TRACED))
    assert {e["args"]["step"] for track in spans.values() for e in track} == expected
    assert sorted(e["args"]["step"] for e in spans["step"]) == sorted(expected)
    finishes = [e for e in spans["optimizer worker"] if e["name"] == "step finish"]
    assert sorted(e["args"]["step"] for e in finishes) == sorted(expected)


def test_every_block_appears_on_every_track_in_each_traced_step(traced_run):
    _, spans = _spans(traced_run["path"])
    blocks = set(range(NUM_BLOCKS))
    per_step_copies = {block: count // traced_run["steps"] for block, count in traced_run["transfers"].items()}
    for step in range(WARMUP_STEPS, WARMUP_STEPS + TRACED):

        def of(track, step=step):
            return [e for e in spans[track] if e["args"]["step"] == step]

        for phase in ("forward", "recompute", "backward"):
            assert sorted(e["args"]["block"] for e in of("compute") if e["args"]["phase"] == phase) == sorted(blocks)
        copies = defaultdict(int)
        for event in of("h2d"):
            copies[event["args"]["block"]] += 1
        assert dict(copies) == per_step_copies  # what the streamer counted
        # Gradient copies cover every trained element of every block once. Held gradients
        # without accumulation land by the copy alone (gradients/sink.py): the worker sees
        # a block's chunks only when it steps them during backward (speculation), all of them.
        numel: dict[str, dict[int, int]] = {"d2h": defaultdict(int), "optimizer worker": defaultdict(int)}
        for track, name in (("d2h", "grads"), ("optimizer worker", "consume")):
            for event in of(track):
                if event["name"].split()[0] == name:
                    numel[track][event["args"]["state"]] += event["args"]["numel"]
        assert [numel["d2h"][block] for block in range(NUM_BLOCKS)] == traced_run["trained"]
        speculated = {e["args"]["state"] for e in of("optimizer worker") if e["args"].get("speculative")}
        consumed = {block for block in blocks if numel["optimizer worker"][block]}
        assert consumed == speculated & blocks
        assert all(numel["optimizer worker"][block] == traced_run["trained"][block] for block in consumed)
        updated = defaultdict(list)
        for event in of("optimizer worker"):
            if event["name"].startswith("adamw"):
                updated[event["args"]["state"]].append(
                    (event["args"]["offset"], event["args"]["offset"] + event["args"]["numel"])
                )
        for block in blocks:
            assert _union(updated[block]) >= traced_run["trained"][block]


def test_spans_are_in_schedule_order(traced_run):
    _, spans = _spans(traced_run["path"])
    for step in range(WARMUP_STEPS, WARMUP_STEPS + TRACED):
        compute = {(e["args"]["phase"], e["args"]["block"]): e for e in spans["compute"] if e["args"]["step"] == step}
        copies = defaultdict(list)
        for event in spans["h2d"]:
            if event["args"]["step"] == step:
                copies[event["args"]["block"]].append(event)
        step_span = next(e for e in spans["step"] if e["args"]["step"] == step)
        for block in range(NUM_BLOCKS):
            forward, recompute, backward = (compute[(p, block)] for p in ("forward", "recompute", "backward"))
            first, second = sorted(copies[block], key=lambda e: e["ts"])
            # Weights are copied (started) before the block computes with them.
            assert first["ts"] < _end(forward) and second["ts"] < _end(recompute)
            assert _end(forward) <= recompute["ts"] and _end(recompute) <= backward["ts"]
            if block + 1 < NUM_BLOCKS:  # forward in block order, backward in reverse
                assert _end(forward) <= compute[("forward", block + 1)]["ts"]
                assert _end(compute[("backward", block + 1)]) <= recompute["ts"]
            grads = [e for e in spans["d2h"] if e["args"]["step"] == step and e["args"]["state"] == block]
            # Each parameter's gradient leaves as soon as backward has finished it: during
            # the block's backward, never before it.
            assert grads and min(e["ts"] for e in grads) >= backward["ts"]
            for event in (forward, recompute, backward, *grads):
                assert step_span["ts"] <= event["ts"] and _end(event) <= _end(step_span)
        # The worker consumes a chunk only after its copy is done.
        copies_by_chunk = {
            (e["args"]["state"], e["args"]["offset"]): e for e in spans["d2h"] if e["args"]["step"] == step
        }
        for event in spans["optimizer worker"]:
            if event["args"]["step"] == step and event["name"].startswith("consume"):
                assert event["ts"] >= _end(copies_by_chunk[(event["args"]["state"], event["args"]["offset"])])


def test_trace_is_written_atomically(tmp_path, monkeypatch):
    runtime = DeviceRuntime.create(torch.device("cpu"))
    tracer = Tracer(runtime)
    with tracer.span("work", "compute"):
        pass
    target = tmp_path / "trace.json"
    target.write_text("previous\n")

    def half_then_fail(self, text, *args, **kwargs):
        with open(self, "w") as handle:
            handle.write(text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        tracer.write(target)
    monkeypatch.undo()
    assert target.read_text() == "previous\n"  # never half a file at the path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no temporary left
    tracer.write(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    assert [e["name"] for e in json.loads(target.read_text())["traceEvents"] if e["ph"] == "X"] == ["work"]


def test_destroy_writes_a_trace_cut_short(tmp_path):
    path = tmp_path / "short.json"
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=2),
        parse_engine_config(ds_config(megatrain={"trace": str(path), "trace_steps": 5})),
    )
    try:
        _train(engine, WARMUP_STEPS + 1)
        assert not path.exists()
    finally:
        engine.destroy()
    _, spans = _spans(path)
    assert {e["args"]["step"] for e in spans["compute"]} == {WARMUP_STEPS}


def test_a_resumed_run_traces_the_steps_after_its_own_warm_up(tmp_path):
    """Steps count from the first forward: a run resumed at step 40 traces 40 + WARMUP_STEPS on."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    schedule = trace_module.TraceSchedule(runtime, tmp_path / "resumed.json", num_steps=1)
    first = 40
    for step in range(first, first + WARMUP_STEPS + 2):
        schedule.before_forward(step)
        traced = runtime.tracer is not NULL_TRACER
        assert traced == (step == first + WARMUP_STEPS)
        schedule.after_step(step)
    assert runtime.tracer is NULL_TRACER
    _, spans = _spans(tmp_path / "resumed.json")
    assert [e["args"]["step"] for e in spans["step"]] == [first + WARMUP_STEPS]


def test_tracing_off_writes_nothing_and_never_builds_a_tracer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def no_tracer(*args, **kwargs):
        raise AssertionError("a Tracer was built with tracing off")

    monkeypatch.setattr(trace_module.Tracer, "__init__", no_tracer)
    engine = MegatrainEngine(tiny_models.llama(num_layers=2), parse_engine_config(ds_config()))
    try:
        _train(engine, WARMUP_STEPS + 2)
        assert engine.runtime.tracer is NULL_TRACER
    finally:
        engine.destroy()
    assert list(tmp_path.iterdir()) == []
    # The null tracer hands out one shared no-op context: nothing allocated per span.
    assert NULL_TRACER.span("a", "compute", block=1) is NULL_TRACER.device_span("b", "h2d", None)


def test_device_span_times_are_read_relative_to_the_anchor():
    """CUDA path without CUDA: an event's host time is the anchor's plus elapsed_time (ms)."""

    class FakeCudaEvent:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    def event(ms):
        clock = CudaClockEvent.__new__(CudaClockEvent)
        clock.event = FakeCudaEvent(ms)
        return clock

    anchor = ClockAnchor(event(2.0), host_ns=1_000_000_000)
    assert event(2.0).host_ns(anchor) == 1_000_000_000
    assert event(3.5).host_ns(anchor) == 1_000_000_000 + 1_500_000


@pytest.mark.parametrize(
    "options, key",
    [({"trace": 5}, "trace"), ({"trace_steps": 0}, "trace_steps"), ({"trace_steps": True}, "trace_steps")],
)
def test_bad_trace_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=f"megatrain.{key}"):
        parse_engine_config(ds_config(megatrain=options))


def test_timeline_renders_a_step(traced_run, tmp_path):
    spec = importlib.util.spec_from_file_location("timeline", Path(__file__).parents[1] / "bench" / "timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    out = tmp_path / "step.png"
    assert timeline.main([str(traced_run["path"]), "--step", str(WARMUP_STEPS), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    spans, _ = timeline.load_spans(traced_run["path"])
    assert timeline.steps_in(spans) == list(range(WARMUP_STEPS, WARMUP_STEPS + TRACED))


def test_compare_reports_each_steps_time_outside_block_compute(traced_run, monkeypatch):
    bench = Path(__file__).parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("compare", bench / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    idle = compare._device_idle_seconds(traced_run["path"])

    # Reference: one compute stream runs one block at a time, so its spans do not overlap
    # and their plain sum is the busy time.
    _, spans = _spans(traced_run["path"])
    expected = []
    for step in range(WARMUP_STEPS, WARMUP_STEPS + TRACED):
        length = sum(e["dur"] for e in spans["step"] if e["args"]["step"] == step)
        busy = sum(e["dur"] for e in spans["compute"] if e["args"]["step"] == step)
        expected.append((length - busy) / 1e6)  # trace-event times are microseconds
    assert idle == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert all(seconds > 0 for seconds in idle)


# -- the warning ------------------------------------------------------------------------------


def _hardware_needing(tokens):
    """fp32 (w = 4) figures for which the planner's break-even is exactly ``tokens``:
    int(4 * F / (4 * B)) + 1 with B = 1, F = tokens - 1."""
    return Hardware("test-gpu", float(tokens - 1), 1.0, 1.0, 1.0, 1 << 40)


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "far too small" in r.getMessage()]


@pytest.mark.parametrize("batch_size", [2, 3])
def test_small_batch_warns_once_per_engine_with_the_numbers(batch_size, caplog, monkeypatch):
    tokens = batch_size * 12  # make_batch: length 12
    needed = 4 * tokens + 1  # just past the "under a quarter" threshold
    monkeypatch.setattr(transfer_hiding, "hardware_of", lambda runtime: (_hardware_needing(needed), "test figures"))
    engine = MegatrainEngine(tiny_models.llama(num_layers=2), parse_engine_config(ds_config(accumulation=2)))
    try:
        with caplog.at_level(logging.WARNING):
            engine.eval()
            with torch.no_grad():  # evaluation is not a training step: no advice yet
                engine(**tiny_models.make_batch(0, batch=batch_size))
            assert not _warnings(caplog)
            engine.train()
            _train(engine, 4, batch_size)
    finally:
        engine.destroy()
    (record,) = _warnings(caplog)
    message = record.getMessage()
    assert f"{tokens} tokens ({batch_size} x 12)" in message and f"about {needed} tokens" in message
    assert f"about {math.ceil(needed / 12)} at this sequence length" in message
    assert "gradient accumulation does not help" in message


def test_batch_at_a_quarter_of_the_break_even_does_not_warn(caplog, monkeypatch):
    tokens = 2 * 12
    monkeypatch.setattr(transfer_hiding, "hardware_of", lambda runtime: (_hardware_needing(4 * tokens), "test"))
    engine = MegatrainEngine(tiny_models.llama(num_layers=2), parse_engine_config(ds_config()))
    try:
        with caplog.at_level(logging.WARNING):
            _train(engine, 2)
    finally:
        engine.destroy()
    assert not _warnings(caplog)


def test_cpu_figures_are_this_machines_own():
    hardware, source = transfer_hiding.hardware_of(DeviceRuntime.create(torch.device("cpu")))
    assert hardware.shares_host_memory and hardware.flops > 0 and hardware.h2d_bytes_per_s > 0
    assert "measured" in source


def test_tokens_are_counted_from_ids_or_embeddings():
    assert transfer_hiding.tokens_per_pass((), {"input_ids": torch.zeros(3, 7, dtype=torch.long)}) == (3, 21)
    assert transfer_hiding.tokens_per_pass((torch.zeros(2, 5, dtype=torch.long),), {}) == (2, 10)
    assert transfer_hiding.tokens_per_pass((), {"inputs_embeds": torch.zeros(4, 6, 32)}) == (4, 24)
    assert transfer_hiding.tokens_per_pass((), {}) is None


# -- on a real GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trace_shows_weight_copies_overlapping_compute(tmp_path):
    """Device spans come from CUDA events: one stream's spans do not overlap, and the copy
    of block i+1 runs during block i's forward (the prefetch), by device time. Every state
    in host memory: with the default ("auto") the tiny model's blocks would stay on the GPU,
    and no weight would be copied."""
    path = tmp_path / "cuda.json"
    megatrain = {"trace": str(path), "trace_steps": 1, "device_state": "none"}
    engine = MegatrainEngine(
        tiny_models.llama(num_layers=NUM_BLOCKS),
        parse_engine_config(ds_config(megatrain=megatrain)),
        device=torch.device("cuda"),
    )
    try:
        for step in range(WARMUP_STEPS + 1):
            batch = {k: v.cuda() for k, v in tiny_models.make_batch(step).items()}
            engine.backward(engine(**batch).loss)
            engine.step()
    finally:
        engine.destroy()
    _, spans = _spans(path)
    for track in ("compute", "h2d", "d2h"):
        ordered = sorted(spans[track], key=lambda e: e["ts"])
        for before, after in zip(ordered, ordered[1:]):
            assert _end(before) <= after["ts"] + 1.0  # one stream: in order (1 us of rounding)
    forward = {e["args"]["block"]: e for e in spans["compute"] if e["args"]["phase"] == "forward"}
    copies = sorted(spans["h2d"], key=lambda e: e["ts"])
    for block in range(NUM_BLOCKS - 1):
        prefetch = next(e for e in copies if e["args"]["block"] == block + 1)
        assert prefetch["ts"] < _end(forward[block])


def _end(event):
    """End time in us, less 1 ns: ``ts + dur`` of two spans that touch may round either way."""
    return event["ts"] + event["dur"] - 1e-3


def _union(ranges):
    total, cursor = 0, -1
    for start, end in sorted(ranges):
        start = max(start, cursor)
        if end > start:
            total += end - start
            cursor = end
    return total
