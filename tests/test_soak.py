"""Soak: a few hundred steps with periodic checkpoints; nothing grows, nothing leaks.

Marked ``slow`` (CI runs it; ~5 s on one idle CPU core): 240 optimizer steps of a 3-block
Llama with clipping, a save every 20 steps (two tags, overwritten in turn, so the
replace path runs) and a load every 80. After warm-up (step 40) the resident set may
grow by less than 2%; the gradient worker is the only thread the engine adds and
``destroy`` ends it; no file descriptor stays open. The reference for the numbers is
the engine itself: the last checkpoint, loaded into a second engine, equals the live
state bit for bit, and the training loss falls.
"""

import os
import threading

import pytest
import tiny_models
import torch
from side_by_side import ds_config

from megatrain_ds import MegatrainEngine, parse_engine_config

STEPS, WARM_UP, SAVE_EVERY, LOAD_EVERY = 240, 40, 20, 80


pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_files() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_soak_keeps_memory_threads_and_files_flat(tmp_path):
    threads_before, files_before = threading.active_count(), _open_files()
    torch.manual_seed(0)
    engine = MegatrainEngine(tiny_models.llama(num_layers=3), parse_engine_config(ds_config()))
    batches = [tiny_models.make_batch(seed) for seed in range(8)]
    losses = []
    try:
        for step in range(STEPS):
            loss = engine(**batches[step % len(batches)]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step % SAVE_EVERY == SAVE_EVERY - 1:
                engine.save_checkpoint(tmp_path, tag=f"tag{step // SAVE_EVERY % 2}")
            if step % LOAD_EVERY == LOAD_EVERY - 1:
                engine.load_checkpoint(tmp_path)  # the state just saved: training goes on unchanged
            if step == WARM_UP:
                rss_warm, files_warm = _rss(), _open_files()
            # The gradient worker and the optimizer's finish worker (optimizer/pipelined_finish.py).
            assert threading.active_count() == threads_before + 2
        growth = (_rss() - rss_warm) / rss_warm
        assert growth < 0.02, f"resident set grew by {growth:.2%} after warm-up"
        assert _open_files() == files_warm
        assert sum(losses[-8:]) < 0.5 * sum(losses[:8])
        torch.manual_seed(1)
        other = MegatrainEngine(tiny_models.llama(num_layers=3), parse_engine_config(ds_config()))
        other.load_checkpoint(tmp_path)
        engine.settle_optimizer()  # the host state is read directly
        for ours, theirs in zip(engine.states, other.states):
            assert torch.equal(ours.master, theirs.master) and torch.equal(ours.exp_avg_sq, theirs.exp_avg_sq)
        other.destroy()
    finally:
        engine.destroy()
    assert threading.active_count() == threads_before
    assert _open_files() == files_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "tag0", "tag1"]
