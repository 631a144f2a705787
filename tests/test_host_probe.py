"""``planning/host_probe.py``: the host's AdamW probe does the pass the run does
([Note: probing AdamW as the run runs it]), and ``megatrain plan`` says where each figure
came from.

The kernel is replaced by a recording one where the test is about what the probe hands it
(a 2-core CI machine times millisecond work with several-fold noise); the rates themselves
are the kernel's, checked by ``bench/host_contention.py`` on the machine that trains.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

from megatrain_ds.planning import host_probe
from megatrain_ds.planning.hardware_figures import figure_sources, hardware_from_file
from megatrain_ds.planning.host_probe import AdamWork, PinnedCopyLoad, adam_bytes_per_s, adam_work, probe_adam
from megatrain_ds.planning.planner import Hardware, ModelShape, RunSettings
from megatrain_ds.planning.step_time import optimizer_seconds
from megatrain_ds.runtime.device_runtime import DeviceRuntime


class RecordingKernel:
    """Records what each call is handed, and on which thread; updates nothing."""

    def __init__(self, during_call=None) -> None:
        self.calls: list[dict] = []
        self.during_call = during_call

    def step_(self, p, g, m, v, shadow, *, step, hyper, grad_scale=1.0, before_chunk=None):
        if self.during_call is not None:
            self.during_call()
        self.calls.append(
            {
                "span": (p.storage_offset(), p.storage_offset() + p.numel()),
                "grad_dtype": g.dtype,
                "shadow": None if shadow is None else shadow.dtype,
                "grad_scale": grad_scale,
                "thread": threading.current_thread(),
                "sizes": {t.numel() for t in (p, g, m, v)},
            }
        )


def _recording(monkeypatch, kernel: RecordingKernel) -> None:
    monkeypatch.setattr("megatrain_ds.optimizer.cpu_adam.make_cpu_kernel", lambda choice: kernel)


@pytest.mark.parametrize(
    ("settings", "grad_dtype", "shadow", "clipped"),
    [
        (RunSettings(seq_len=8), torch.bfloat16, True, True),  # bf16, clipping: the H200 runs
        (RunSettings(seq_len=8, clipping=False), torch.bfloat16, True, False),
        (RunSettings(seq_len=8, accumulation=4), torch.float32, True, True),  # fp32 held gradients
        (RunSettings(seq_len=8, bf16=False), torch.float32, False, True),  # fp32 compute: no shadow
    ],
)
def test_the_probe_makes_the_runs_pass_and_counts_the_planners_bytes(settings, grad_dtype, shadow, clipped):
    """The work follows the run's settings, and the bytes per element it rates the pass by
    are the ones the planner divides by the rate (``optimizer_seconds``: an independent
    count, ``24 + g + s`` there): a rate measured here and used there times the same bytes."""
    work = adam_work(settings, state_elements=1000, cache_bytes=1 << 20)
    assert work.grad_dtype == grad_dtype and work.shadow == shadow
    assert (work.grad_scale != 1.0) == clipped
    shape = ModelShape(num_blocks=2, block_params=1000, total_block_params=2000, resident_params=0, hidden=8, vocab=8)
    rate = 1e9
    hardware = Hardware("x", 1e12, 1e9, 1e9, 1e9, 1 << 40, adam_bytes_per_s=rate)
    assert optimizer_seconds(shape, settings, hardware) == pytest.approx(work.bytes_per_element * shape.params / rate)


@pytest.mark.skipif(not Path("/sys/devices/system/cpu").exists(), reason="reads the cache sizes from Linux's sysfs")
def test_the_probe_steps_states_past_the_last_level_cache_in_block_sized_calls():
    """The probe's states span at least ``ADAM_PROBE_CACHE_MULTIPLE`` times the last-level
    cache (read here from sysfs apart from the probe's reader: the largest level's size per
    distinct instance), in calls of one block's state, and a state larger than the cache is
    one call (at most ``MAX_CALL_ELEMENTS``)."""
    top, instances = 0, {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        level = int((index / "level").read_text())
        size_kib = int((index / "size").read_text().strip().rstrip("K"))
        instances[(level, (index / "shared_cpu_list").read_text().strip())] = size_kib << 10
        top = max(top, level)
    cache = sum(size for (level, _), size in instances.items() if level == top)
    assert host_probe.last_level_cache_bytes() == cache
    small = adam_work(RunSettings(seq_len=8), state_elements=5000)
    assert 16 * small.elements >= host_probe.ADAM_PROBE_CACHE_MULTIPLE * cache and small.call_elements == 5000
    huge = adam_work(RunSettings(seq_len=8), state_elements=10**9, cache_bytes=cache)
    assert huge.call_elements == host_probe.MAX_CALL_ELEMENTS and huge.elements >= huge.call_elements
    frozen = adam_work(RunSettings(seq_len=8), state_elements=0, cache_bytes=cache)  # blocks with nothing trained
    assert frozen.call_elements == min(frozen.elements, host_probe.MAX_CALL_ELEMENTS) > 1


def test_the_probe_steps_every_element_on_a_thread_of_its_own_with_the_runs_arguments(monkeypatch):
    """What the kernel is handed: every element once per pass, in calls of ``call_elements``
    (the last one shorter), the run's gradient dtype, shadow and clipping scale, on a thread
    that is not the caller's (the run steps on its finish or gradient worker)."""
    kernel = RecordingKernel()
    _recording(monkeypatch, kernel)
    work = AdamWork(elements=2500, call_elements=1000, grad_dtype=torch.bfloat16, shadow=True, grad_scale=0.5)
    rate = adam_bytes_per_s(work, seconds=0.0)
    assert rate > 0
    first_pass = kernel.calls[:3]  # the warm-up pass
    assert [call["span"] for call in first_pass] == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert len(kernel.calls) % 3 == 0 and len(kernel.calls) >= 3 * 4  # warm-up and at least 3 timed passes
    for call in kernel.calls:
        assert call["grad_dtype"] == torch.bfloat16 and call["shadow"] == torch.bfloat16
        assert call["grad_scale"] == 0.5 and len(call["sizes"]) == 1
        assert call["thread"] is not threading.current_thread()


def test_the_beside_copies_probe_steps_while_the_copies_run(monkeypatch):
    """With a copy load every call of the timed passes runs while the load's thread is
    copying (the kernel waits in its first call until the load has moved a copy, so the
    check does not depend on the threads' timing); the CPU runtime's copies are host copies,
    as ``bench/host_contention.py``'s are without a GPU."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    load = PinnedCopyLoad(runtime, nbytes=1 << 16)
    running = []

    def copies_running() -> None:
        for _ in range(10_000):
            if load.moved:
                break
            threading.Event().wait(0.001)
        running.append(load._thread is not None and load._thread.is_alive() and load.moved > 0)

    kernel = RecordingKernel(during_call=copies_running)
    _recording(monkeypatch, kernel)
    work = AdamWork(elements=100, call_elements=100, grad_dtype=torch.float32, shadow=False, grad_scale=1.0)
    adam_bytes_per_s(work, seconds=0.0, beside=load)
    timed = running[1:]  # the warm-up pass runs before the load starts
    assert timed and all(timed)
    assert load._thread is not None and not load._thread.is_alive()  # stopped on leaving


def test_without_a_cuda_device_the_rate_beside_copies_is_not_probed_and_the_plan_says_so(monkeypatch):
    """No device: 0.0, which ``optimizer_seconds`` replaces by the rate alone, and the plan's
    sources name it as not probed with the figure that stands in."""
    _recording(monkeypatch, RecordingKernel())
    work = AdamWork(elements=64, call_elements=64, grad_dtype=torch.float32, shadow=False, grad_scale=1.0)
    rates = probe_adam(work, seconds=0.0, runtime=DeviceRuntime.create(torch.device("cpu")))
    assert rates.adam_bytes_per_s > 0 and rates.adam_beside_copies_bytes_per_s == 0.0
    sources = figure_sources("h200", probed=True, device_here=False)
    assert sources["adam_beside_copies_bytes_per_s"].startswith("not probed (no CUDA device here)")
    assert "adam_bytes_per_s stands in" in sources["adam_beside_copies_bytes_per_s"]
    assert sources["block_efficiency"].startswith("the h200 table's")
    probed = figure_sources("h200", probed=True, device_here=True)
    assert probed["adam_beside_copies_bytes_per_s"].startswith("measured here")
    assert figure_sources("h200", probed=False, device_here=True)["adam_bytes_per_s"].startswith("the h200")


def test_a_plans_figures_read_back_from_its_json_name_their_file(tmp_path):
    """``--hardware``: a plan's JSON (``hardware`` and ``hardware_sources``) gives the same
    figures back, each source naming the file; a figure the planner does not know is refused."""
    hardware = Hardware("h200", 7.9e14, 5.4e10, 5.4e10, 2.5e11, 1 << 40, block_efficiency=0.27, adam_bytes_per_s=1e11)
    sources = figure_sources("h200", probed=True, device_here=False)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"hardware": dataclasses.asdict(hardware), "hardware_sources": sources}))
    read, named = hardware_from_file(str(path))
    assert read == hardware
    assert named == {name: f"{source} (read from {path})" for name, source in sources.items()}
    path.write_text(json.dumps({**dataclasses.asdict(hardware), "pcie_gen": 5}))
    with pytest.raises(ValueError, match=r"unknown figures \['pcie_gen'\]"):
        hardware_from_file(str(path))


def test_plan_refuses_a_hardware_file_that_does_not_hold_its_figures(tmp_path, capsys):
    """``megatrain plan --hardware``: a missing file, a figure missing, or another device's
    figures (a CPU profile's for ``--gpu h200``: its device would be its host) is an error
    naming the file and what is wrong -- from ``plan`` a usage error, not a traceback nor a
    plan of the wrong machine."""
    from megatrain_ds import cli

    cpu = Hardware("cpu", 1e11, 1e10, 1e10, 2e10, 1 << 34, shares_host_memory=True)
    incomplete = {"hardware": {"name": "h200", "flops": 7.9e14}}
    cases = {
        "absent.json": (None, "not a plan's JSON"),
        "incomplete.json": (incomplete, "missing"),
        "cpu.json": ({"hardware": dataclasses.asdict(cpu)}, "for --gpu cpu, not h200"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=f"--hardware {path}") as raised:
            hardware_from_file(str(path), "h200")
        assert message in str(raised.value)
    assert hardware_from_file(str(tmp_path / "cpu.json"), "cpu")[0] == cpu
    model = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny_llama.json"
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--model", str(model), "--gpu", "h200", "--seq-len", "64", "--hardware", str(path)])
    assert exited.value.code == 2 and f"--hardware {path}: the figures are for --gpu cpu" in capsys.readouterr().err


def test_plan_refuses_probe_for_the_cpu(capsys):
    """``--probe`` measures a GPU machine's host for that GPU's plan; for ``--gpu cpu`` (whose
    profile measures this machine anyway) it is a usage error, not silently ignored."""
    from megatrain_ds import cli

    model = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny_llama.json"
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--model", str(model), "--gpu", "cpu", "--seq-len", "64", "--probe"])
    assert exited.value.code == 2 and "--probe measures a GPU machine's host" in capsys.readouterr().err


def test_the_probe_gets_the_thread_team_of_the_engines_workers(monkeypatch):
    """The kernel's team is ``torch.get_num_threads()`` on the calling thread: the probe's
    calls see what a thread the engine starts for its workers (``DeviceRuntime.start_thread``)
    sees, after the main thread set another team (torch 2.13 hands ``set_num_threads`` on to
    new threads; the H200 runs' torch 2.11 may not, and the probe follows either way)."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        torch.set_num_threads(1)
        runtime.start_thread(lambda: seen.append(torch.get_num_threads()), "worker team").join()
        kernel = RecordingKernel(during_call=lambda: seen.append(torch.get_num_threads()))
        _recording(monkeypatch, kernel)
        work = AdamWork(elements=64, call_elements=64, grad_dtype=torch.float32, shadow=False, grad_scale=1.0)
        adam_bytes_per_s(work, seconds=0.0)
    finally:
        torch.set_num_threads(before)
    worker, *probe = seen
    assert probe and set(probe) == {worker}


def test_a_copy_load_that_fails_fails_the_probe_instead_of_leaving_the_pass_alone(monkeypatch):
    """The load copies on a thread of its own: an error there (a CUDA error on the GPU) would
    end only that thread, the pass would then run alone and its rate be recorded as the rate
    beside copies. The error is raised where the load is left, so the probe fails."""
    runtime = DeviceRuntime.create(torch.device("cpu"))
    load = PinnedCopyLoad(runtime, nbytes=1 << 10)

    def broken_copy(*args, **kwargs):
        raise torch.OutOfMemoryError("pinned copy failed")

    monkeypatch.setattr(load, "_copy_until_stopped", broken_copy)
    _recording(monkeypatch, RecordingKernel())
    work = AdamWork(elements=64, call_elements=64, grad_dtype=torch.float32, shadow=False, grad_scale=1.0)
    with pytest.raises(RuntimeError, match="copy load failed") as raised:
        adam_bytes_per_s(work, seconds=0.0, beside=load)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_a_figure_the_table_does_not_give_names_what_stands_in_for_it():
    """The GPU table gives no AdamW rate (0): without ``--probe`` the plan must not call 0
    "the h200 table's" rate but name what ``optimizer_seconds`` takes instead -- the host's
    memory bandwidth at ``ADAM_HOST_BYTES_PER_PARAM`` bytes per parameter (checked here
    against the time it gives) -- and a probed rate keeps its source as it is."""
    from megatrain_ds.planning.hardware_figures import name_stand_ins
    from megatrain_ds.planning.planner import GPU_HARDWARE
    from megatrain_ds.planning.step_time import ADAM_HOST_BYTES_PER_PARAM

    table = GPU_HARDWARE["h200"]
    named = name_stand_ins(table, figure_sources("h200", probed=False, device_here=False))
    assert named["adam_bytes_per_s"].endswith(
        f": 0, host_memory_bytes_per_s at {ADAM_HOST_BYTES_PER_PARAM} B/param stands in"
    )
    assert named["adam_beside_copies_bytes_per_s"].count("stands in") == 1
    shape = ModelShape(num_blocks=2, block_params=1000, total_block_params=2000, resident_params=0, hidden=8, vocab=8)
    settings = RunSettings(seq_len=8)
    expected = ADAM_HOST_BYTES_PER_PARAM * shape.params / table.host_memory_bytes_per_s
    assert optimizer_seconds(shape, settings, table) == pytest.approx(expected)
    probed = dataclasses.replace(table, adam_bytes_per_s=1e11, adam_beside_copies_bytes_per_s=6e10)
    sources = figure_sources("h200", probed=True, device_here=True)
    assert name_stand_ins(probed, sources) == sources
