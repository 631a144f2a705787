"""The planner: what a run needs in memory, and the choices made from its predicted step.

Host and device memory by kind (:func:`host_bytes`, :func:`gpu_bytes`), the longest
sequence and the largest micro-batch that fit, ``"recompute": "auto"``
(:func:`choose_stashed_blocks`: the number of stashed blocks with the shortest predicted
step whose stash fits the host memory left), ``"fragment_bytes": "auto"``
(:func:`choose_fragment_bytes`), and :func:`plan`, everything ``megatrain plan`` prints.
The step's time is ``planning/step_time.py``'s model ([Note: a step's phases] there);
its records and functions are imported here too, so ``planner`` stays the one entry point.

Peak host memory where the device is the host is the persistent state plus the
compute-side buffers (:func:`gpu_bytes`), which live in host RAM too. With the NVMe tier
(``RunSettings.nvme``, ``state/nvme_tier.py``) the blocks' Adam m and v (and the fp32
masters with bf16 compute) live on disk and a window of ``nvme_window_blocks`` blocks of
them in host memory; with the weights on the tier too (``RunSettings.nvme_weights``,
``state/nvme_weights.py``) no block keeps a shadow in host memory and the weight window
holds a few blocks in the compute dtype (and an fp32 staging copy with bf16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain_ds.config.megatrain_options import DEVICE_STATE_AUTO_SHARE, DEVICE_STATE_HEADROOM_BYTES
from megatrain_ds.planning.long_context import (
    choose_loss_chunk_tokens,
    choose_mlp_tile_tokens,
    loss_chunk_bytes_per_token,
    mlp_tile_bytes_per_token,
)
from megatrain_ds.planning.step_time import (
    ADAM_HOST_BYTES_PER_PARAM,
    FRAGMENT_COPY_OVERHEAD_S,
    GIB,
    GPU_HARDWARE,
    LOSS_PASSES,
    ConfigSizes,
    Hardware,
    ModelShape,
    RunSettings,
    checkpoint_bytes,
    disk_bytes,
    frozen_in_compute_dtype,
    journal_bytes_per_element,
    journal_numel,
    min_tokens_to_hide_transfer,
    num_checkpoints,
    phase_seconds,
    predicted_from_phases,
    predicted_step_seconds,
    sizes_from_config,
    stash_bytes_per_block,
    step_seconds,
    weight_fill_seconds,
)
from megatrain_ds.state.placement import (
    ElementSizes,
    Placement,
    StateShape,
    TierSettings,
    Topology,
    device_prefix,
    device_prefix_within,
    device_state_indices,
)

__all__ = [  # the step-time model's names, for callers of the planner
    "ADAM_HOST_BYTES_PER_PARAM",
    "FRAGMENT_COPY_OVERHEAD_S",
    "GIB",
    "GPU_HARDWARE",
    "LOSS_PASSES",
    "ConfigSizes",
    "Hardware",
    "ModelShape",
    "RunSettings",
    "disk_bytes",
    "min_tokens_to_hide_transfer",
    "predicted_step_seconds",
    "sizes_from_config",
    "stash_bytes_per_block",
    "step_seconds",
    "weight_fill_seconds",
]

# Per token per block, bytes of activations a block's recompute holds for backward in
# 16-bit (Korthikanti et al., "Reducing Activation Recomputation", with flash/SDPA
# attention): 34 * hidden, of which 19 * hidden are the MLP's (a 4 * hidden FFN) and 15
# the rest. With the MLP's width known (``ModelShape.intermediate``) its intermediates are counted
# apart, over one tile when it is tiled (planning/long_context.py). Scaled by bytes per
# value / 2 for fp32 compute.
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 34
NON_MLP_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 15

# Fraction of the host memory left that "auto" may fill with stashed activations: the rest
# stays for the step's transients and the rest of the machine.
STASH_HOST_FRACTION = 0.8

# "recompute": "auto" takes the fewest stashed blocks whose predicted step is within this
# fraction of the shortest.
STASH_GAIN_TOLERANCE = 1e-3

# The disk is named the bottleneck when its time is more than this share of the step.
DISK_BOUND_SHARE = 0.5

# "fragment_bytes": "auto" turns fragments on only when the planner predicts a step this
# much shorter: below it, the model's error (the overhead above, the fill's overlap with
# the embedding and the optimizer's tail) is larger than the gain.
FRAGMENT_GAIN_MARGIN = 0.02

# The smallest fragment "auto" considers (and "fragment_bytes" accepts); "auto" tries
# powers of two from here to below a block's bytes.
MIN_FRAGMENT_BYTES = 4096

# Fraction of device memory the plan may use (allocator fragmentation, CUDA context).
DEVICE_MEMORY_HEADROOM = 0.9


@dataclass
class Plan:
    """Everything ``megatrain plan`` reports."""

    params: int
    host_bytes: dict[str, int]
    gpu_bytes: dict[str, int]
    min_tokens_to_hide_transfer: int
    step_seconds_by_bound: dict[str, float]
    """Each resource alone (:func:`step_seconds`): the largest is the floor."""
    predicted_step_seconds: float
    predicted_tokens_per_second: float
    max_micro_batch: int
    recommended: dict[str, Any] = field(default_factory=dict)
    predicted_peak_host_bytes: int = 0
    """Host memory at the step's peak: the state, plus the compute-side buffers where the
    device is the host."""
    recompute: dict[str, dict[str, float]] = field(default_factory=dict)
    """``"full"``, ``"none"`` and ``"auto"``: blocks stashed, host bytes of the stash and
    the predicted step (:func:`recompute_policies`)."""
    bytes_per_token: int = 0
    """How much more memory each further token of sequence takes (device memory, or host
    memory where the device is the host)."""
    max_seq_len: int = 0
    """The longest sequence (at this micro-batch) that fits; 0 when none does."""
    disk_bytes: int = 0
    """The NVMe tier's swap files."""
    weight_fill_seconds: float = 0.0
    """Of the predicted step, the weight pipeline's exposed ends ([Note: the weight pipeline])."""
    step_seconds_by_phase: dict[str, float] = field(default_factory=dict)
    """The step as the engine runs it (:func:`phase_seconds`: [Note: a step's phases])."""
    fragments: dict[str, dict[str, float]] = field(default_factory=dict)
    """``"whole"`` and ``"fragments"`` (the best fragment size): bytes per piece and the
    predicted step; ``"chosen"``: what ``"fragment_bytes": "auto"`` picks (:func:`fragment_policies`)."""

    @property
    def host_bytes_total(self) -> int:
        return sum(self.host_bytes.values())

    @property
    def gpu_bytes_total(self) -> int:
        return sum(self.gpu_bytes.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["host_bytes_total"] = self.host_bytes_total
        data["gpu_bytes_total"] = self.gpu_bytes_total
        return data


def host_bytes(shape: ModelShape, settings: RunSettings) -> dict[str, int]:
    """Host memory of the run, by kind (the engine's persistent state plus staging). The flat
    states' buffers, the NVMe tier's window and the weight window are the engine's own
    accounting: the :class:`~megatrain_ds.state.placement.Placement` of :func:`placement_of`,
    which the engine's ``host_bytes()`` and preflight read too."""
    placement = placement_of(shape, settings)
    state = placement.host_bytes()
    result = {"master": state.get("master", 0), "adam_m_v": state.get("exp_avg", 0) + state.get("exp_avg_sq", 0)}
    if placement.tier is not None:
        result["nvme_window"] = placement.tier.window_bytes
    if placement.weights_on_tier:
        result["nvme_weights"] = placement.weight_window_bytes(settings.num_buffers, settings.checkpoint_interval)
    if settings.weight_bytes != settings.master_bytes:
        result["bf16_shadow"] = state.get("shadow", 0)
    if state.get("frozen"):  # frozen weights not in the compute dtype, apart beside a cut master
        result["frozen"] = state["frozen"]
    if settings.holds_gradients:
        result["gradients"] = state.get("grad", 0)
    journal = journal_numel(shape, settings) * journal_bytes_per_element(settings)
    if journal:
        result["journal"] = journal
    result["staging"] = settings.num_staging_buffers * min(shape.block_params, 1 << 22) * settings.weight_bytes
    if settings.offload_checkpoints:
        result["checkpoints"] = checkpoint_bytes(shape, settings) * num_checkpoints(shape, settings)
    if settings.stashed_blocks:
        result["stash"] = settings.stashed_blocks * stash_bytes_per_block(shape, settings)
    return result


def placement_of(shape: ModelShape, settings: RunSettings) -> Placement:
    """Where the planned run's buffers live (one process), from the model's sizes alone
    (:func:`_state_shapes`)."""
    states = _state_shapes(shape, settings)
    element_sizes = ElementSizes(
        master=settings.master_bytes,
        compute=settings.weight_bytes,
        grad=settings.grad_bytes if settings.holds_gradients else None,
        with_shadow=settings.weight_bytes != settings.master_bytes,
    )
    nvme = ("all" if settings.nvme_weights else "optimizer") if settings.nvme else "none"
    tier = TierSettings(window_blocks=settings.nvme_window_blocks)
    # The GPU tier's prefix, by the engine's rule; it goes with no NVMe tier (the config refuses both).
    on_device = device_prefix(settings.device_state_share, states) if nvme == "none" else 0
    return Placement.of_sizes(element_sizes, tier, nvme, Topology(), states, on_device)


def _state_shapes(shape: ModelShape, settings: RunSettings) -> list[StateShape]:
    """The planned run's states: ``num_blocks`` blocks, each of ``block_sizes`` where the
    shape has them, else the largest of ``block_params`` and the others sharing the rest
    evenly, each with ``frozen_block_params`` frozen (at most its size), and the resident
    state with the frozen parameters left (exact for the usual model of identical blocks).
    Flat layouts' alignment padding is not counted: a model's sizes are its parameters'."""
    if shape.block_sizes:  # blocks that differ (LoRA on some layers, blocks frozen whole): each as it is
        sizes, frozen = [size for size, _ in shape.block_sizes], [f for _, f in shape.block_sizes]
    else:
        rest, others = shape.num_blocks - 1, shape.total_block_params - shape.block_params
        sizes = [shape.block_params] + [others // rest + (i < others % rest) for i in range(rest)]
        frozen = [min(shape.frozen_block_params, size) for size in sizes]
    resident = shape.resident_params
    frozen.append(min(max(shape.frozen_params - sum(frozen), 0), resident))
    # Only a shadow can hold frozen weights alone, and only in its (2-byte) compute dtype.
    in_compute = frozen_in_compute_dtype(shape, settings)
    return [StateShape(size, size - f, bool(f) and in_compute) for size, f in zip([*sizes, resident], frozen)]


def auto_device_state_share(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    """``device_state: "auto"`` (the engine's default) as the engine resolves it at start-up
    (``engine_build.py``), the device's whole memory standing for the free memory it asks
    CUDA for: the share of the trained parameters in the longest prefix of the states
    (resident state first) that fits in ``DEVICE_STATE_AUTO_SHARE`` of the device memory left
    after ``DEVICE_STATE_HEADROOM_BYTES`` and the engine's own planned peak -- preflight's,
    the weight buffers and the resident copy: like the engine, it does not know the batch,
    so the activations must fit in what is left (the plan's limits show whether they do).
    0 where the tier cannot run: the device is the host, the NVMe tier, a bf16 master."""
    if hardware.shares_host_memory or settings.nvme or settings.master_bytes != 4:
        return 0.0
    device = gpu_bytes(shape, _with(settings, device_state_share=0.0), hardware)
    own = device["weight_buffers"] + device["resident_params"]
    budget = int(DEVICE_STATE_AUTO_SHARE * max(hardware.device_memory_bytes - own - DEVICE_STATE_HEADROOM_BYTES, 0))
    count = device_prefix_within(placement_of(shape, _with(settings, device_state_share=1.0)), budget)
    states = _state_shapes(shape, settings)
    trained = [state.trained_numel for state in states]
    on_device = sum(trained[index] for index in device_state_indices(states, count))
    return on_device / sum(trained) if sum(trained) else 0.0


def gpu_bytes(shape: ModelShape, settings: RunSettings, hardware: Hardware | None = None) -> dict[str, int]:
    """Device memory of the run, by component (host memory where the device is the host:
    there weights and resident parameters are used in place and cost nothing here)."""
    w = settings.weight_bytes
    in_place = hardware is not None and hardware.shares_host_memory
    slots = settings.num_buffers + settings.checkpoint_interval - 1
    checkpoints_on_device = slots if settings.offload_checkpoints else num_checkpoints(shape, settings)
    result = {
        "weight_buffers": 0 if in_place else slots * shape.block_params * w,
        "resident_params": 0 if in_place else shape.resident_params * w,
        # Upper bounds: a tied embedding's gradient is built whole (untied ones leave in
        # row chunks, gradients/row_chunked.py; the shape does not say which), and a block's
        # gradients leave in buckets as backward finishes them (gradients/outbox.py).
        "resident_grads": min(shape.resident_params, shape.vocab * shape.hidden) * w,
        "block_grads": shape.block_params * w,
        "checkpoints": checkpoints_on_device * checkpoint_bytes(shape, settings),
    }
    if settings.device_state_share:  # the GPU tier's states (state/placement.py: [Note: the GPU tier])
        result["device_state"] = sum(placement_of(shape, settings).device_bytes().values())
        if not in_place and placement_of(shape, settings).resident.on_device:
            result["resident_params"] = 0  # its device copy is the state's own shadow
    return {**result, **_activation_bytes(shape, settings, hardware)}


def _activation_bytes(shape: ModelShape, settings: RunSettings, hardware: Hardware | None) -> dict[str, int]:
    """One block's recompute and the head, by what they hold (see planning/long_context.py)."""
    w, tokens, k = settings.weight_bytes, settings.tokens_per_pass, settings.checkpoint_interval
    # "auto" tile sizes follow the device's memory (the engine asks for what is free at start-up).
    free = hardware.device_memory_bytes if hardware is not None else 80 * GIB
    result = {}
    if shape.intermediate:
        result["block_activations"] = k * tokens * shape.hidden * NON_MLP_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * w // 2
        tile = choose_mlp_tile_tokens(shape.intermediate, w, free) if settings.tiled_mlp else tokens
        result["mlp_intermediates"] = k * min(tokens, tile) * mlp_tile_bytes_per_token(shape.intermediate, w)
    else:
        result["block_activations"] = k * tokens * shape.hidden * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * w // 2
    if settings.chunked_loss:
        chunk = choose_loss_chunk_tokens(shape.vocab, w, free)
        # A chunk's logits and their fp32 copies, the hidden states' gradient and the
        # output projection's fp32 weight-gradient accumulator (model/chunked_loss.py).
        result["logits"] = (
            min(tokens, chunk) * loss_chunk_bytes_per_token(shape.vocab, w)
            + tokens * shape.hidden * w
            + shape.vocab * shape.hidden * 4
        )
    else:
        # Hugging Face upcasts logits to fp32 for the loss: compute-dtype logits, their
        # fp32 copy and its gradient.
        result["logits"] = tokens * shape.vocab * (w + 4 + 4)
    return result


def choose_fragment_bytes(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> int:
    """``"fragment_bytes": "auto"``: the fragment size with the shortest predicted step,
    or 0 (whole blocks) unless it beats whole blocks by :data:`FRAGMENT_GAIN_MARGIN`.
    Always 0 where the device is the host: nothing is copied there."""
    if hardware.shares_host_memory:
        return 0
    whole = predicted_step_seconds(shape, _with(settings, fragment_bytes=0), hardware)
    size, seconds = _best_fragment(shape, settings, hardware)
    return size if seconds < whole * (1 - FRAGMENT_GAIN_MARGIN) else 0


def _best_fragment(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> tuple[int, float]:
    """The power-of-two fragment size below a block's bytes with the shortest predicted
    step, and that step; ``(0, whole blocks' step)`` when a block is too small to cut."""
    block = settings.weight_bytes * shape.block_params
    sizes = [MIN_FRAGMENT_BYTES << k for k in range(64) if MIN_FRAGMENT_BYTES << k < block]
    steps = [(size, predicted_step_seconds(shape, _with(settings, fragment_bytes=size), hardware)) for size in sizes]
    return min(
        steps,
        key=lambda step: step[1],
        default=(0, predicted_step_seconds(shape, _with(settings, fragment_bytes=0), hardware)),
    )


def fragment_policies(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, dict[str, float]]:
    """Whole blocks and the best fragment size side by side, and what ``"auto"`` chooses."""
    whole = predicted_step_seconds(shape, _with(settings, fragment_bytes=0), hardware)
    size, seconds = _best_fragment(shape, settings, hardware)
    chosen = choose_fragment_bytes(shape, settings, hardware)
    return {
        "whole": {"fragment_bytes": 0, "predicted_step_seconds": whole},
        "fragments": {"fragment_bytes": size, "predicted_step_seconds": seconds},
        "chosen": {"fragment_bytes": chosen, "predicted_step_seconds": seconds if chosen else whole},
    }


def choose_stashed_blocks(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_left: int) -> int:
    """``"recompute": "auto"``: how many blocks stash their activations.

    The number with the shortest predicted step (fewest blocks among equals, within
    :data:`STASH_GAIN_TOLERANCE`: a stash that gains nothing only costs memory) among those whose stash fits in
    :data:`STASH_HOST_FRACTION` of ``host_memory_left`` (the host memory not taken by the
    run's persistent state; where the device is the host, less the step's transients).
    On a GPU the step stops improving once the stash traffic saturates the link; on the
    CPU nothing moves and the stash is limited by memory alone.
    """
    budget = STASH_HOST_FRACTION * host_memory_left
    if hardware.shares_host_memory:
        budget -= sum(gpu_bytes(shape, settings, hardware).values())
    per_block = stash_bytes_per_block(shape, settings)
    most = min(shape.num_blocks, int(budget // per_block) if per_block > 0 and budget > 0 else 0)
    steps = [
        predicted_step_seconds(shape, _with(settings, stashed_blocks=stashed), hardware) for stashed in range(most + 1)
    ]
    # Within STASH_GAIN_TOLERANCE of the shortest counts as equal: a stash that gains less
    # than that (e.g. only a shorter last backward block at the weight pipeline's end,
    # [Note: the weight pipeline]) is not worth its memory.
    return next(stashed for stashed, seconds in enumerate(steps) if seconds <= min(steps) * (1 + STASH_GAIN_TOLERANCE))


def recompute_policies(
    shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_left: int
) -> dict[str, dict[str, float]]:
    """``full``, ``none`` and ``auto`` side by side: blocks stashed, stash bytes, step seconds."""
    choices = {
        "full": 0,
        "none": shape.num_blocks,
        "auto": choose_stashed_blocks(shape, settings, hardware, host_memory_left),
    }
    result = {}
    for name, stashed in choices.items():
        with_stash = _with(settings, stashed_blocks=stashed)
        result[name] = {
            "stashed_blocks": stashed,
            "stash_bytes": stashed * stash_bytes_per_block(shape, with_stash),
            "predicted_step_seconds": predicted_step_seconds(shape, with_stash, hardware),
        }
    return result


def plan(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_bytes: int) -> Plan:
    """Memory, speed and recommendations for ``settings`` on ``hardware``."""
    by_bound = step_seconds(shape, settings, hardware)
    phases = phase_seconds(shape, settings, hardware)
    step = predicted_from_phases(phases, shape, settings, hardware)
    fragments = fragment_policies(shape, settings, hardware)
    state_bytes = sum(host_bytes(shape, _with(settings, stashed_blocks=0)).values())
    policies = recompute_policies(shape, settings, hardware, host_memory_bytes - state_bytes)
    hide = min_tokens_to_hide_transfer(hardware, settings.bf16)
    max_micro = _max_micro_batch(shape, settings, hardware, host_memory_bytes)
    wanted_micro = max(1, -(-hide // settings.seq_len))
    host = host_bytes(shape, settings)
    device = gpu_bytes(shape, settings, hardware)
    disk = by_bound.get("disk", 0.0)
    recommended: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": min(max(wanted_micro, 1), max(max_micro, 1)),
        "offload_checkpoints": num_checkpoints(shape, settings) * checkpoint_bytes(shape, settings)
        > 0.25 * hardware.device_memory_bytes,
        "checkpoint_interval": 1,
        "num_buffers": 2,
        "recompute": _recompute_value(int(policies["auto"]["stashed_blocks"]), shape.num_blocks),
        "fragment_bytes": int(fragments["chosen"]["fragment_bytes"]) or None,
        "optimizer_device": "gpu"
        if by_bound["optimizer"] > 24 * shape.params / hardware.h2d_bytes_per_s and not hardware.shares_host_memory
        else "cpu",
    }
    per_token = _total_bytes(shape, _with(settings, seq_len=2 * settings.seq_len), hardware) - _total_bytes(
        shape, settings, hardware
    )
    if disk > DISK_BOUND_SHARE * step:
        recommended["bottleneck"] = "disk"
        recommended["gradient_accumulation_steps"] = _accumulation_hiding_disk(shape, settings, hardware)
    return Plan(
        bytes_per_token=per_token // settings.tokens_per_pass,
        max_seq_len=max_sequence_length(shape, settings, hardware, host_memory_bytes),
        params=shape.params,
        host_bytes=host,
        gpu_bytes=device,
        min_tokens_to_hide_transfer=hide,
        step_seconds_by_bound=by_bound,
        step_seconds_by_phase=phases,
        predicted_step_seconds=step,
        predicted_tokens_per_second=settings.tokens_per_pass * settings.accumulation / step,
        max_micro_batch=max_micro,
        recommended=recommended,
        predicted_peak_host_bytes=sum(host.values()) + (sum(device.values()) if hardware.shares_host_memory else 0),
        recompute=policies,
        disk_bytes=disk_bytes(shape, settings),
        weight_fill_seconds=phases.get("weight_fill", 0.0),
        fragments=fragments,
    )


def _recompute_value(stashed: int, num_blocks: int) -> str | int:
    """The ``"recompute"`` setting that stashes ``stashed`` of ``num_blocks`` blocks."""
    return "full" if stashed == 0 else "none" if stashed == num_blocks else num_blocks - stashed


def _total_bytes(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> int:
    """What bounds the sequence: device memory, or everything where the device is the host."""
    device = sum(gpu_bytes(shape, settings, hardware).values())
    return device + sum(host_bytes(shape, settings).values()) if hardware.shares_host_memory else device


def max_sequence_length(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_bytes: int) -> int:
    """The longest sequence (at ``settings.micro_batch``) whose step fits (0: none does)."""
    return _largest(
        lambda length: _fits(shape, _with(settings, seq_len=length), hardware, host_memory_bytes), limit=1 << 30
    )


def _accumulation_hiding_disk(shape: ModelShape, settings: RunSettings, hardware: Hardware, limit: int = 256) -> int:
    """The fewest micro-batches per optimizer step for which the disk's share of the step
    falls to :data:`DISK_BOUND_SHARE`: the optimizer state moves once per optimizer step,
    so accumulating spreads it over more weight passes."""
    accumulation = settings.accumulation
    while accumulation < limit:
        accumulating = _with(settings, accumulation=accumulation)
        disk = step_seconds(shape, accumulating, hardware)["disk"]
        if disk <= DISK_BOUND_SHARE * predicted_step_seconds(shape, accumulating, hardware):
            break
        accumulation *= 2
    return accumulation


def _fits(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_bytes: int) -> bool:
    device = sum(gpu_bytes(shape, settings, hardware).values())
    host = sum(host_bytes(shape, settings).values())
    if hardware.shares_host_memory:
        return host + device <= host_memory_bytes
    return device <= DEVICE_MEMORY_HEADROOM * hardware.device_memory_bytes and host <= host_memory_bytes


def _max_micro_batch(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_bytes: int) -> int:
    """Largest micro-batch that fits (0 when not even one sequence does)."""

    def fits(micro: int) -> bool:
        return _fits(shape, _with(settings, micro_batch=micro), hardware, host_memory_bytes)

    return _largest(fits, limit=1 << 20)


def _largest(fits, limit: int) -> int:
    """The largest ``n >= 1`` with ``fits(n)`` (fits is monotone), 0 when ``fits(1)`` fails."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < limit:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _with(settings: RunSettings, **changes: Any) -> RunSettings:
    return RunSettings(**{**asdict(settings), **changes})
