"""The GPU tier (``"device_state"``): a prefix of the states kept whole on the device.

Without CUDA the "device" is the CPU and the Triton kernel runs through its interpreter
(``TRITON_INTERPRET=1``, the root ``conftest.py``), so these runs take the exact code a GPU
runs: the device update, the gradients added on the device, the streamer's slots pointing at
the device weights, the events.

Tolerances. fp32 parity with ``torch.optim.AdamW`` + ``clip_grad_norm_``: the engine-core
figures of ``test_parity.py`` and ``test_optimizer_placement.py`` (1e-5 relative per-step
loss and norm, 2e-6 global relative weight error after 5 steps): the Triton kernel rounds a
few multiply-adds differently from torch's single-tensor AdamW (< 1 ulp of a parameter per
step, ``test_optimizer_placement.py`` measured 1.4e-8 for it), and the norm sums the same
per-chunk fp32 norms in fp64. bf16 compute against the same run with ``"none"``: each is
within ``test_bf16.py``'s bound of the fp32 reference (5e-3 relative weight error, the bf16
shadow's rounding fed back through 3 steps of bf16 matmuls), so the two are within 1e-2 of
each other (the triangle inequality); measured 4e-4, the device shadow truncated by the
interpreter where the host rounds it. Checkpoints are compared bit for bit: the same
kernels on the same values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from types import SimpleNamespace

import pytest
import tiny_models
import torch
from placement_check import engine_preflight, placement_disagreements, planner_disagreements, preflight_disagreements
from side_by_side import ds_config, relative_weight_error, train_side_by_side

from megatrain_ds import ConfigError, MegatrainEngine, cli, parse_engine_config
from megatrain_ds.engine_build import _device_state_count
from megatrain_ds.planning.planner import auto_device_state_share
from megatrain_ds.planning.step_time import GPU_HARDWARE, ModelShape, RunSettings, optimizer_seconds
from megatrain_ds.state.placement import Topology, device_prefix, state_shapes
from megatrain_ds.state.state_placement import Where

pytestmark = pytest.mark.usefixtures("cpu_single_thread")

# Reference norms of the llama below with accumulation 2: 1.676, 1.626, 1.624, 1.525, 1.484;
# a threshold of 1.6 clips the first three steps and not the last two (test_optimizer_placement.py).
CLIP = 1.6


@pytest.mark.parametrize(
    "accumulation, fraction, clipping", [(1, 1.0, CLIP), (2, 0.5, CLIP), (1, 0.5, 0.0)], ids=["all", "half", "unheld"]
)
def test_fp32_matches_torch_adamw(accumulation, fraction, clipping):
    """Every state on the device (no accumulation, clipping on every step); the resident
    state and the first blocks with the rest on the host (accumulation 2, clipping that fires
    in the first three steps only, the host blocks speculating); the same without clipping
    (the host holds no gradient and steps its blocks during backward, the device states hold
    theirs until ``step()``): PyTorch's numbers."""
    config = ds_config(
        accumulation=accumulation, clipping=clipping, megatrain={"device_state": fraction, "speculative_blocks": 4}
    )
    engine, reference, trace = train_side_by_side(tiny_models.llama, config)
    try:
        if accumulation == 2:
            clipped = [norm > CLIP for norm in trace.reference_norms]
            assert any(clipped) and not all(clipped), trace.reference_norms
        for ours, theirs in zip(trace.engine_losses, trace.reference_losses):
            assert math.isclose(ours, theirs, rel_tol=1e-5)
        for ours, theirs in zip(trace.engine_norms, trace.reference_norms):
            assert math.isclose(ours, theirs, rel_tol=1e-5)
        assert relative_weight_error(engine, reference) < 2e-6
        _check_device_placement(engine, fraction)
    finally:
        engine.destroy()


def _check_device_placement(engine: MegatrainEngine, fraction: float) -> None:
    """The prefix the fraction asks for is on the device, and nothing of it ever crossed:
    no weight copy, no journal; the rest is the host's as with ``"none"``."""
    placement, resident = engine.placement, engine._resident_index
    on_device = placement.device_indices
    assert on_device[0] == resident and list(on_device[1:]) == list(range(len(on_device) - 1))
    trained = [state.layout.trained_numel for state in engine.states]
    assert sum(trained[index] for index in on_device) <= fraction * sum(trained)
    assert (len(on_device) == len(engine.states)) == (fraction == 1.0)
    for block in range(resident):
        assert (engine.streamer.transfers[block] == 0) == (block in on_device), block
    assert not any(extent.index in on_device for extent in engine.stepper.journal.extents)
    if fraction < 1.0 and engine.config.holds_gradients:
        assert engine.stepper.journal.extents  # the host blocks still speculate
    assert placement_disagreements(engine) == []
    assert preflight_disagreements(engine) == []
    assert planner_disagreements(engine) == []
    assert engine_preflight(engine).host["device_state"] == engine.device_bytes()["device_state"] > 0


def test_bf16_against_the_same_run_without_device_states():
    """bf16 compute, every state on the device, against the run with ``"none"`` and the fp32
    reference (the module docstring's tolerances); the device kernel wrote each shadow."""
    runs = {}
    for setting in ("none", 1.0):
        config = ds_config(bf16=True, clipping=CLIP, megatrain={"device_state": setting})
        runs[setting] = train_side_by_side(tiny_models.llama, config, steps=3)
    (host, reference, host_trace), (device, _, device_trace) = runs["none"], runs[1.0]
    try:
        assert relative_weight_error(device, reference) < 5e-3
        assert relative_weight_error(device, host.module) < 1e-2  # the masters of both, by the hook
        for a, b in zip(device_trace.engine_losses, host_trace.engine_losses):
            assert math.isclose(a, b, rel_tol=1e-2)
        device.settle_optimizer()
        for state in device.states:
            assert state.placement.on_device and state.shadow is not None
            truncated = (state.master.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            assert bool(((state.shadow == truncated) | (state.shadow == state.master.to(torch.bfloat16))).all())
    finally:
        host.destroy()
        device.destroy()


def _engine(seed: int, device_state: float | str) -> MegatrainEngine:
    torch.manual_seed(seed)
    config = ds_config(accumulation=2, megatrain={"device_state": device_state})
    engine = MegatrainEngine(tiny_models.gpt2(), parse_engine_config(config))
    engine.train()
    return engine


def _train(engine: MegatrainEngine, micro_steps: int) -> list[float]:
    losses = []
    for _ in range(micro_steps):
        torch.manual_seed(1000 + engine.micro_steps)  # the same dropout masks in every engine
        loss = engine(**tiny_models.make_batch(engine.micro_steps)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _states(engine: MegatrainEngine) -> list[dict[str, torch.Tensor]]:
    engine.settle_optimizer()  # the states are read directly
    kinds = ("master", "exp_avg", "exp_avg_sq", "grad")
    return [{kind: getattr(state, kind).clone() for kind in kinds} for state in engine.states]


def test_checkpoint_resumes_bit_exactly_and_loads_into_none(tmp_path):
    """Saved inside an accumulation window (the device states' held gradients are saved),
    loaded into a fresh engine with the same setting: it trains on bit for bit as the saved
    one; loaded into one with ``"none"``: the same masters, moments and held gradients."""
    engine, resumed, plain = _engine(0, 0.6), _engine(1, 0.6), _engine(2, "none")
    try:
        assert 0 < len(engine.placement.device_indices) < len(engine.states)
        _train(engine, 3)  # one step and a half
        engine.save_checkpoint(tmp_path, tag="middle")
        saved = _states(engine)
        losses = _train(engine, 3)
        for other in (resumed, plain):
            other.load_checkpoint(tmp_path)
            for index, (ours, theirs) in enumerate(zip(_states(other), saved)):
                for kind in ours:
                    assert torch.equal(ours[kind], theirs[kind]), (other.config.options.device_state, index, kind)
        assert _train(resumed, 3) == losses
        for index, (ours, theirs) in enumerate(zip(_states(resumed), _states(engine))):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[kind], theirs[kind]), (index, kind)
    finally:
        for one in (engine, resumed, plain):
            one.destroy()


@pytest.mark.parametrize(
    "block, words",
    [
        ({"megatrain": {"device_state": 1.5}}, ["megatrain.device_state", "fraction"]),
        ({"megatrain": {"device_state": True}}, ["megatrain.device_state"]),
        ({"megatrain": {"device_state": "gpu"}}, ["megatrain.device_state", '"auto"']),
        ({"megatrain": {"device_state": 0.5, "master_dtype": "bf16"}}, ["master_dtype", '"none"']),
        (
            {"megatrain": {"device_state": 0.5, "nvme_offload": "optimizer", "nvme_path": "/tmp"}},
            ["nvme_offload", '"none"'],
        ),
        ({"megatrain": {"device_state": 0.5}, "fp16": {"enabled": True}}, ["fp16", '"none"']),
        ({"zero_optimization": {"offload_optimizer": {"ratio": 2}}}, ["offload_optimizer.ratio", "0 to 1"]),
    ],
)
def test_unsupported_settings_name_the_key_and_the_fix(block, words):
    config = {**ds_config(), **block, "megatrain": {**ds_config()["megatrain"], **block.get("megatrain", {})}}
    with pytest.raises(ConfigError) as error:
        parse_engine_config(config)
    for word in words:
        assert word in str(error.value)


def test_deepspeed_ratio_maps_to_device_state_and_the_megatrain_key_wins():
    """The default is "auto"; DeepSpeed's ratio sets ``1 - ratio`` (1.0, DeepSpeed's "all on
    the host", keeps every state in host memory); the megatrain key has the last word."""
    zero = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}}
    assert parse_engine_config({**ds_config(), **zero}).options.device_state == 0.75
    config = {**ds_config(), **zero, "megatrain": {"device_state": "none"}}
    assert parse_engine_config(config).options.device_state == "none"
    assert parse_engine_config(ds_config()).options.device_state == "auto"
    all_on_host = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.0}}}
    options = parse_engine_config({**ds_config(), **all_on_host}).options
    assert options.device_state == 0.0 and not options.wants_device_state


@pytest.mark.parametrize(
    "block, reason",
    [
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"megatrain": {"master_dtype": "bf16"}}, "master_dtype"),
        ({"megatrain": {"nvme_offload": "optimizer", "nvme_path": "/tmp"}}, "nvme_offload"),
    ],
)
def test_the_default_auto_keeps_every_state_on_the_host_where_the_tier_cannot_run(block, reason, caplog):
    """``"auto"`` (the default, or written) becomes "none" where the tier cannot run, with
    the reason at INFO (no warning: nothing the user asked for is dropped); a fraction
    written there is still refused (``test_unsupported_settings_name_the_key_and_the_fix``)."""
    for megatrain in (block.get("megatrain", {}), {**block.get("megatrain", {}), "device_state": "auto"}):
        config = {**ds_config(), **block, "megatrain": megatrain}
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatrain_ds.config.engine_config"):
            options = parse_engine_config(config).options
        assert options.device_state == "none" and not options.wants_device_state
        [record] = [record for record in caplog.records if "device_state" in record.getMessage()]
        assert record.levelno == logging.INFO and reason in record.getMessage()


@pytest.mark.parametrize(
    "block, world_size, reason",
    [
        ({"fp16": {"enabled": True}}, 1, "fp16"),
        ({"megatrain": {"master_dtype": "bf16"}}, 1, "master_dtype"),
        ({}, 2, "data parallel"),
    ],
)
def test_a_deepspeed_ratio_the_gpu_tier_cannot_honour_is_ignored_with_a_warning(block, world_size, reason, caplog):
    """DeepSpeed's ``offload_optimizer.ratio`` was ignored (with a warning) before the GPU
    tier existed: a JSON that trained then still trains where the tier cannot run, the key
    ignored with a warning naming why; ``megatrain.device_state`` itself is refused there."""
    zero = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}}
    megatrain = {**ds_config()["megatrain"], **block.get("megatrain", {})}
    config = {**ds_config(), **zero, **block, "megatrain": megatrain}
    if world_size > 1:
        config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * world_size
    with caplog.at_level(logging.WARNING, logger="megatrain_ds.config.engine_config"):
        options = parse_engine_config(config, world_size=world_size).options
    assert options.device_state == "none"
    assert "offload_optimizer.ratio" in caplog.text and reason in caplog.text
    if world_size == 1:  # data parallel with the megatrain key is refused at the build (below)
        with pytest.raises(ConfigError, match=reason):
            parse_engine_config({**config, "megatrain": {**megatrain, "device_state": 0.75}}, world_size=world_size)


def test_fractions_auto_and_data_parallel(caplog):
    """A fraction takes the longest prefix (resident state first) within its share of the
    trained elements; ``"auto"`` takes none without CUDA or with data parallel (logged at
    INFO), where a fraction is refused."""
    model = tiny_models.llama()
    named = [list(block.named_parameters()) for block in model.model.layers]
    blocks = {id(p) for group in named for _, p in group}
    named.append([(n, p) for n, p in model.named_parameters() if id(p) not in blocks])
    shapes = state_shapes(named, {p: 0 for _, p in model.named_parameters()}, torch.float32)
    trained = [shape.trained_numel for shape in shapes]
    total, resident, block = sum(trained), trained[-1], trained[0]
    assert device_prefix("none", shapes) == device_prefix("auto", shapes) == device_prefix(0.0, shapes) == 0
    assert device_prefix(resident / total, shapes) == 1
    assert device_prefix((resident + 2 * block) / total, shapes) == 3
    assert device_prefix((resident + 2 * block - 1) / total, shapes) == 2
    assert device_prefix(1.0, shapes) == len(shapes)
    engine = SimpleNamespace(
        config=parse_engine_config(ds_config(megatrain={"device_state": "auto"})),
        runtime=SimpleNamespace(device=torch.device("cpu"), is_cuda=False),
    )
    assert _device_state_count(engine, model, "none", Topology(), shapes) == 0  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="megatrain_ds.engine_build"):
        assert _device_state_count(engine, model, "none", Topology(node_ranks=2), shapes) == 0  # type: ignore[arg-type]
    assert [record.levelno for record in caplog.records if "data parallel" in record.getMessage()] == [logging.INFO]
    engine.config = parse_engine_config(ds_config(megatrain={"device_state": 0.5}))
    with pytest.raises(ConfigError, match="data parallel"):
        _device_state_count(engine, model, "none", Topology(node_ranks=2), shapes)  # type: ignore[arg-type]
    assert Where.DEVICE.on_device and not Where.DEVICE.on_host


def test_the_planner_times_the_host_pass_over_the_host_states_only():
    """``megatrain plan``'s optimizer time: the host kernel's share shrinks by the GPU tier's,
    which costs its ``24 + g + s`` bytes per parameter at the device's memory bandwidth."""
    shape = ModelShape(
        num_blocks=4, block_params=1000, total_block_params=4000, resident_params=1000, hidden=8, vocab=8
    )
    hardware = GPU_HARDWARE["h200"]
    untimed = dataclasses.replace(hardware, device_memory_bytes_per_s=0.0)
    base, half = RunSettings(seq_len=8), RunSettings(seq_len=8, device_state_share=0.5)
    assert optimizer_seconds(shape, half, untimed) == pytest.approx(0.5 * optimizer_seconds(shape, base, untimed))
    on_device = 0.5 * shape.params * (24 + half.grad_bytes + 2) / hardware.device_memory_bytes_per_s
    assert optimizer_seconds(shape, half, hardware) == pytest.approx(
        optimizer_seconds(shape, half, untimed) + on_device
    )


def test_the_planner_resolves_auto_as_the_engine_does():
    """``auto_device_state_share``: the engine's rule on the planned sizes. A bf16 run with
    clipping keeps 16 B per parameter of a state on the device (master 4, m and v 8, shadow 2,
    held bf16 gradient 2): the resident state (2e8 parameters) 3.2 GB, each block (1e8) 1.6
    GB. The engine's own peak is two weight buffers of a block and the resident copy, 0.8 GB.
    On 16 GiB the budget is 0.8 * (17.18 - 0.8 - 4.29) GB = 9.67 GB: the resident state and 4
    blocks (9.6 GB), 6e8 of 1e9 parameters; on 8 GiB 2.8 GB, not even the resident state."""
    shape = ModelShape(
        num_blocks=8,
        block_params=10**8,
        total_block_params=8 * 10**8,
        resident_params=2 * 10**8,
        hidden=4096,
        vocab=32000,
    )
    settings = RunSettings(seq_len=1024)
    for gib, share in ((8, 0.0), (16, 0.6), (4096, 1.0)):
        hardware = dataclasses.replace(GPU_HARDWARE["h100"], device_memory_bytes=gib << 30)
        assert auto_device_state_share(shape, settings, hardware) == pytest.approx(share), gib
    h100 = GPU_HARDWARE["h100"]
    assert auto_device_state_share(shape, dataclasses.replace(settings, nvme=True), h100) == 0.0
    assert auto_device_state_share(shape, dataclasses.replace(settings, master_bytes=2), h100) == 0.0
    assert auto_device_state_share(shape, settings, dataclasses.replace(h100, shares_host_memory=True)) == 0.0


def test_megatrain_plan_defaults_to_auto(capsys):
    """``megatrain plan`` without ``--device-state`` plans the engine's default: a tiny model's
    states all on an H200, none of them in host memory; ``--device-state none`` keeps them
    there."""
    argv = ["plan", "--model", "configs/models/tiny_llama.json", "--gpu", "h200", "--seq-len", "256", "--json"]
    plans = {}
    for extra in ([], ["--device-state", "none"]):
        assert cli.main([*argv, *extra]) == 0
        plans[bool(extra)] = json.loads(capsys.readouterr().out)
    default, host_only = plans[False], plans[True]
    assert default["settings"]["device_state_share"] == 1.0 and default["gpu_bytes"]["device_state"] > 0
    assert host_only["settings"]["device_state_share"] == 0.0 and "device_state" not in host_only["gpu_bytes"]
    assert default["host_bytes"]["master"] == 0 < host_only["host_bytes"]["master"]
    # The table says that its optimizer_device recommendation concerns no state here.
    note = "(optimizer_device, below: where the states left in host memory would be updated; none are here)"
    for extra, noted in (([], True), (["--device-state", "none"], False)):
        assert cli.main([*argv[:-1], *extra]) == 0
        assert (note in capsys.readouterr().out) == noted, extra


def test_a_non_finite_step_leaves_the_device_states_untouched():
    """A NaN in block 0's gradient (on the device): its norm, summed on the device, makes the
    step skipped; no state is updated, on the device or the host, and training goes on."""
    config = ds_config(clipping=1.0, megatrain={"device_state": 0.5, "speculative_blocks": 4})
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))
    try:
        assert 0 in engine.placement.device_indices
        _train(engine, 1)
        before = _states(engine)
        push = engine.sink.push
        engine.sink.push = lambda index, offset, grad, final: push(
            index, offset, grad * float("nan") if index == 0 else grad, final
        )
        _train(engine, 1)
        del engine.sink.push  # the instance attribute: the class's method again
        assert engine.skipped_steps == 1 and not engine.was_step_applied()
        for index, (ours, theirs) in enumerate(zip(_states(engine), before)):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ours[kind], theirs[kind]), (index, kind)
        _train(engine, 1)
        assert engine.was_step_applied() and engine.optimizer_steps == 2
    finally:
        engine.destroy()


def test_without_cuda_or_triton_s_interpreter_every_state_stays_in_host_memory(monkeypatch, caplog):
    """On a CPU-only machine the "device" is the host, where the states live anyway, and the
    tier's kernel runs only in Triton's interpreter (which these tests turn on): without it a
    ``device_state`` (or a DeepSpeed ``ratio``) keeps nothing apart, with a warning, instead
    of failing in the kernel."""
    monkeypatch.setattr("megatrain_ds.engine_build._triton_interpreted", lambda: False)
    with caplog.at_level(logging.WARNING, logger="megatrain_ds.engine_build"):
        engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"device_state": 0.5})))
    try:
        assert engine.device_states is None
        assert all(state.master.device.type == "cpu" for state in engine.states)
        assert "no CUDA device" in caplog.text
        batch = tiny_models.make_batch(0)
        engine.backward(engine(**batch).loss)
        engine.step()
    finally:
        engine.destroy()


def test_the_default_keeps_every_state_in_host_memory_without_cuda(caplog):
    """The default ``"auto"`` on a CPU-only machine, with Triton's interpreter on (these
    tests' setting, under which a fraction would put states on the "device"): no state apart,
    the CPU path as it always was, the reason at INFO."""
    with caplog.at_level(logging.INFO, logger="megatrain_ds.engine_build"):
        engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config()))
    try:
        assert engine.config.options.device_state == "auto"
        assert engine.device_states is None and list(engine.placement.device_indices) == []
        assert engine.device_bytes()["device_state"] == 0
        [record] = [record for record in caplog.records if "no CUDA device" in record.getMessage()]
        assert record.levelno == logging.INFO
    finally:
        engine.destroy()


@pytest.mark.parametrize("setting", [0.5, "none"])
def test_a_device_out_of_memory_error_names_the_gpu_tier_and_its_fix(setting):
    """``"auto"`` sizes the tier at start-up, before any batch: a device out-of-memory error
    in forward (a block's) or in backward (from the loss's gradient hook, as autograd runs it)
    says what the tier holds and how to give it back to activations. Without states on the
    device the error is left as it was."""
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(megatrain={"device_state": setting})))

    def out_of_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = engine.blocks.blocks[0].register_forward_pre_hook(out_of_memory)
    try:
        engine.train()
        batch = tiny_models.make_batch(0)
        with pytest.raises(torch.OutOfMemoryError) as in_forward:
            engine(**batch)
        hook.remove()
        loss = engine(**batch).loss
        loss.register_hook(out_of_memory)
        with pytest.raises(torch.OutOfMemoryError) as in_backward:
            engine.backward(loss)
        for raised in (in_forward.value, in_backward.value):
            message = str(raised)
            assert message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
            explained = 'set "megatrain": {"device_state": "none"}' in message
            assert explained == (setting != "none"), message
            if explained:
                assert f"device_state {setting!r}" in message and "GiB) on the device" in message
    finally:
        engine.destroy()


def test_auto_keeps_every_state_on_the_host_where_triton_is_missing(monkeypatch, caplog):
    """The tier's update is a Triton kernel: on a CUDA machine without Triton the default
    ``"auto"`` keeps every state on the host (logged at INFO) instead of failing at the build;
    with Triton it goes on to size the tier (here stopped where it would ask preflight)."""
    import importlib.util

    from megatrain_ds import engine_build

    model = tiny_models.llama()
    shapes = state_shapes([list(model.named_parameters())], {p: 0 for p in model.parameters()}, torch.float32)
    engine = SimpleNamespace(
        config=parse_engine_config(ds_config()),  # the default: "auto"
        runtime=SimpleNamespace(device=torch.device("cpu"), is_cuda=True),
        optimizer=None,
    )
    monkeypatch.setattr(engine_build, "available_memory", lambda device: SimpleNamespace(device=80 << 30))

    class Sized(Exception):
        pass

    def preflight_reached(*args):
        raise Sized

    monkeypatch.setattr(engine_build, "PreflightInputs", preflight_reached)
    with pytest.raises(Sized):
        _device_state_count(engine, model, "none", Topology(), shapes)  # type: ignore[arg-type]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else find_spec(name))
    with caplog.at_level(logging.INFO, logger="megatrain_ds.engine_build"):
        assert _device_state_count(engine, model, "none", Topology(), shapes) == 0  # type: ignore[arg-type]
    assert "no Triton, every optimizer state stays in host memory" in caplog.text
