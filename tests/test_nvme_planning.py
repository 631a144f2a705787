"""The planner, ``megatrain plan --nvme``, the trace and the warning know the NVMe tier."""

import json
import logging
import time

import pytest
import tiny_models
import transformers
from side_by_side import ds_config
from test_nvme_tier import nvme_options

from megatrain_ds import MegatrainEngine, cli, parse_engine_config
from megatrain_ds.cli import shape_of
from megatrain_ds.planning.planner import (
    DISK_BOUND_SHARE,
    GPU_HARDWARE,
    Hardware,
    RunSettings,
    _with,
    host_bytes,
    plan,
    step_seconds,
)
from megatrain_ds.state import swap_io

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

DISK = dict(disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9)
CPU = Hardware(
    "cpu",
    100e9,
    10e9,
    10e9,
    20e9,
    64 << 30,
    shares_host_memory=True,
    block_efficiency=0.8,
    adam_bytes_per_s=40e9,
    head_flops=50e9,
    **DISK,
)


def _llama(layers: int = 4):
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def test_host_state_with_the_tier_matches_the_engines_accounting(tmp_path):
    """The blocks' m and v leave host memory; a window of them comes in (hidden 64: no
    padding, so the planner's parameter counts are the engine's flat sizes)."""
    model = _llama()
    shape = shape_of(model)
    settings = RunSettings(seq_len=12, micro_batch=2, bf16=False, nvme=True, nvme_window_blocks=2)
    predicted = host_bytes(shape, settings)
    engine = MegatrainEngine(model, parse_engine_config(ds_config(megatrain=nvme_options(tmp_path, engine="threads"))))
    try:
        measured = engine.host_bytes()
        assert predicted["adam_m_v"] == measured["exp_avg"] + measured["exp_avg_sq"] == 8 * shape.resident_params
        # The window's slots are padded to O_DIRECT's 4 KiB; the planner counts 8 bytes/param.
        assert 0 <= measured["nvme_window"] - predicted["nvme_window"] < 2 * 2 * 4096
        assert plan(shape, settings, CPU, 64 << 30).disk_bytes == 8 * shape.total_block_params
    finally:
        engine.destroy()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_host_state_with_the_weights_on_the_tier_matches_the_engines_accounting(tmp_path, bf16):
    """ "all": the blocks' masters (and shadows) leave host memory too; the weight window
    comes in (the planner counts no alignment padding: the engine's is under 4 KiB a buffer)."""
    model = _llama()
    shape = shape_of(model)
    settings = RunSettings(seq_len=12, micro_batch=2, bf16=bf16, nvme=True, nvme_window_blocks=2, nvme_weights=True)
    predicted = host_bytes(shape, settings)
    options = {**nvme_options(tmp_path, engine="threads"), "nvme_offload": "all"}
    engine = MegatrainEngine(model, parse_engine_config(ds_config(bf16=bf16, megatrain=options)))
    try:
        measured = engine.host_bytes()
        assert predicted["master"] == measured["master"] == 4 * shape.resident_params
        assert (
            predicted.get("bf16_shadow", 0) == measured.get("shadow", 0) == (2 * shape.resident_params if bf16 else 0)
        )
        buffers = 3 * (2 if bf16 else 1)  # two device slots + two read ahead - 1; bf16: and their staging
        assert 0 <= measured["nvme_weights"] - predicted["nvme_weights"] < buffers * 4096
        assert plan(shape, settings, CPU, 64 << 30).disk_bytes == 12 * shape.total_block_params
    finally:
        engine.destroy()


STEPS = 8


@pytest.mark.parametrize("accumulation", [1, 2])
def test_disk_traffic_per_step_matches_the_engines_tier(tmp_path, accumulation):
    """What the planner's disk bound charges per optimizer step, in bytes (read and write at
    1 B/s each), against the bytes the engine's tier moved in a measured step (its own
    counters of every read and write it issued), and the planned swap files against the
    files on disk. The tier moves whole O_DIRECT-aligned blocks (padded to 4 KiB) where the
    planner counts 8 bytes per parameter (2.4% more here): within 5%."""
    model = _llama()
    shape = shape_of(model)
    settings = RunSettings(seq_len=12, micro_batch=2, accumulation=accumulation, bf16=False, nvme=True)
    unit = Hardware(**{**CPU.__dict__, "disk_read_bytes_per_s": 1.0, "disk_write_bytes_per_s": 1.0})
    planned = step_seconds(shape, settings, unit)["disk"]  # seconds at 1 B/s: bytes
    config = ds_config(accumulation=accumulation, megatrain=nvme_options(tmp_path, engine="threads"))
    engine = MegatrainEngine(model, parse_engine_config(config))
    try:
        swap_files = sum(path.stat().st_size for path in tmp_path.rglob("*") if path.is_file())
        assert swap_files == pytest.approx(plan(shape, settings, CPU, 64 << 30).disk_bytes, rel=0.05)
        moved = _steady_bytes_per_step(engine, accumulation)
        assert sum(moved) == pytest.approx(planned, rel=0.05)
    finally:
        engine.destroy()


def _steady_bytes_per_step(engine: MegatrainEngine, accumulation: int) -> tuple[float, float]:
    """The tier's bytes read and written per optimizer step, averaged over STEPS steady steps
    after a first one. Each end of the measured run is a quiet point: the update that may run
    behind ``step()`` landed, and every transfer issued by then (the blocks written behind,
    the next step's reads ahead) completed and counted. Which transfers are issued by a step's
    end is the program's order, the same at both ends, while which have completed is the
    threads' timing (a loaded machine counted 5.6% less without the quiet points). A flush
    would not do: it discards the block already read ahead for the next step."""
    tier = engine.nvme_tier
    assert tier is not None

    def one_step(seed: int) -> None:
        for micro in range(accumulation):
            engine.backward(engine(**tiny_models.make_batch(seed * accumulation + micro)).loss)
            engine.step()

    def quiet() -> tuple[int, int]:
        engine.settle_optimizer()
        for slot in tier._slots:  # each slot's last transfer (the tier's flush waits on the same)
            if slot.pending is not None:
                slot.pending.synchronize()
        return tier.bytes_read, tier.bytes_written

    one_step(0)
    read, written = quiet()
    for seed in range(1, STEPS + 1):
        one_step(seed)
    read_after, written_after = quiet()
    return (read_after - read) / STEPS, (written_after - written) / STEPS


@pytest.mark.parametrize("accumulation", [1, 2])
def test_with_the_weights_on_the_tier_the_planned_disk_traffic_bounds_the_measured(tmp_path, accumulation):
    """With the weights on the tier, the planner charges every pass's reads of every block
    (it ignores the weight window's reuse, and the optimizer's read of a block's swap file
    serving the next forward): against the tier's own counters over steady steps, the writes
    are the optimizer state's once per step (within the 4 KiB padding, 5%), and the reads lie
    between the state's read and the planner's charge (an upper bound, never exceeded)."""
    model = _llama(8)
    shape = shape_of(model)
    settings = RunSettings(
        seq_len=12, micro_batch=2, accumulation=accumulation, bf16=False, nvme=True, nvme_weights=True
    )
    unit = Hardware(**{**CPU.__dict__, "disk_read_bytes_per_s": 1.0, "disk_write_bytes_per_s": 1.0})
    planned = step_seconds(shape, settings, unit)["disk"]  # seconds at 1 B/s: bytes
    swap = plan(shape, settings, CPU, 64 << 30).disk_bytes  # the state, written once a step
    options = nvme_options(tmp_path, engine="threads", nvme_offload="all")
    engine = MegatrainEngine(model, parse_engine_config(ds_config(accumulation=accumulation, megatrain=options)))
    try:
        read, written = _steady_bytes_per_step(engine, accumulation)
    finally:
        engine.destroy()
    assert written == pytest.approx(swap, rel=0.05)
    assert swap <= read <= planned - swap


def test_on_the_cpu_the_disk_works_beside_the_optimizer():
    """On the CPU the step is the cores' sum with max(optimizer, disk) in place of the
    optimizer; on a GPU machine the disk is one more bound, the same as on the CPU."""
    shape = shape_of(_llama(8))
    settings = RunSettings(seq_len=128, micro_batch=2, bf16=False, nvme=True)
    by_bound = step_seconds(shape, settings, CPU)
    result = plan(shape, settings, CPU, 64 << 30)
    cores = sum(t for bound, t in by_bound.items() if bound not in ("optimizer", "disk"))
    assert result.predicted_step_seconds == pytest.approx(cores + max(by_bound["optimizer"], by_bound["disk"]))
    gpu = Hardware(**{**GPU_HARDWARE["h100"].__dict__, **DISK})
    assert step_seconds(shape, settings, gpu)["disk"] == pytest.approx(by_bound["disk"])


def test_a_disk_bound_plan_names_the_disk_and_the_accumulation_that_hides_it():
    shape = shape_of(_llama(8))
    gpu = Hardware(**{**GPU_HARDWARE["h100"].__dict__, **DISK})
    settings = RunSettings(seq_len=1024, micro_batch=1, bf16=True, nvme=True)
    result = plan(shape, settings, gpu, 64 << 30)
    assert result.recommended["bottleneck"] == "disk"
    assert result.disk_bytes == 12 * shape.total_block_params  # bf16 compute: the fp32 masters are on disk too
    wanted = result.recommended["gradient_accumulation_steps"]
    for accumulation, hides in ((wanted, True), (wanted // 2, False)):
        by_bound = step_seconds(shape, _with(settings, accumulation=accumulation), gpu)
        step = plan(shape, _with(settings, accumulation=accumulation), gpu, 64 << 30).predicted_step_seconds
        assert (by_bound["disk"] <= DISK_BOUND_SHARE * step) is hides
    assert "bottleneck" not in plan(shape, _with(settings, nvme=False), gpu, 64 << 30).recommended


def test_cli_plan_nvme_measures_the_disk_once_and_caches_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    _llama().config.save_pretrained(tmp_path / "model")
    calls = []
    measure = swap_io.measure_disk_bandwidth

    def counted(directory, *args, **kwargs):
        calls.append(directory)
        return measure(directory, 64 << 20)

    monkeypatch.setattr(swap_io, "measure_disk_bandwidth", counted)
    argv = [
        "plan",
        "--model",
        str(tmp_path / "model"),
        "--gpu",
        "h100",
        "--seq-len",
        "128",
        "--nvme",
        str(tmp_path / "nvme"),
        "--json",
    ]
    for _ in range(2):
        capsys.readouterr()
        assert cli.main(argv) == 0
    assert calls == [str(tmp_path / "nvme")]
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])
    cached = json.loads((tmp_path / "cache" / "disk_bandwidth.json").read_text())
    (figures,) = cached.values()
    assert data["hardware"]["disk_read_bytes_per_s"] == figures["read"] > 0
    assert data["disk_bytes"] == 12 * shape_of(_llama()).total_block_params  # bf16 (the default): masters too
    assert "disk" in data["step_seconds_by_bound"] and data["host_bytes"]["nvme_window"] > 0


def test_trace_has_the_tiers_read_and_write_tracks(tmp_path):
    trace = tmp_path / "trace.json"
    config = ds_config(megatrain={**nvme_options(tmp_path / "nvme"), "trace": str(trace), "trace_steps": 2})
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        for step in range(3):
            engine.backward(engine(**tiny_models.make_batch(step)).loss)
            engine.step()
        engine_name = engine.nvme_tier.engine_name
        file_bytes = engine.nvme_tier.directory.nbytes // 4
    finally:
        engine.destroy()
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    for track in ("nvme read", "nvme write"):
        mine = [e for e in spans if tracks[e["tid"]] == track]
        assert {e["args"]["step"] for e in mine} == {1, 2}, track
        assert all(e["args"]["bytes"] == file_bytes and e["args"]["engine"] == engine_name for e in mine)
        # Four blocks through a two-block window: each traced step moves (nearly) all of them.
        assert len(mine) >= 2 * (4 - 2), track


def test_a_disk_that_cannot_keep_up_is_named_with_the_fix(tmp_path, caplog):
    """Reads slowed to a crawl: from the second step on the training threads wait most of
    the step, and the warning names the disk and gradient accumulation (once)."""
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain=nvme_options(tmp_path))))
    read = engine.nvme_tier.io.read

    def slow_read(*args):
        time.sleep(0.2)
        read(*args)

    engine.nvme_tier.io.read = slow_read
    try:
        with caplog.at_level(logging.WARNING, logger="megatrain_ds"):
            for step in range(4):
                engine.backward(engine(**tiny_models.make_batch(step)).loss)
                engine.step()
    finally:
        engine.destroy()
    warnings = [r.getMessage() for r in caplog.records if "does not hide" in r.getMessage()]
    assert len(warnings) == 1
    assert "disk is the bottleneck" in warnings[0] and "gradient_accumulation_steps" in warnings[0]
    assert engine.nvme_tier.wait_seconds > 0.2
