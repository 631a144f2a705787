"""Fixtures shared by the unit tests, and the tests that also run under the race checker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import megatrain_ds.engine
from megatrain_ds.checkpoint import save as checkpoint_save

EVERY = None
"""In :data:`CHECKED_SUITES`: every variant of the test runs checked too."""

CHECKED_SUITES: dict[str, dict[str, tuple[str, ...] | None]] = {
    "test_parity.py": {
        # Each pairing of accumulation 1/2 and checkpoint interval 1/2 (held gradients
        # accumulated or written once; one- or two-block segments and their offloaded
        # checkpoints), each family's block once (Llama, GPT-2's fused Conv1D attention,
        # Mixtral's MoE, whose idle experts give no gradient): the pairs each family runs
        # are test_parity.py's families_on_two_schedules.
        "test_parity_with_clipping": ("gpt2-1-1", "llama-1-2", "mixtral-2-1", "gpt2-2-2"),
        # Blocks stepped by the worker while backward runs, from the staging buffers (GA 1)
        # and from the held gradients (GA 2), with the checkpoints offloaded and without.
        "test_parity_without_clipping_steps_blocks_during_backward": ("1-True", "2-False"),
        "test_parity_with_three_buffers_and_odd_depth": EVERY,  # a third weight buffer reused
    },
    "test_optimizer_placement.py": {
        # The host optimizer and the device one (its own stream, the d2h write-back); the
        # CPU kernels differ in arithmetic only, and "auto" places on the CPU here.
        "test_placements_match_torch_adamw_with_clipping_and_accumulation": ("cpu-auto", "gpu-auto"),
        "test_device_placement_in_bf16_writes_the_shadow": EVERY,  # the device writes the shadow
        "test_measured_calibration_on_the_cpu": EVERY,  # times copies on the runtime's streams
    },
    "test_speculative_step.py": {
        # Speculative updates refuted and restored from the journal: the bf16 run journals
        # the fp32 master and the shadow (fp32 journals the master alone).
        "test_speculation_is_bit_exact_through_clipping": ("bf16",),
    },
    "test_recompute.py": {
        # Every block stashed (copied to pooled host buffers and back: under the checker the
        # "device" is apart from the host), GA 2 and two-block segments, on a MoE block (its
        # routing decides which expert tensors are saved). A dense block's variant runs the
        # same engine path with the same settings: plain only.
        "test_no_recompute_matches_pytorch_on_every_family": ("qwen2_moe",),
        # Stashed and recomputed blocks in one model: each split, GA 1 and 2, K 1 and 2.
        "test_stash_and_recompute_mixed": ("none-4-1-1", "1-3-1-2", "3-1-2-2"),
        # The copying stash on its own, and a stash given back without its backward.
        "test_stash_keeps_activations_and_repoints_weight_views": ("False",),
        "test_a_forward_without_backward_gives_its_stash_back": EVERY,
    },
    "test_layer_checkpointing.py": {
        # The model's own checkpointing inside streamed blocks drops what backward read at
        # other points of its schedule: non-reentrant and reentrant, inside the block and
        # around it; and around modules outside the blocks.
        "test_hf_gradient_checkpointing_trains_as_without_it": ("llama-kwargs0", "llama-kwargs1"),
        "test_user_checkpoint_around_a_block_trains_as_without_it": EVERY,
        "test_checkpointing_outside_the_blocks_is_kept": EVERY,
    },
    "test_nvme_tier.py": {
        # Adam's moments on the tier (the journal restored into swapped states with GA 2 is
        # the mutation test's "nvme" scenario, checked in every run): the speculation
        # holding, blocks stepped during backward; the thread I/O engine (the others run
        # DeepSpeed's async I/O); the bf16 master on the tier; destroy with writes in flight.
        "test_parity_and_bit_identical_to_ram_only": ("speculation-holds-ga1", "no-clipping"),
        "test_both_io_engines_give_the_same_run": ("threads",),
        "test_bf16_compute_is_bit_identical_to_ram_only": EVERY,
        "test_destroy_twice_is_destroy_once": EVERY,
        # The weights on the tier too (read through the weight window): the same step paths,
        # and the state dict read from the swap files mid-training.
        "test_weights_on_the_tier_match_pytorch_and_are_bit_identical_to_ram_only": (
            "speculation-holds-ga2",
            "no-clipping",
            "bf16-clip-refuted-ga2",
        ),
        "test_save_pretrained_mid_training_with_the_weights_on_the_tier": EVERY,
    },
    "test_lora.py": {
        # The weights on the tier with frozen weights apart: each block's read from its own
        # file on the tier's I/O threads, with the master, into the weight window's buffers.
        "test_fp32_lora_matches_plain_pytorch_with_accumulation_and_clipping": ("all",),
    },
    "test_nvme_checkpoint.py": {
        # Saved from and loaded into the swap files with the bf16 masters on them (the
        # moments alone, and the weights too, are the "nvme" and "nvme-all" scenarios' saves
        # and loads); a swap write failing mid-step with others in flight.
        "test_checkpoints_with_and_without_the_tier_are_the_same_bytes_and_cross_load": ("bf16-masters-on-tier",),
        "test_disk_full_during_a_step_is_a_clear_error_and_the_checkpoint_survives": EVERY,
    },
    "test_checkpoint.py": {
        # Saved inside an accumulation window (held gradients) and loaded into another
        # engine that trains on, loaded partly, with frozen parameters. (A save between
        # steps and its load are the mutation test's "host" scenario, checked in every run;
        # loading it in a fresh process, test_resume_in_a_fresh_process_is_exact, runs the
        # same load in another process: no path of its own, and the costliest variant.)
        "test_resume_from_inside_an_accumulation_window_is_exact": EVERY,
        "test_partial_loads_leave_the_rest_alone": EVERY,
        "test_frozen_parameters_can_be_left_out": EVERY,
    },
    "test_nonfinite_steps.py": {
        # A skipped step undoes speculative updates: on the host (fp32) and on the device
        # (bf16 shadow), journal blocks stepped before the non-finite block or all of them;
        # with accumulation; and without clipping, where gradients are held instead.
        "test_nan_step_leaves_every_bit_and_training_continues": ("fp32-cpu-block", "bf16-gpu-embedding"),
        "test_inf_with_accumulation_and_clipping_is_skipped": EVERY,
        "test_skip_without_clipping_holds_gradients": EVERY,
    },
    "test_fp16.py": {
        # fp16's loss scaling: overflowing steps skipped, with clipping and accumulation
        # (speculative updates undone) and without clipping (blocks stepped during backward,
        # undone); the other cases differ in the scaler's arithmetic only.
        "test_fp16_matches_pytorch_with_deepspeeds_scaler": ("accumulation", "no_clipping"),
    },
    "test_state_dict_placements.py": {
        # Every placement's state dict read while the engine lives, with fp16 compute (the
        # NVMe tests above run bf16).
        "test_every_placement_gives_the_ram_runs_fp32_masters": ("fp16",),
    },
    "test_held_gradients.py": {
        # Chunks copied straight into the held gradients, through staging, accumulated.
        "test_without_accumulation_chunks_reach_the_held_gradients_by_the_copy_alone": EVERY,
        "test_the_staged_path_sums_the_same_norm_as_the_direct_path": EVERY,
        "test_accumulated_held_gradients_match_pytorch": EVERY,
    },
}
"""Module -> test function -> the parameter ids (without ``checked``) of its variants that
also run with ``MEGATRAIN_STREAM_CHECK=1`` (their ``[checked]`` variant; :data:`EVERY`:
all of them). The race checker finds missing synchronisation, and synchronisation is the
engine's, not a model's or a setting's: one checked run per distinct engine path is the
evidence (each entry says which path), and a second run of the same path under the
checker proves nothing new. So: bf16, fp32 and fp16 compute, accumulation 1 and 2,
clipping and speculation (held or refuted), steps during backward, the device optimizer,
stashed and recomputed blocks, the model's own checkpointing, the NVMe tier with the
moments, the masters and the weights on it, checkpoints, non-finite steps, every
placement's state dict and 2-rank data parallel. Fragmented weights have no entry: the
mutation test's "fragments" scenario, which ``tests/test_stream_ordering.py`` runs
unmutated in every run, stashes two blocks (each one's backward waits for all of its
pieces) and recomputes one (each of its modules waits for its own). Left plain: tests whose variants
differ in arithmetic, configuration or error messages only, or build no engine; timings
(the checker slows the host thread down) and crashes (their workers read the environment
at import, so a checked variant never checked them). ``tests/test_stream_ordering.py``
runs every scenario of the mutation test under the checker too, and proves the checker
bites (issue 43: the checked runs were 40% of the test command before this selection).
Three data-parallel tests run only checked (2 ranks of one node, two simulated nodes,
and two ranks with the NVMe tier; their docstrings say what covers their plain path).
A checked variant that compares the NVMe tier with the RAM-only engine builds that engine
without the checker (``side_by_side.unchecked``): the RAM-only path's checked runs are
the entries above, so only the path the variant stands for pays for the checker."""


def _checked_id(item: pytest.Item) -> str | None:
    """The parameter id of ``item``'s checked variant without ``checked`` ("" when that is
    its only parameter); None for a test that is not a checked variant."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or callspec.params.get("stream_mode") != "checked":
        return None
    return callspec.id.removeprefix("checked").removeprefix("-")


@pytest.hookimpl(tryfirst=True)  # before -k and --deselect: the table is checked against every test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the checked variants :data:`CHECKED_SUITES` names, and fail on a name there that
    no collected test has (a renamed parameter must not drop out of the checked runs)."""
    kept, dropped, collected = [], [], {}
    for item in items:
        checked_id = _checked_id(item)
        if checked_id is None:
            kept.append(item)
            continue
        test = (item.path.name, getattr(item, "originalname", item.name))
        collected.setdefault(test, set()).add(checked_id)
        ids = CHECKED_SUITES[test[0]][test[1]]
        (kept if ids is None or checked_id in ids else dropped).append(item)  # None: EVERY
    narrowed = any("::" in arg for arg in config.args)  # single tests named: others not collected
    for (module, name), ids in collected.items():
        missing = set(CHECKED_SUITES[module][name] or ()) - ids
        if missing and not narrowed:
            raise pytest.UsageError(
                f"tests/conftest.py CHECKED_SUITES names {sorted(missing)} of {name}: no such variant"
            )
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Give the tests of :data:`CHECKED_SUITES` a ``plain`` and a ``checked`` variant (as
    parametrised items, so pytest-xdist spreads them over the workers)."""
    module = metafunc.definition.path.name
    if metafunc.definition.originalname not in CHECKED_SUITES.get(module, {}):
        return
    if "stream_mode" in metafunc.fixturenames:
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
