"""The engine on a real CUDA device: parity, copy/compute overlap, memory flat in depth.

Skipped without CUDA (CI has none); run on a GPU machine with ``bash scripts/test.sh -m gpu``
or ``python -m pytest tests/test_gpu.py``.
"""

import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers
from side_by_side import LR, WEIGHT_DECAY, ds_config, relative_weight_error

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.model.block_template import BlockTemplate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HOST_STATE = {"device_state": "none"}
"""The streaming path's tests keep every optimizer state in host memory: the default ("auto",
the GPU tier) would keep a tiny model's states whole on the GPU, and these would then test
the tier (below) instead of the weight copies, the gradients' way to the host and host AdamW."""


def _train_on_cuda(make_model, config, autocast_reference, steps=5):
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model).cuda()
    engine = MegatrainEngine(model, parse_engine_config(config))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ours, theirs = [], []
    for step in range(steps):
        batch = {k: v.cuda() for k, v in tiny_models.make_batch(step).items()}
        torch.manual_seed(1000 + step)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
        torch.manual_seed(1000 + step)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_reference):
            reference_loss = reference(**batch).loss
        reference_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), config["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad()
        theirs.append(reference_loss.item())
    return engine, reference.cpu(), ours, theirs


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mixtral"])
def test_fp32_parity_on_cuda(family):
    """fp32 on CUDA: same tolerances as the CPU parity suite (TF32 disabled by default)."""
    engine, reference, ours, theirs = _train_on_cuda(
        tiny_models.FAMILIES[family], ds_config(clipping=1.0, megatrain=HOST_STATE), autocast_reference=False
    )
    try:
        for a, b in zip(ours, theirs):
            assert math.isclose(a, b, rel_tol=1e-5)
        assert relative_weight_error(engine, reference) < 2e-6
    finally:
        engine.destroy()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_compute_against_bf16_autocast_reference(family):
    """bf16 compute vs a bf16-autocast fp32-master reference. The engine runs norms and
    residual adds in bf16 too (autocast keeps some in fp32), so agreement is at bf16
    resolution: per-step loss 1e-2 relative, weights 1e-2 global relative after 5 steps."""
    engine, reference, ours, theirs = _train_on_cuda(
        tiny_models.FAMILIES[family], ds_config(clipping=1.0, bf16=True, megatrain=HOST_STATE), autocast_reference=True
    )
    try:
        for a, b in zip(ours, theirs):
            assert math.isclose(a, b, rel_tol=1e-2)
        assert relative_weight_error(engine, reference) < 1e-2
    finally:
        engine.destroy()


def _wide_llama(num_layers: int, hidden: int = 1024, intermediate: int = 4096) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _sleep_cycles_lasting(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that take ``ms`` at the clock the device runs now.
    Not ``ms * clock_rate``: that is the top clock, and an H200 that has just been idle runs
    slower (the first GPU run's sleeps took ~1.6x as long, which made full overlap look
    serialised)."""
    cycles = int(ms * torch.cuda.get_device_properties(0).clock_rate)  # kHz = cycles per ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # the clock rises under load: measure again at the one it reaches
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        cycles = max(1, int(cycles * ms / start.elapsed_time(end)))
    return cycles


def test_weight_copies_overlap_block_compute(monkeypatch):
    """Each block's compute is padded with a sleep kernel as long as its weight copy; with
    overlap the forward takes about one of the two per block, serialised it would take both.

    The blocks are large (128 MiB of bf16 weights, ~2.4 ms a copy on PCIe 5) so that the
    device, not the host, sets the pace. With 1024-wide blocks (0.6 ms copies, 0.6 ms
    sleeps) an H200 machine took 9.4 ms for the 8 blocks, 1.2 ms a block: the host's pace
    at 16 tokens, since device timestamps there showed each copy overlapping the block
    before it (tests/test_trace.py; bench/results/gpu_H200/timeline.png at 4096 tokens)."""
    config = parse_engine_config(ds_config(bf16=True, megatrain=HOST_STATE))  # every block's weights copied
    engine = MegatrainEngine(_wide_llama(8, hidden=2048, intermediate=8192), config)
    try:
        state = engine.states[0]
        buffer = torch.empty_like(state.streamed, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            buffer.copy_(state.streamed, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        copy_ms = start.elapsed_time(end) / 8
        cycles = _sleep_cycles_lasting(copy_ms)
        original_run = BlockTemplate.run

        def slow_run(self, *args, **kwargs):
            torch.cuda._sleep(cycles)
            return original_run(self, *args, **kwargs)

        monkeypatch.setattr(BlockTemplate, "run", slow_run)
        batch = torch.randint(0, 256, (1, 16), device="cuda")
        engine.eval()
        with torch.no_grad():
            engine(input_ids=batch)  # warm-up
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine(input_ids=batch)
            torch.cuda.synchronize()
        forward_ms = (time.perf_counter() - started) * 1000
        serialised_ms = 8 * 2 * copy_ms
        assert forward_ms < 0.8 * serialised_ms, (forward_ms, serialised_ms, copy_ms)
    finally:
        engine.destroy()


def peak_bytes_of_two_steps(depth: int) -> tuple[int, dict[str, int]]:
    """Peak device memory of two training steps of ``depth`` wide blocks, above what was
    allocated before the engine, and what the engine itself accounts for."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    # The streamed engine's memory: states kept on the GPU ("auto") would grow with depth.
    engine = MegatrainEngine(_wide_llama(depth), parse_engine_config(ds_config(bf16=True, megatrain=HOST_STATE)))
    try:
        for _step in range(2):
            ids = torch.randint(0, 256, (2, 128), device="cuda")
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, engine.device_bytes()
    finally:
        engine.destroy()


def test_peak_gpu_memory_is_flat_in_depth():
    """Each depth in a process of its own. In one process the first GPU run measured
    33.5 MB for 8 blocks against 170 MB for 32, less than the 8 blocks' own weight buffers
    (64 MiB): device memory allocated before the measurement (most likely the engine of the
    test that failed before it, held by its traceback) was freed during it."""
    code = "import json, sys, test_gpu; print(json.dumps(test_gpu.peak_bytes_of_two_steps(int(sys.argv[1]))))"
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    peaks, held = {}, {}
    for depth in (8, 32):
        child = subprocess.run(
            [sys.executable, "-c", code, str(depth)], cwd=here, env=env, capture_output=True, text=True, timeout=300
        )
        assert child.returncode == 0, child.stderr[-3000:]
        peaks[depth], held[depth] = json.loads(child.stdout.strip().splitlines()[-1])
    assert peaks[32] <= 1.10 * peaks[8], (peaks, held)


def test_checkpoint_save_and_resume_on_cuda(tmp_path):
    """Save after 2 steps, train 2 more, load, train the same 2 again: the same losses and
    masters bit for bit (pinned host state, device resident copies and streams on CUDA)."""
    torch.manual_seed(0)
    config = ds_config(accumulation=2, clipping=1.0, megatrain=HOST_STATE)  # the GPU tier's: further down
    engine = MegatrainEngine(tiny_models.llama(), parse_engine_config(config))

    def train(first_step: int, steps: int) -> list[float]:
        losses = []
        for micro in range(2 * first_step, 2 * (first_step + steps)):
            batch = {k: v.cuda() for k, v in tiny_models.make_batch(micro).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    try:
        train(0, 2)
        engine.save_checkpoint(str(tmp_path), tag="step2")
        straight = train(2, 2)
        engine.settle_optimizer()  # the host state is read directly: the last update may run behind step()
        masters = [state.master.clone() for state in engine.states]
        engine.load_checkpoint(str(tmp_path), tag="step2")
        assert train(2, 2) == straight
        engine.settle_optimizer()
        for ours, theirs in zip((state.master for state in engine.states), masters):
            assert torch.equal(ours, theirs)
    finally:
        engine.destroy()


# -- the GPU tier ("device_state"; its CPU side is tests/test_device_state.py) -------------------


def test_device_state_parity_on_cuda():
    """Half the states kept on the GPU (the resident state and the first blocks: their events,
    the optimizer stream, the Triton kernel in place, the gradients added on the device), the
    rest on the host: the CPU parity suite's tolerances (the kernel rounds < 1 ulp per step).
    Named for the sanitizer step of scripts/gpu_validate.sh ("parity")."""
    config = ds_config(clipping=1.0, megatrain={"device_state": 0.5})
    engine, reference, ours, theirs = _train_on_cuda(tiny_models.llama, config, autocast_reference=False)
    try:
        on_device = engine.placement.device_indices
        assert 0 < len(on_device) < len(engine.states)
        assert all(engine.states[index].master.is_cuda for index in on_device)
        assert all(engine.streamer.transfers[index] == 0 for index in on_device if index != engine._resident_index)
        for a, b in zip(ours, theirs):
            assert math.isclose(a, b, rel_tol=1e-5)
        assert relative_weight_error(engine, reference) < 2e-6
    finally:
        engine.destroy()


def test_device_state_checkpoint_on_cuda(tmp_path):
    """Saved from device tensors and loaded into them (through host copies,
    checkpoint/tensor_files.py), inside an accumulation window: a fresh engine with the same
    setting, and one with "none", hold the saved masters, moments and gradients bit for bit."""
    kinds = ("master", "exp_avg", "exp_avg_sq", "grad")
    engines = []

    def build(seed: int, setting: float | str) -> MegatrainEngine:
        torch.manual_seed(seed)
        config = ds_config(accumulation=2, clipping=1.0, megatrain={"device_state": setting})
        engines.append(MegatrainEngine(tiny_models.llama(), parse_engine_config(config)))
        return engines[-1]

    try:
        engine = build(0, 0.5)
        for micro in range(3):
            batch = {k: v.cuda() for k, v in tiny_models.make_batch(micro).items()}
            engine.backward(engine(**batch).loss)
            engine.step()
        engine.save_checkpoint(str(tmp_path), tag="middle")
        engine.settle_optimizer()  # the states are read directly
        saved = [{kind: getattr(state, kind).cpu().clone() for kind in kinds} for state in engine.states]
        for setting in (0.5, "none"):
            other = build(1, setting)
            other.load_checkpoint(str(tmp_path), tag="middle")
            other.settle_optimizer()
            for index, (state, expected) in enumerate(zip(other.states, saved)):
                for kind in kinds:
                    assert torch.equal(getattr(state, kind).cpu(), expected[kind]), (setting, index, kind)
    finally:
        for one in engines:
            one.destroy()


def test_device_state_auto_keeps_a_small_model_whole_on_the_gpu(caplog):
    """The default ("auto") on a GPU with room: every state of a tiny model fits, and the
    decision is logged."""
    torch.manual_seed(0)
    config = parse_engine_config(ds_config())
    assert config.options.device_state == "auto"
    with caplog.at_level("INFO", logger="megatrain_ds.optimizer_build"):
        engine = MegatrainEngine(tiny_models.llama(), config)
    try:
        assert len(engine.placement.device_indices) == len(engine.states)
        assert "megatrain: device_state 'auto'" in caplog.text
        assert engine.device_bytes()["device_state"] == sum(engine.placement.device_bytes().values()) > 0
    finally:
        engine.destroy()
