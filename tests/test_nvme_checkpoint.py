"""Nothing is lost with the NVMe tier: checkpoints, crashes, dead runs' swap files, full disks.

Every comparison is bitwise: checkpoints saved with and without the tier hold the same
bytes; a run resumed (with or without the tier) continues exactly as the uninterrupted
RAM-only run, which is itself checked against plain PyTorch by ``test_nvme_tier.py``.
"""

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import fork_server
import nvme_worker
import pytest
import torch
from side_by_side import unchecked

from megatrain_ds.planning.preflight import InsufficientMemoryError
from megatrain_ds.state import swap_directory
from megatrain_ds.state.swap_directory import DiskSpaceError, SwapDirectory

TESTS = Path(__file__).parent
WORKER_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")])),
}

pytestmark = pytest.mark.usefixtures("cpu_single_thread")


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "bf16, level",
    [(False, "optimizer"), (True, "optimizer"), (False, "all"), (True, "all")],
    ids=["fp32", "bf16-masters-on-tier", "fp32-weights-on-tier", "bf16-weights-on-tier"],
)
def test_checkpoints_with_and_without_the_tier_are_the_same_bytes_and_cross_load(tmp_path, bf16, level):
    """Saved from the tier (moments, and with bf16 compute or the weights on the tier the
    fp32 masters, streamed from the swap files) or from host memory: the same safetensors
    bytes. Each loads into an engine of the other kind and training goes on bit for bit as
    the uninterrupted RAM-only run."""
    with unchecked():  # the reference; the RAM-only path's training and save are checked elsewhere
        ram = nvme_worker.build(0, None, bf16)
    tiered = nvme_worker.build(0, str(tmp_path / "nvme"), bf16, level)
    assert ("master" in tiered.nvme_tier.kinds) is (bf16 or level == "all")
    try:
        assert nvme_worker.train(ram, 2) == nvme_worker.train(tiered, 2)
        ram.save_checkpoint(tmp_path / "from_ram", tag="t")
        tiered.save_checkpoint(tmp_path / "from_tier", tag="t")
        names = sorted(p.name for p in (tmp_path / "from_ram" / "t").glob("*.safetensors"))
        assert any(name.startswith("optimizer-") for name in names)
        for name in names:
            assert (tmp_path / "from_ram" / "t" / name).read_bytes() == (
                tmp_path / "from_tier" / "t" / name
            ).read_bytes(), name
        straight = nvme_worker.train(ram, 2)
        expected = nvme_worker.snapshot(ram)
    finally:
        ram.destroy()
        tiered.destroy()
    for source, nvme in (("from_tier", None), ("from_ram", str(tmp_path / "nvme2"))):
        engine = nvme_worker.build(1, nvme, bf16, level)
        try:
            engine.load_checkpoint(tmp_path / source)
            assert nvme_worker.train(engine, 2) == straight, source
            assert_same(nvme_worker.snapshot(engine), expected)
        finally:
            engine.destroy()


def test_kill_mid_step_then_resume(tmp_path, caplog):
    """A run with the tier dies by SIGKILL while step 3 is half written back to its swap
    files. Its checkpoint (step 2) is intact; a new run on the same nvme_path removes the
    dead run's swap directory (never reads it), loads the checkpoint and trains steps 3-4
    exactly as an uninterrupted run does."""
    nvme, checkpoints = tmp_path / "nvme", tmp_path / "checkpoints"
    threads = torch.get_num_threads()
    crash = [sys.executable, str(TESTS / "nvme_worker.py"), "crash", str(nvme), str(checkpoints), str(threads)]
    crashed = fork_server.run(crash, cwd=TESTS, env=WORKER_ENV, timeout=300)
    assert crashed.returncode == -9 and "KILLED after writing" in crashed.stdout, crashed.stderr[-2000:]
    left = list(nvme.glob("megatrain-swap-*"))
    assert len(left) == 1 and json.loads((left[0] / "owner.json").read_text())["pid"] != os.getpid()

    out = tmp_path / "resumed.pt"
    resume = [sys.executable, str(TESTS / "nvme_worker.py"), "resume", str(nvme), str(checkpoints), str(out)]
    resumed = fork_server.run([*resume, str(threads)], cwd=TESTS, env=WORKER_ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "removing the swap directory" in resumed.stderr and str(left[0]) in resumed.stderr
    assert not left[0].exists()

    straight = nvme_worker.build(0, None)
    try:
        nvme_worker.train(straight, 2)
        expected_losses = nvme_worker.train(straight, 2)
        expected = nvme_worker.snapshot(straight)
    finally:
        straight.destroy()
    result = torch.load(out)
    assert result["losses"] == expected_losses and result["steps"] == 4
    assert_same(result["state"], expected)


def test_swap_directories_of_dead_live_and_foreign_owners(tmp_path, caplog):
    """A dead run's directory (its lock free) is removed with a warning; a live run's
    (lock held) and an unknown ``megatrain-swap-*`` entry are left alone; nothing else in
    nvme_path is touched; each run gets its own directory."""
    swap_directory_here = (
        f"from megatrain_ds.state.swap_directory import SwapDirectory\n"
        f"d = SwapDirectory({str(tmp_path)!r}, {{'a.swap': 4096}}); print(d.path, flush=True)\n"
    )
    holding = [sys.executable, "-c", swap_directory_here + "import time; time.sleep(60)"]
    holder = fork_server.popen(holding, env=WORKER_ENV, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    try:
        live = Path(holder.stdout.readline().strip())
        dying = [sys.executable, "-c", swap_directory_here + "import os; os._exit(0)"]
        dead = fork_server.run(dying, env=WORKER_ENV, check=True)
        dead_path = Path(dead.stdout.strip())
        assert dead_path.exists() and live.exists()
        foreign = tmp_path / "megatrain-swap-not-ours"
        foreign.mkdir()
        (foreign / "data").write_bytes(b"x")
        (tmp_path / "user_file").write_bytes(b"keep")
        with caplog.at_level(logging.INFO, logger="megatrain_ds"):
            mine = SwapDirectory(tmp_path, {"block00000.swap": 8192})
        try:
            assert not dead_path.exists()
            assert live.exists() and (foreign / "data").read_bytes() == b"x"
            assert (tmp_path / "user_file").read_bytes() == b"keep"
            assert mine.path not in (live, dead_path) and os.path.getsize(mine.files["block00000.swap"]) == 8192
            messages = "\n".join(r.getMessage() for r in caplog.records)
            assert f"removing the swap directory {dead_path}" in messages
            assert f"{foreign} looks like a swap directory" in messages
            assert f"{live} belongs to a live run" in messages
        finally:
            mine.close()
        assert not mine.path.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_full_disk_is_found_before_training(tmp_path, monkeypatch):
    """Preflight counts the swap files' bytes against the free space under nvme_path and
    names both; nothing is allocated."""
    real = swap_directory.shutil.disk_usage

    def tiny_disk(path):
        usage = real(path)
        return usage._replace(free=4096)

    monkeypatch.setattr(swap_directory.shutil, "disk_usage", tiny_disk)
    with pytest.raises(DiskSpaceError) as caught:
        nvme_worker.build(0, str(tmp_path / "nvme"))
    message = str(caught.value)
    assert str(tmp_path / "nvme") in message and "GiB are free" in message and "needs" in message
    assert caught.value.errno == errno.ENOSPC
    assert not list((tmp_path).glob("nvme/megatrain-swap-*"))


def test_preflight_suggests_the_tier_when_host_memory_is_short(tmp_path):
    import tiny_models
    from side_by_side import ds_config

    from megatrain_ds import parse_engine_config
    from megatrain_ds.engine import STAGING_CHUNK_ELEMENTS
    from megatrain_ds.optimizer.facade import build_optimizer
    from megatrain_ds.planning.preflight import AvailableMemory, PreflightInputs, preflight

    model = tiny_models.llama()
    config = parse_engine_config(ds_config(megatrain={"nvme_path": str(tmp_path)}))
    optimizer = build_optimizer(model, None, config.optimizer, None)
    run = PreflightInputs(model, config, optimizer, torch.device("cpu"), STAGING_CHUNK_ELEMENTS)
    need = preflight(run)
    tier = preflight(run, nvme="optimizer")
    assert tier.host["adam_m_v"] < need.host["adam_m_v"] and tier.disk > 0 and need.disk == 0
    short = AvailableMemory(host=need.host_total - 1)
    with pytest.raises(InsufficientMemoryError, match="nvme_offload"):
        preflight(run, available=short)


def test_disk_full_during_a_step_is_a_clear_error_and_the_checkpoint_survives(tmp_path):
    """ENOSPC injected into a swap write in the middle of a step: the step fails with an
    error naming the file and saying the disk is full; the last checkpoint is untouched and
    a fresh run resumes from it exactly."""
    engine = nvme_worker.build(0, str(tmp_path / "nvme"))
    try:
        nvme_worker.train(engine, 2)
        engine.save_checkpoint(tmp_path / "checkpoints")
        before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "global_step2").iterdir()}

        def no_space(buffer, path, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        engine.nvme_tier.io.write = no_space
        with pytest.raises(Exception) as caught:
            nvme_worker.train(engine, 1)
        chain = [caught.value] + ([caught.value.__cause__] if caught.value.__cause__ else [])
        failure = next(e for e in chain if isinstance(e, DiskSpaceError))
        assert (
            "the disk is full" in str(failure)
            and "block" in str(failure)
            and "last checkpoint is intact" in str(failure)
        )
    finally:
        engine.destroy()
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / "global_step2").iterdir()}
    assert after == before

    with unchecked():  # the uninterrupted RAM-only run: the reference
        straight = nvme_worker.build(0, None)
    resumed = nvme_worker.build(1, str(tmp_path / "nvme"))
    try:
        nvme_worker.train(straight, 2)
        resumed.load_checkpoint(tmp_path / "checkpoints")
        assert nvme_worker.train(resumed, 2) == nvme_worker.train(straight, 2)
        assert_same(nvme_worker.snapshot(resumed), nvme_worker.snapshot(straight))
    finally:
        straight.destroy()
        resumed.destroy()
