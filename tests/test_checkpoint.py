"""Checkpoints: exact resume, Hugging Face compatibility, DeepSpeed's API, crash safety.

Every comparison here is bitwise (``torch.equal``, ``==`` on floats): a resumed run must
continue exactly as the uninterrupted one, on the same machine and thread count.
"""

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoint_worker
import fork_server
import pytest
import tiny_models
import torch
import transformers
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config
from megatrain_ds.checkpoint import save as checkpointing
from megatrain_ds.checkpoint.directories import LATEST_FILE, MANIFEST_FILE

TESTS = Path(__file__).parent
# The workers import this checkout's package whether or not (and however) it is installed.
WORKER_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
}


pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def assert_same_host_state(a, b):
    a.settle_optimizer(), b.settle_optimizer()  # the host state is read directly
    assert len(a.states) == len(b.states)
    for index, (x, y) in enumerate(zip(a.states, b.states)):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(x, kind), getattr(y, kind)), (index, kind)


def run_worker(*args, timeout=120):
    command = [sys.executable, str(TESTS / "checkpoint_worker.py"), *map(str, args)]
    return fork_server.run(command, cwd=TESTS, env=WORKER_ENV, timeout=timeout)


@pytest.fixture
def one_thread():
    """The thread count the workers must use: the uninterrupted run and the resumed one
    use the same (CPU kernels may sum in another order with another count)."""
    return torch.get_num_threads()  # 1, set by on_the_cpu


def test_resume_in_a_fresh_process_is_exact(tmp_path, one_thread):
    """Train 3 steps (accumulation 2, clipping, warm-up scheduler, dropout), save, train 3
    more; a fresh process with another initialisation loads and trains the same 3 steps:
    identical losses, weights, Adam moments, learning rates and counters."""
    engine = checkpoint_worker.build(seed=0)
    try:
        checkpoint_worker.train(engine, 3)
        assert engine.save_checkpoint(tmp_path) is True
        assert (tmp_path / LATEST_FILE).read_text() == "global_step3"
        losses = checkpoint_worker.train(engine, 3)
        result = run_worker("resume", tmp_path, 3, tmp_path / "resumed.pt", one_thread)
        assert result.returncode == 0, result.stderr[-3000:]
        resumed = torch.load(tmp_path / "resumed.pt")
        assert resumed["losses"] == losses
        assert resumed["lr"] == engine.get_lr()
        assert resumed["counters"] == (engine.global_steps, engine.micro_steps, engine.optimizer_steps) == (6, 12, 6)
        expected = checkpoint_worker.host_state(engine)
        assert expected.keys() == resumed["state"].keys()
        for key, value in expected.items():
            assert torch.equal(value, resumed["state"][key]), key
    finally:
        engine.destroy()


def test_resume_from_inside_an_accumulation_window_is_exact(tmp_path):
    """Saved after the first of two micro-batches: the fp32 gradient accumulator is part
    of the checkpoint, so the resumed step equals the uninterrupted one."""
    engine = checkpoint_worker.build(seed=0)
    other = checkpoint_worker.build(seed=1)
    try:
        checkpoint_worker.train(engine, 1)
        batch = tiny_models.make_batch(engine.micro_steps)
        engine.backward(engine(**batch).loss)
        engine.step()
        assert engine.micro_steps % 2 == 1
        engine.save_checkpoint(tmp_path, tag="middle")
        losses = checkpoint_worker.train(engine, 2)
        other.load_checkpoint(tmp_path)
        assert checkpoint_worker.train(other, 2) == losses
        assert_same_host_state(engine, other)
    finally:
        engine.destroy()
        other.destroy()


@pytest.mark.parametrize("family, bf16", [("qwen2", True), ("gpt2", False)])
def test_tag_directory_loads_with_from_pretrained(tmp_path, family, bf16):
    """Tied embeddings (qwen2) and Conv1D weights (gpt2); with bf16 compute the files
    still hold the fp32 masters. Shards are forced small so the index is exercised."""
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.FAMILIES[family](), parse_engine_config(ds_config(bf16=bf16)))
    try:
        for seed in range(2):
            engine.backward(engine(**tiny_models.make_batch(seed)).loss)
            engine.step()
        engine.settle_optimizer()  # the module's save_checkpoint, called directly, does not
        checkpointing.save_checkpoint(engine, tmp_path, tag="hf", max_shard_bytes=20_000)
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
        ours, theirs = engine.module.state_dict(), loaded.state_dict()
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            assert value.dtype == torch.float32 and torch.equal(value, theirs[key]), key
        batch = tiny_models.make_batch(5)
        engine.eval()
        loaded.eval()
        if not bf16:  # the same fp32 model computes the same loss
            assert engine(**batch).loss.item() == pytest.approx(loaded(**batch).loss.item(), rel=1e-6)
    finally:
        engine.destroy()


def test_deepspeed_semantics_of_tags_latest_and_return_values(tmp_path, caplog):
    engine = checkpoint_worker.build(seed=0)
    fresh = checkpoint_worker.build(seed=1)
    try:
        with caplog.at_level(logging.WARNING):
            assert fresh.load_checkpoint(tmp_path) == (None, None)
        assert "no 'latest' file" in caplog.text
        checkpoint_worker.train(engine, 1)
        engine.save_checkpoint(tmp_path, client_state={"epoch": 7, "sampler": [3, 1]})
        checkpoint_worker.train(engine, 1)
        engine.save_checkpoint(tmp_path, tag="second", save_latest=False)
        assert (tmp_path / LATEST_FILE).read_text() == "global_step1"
        path, client_state = fresh.load_checkpoint(tmp_path)
        assert path == str(tmp_path / "global_step1") and client_state == {"epoch": 7, "sampler": [3, 1]}
        assert (fresh.global_steps, fresh.micro_steps, fresh.optimizer_steps) == (1, 2, 1)
        path, client_state = fresh.load_checkpoint(tmp_path, tag="second")
        assert path == str(tmp_path / "second") and client_state == {}
        assert_same_host_state(engine, fresh)
    finally:
        engine.destroy()
        fresh.destroy()


def test_partial_loads_leave_the_rest_alone(tmp_path):
    """load_module_only: weights only. load_optimizer_states=False: no Adam moments or
    step count (the Adam bias correction belongs with them), but counters and scheduler."""
    engine = checkpoint_worker.build(seed=0)
    checkpoint_worker.train(engine, 2)
    engine.save_checkpoint(tmp_path)  # settles the last step's update: engine.states are read below
    for kwargs in ({"load_module_only": True}, {"load_optimizer_states": False}):
        fresh = checkpoint_worker.build(seed=1)
        try:
            moments = [state.exp_avg.clone() for state in fresh.states]
            fresh.load_checkpoint(tmp_path, **kwargs)
            for ours, theirs, before in zip(fresh.states, engine.states, moments):
                assert torch.equal(ours.master, theirs.master)
                assert torch.equal(ours.exp_avg, before)
            assert fresh.optimizer_steps == 0
            module_only = kwargs.get("load_module_only", False)
            assert fresh.global_steps == (0 if module_only else 2)
            assert fresh.lr_scheduler.last_epoch == (0 if module_only else 2)
        finally:
            fresh.destroy()
    engine.destroy()


def test_frozen_parameters_can_be_left_out(tmp_path):
    torch.manual_seed(0)
    model = tiny_models.llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = MegatrainEngine(model, parse_engine_config(ds_config()))
    torch.manual_seed(1)
    other_model = tiny_models.llama()
    other_model.model.embed_tokens.weight.requires_grad_(False)
    other = MegatrainEngine(other_model, parse_engine_config(ds_config()))
    try:
        engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
        index = json.loads((tmp_path / "global_step0" / "model.safetensors.index.json").read_text())
        assert "model.embed_tokens.weight" not in index["weight_map"]
        frozen_before = other_model.model.embed_tokens.weight.detach().clone()
        other.load_checkpoint(tmp_path)
        assert torch.equal(other.module.state_dict()["model.embed_tokens.weight"], frozen_before)
        assert torch.equal(other.states[0].master, engine.states[0].master)
    finally:
        engine.destroy()
        other.destroy()


def test_master_dtype_change_converts_on_load(tmp_path):
    """A bf16-master checkpoint (bf16 files) loads into an fp32-master engine, upcast exactly."""
    torch.manual_seed(0)
    bf16 = MegatrainEngine(
        tiny_models.llama(), parse_engine_config(ds_config(bf16=True, megatrain={"master_dtype": "bf16"}))
    )
    torch.manual_seed(1)
    fp32 = MegatrainEngine(tiny_models.llama(), parse_engine_config(ds_config(bf16=True)))
    try:
        bf16.backward(bf16(**tiny_models.make_batch(0)).loss)
        bf16.step()
        bf16.save_checkpoint(tmp_path)
        fp32.load_checkpoint(tmp_path)
        for ours, theirs in zip(fp32.states, bf16.states):
            assert ours.master.dtype == torch.float32 and torch.equal(ours.master, theirs.master.float())
            assert torch.equal(ours.shadow, theirs.master)  # the streamed bf16 copy follows
            assert torch.equal(ours.exp_avg, theirs.exp_avg)
    finally:
        bf16.destroy()
        fp32.destroy()


# -- crash safety ----------------------------------------------------------------------------


def test_a_failed_save_removes_its_partial_directory(tmp_path, monkeypatch):
    """A full disk (or any error) in the middle of a save: the error reaches the caller,
    the partial directory is gone, the previous checkpoint and ``latest`` are untouched."""
    engine = checkpoint_worker.build(seed=0)
    fresh = checkpoint_worker.build(seed=1)
    try:
        engine.save_checkpoint(tmp_path, tag="before")
        checkpoint_worker.train(engine, 1)
        original = checkpointing.write_safetensors
        calls = []

        def disk_full(path, *args, **kwargs):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            return original(path, *args, **kwargs)

        monkeypatch.setattr(checkpointing, "write_safetensors", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            engine.save_checkpoint(tmp_path, tag="after")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["before", LATEST_FILE]
        fresh.load_checkpoint(tmp_path)
        assert fresh.global_steps == 0
    finally:
        engine.destroy()
        fresh.destroy()


class _Crash(BaseException):
    """Stands for the process dying: nothing after it runs, not even clean-up."""


def _crash_at(monkeypatch, event: int) -> list[str]:
    """Make the ``event``-th durable write, rename or directory removal of a save raise
    ``_Crash``, and disable the clean-up a real crash would not get to run."""
    seen: list[str] = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            seen.append(name)
            if len(seen) == event:
                raise _Crash(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, hooked)

    from megatrain_ds.checkpoint import directories as checkpoint_files

    for name in ("write_safetensors", "write_bytes_durably", "write_manifest", "publish_dir", "write_latest"):
        wrap(checkpointing, name)
    wrap(checkpoint_files.os, "rename")
    wrap(checkpoint_files.os, "replace")
    monkeypatch.setattr(checkpointing.shutil, "rmtree", lambda *args, **kwargs: None)
    return seen


def test_a_crash_at_any_point_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    """Crash the second save at every write, rename and replace in turn (the same tag
    saved twice, so the set-aside path is crossed too): whatever ``latest`` then names,
    and the tag itself, load completely and equal one of the two saved states."""
    engine = checkpoint_worker.build(seed=0)
    checkpoint_worker.train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    first = [state.master.clone() for state in engine.states]
    checkpoint_worker.train(engine, 1)
    engine.settle_optimizer()  # the host state is read directly
    second = [state.master.clone() for state in engine.states]
    fresh = checkpoint_worker.build(seed=1)
    event = 0
    try:
        while True:
            event += 1
            with monkeypatch.context() as patch:
                seen = _crash_at(patch, event)
                try:
                    engine.save_checkpoint(tmp_path, tag="t")
                    finished = True
                except _Crash:
                    finished = False
            with caplog.at_level(logging.WARNING):
                fresh.load_checkpoint(tmp_path)
            loaded = [state.master for state in fresh.states]
            assert all(map(torch.equal, loaded, first)) or all(map(torch.equal, loaded, second)), seen
            if finished:
                break
        assert event > 8 and all(map(torch.equal, loaded, second))
        assert "ignoring" in caplog.text and "partial directory of an interrupted save" in caplog.text
        assert "loading the previous copy" in caplog.text  # crashed between the two renames
        engine.save_checkpoint(tmp_path, tag="t")  # a later save clears the leftovers
        assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_FILE, "t"]
    finally:
        engine.destroy()
        fresh.destroy()


def test_sigkill_at_a_random_moment_of_a_save(tmp_path, one_thread):
    """A process saving over and over is killed at a random moment: the checkpoint
    ``latest`` names loads, equals the one saved before, and resumes identically."""
    command = [sys.executable, str(TESTS / "checkpoint_worker.py"), "save-loop", str(tmp_path), str(one_thread)]
    process = fork_server.popen(command, cwd=TESTS, env=WORKER_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    try:
        assert process.stdout.readline().strip() == "READY", process.stderr.read()[-3000:]
        time.sleep(random.uniform(0.0, 0.5))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    latest = checkpoint_worker.build(seed=2)
    base = checkpoint_worker.build(seed=3)
    try:
        # Each load restores the (global) RNG state, so each resumed step follows its load.
        latest.load_checkpoint(tmp_path)
        latest_losses = checkpoint_worker.train(latest, 1)
        base.load_checkpoint(tmp_path, tag="base")
        assert checkpoint_worker.train(base, 1) == latest_losses
        assert_same_host_state(latest, base)
    finally:
        latest.destroy()
        base.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_save_and_load_on_cuda(tmp_path):
    """Pinned host state is written and read in place; the resident device copy and the
    CUDA RNG state come back with it. Every state in host memory ("device_state": "none"):
    the default would keep the tiny model's states on the GPU, whose checkpoints
    tests/test_gpu.py checks."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    host_state = {"device_state": "none"}
    engine = checkpoint_worker.build(seed=0, device=cuda, megatrain=host_state)
    fresh = checkpoint_worker.build(seed=1, device=cuda, megatrain=host_state)
    try:
        checkpoint_worker.train(engine, 2)
        engine.save_checkpoint(tmp_path)
        rng = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(123)
        fresh.load_checkpoint(tmp_path)
        assert torch.equal(torch.cuda.get_rng_state(), rng)
        assert_same_host_state(engine, fresh)
        torch.cuda.synchronize()
        assert torch.equal(fresh.resident.device_flat.cpu(), fresh.resident.state.streamed)
        losses = checkpoint_worker.train(fresh, 1)
        assert all(math.isfinite(loss) for loss in losses)
    finally:
        engine.destroy()
        fresh.destroy()


# -- integrity --------------------------------------------------------------------------------


@pytest.fixture
def damaged(saved, tmp_path):
    import shutil

    shutil.copytree(saved.root, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.fixture
def fresh_engine():
    engine = checkpoint_worker.build(seed=1)
    yield engine
    engine.destroy()


def _file(directory: Path, name: str) -> Path:
    """``"model:1"``: the second weight shard; other names are plain file names."""
    if ":" not in name:
        return directory / "good" / name
    prefix, number = name.split(":")
    return sorted((directory / "good").glob(f"{prefix}-*.safetensors"))[int(number)]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model:1", "optimizer:0", "engine_state.json", "engine_state.safetensors"])
def test_truncated_file_is_named(damaged, fresh_engine, name):
    path = _file(damaged, name)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(checkpointing.CheckpointError, match=f"{path.name}: file is truncated"):
        fresh_engine.load_checkpoint(damaged)


@pytest.mark.parametrize(
    "name, where, message",
    [
        ("model:2", "data", "checksum mismatch"),
        ("model:0", "header", r"corrupted header \(checksum mismatch\)"),
        ("optimizer:1", "data", "checksum mismatch"),
        ("engine_state.json", "data", "checksum mismatch"),
        ("engine_state.safetensors", "data", "checksum mismatch"),
    ],
)
def test_flipped_bytes_are_named(damaged, fresh_engine, name, where, message):
    path = _file(damaged, name)
    _flip(path, 20 if where == "header" else path.stat().st_size // 2)
    with pytest.raises(checkpointing.CheckpointError, match=f"{path.name}: {message}"):
        fresh_engine.load_checkpoint(damaged)


def test_damaged_manifest_is_named(damaged, fresh_engine):
    _flip(damaged / "good" / MANIFEST_FILE, 40)
    with pytest.raises(checkpointing.CheckpointError, match=f"{MANIFEST_FILE}: corrupted manifest"):
        fresh_engine.load_checkpoint(damaged)


@pytest.mark.parametrize(
    "make_model, message",
    [
        (lambda: tiny_models.llama(), r"the checkpoint has no tensor 'model.embed_tokens.weight'"),
        (
            lambda: tiny_models.gpt2(num_layers=3),
            r"tensor 'transformer.h.3.[\w.]+' of model-0000\d-of-00003.safetensors does not exist in this model",
        ),
        (lambda: tiny_models.gpt2(num_layers=5), r"the checkpoint has no tensor 'transformer.h.4.ln_1.weight'"),
    ],
)
def test_checkpoint_of_another_model_names_the_tensor(saved, make_model, message):
    engine = MegatrainEngine(make_model(), parse_engine_config(ds_config()))
    try:
        with pytest.raises(checkpointing.CheckpointError, match=message):
            engine.load_checkpoint(saved.root)
    finally:
        engine.destroy()


def test_different_shape_names_the_tensor_and_both_shapes(saved):
    import transformers as tf

    config = tf.GPT2Config(
        vocab_size=tiny_models.VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_inner=64,
        n_positions=64,
        attn_implementation="eager",
    )
    engine = MegatrainEngine(tf.GPT2LMHeadModel(config), parse_engine_config(ds_config()))
    try:
        with pytest.raises(
            checkpointing.CheckpointError,
            match=r"tensor 'transformer.h.0.mlp.c_fc.weight': the checkpoint \(model-\d+-of-\d+"
            r".safetensors\) has shape \[32, 128\], this model has \[32, 64\]",
        ):
            engine.load_checkpoint(saved.root)
    finally:
        engine.destroy()
