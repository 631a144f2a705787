"""Fixtures shared by the unit tests, and the suites that also run under the race checker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import megatrain_ds.engine
from megatrain_ds.checkpoint import save as checkpoint_save

CHECKED_SUITES: dict[str, tuple[str, ...] | None] = {
    "test_parity.py": None,
    "test_optimizer_placement.py": None,
    "test_speculative_step.py": None,
    "test_recompute.py": None,
    "test_fragments.py": None,
    "test_layer_checkpointing.py": None,
    "test_nvme_tier.py": None,
    "test_nvme_checkpoint.py": None,
    "test_checkpoint.py": None,
    "test_nonfinite_steps.py": None,
    "test_fp16.py": None,
    "test_state_dict_placements.py": None,
    "test_held_gradients.py": (
        "test_without_accumulation_chunks_reach_the_held_gradients_by_the_copy_alone",
        "test_the_staged_path_sums_the_same_norm_as_the_direct_path",
        "test_accumulated_held_gradients_match_pytorch",
    ),
    "test_data_parallel.py": ("test_two_ranks_match_one_process_with_both_batches",),
}
"""Test modules (``None``: every test; else the tests named) that run twice: as they are, and
with ``MEGATRAIN_STREAM_CHECK=1`` (their ``[checked]`` variant), so the parity suite (three
families of :data:`CHECKED_FAMILIES`, GA 1/2, K 1/2, offload on/off), the optimizer placements and speculative steps,
stashed activations and fragmented weights, models that checkpoint their own layers, the
NVMe tier and its checkpoints, checkpoints, fp16, every placement's state dict and 2-rank
data parallel are all proved race-free on the CPU (``tests/test_stream_ordering.py`` proves the checker bites). Two
data-parallel tests run only checked, to keep the test command under 10 minutes: two
simulated nodes, and two ranks with the NVMe tier (their docstrings say what covers their
plain path)."""

NOT_CHECKED = {
    "test_cpu_update_overlaps_backward",
    "test_kill_mid_step_then_resume",
    "test_sigkill_at_a_random_moment_of_a_save",
}
"""Not what the checker is for: a timing (the checker slows the host thread down), and
crashes, whose runs are worker processes started with the environment the module read at
import (so their ``[checked]`` variants never checked them) and whose in-process rest, a
plain run or load, the checked suites run already."""


CHECKED_FAMILIES = ("llama", "gpt2", "mixtral")
"""The model families whose ``test_parity_with_clipping`` also runs checked. Every family's
plain variant proves its parity; what the checker proves, the order of copies, events and
the gradient worker, is the engine's and not a family's, so three families stand for the
block shapes (a Llama block, GPT-2's fused Conv1D attention, a Mixtral MoE block). The
other seven checked variants cost about a minute of the test command (issue 43)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the checked parity variants of the families not in :data:`CHECKED_FAMILIES`."""
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        family_checked = params.get("stream_mode") == "checked" and "family" in params
        if (
            family_checked
            and item.name.startswith("test_parity_with_clipping[")
            and (params["family"] not in CHECKED_FAMILIES)
        ):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give the tests of :data:`CHECKED_SUITES` a ``plain`` and a ``checked`` variant (as
    parametrised items, so pytest-xdist spreads them over the workers)."""
    module = metafunc.definition.path.name
    if module not in CHECKED_SUITES or "stream_mode" not in metafunc.fixturenames:
        return
    name = metafunc.definition.originalname
    selected = CHECKED_SUITES[module]
    if name in NOT_CHECKED or (selected is not None and name not in selected):
        return
    metafunc.parametrize("stream_mode", ["plain", "checked"], indirect=True)


@pytest.fixture(autouse=True)
def stream_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"checked"``: CPU runtimes created in the test (and the processes it launches, which
    inherit the environment) check stream ordering; ``"plain"`` otherwise."""
    mode = getattr(request, "param", "plain")
    if mode == "checked":
        monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")
    return mode


@pytest.fixture
def cpu_single_thread(monkeypatch):
    """CPU numerics are the reference (CUDA is covered where marked gpu), on one thread:
    tiny models gain nothing from a second one, and on a shared machine spinning OpenMP
    threads make them several times slower."""
    monkeypatch.setattr(megatrain_ds.engine, "default_device", lambda: torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stream_check(monkeypatch):
    """CPU runtimes created in the test check stream ordering (``MEGATRAIN_STREAM_CHECK=1``):
    virtual streams and events, and ``StreamRaceError`` on an access no synchronisation orders."""
    monkeypatch.setenv("MEGATRAIN_STREAM_CHECK", "1")


@dataclass
class SavedCheckpoint:
    """What the :func:`saved` fixture gives: a checkpoint directory and the engine saved into it."""

    root: Path
    engine: megatrain_ds.MegatrainEngine


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint_worker``'s engine after one step, saved as tag "good" under ``root`` (its
    model in 3 shards, with ``checkpoint_worker.CLIENT_STATE``); the engine lives until the
    module's tests are done. Tests copy the directory before damaging it."""
    import checkpoint_worker  # a test helper beside this file: only the modules that use it pay for it

    root = tmp_path_factory.mktemp("saved")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as cpu_single_thread, which runs after module-scoped fixtures
    engine = checkpoint_worker.build(seed=0)
    checkpoint_worker.train(engine, 1)
    torch.set_num_threads(threads)
    engine.settle_optimizer()  # checkpoint/save.py's save_checkpoint, called directly, does not
    checkpoint_save.save_checkpoint(
        engine, str(root), tag="good", client_state=checkpoint_worker.CLIENT_STATE, max_shard_bytes=120_000
    )
    assert len(list((root / "good").glob("model-*.safetensors"))) == 3
    yield SavedCheckpoint(root, engine)
    engine.destroy()
