"""Which blocks stash their activations and which are recomputed: ``"megatrain": {"recompute"}``.

``"full"`` recomputes every block, ``"none"`` stashes every block, an integer ``N``
recomputes the last ``N`` blocks and stashes the others (a stash of the last blocks would
cross the link twice with only the head computing in between). ``"auto"`` is decided at
the first training forward, when the tokens per weight pass are known, by the planner
(:func:`~megatrain_ds.planning.planner.choose_stashed_blocks`) from:

- the link: host<->device copy rates measured here (pinned copies, once per engine); on
  the CPU nothing moves (the stash stays where it is), so only memory limits it;
- the blocks' compute: the planner's rate for this device (its table for an H100, H200
  or GH200, this CPU's measured matmul rate; ``planning/transfer_hiding.py``);
- the host memory left: ``MemAvailable`` (or the cgroup's room) now that the run's
  persistent state is allocated.

The choice is logged once with the blocks stashed, the host bytes per step and the
predicted step times of ``full``, ``none`` and the choice. For ``"none"`` and an integer,
the same first forward checks that the stash fits in the host memory left and fails with
the numbers and the setting that would fit (the preflight of the stash, which depends on
the batch and so cannot be checked before it is seen).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from megatrain_ds.config import EngineConfig
from megatrain_ds.planning.planner import (
    Hardware,
    ModelShape,
    RunSettings,
    recompute_policies,
    sizes_from_config,
    stash_bytes_per_block,
)
from megatrain_ds.planning.preflight import InsufficientMemoryError, available_memory
from megatrain_ds.planning.transfer_hiding import hardware_of
from megatrain_ds.runtime.device_runtime import DeviceRuntime

logger = logging.getLogger(__name__)

GIB = float(1 << 30)


def stashed_blocks_of(recompute: str | int, num_blocks: int) -> int | None:
    """Blocks stashed by a ``recompute`` setting; ``None`` for ``"auto"`` (decided later)."""
    if recompute == "auto":
        return None
    if recompute == "full":
        return 0
    if recompute == "none":
        return num_blocks
    assert isinstance(recompute, int)
    return max(num_blocks - recompute, 0)


@dataclass(frozen=True)
class RecomputeChoice:
    """What the first training forward decided, as logged."""

    stashed_blocks: int
    stash_bytes_per_block: int
    """The planner's estimate (the engine measures its own: ``ActivationStash.block_bytes``)."""
    host_memory_left: int
    predicted: dict[str, dict[str, float]]
    """:func:`~megatrain_ds.planning.planner.recompute_policies` for this run."""


def planned_run(
    runtime: DeviceRuntime, config: EngineConfig, model: Any, block_numels: list[int], resident_numel: int, tokens: int
) -> tuple[ModelShape, RunSettings, Hardware]:
    """The planner's view of this run at ``tokens`` tokens per weight pass: the model's
    shape, the settings, and this device with its host<->device copy rates measured."""
    options = config.options
    sizes = sizes_from_config(getattr(model, "config", None))
    shape = ModelShape(
        num_blocks=len(block_numels),
        block_params=max(block_numels),
        total_block_params=sum(block_numels),
        resident_params=resident_numel,
        **sizes,
    )
    settings = RunSettings(
        seq_len=tokens,
        micro_batch=1,
        accumulation=config.gradient_accumulation_steps,
        bf16=config.compute_dtype.itemsize == 2,  # the planner's "bf16" is 2-byte compute: fp16 too
        clipping=config.gradient_clipping > 0,
        master_bytes=config.master_dtype.itemsize,
        checkpoint_interval=options.checkpoint_interval,
        num_buffers=options.num_buffers,
        offload_checkpoints=options.offload_checkpoints,
        fragment_bytes=options.fragment_bytes if isinstance(options.fragment_bytes, int) else 0,
    )
    hardware, _ = hardware_of(runtime)
    rates = runtime.measure_copy_rates()
    if rates is not None:
        hardware = dataclasses.replace(hardware, h2d_bytes_per_s=rates[0], d2h_bytes_per_s=rates[1])
    return shape, settings, hardware


def choose_recompute(
    runtime: DeviceRuntime,
    config: EngineConfig,
    run: tuple[ModelShape, RunSettings, Hardware],
    host_memory_left: int | None = None,
) -> RecomputeChoice:
    """Decide (``"auto"``) or check (``"none"``, an integer) how many blocks stash, for the
    weight pass :func:`planned_run` describes; ``host_memory_left`` defaults to what the
    machine has free now. Raises :class:`InsufficientMemoryError` when a stash asked for
    cannot fit."""
    options = config.options
    shape, settings, hardware = run
    tokens = settings.tokens_per_pass
    if host_memory_left is None:
        host_memory_left = available_memory(runtime.device).host
    per_block = stash_bytes_per_block(shape, settings) if shape.hidden else 0
    predicted = recompute_policies(shape, settings, hardware, host_memory_left) if shape.hidden else {}
    fixed = stashed_blocks_of(options.recompute, shape.num_blocks)
    if fixed is None:
        stashed = int(predicted["auto"]["stashed_blocks"]) if predicted else 0
    else:
        stashed = fixed
        if stashed * per_block > host_memory_left:
            fits = min(int(host_memory_left // per_block), shape.num_blocks) if per_block else shape.num_blocks
            raise InsufficientMemoryError(
                f"megatrain.recompute={options.recompute!r} stashes {stashed} blocks' activations, about "
                f"{per_block / GIB:.2f} GiB each at {tokens} tokens per micro-batch ({stashed * per_block / GIB:.2f} "
                f"GiB), but only {host_memory_left / GIB:.2f} GiB of host memory is left; stash at most {fits} "
                f'blocks ("recompute": {shape.num_blocks - fits}), or set "recompute": "auto"'
            )
    choice = RecomputeChoice(stashed, per_block, host_memory_left, predicted)
    if options.recompute == "auto":
        _log(choice, shape.num_blocks, tokens, hardware.name)
    return choice


def _log(choice: RecomputeChoice, num_blocks: int, tokens: int, device: str) -> None:
    times = ", ".join(f"{name} {policy['predicted_step_seconds']:.3g} s" for name, policy in choice.predicted.items())
    logger.info(
        "megatrain: recompute auto: %d of %d blocks stash their activations (%.1f MiB each at %d tokens, "
        "%.2f GiB of host memory per micro-batch; %.1f GiB left), the other %d are recomputed; "
        "predicted step on %s: %s",
        choice.stashed_blocks,
        num_blocks,
        choice.stash_bytes_per_block / 2**20,
        tokens,
        choice.stashed_blocks * choice.stash_bytes_per_block / GIB,
        choice.host_memory_left / GIB,
        num_blocks - choice.stashed_blocks,
        device,
        times,
    )
