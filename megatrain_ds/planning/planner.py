"""The engine's cost model: host and device memory, transfer-hiding batch, step time.

Pure arithmetic over a :class:`ModelShape`, :class:`RunSettings` and :class:`Hardware`;
``megatrain plan`` (:mod:`megatrain_ds.cli`) prints it. Per optimizer step with ``P_b``
streamed block parameters, ``T`` tokens per weight pass and ``w`` bytes per streamed
weight (2 in bf16, 4 in fp32):

- compute: ``8 * P_b * T`` FLOPs for blocks (forward, recompute, backward) plus
  ``6 * V * h * T`` for the lm_head; the throughput metric counts ``6 * P * T``;
- host->device: ``2 * w * P_b`` bytes (forward and backward) + checkpoints coming back;
- device->host: ``w * P`` bytes of gradients + checkpoints going out;
- host optimizer: ~30 bytes of host memory traffic per parameter (read p, g, m, v;
  write p, m, v, shadow), at the host AdamW kernel's measured rate where ``megatrain plan
  --probe`` measured it; overlapped with backward on a GPU machine only where no gradient
  is held (see [Note: clipping's serialisation]).

[Note: clipping's serialisation]
With clipping (or accumulation, fp16, skipped non-finite steps) the engine holds the
gradients and updates nothing before the global norm is known, i.e. before backward's
last gradient has reached the host (``optimizer/speculative_step.py``). So on a GPU
machine the step is the longest of the overlapped bounds (compute, the copies, the host's
gradient path, the disk) *plus* the whole optimizer pass, not the longest of all of them:
the first GPU run measured 0.83 s at 940M where the all-overlapped model said 0.15 s. Only
without held gradients does the optimizer run behind backward, chunk by chunk, and then
only the last block's update is exposed.

With ``n`` blocks stashing their activations instead of recomputing
(``"megatrain": {"recompute": ...}``, ``streaming/activation_stash.py``) the blocks'
compute falls by ``2 * n * P_b * T`` FLOPs, and each stashed block's saved activations
(:func:`stash_bytes_per_block`) cross device->host in forward and host->device in
backward, and are held in host memory between the two (on the CPU: held, nothing moves).
:func:`choose_stashed_blocks` is ``"auto"``: the ``n`` with the shortest predicted step
whose stash fits the host memory left.

[Note: the weight pipeline]
The bounds above assume the copies and the compute overlap perfectly. They cannot at the
ends of a weight pass: a two-stage pipeline of ``n`` pieces, each crossing in ``a`` and
computing in ``b`` seconds, takes ``a + (n - 1) * max(a, b) + b``, which is
``n * max(a, b) + min(a, b)``: one piece's copy is exposed before the first computes (the
fill; compute-bound), or one piece's compute after the last has crossed (the drain;
link-bound). With whole blocks a piece is a block: forward waits for block 0's whole
weights, and backward for the last block's, less the head's forward and backward that
run while it crosses (``streaming/streamed_blocks.py`` plans backward after the last
block's forward). With ``"fragment_bytes"`` (``streaming/weight_fragments.py``) a piece is
a fragment, so the exposed part of each pass shrinks to about one fragment's copy or
compute, while every further copy adds :data:`FRAGMENT_COPY_OVERHEAD_S` to the link.
:func:`weight_fill_seconds` is ``min(a, b)`` per pass, added to the predicted step;
:func:`choose_fragment_bytes` is ``"auto"``. The device's weight buffers stay sized by
whole blocks either way (a block computes on views of its whole flat buffer).

Transfers hide behind compute once ``8 * P_b * T / F >= 2 * w * P_b / B``, i.e.
``T >= w * F / (4 * B)``, independent of model size.

[Note: the CPU as the device]
When the device is the host (``Hardware.shares_host_memory``) one set of cores does
everything in turn, so a step is the *sum* of its parts, and blocks and resident
parameters are computed on in place (``streaming/weight_streamer.py``: [Note: the host as the
device]): no weight copies, no weight buffers. The parts, per optimizer step
(``g``: gradient width, 4 when accumulating over micro-batches, else ``w``; ``s``: 2 for
the bf16 shadow of an fp32 master, else 0):

- blocks: ``8 * P_b * T`` FLOPs at ``flops * block_efficiency``. ``flops`` is the matmul
  rate at the model's own linear shapes and ``T``; ``block_efficiency`` the fraction of it
  one real block of the model achieves forward, then forward and backward (attention,
  norms, activations, dispatch). ``megatrain plan --gpu cpu`` measures both;
- head: ``6 * V * h * T`` FLOPs at ``head_flops`` (the matmul rate at the lm_head's shape)
  and :data:`LOSS_PASSES` passes over the fp32 logits at host memory bandwidth;
- the gradient path, at host memory bandwidth: the sink's staging copy (``2w`` bytes per
  parameter, read + write, each micro-batch), the global norm's read (``g``) and, with
  gradients held (clipping or accumulation), zeroing (``g``) and accumulating
  (``2g + w`` per micro-batch), plus the speculative-step journal's copy;
- the optimizer: ``24 + g + s`` bytes per parameter at ``adam_bytes_per_s``, the engine's
  own CPU AdamW kernel on states past the caches (measured by ``megatrain plan``);
- checkpoints: each copied to a host tensor and back (``4 * T * h * w`` per segment).

Peak host memory there is the persistent state plus the compute-side buffers
(:func:`gpu_bytes`), which live in host RAM too.

With the NVMe tier (``RunSettings.nvme``, ``state/nvme_tier.py``) the blocks' Adam m and v
(8 bytes per block parameter; 12 with the fp32 master, which joins them with bf16 compute)
live on disk and a window of ``nvme_window_blocks`` blocks of them in host memory; every
optimizer step reads and writes them once (``disk``: ``t * P_b / read + t * P_b / write``,
``t`` those bytes per parameter, at the disk's measured sequential bandwidth), however
many micro-batches it accumulates. The disk works beside the cores and the copy engines
and the optimizer overlaps it block by block, so on a GPU machine it is one more bound
of the max; on the CPU the optimizer's part of the sum becomes ``max(optimizer, disk)``.
With the weights on the tier too (``RunSettings.nvme_weights``, ``state/nvme_weights.py``)
the tier holds every block's fp32 master (12 bytes per block parameter), no block keeps a
shadow in host memory, the weight window holds a few blocks in the compute dtype (and an
fp32 staging copy with bf16), and each weight pass reads every block's fp32 master from
disk twice, forward and backward (``passes * 8 * P_b / read`` more in ``disk``; the
window's reuse of the last forward blocks in backward is not counted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from megatrain_ds.optimizer.speculative_step import AUTO_JOURNAL_BYTES_PER_PARAM, choose_journal_blocks
from megatrain_ds.planning.long_context import (
    choose_loss_chunk_tokens,
    choose_mlp_tile_tokens,
    loss_chunk_bytes_per_token,
    mlp_tile_bytes_per_token,
)
from megatrain_ds.state.nvme_weights import weight_window_buffers

GIB = 1 << 30

# Per token per block, bytes of activations a block's recompute holds for backward in
# 16-bit (Korthikanti et al., "Reducing Activation Recomputation", with flash/SDPA
# attention): 34 * hidden, of which 19 * hidden are the MLP's (a 4 * hidden FFN) and 15
# the rest. With the MLP's width known (``ModelShape.intermediate``) its intermediates are counted
# apart, over one tile when it is tiled (planning/long_context.py). Scaled by bytes per
# value / 2 for fp32 compute.
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 34
NON_MLP_ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 15

# Host-memory traffic of one AdamW update, bytes per parameter (fp32 p, g, m, v read;
# p, m, v written; bf16 shadow written).
ADAM_HOST_BYTES_PER_PARAM = 30

# Values per token that autograd saves inside one pre-norm block with a gated MLP and fused
# attention (Llama, Mistral, Qwen with SDPA; counted by activation_stash on Hugging Face's
# Llama): the block input, both norms' inputs and outputs and the attention output with its
# o_proj input (8 * hidden), k and v (2 * kv_hidden), gate, up, act(gate) and their product
# (4 * intermediate). Norm statistics, softmax log-sum-exp and rotary tables add under 1%;
# eager attention adds its probabilities (heads * seq_len per token).
STASH_HIDDEN_VALUES, STASH_KV_VALUES, STASH_INTERMEDIATE_VALUES = 8, 2, 4

# Fraction of the host memory left that "auto" may fill with stashed activations: the rest
# stays for the step's transients and the rest of the machine.
STASH_HOST_FRACTION = 0.8

# "recompute": "auto" takes the fewest stashed blocks whose predicted step is within this
# fraction of the shortest.
STASH_GAIN_TOLERANCE = 1e-3

# Passes over the fp32 logits outside the lm_head matmul: the loss's log-softmax written
# and read, its gradient written, read and handed to the head (Hugging Face's loss).
LOSS_PASSES = 6

# The disk is named the bottleneck when its time is more than this share of the step.
DISK_BOUND_SHARE = 0.5

# Time one more host-to-device copy costs the link: the gap between back-to-back
# cudaMemcpyAsync calls on one stream and the event recorded after each (a few
# microseconds; an assumption, not measured here).
FRAGMENT_COPY_OVERHEAD_S = 10e-6

# "fragment_bytes": "auto" turns fragments on only when the planner predicts a step this
# much shorter: below it, the model's error (the overhead above, the fill's overlap with
# the embedding and the optimizer's tail) is larger than the gain.
FRAGMENT_GAIN_MARGIN = 0.02

# The smallest fragment "auto" considers (and "fragment_bytes" accepts); "auto" tries
# powers of two from here to below a block's bytes.
MIN_FRAGMENT_BYTES = 4096

# Fraction of device memory the plan may use (allocator fragmentation, CUDA context).
DEVICE_MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class Hardware:
    """What bounds a step on one machine."""

    name: str
    flops: float
    """Achievable dense matmul throughput in the compute dtype, FLOP/s."""
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    host_memory_bytes_per_s: float
    """Host memory bandwidth available to the optimizer (read + write)."""
    device_memory_bytes: int
    shares_host_memory: bool = False
    """The CPU target: compute, copies and the optimizer share the same cores and memory,
    so nothing overlaps and device memory is host memory ([Note: the CPU as the device])."""
    block_efficiency: float = 1.0
    """Fraction of ``flops`` a whole block achieves forward and backward (measured on the
    CPU; the GPU figures assume the matmuls dominate)."""
    adam_bytes_per_s: float = 0.0
    """The host AdamW kernel, bytes of state touched per second; 0: bound by
    ``host_memory_bytes_per_s`` at :data:`ADAM_HOST_BYTES_PER_PARAM`."""
    head_flops: float = 0.0
    """Matmul throughput at the lm_head's shape, FLOP/s (measured on the CPU, where a small
    hidden size makes block matmuls much slower than the head's); 0: ``flops``."""
    disk_read_bytes_per_s: float = 0.0
    """Sequential O_DIRECT read bandwidth of the NVMe tier's disk (``megatrain plan --nvme``)."""
    disk_write_bytes_per_s: float = 0.0


# Achievable (not peak) figures: ~80% of dense bf16 peak, measured PCIe Gen5 x16 copy
# rates, typical dual-socket DDR5 host bandwidth; GH200 uses NVLink-C2C and LPDDR5X.
GPU_HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 790e12, 50e9, 50e9, 200e9, 80 * GIB),
    "h200": Hardware("h200", 790e12, 50e9, 50e9, 200e9, 141 * GIB),
    "gh200": Hardware("gh200", 790e12, 400e9, 400e9, 450e9, 96 * GIB),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs, read from a model (see :func:`shape_of`)."""

    num_blocks: int
    block_params: int
    """Parameters of the largest block."""
    total_block_params: int
    resident_params: int
    hidden: int
    vocab: int
    intermediate: int = 0
    """Width of a block's MLP intermediate (one expert's, for stacked experts); 0: unknown
    (the stash counts ``4 * hidden``, activations the ``34 * hidden`` rule)."""
    kv_hidden: int = 0
    """Width of the keys (and of the values): ``kv_heads * head_dim``; 0: ``hidden``."""
    frozen_params: int = 0
    """Parameters that are not trained (``requires_grad=False``, a LoRA model's base weights):
    without the NVMe tier their weights alone are held (``state/host_store.py``: [Note: frozen
    weights])."""
    frozen_block_params: int = 0
    """Frozen parameters of the largest block (a journal slot holds the trained ones only)."""
    frozen_in_bf16: bool = False
    """Whether every frozen parameter is bf16: with bf16 compute held in the shadow alone."""

    @property
    def params(self) -> int:
        return self.total_block_params + self.resident_params


class ConfigSizes(TypedDict):
    """What a model config says of :class:`ModelShape` (its field names: ``**`` them in)."""

    hidden: int
    vocab: int
    intermediate: int
    kv_hidden: int


def sizes_from_config(config: Any) -> ConfigSizes:
    """``hidden``, ``vocab``, ``intermediate`` and ``kv_hidden`` of a Hugging Face model
    config (:class:`ModelShape`'s names; 0 where the config does not say)."""

    def first(*names: str) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    hidden = first("hidden_size", "n_embd")
    heads = first("num_attention_heads", "n_head")
    head_dim = first("head_dim") or (hidden // heads if heads else 0)
    kv_heads = first("num_key_value_heads")
    return ConfigSizes(
        hidden=hidden,
        vocab=first("vocab_size"),
        intermediate=first("intermediate_size", "n_inner"),
        kv_hidden=kv_heads * head_dim if kv_heads and head_dim else 0,
    )


@dataclass(frozen=True)
class RunSettings:
    """The run being planned (the DeepSpeed JSON's relevant values)."""

    seq_len: int
    micro_batch: int = 1
    accumulation: int = 1
    bf16: bool = True
    clipping: bool = True
    checkpoint_interval: int = 1
    num_buffers: int = 2
    offload_checkpoints: bool = True
    num_staging_buffers: int = 4
    stashed_blocks: int = 0
    """Blocks that stash their activations in host memory instead of recomputing."""
    chunked_loss: bool = True
    """The loss in chunks (``loss_chunk_tokens``, "auto"), no ``tokens x vocab`` logits."""
    tiled_mlp: bool = True
    """The MLP in sequence tiles (``mlp_tile_tokens``, "auto")."""
    nvme: bool = False
    """The blocks' Adam m and v (and with ``bf16`` their fp32 masters) on the NVMe tier."""
    nvme_window_blocks: int = 4
    """Blocks of the tier's state in host memory at once (the read-ahead window)."""
    nvme_weights: bool = False
    """The blocks' weights on the tier too (``"nvme_offload": "all"``; needs ``nvme``)."""
    fragment_bytes: int = 0
    """Blocks' weights cross host-to-device in pieces of this many bytes; 0: whole blocks."""

    @property
    def tokens_per_pass(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def weight_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def grad_bytes(self) -> int:
        """Width of a held or consumed gradient: fp32 when accumulating, else compute."""
        return 4 if self.accumulation > 1 else self.weight_bytes

    @property
    def holds_gradients(self) -> bool:
        return self.clipping or self.accumulation > 1


@dataclass
class Plan:
    """Everything ``megatrain plan`` reports."""

    params: int
    host_bytes: dict[str, int]
    gpu_bytes: dict[str, int]
    min_tokens_to_hide_transfer: int
    step_seconds_by_bound: dict[str, float]
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
    """Host memory of the run, by kind (the engine's persistent state plus staging)."""
    params = shape.params
    frozen = 0 if settings.nvme else shape.frozen_params  # the tier keeps every buffer whole
    trained = params - frozen
    in_shadow = frozen if settings.bf16 and shape.frozen_in_bf16 else 0
    result = {"master": 4 * (params - in_shadow), "adam_m_v": 8 * trained}
    if settings.nvme:
        result["adam_m_v"] = 8 * shape.resident_params
        if settings.bf16 or settings.nvme_weights:  # the blocks' fp32 masters go to the tier too
            result["master"] = 4 * shape.resident_params
        result["nvme_window"] = (
            min(settings.nvme_window_blocks, shape.num_blocks) * _tier_bytes_per_param(settings) * shape.block_params
        )
    if settings.nvme and settings.nvme_weights:
        buffers = weight_window_buffers(settings.num_buffers, settings.checkpoint_interval, settings.nvme_window_blocks)
        staging = 4 if settings.weight_bytes != 4 else 0
        result["nvme_weights"] = buffers * (settings.weight_bytes + staging) * shape.block_params
    if settings.bf16:
        shadowed = shape.resident_params if settings.nvme and settings.nvme_weights else params
        result["bf16_shadow"] = 2 * shadowed
    if settings.holds_gradients:
        result["gradients"] = settings.grad_bytes * trained
    journal = _journal_numel(shape, settings) * _journal_bytes_per_element(settings)
    if journal:
        result["journal"] = journal
    result["staging"] = settings.num_staging_buffers * min(shape.block_params, 1 << 22) * settings.weight_bytes
    if settings.offload_checkpoints:
        result["checkpoints"] = _checkpoint_bytes(shape, settings) * _num_checkpoints(shape, settings)
    if settings.stashed_blocks:
        result["stash"] = settings.stashed_blocks * stash_bytes_per_block(shape, settings)
    return result


def stash_bytes_per_block(shape: ModelShape, settings: RunSettings) -> int:
    """Host bytes one stashed block holds between its forward and backward (an estimate for
    Llama-like blocks, see :data:`STASH_HIDDEN_VALUES`; the engine measures its own)."""
    values = (
        STASH_HIDDEN_VALUES * shape.hidden
        + STASH_KV_VALUES * (shape.kv_hidden or shape.hidden)
        + STASH_INTERMEDIATE_VALUES * (shape.intermediate or 4 * shape.hidden)
    )
    return values * settings.tokens_per_pass * settings.weight_bytes


def _block_flops(shape: ModelShape, settings: RunSettings) -> int:
    """FLOPs of the blocks per weight pass: forward, backward, and the recompute of the
    blocks that do not stash."""
    return (8 * shape.total_block_params - 2 * settings.stashed_blocks * shape.block_params) * settings.tokens_per_pass


def _tier_bytes_per_param(settings: RunSettings) -> int:
    """What the NVMe tier holds per block parameter: m and v, and the fp32 master with bf16
    compute or the weights on the tier (``state/nvme_tier.py``: ``tier_kinds``)."""
    return 12 if settings.bf16 or settings.nvme_weights else 8


def disk_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """Bytes of the NVMe tier's swap files (every block's :func:`_tier_bytes_per_param`); 0 without the tier."""
    return _tier_bytes_per_param(settings) * shape.total_block_params if settings.nvme else 0


def _disk_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    """Seconds per optimizer step the disk needs to read and write every block's state on the
    tier, and with the weights there to read every block's master in each forward and backward."""
    swap = disk_bytes(shape, settings)
    if not swap:
        return 0.0
    if not (hardware.disk_read_bytes_per_s and hardware.disk_write_bytes_per_s):
        raise ValueError("planning the NVMe tier needs the disk's bandwidth: megatrain plan --nvme PATH")
    weights = settings.accumulation * 2 * 4 * shape.total_block_params if settings.nvme_weights else 0
    return (swap + weights) / hardware.disk_read_bytes_per_s + swap / hardware.disk_write_bytes_per_s


def gpu_bytes(shape: ModelShape, settings: RunSettings, hardware: Hardware | None = None) -> dict[str, int]:
    """Device memory of the run, by component (host memory where the device is the host:
    there weights and resident parameters are used in place and cost nothing here)."""
    w = settings.weight_bytes
    in_place = hardware is not None and hardware.shares_host_memory
    slots = settings.num_buffers + settings.checkpoint_interval - 1
    checkpoints_on_device = slots if settings.offload_checkpoints else _num_checkpoints(shape, settings)
    result = {
        "weight_buffers": 0 if in_place else slots * shape.block_params * w,
        "resident_params": 0 if in_place else shape.resident_params * w,
        # Upper bounds: a tied embedding's gradient is built whole (untied ones leave in
        # row chunks, gradients/row_chunked.py; the shape does not say which), and a block's
        # gradients leave in buckets as backward finishes them (gradients/outbox.py).
        "resident_grads": min(shape.resident_params, shape.vocab * shape.hidden) * w,
        "block_grads": shape.block_params * w,
        "checkpoints": checkpoints_on_device * _checkpoint_bytes(shape, settings),
    }
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


def _checkpoint_bytes(shape: ModelShape, settings: RunSettings) -> int:
    return settings.tokens_per_pass * shape.hidden * settings.weight_bytes


def _num_checkpoints(shape: ModelShape, settings: RunSettings) -> int:
    """Segments of recomputed blocks (a stashed block keeps no checkpoint)."""
    return -(-max(shape.num_blocks - settings.stashed_blocks, 0) // settings.checkpoint_interval)


def _journal_bytes_per_element(settings: RunSettings) -> int:
    """Master, m and v (fp32) and the bf16 shadow, as ``optimizer/speculative_step.py`` journals them."""
    return 12 + (2 if settings.bf16 else 0)


def _journal_numel(shape: ModelShape, settings: RunSettings) -> int:
    """Elements the speculative-step journal holds: the engine's ``"auto"`` rule."""
    if not settings.holds_gradients:
        return 0
    trained = shape.block_params - (0 if settings.nvme else shape.frozen_block_params)  # frozen: never stepped
    cost = _journal_bytes_per_element(settings) * trained
    chosen = choose_journal_blocks([cost] * shape.num_blocks, shape.params, "auto", AUTO_JOURNAL_BYTES_PER_PARAM)
    return len(chosen) * trained


def min_tokens_to_hide_transfer(hardware: Hardware, bf16: bool = True) -> int:
    """Tokens per weight pass at which block compute covers the host->device weight copies
    (0 where the device is the host: blocks are computed on in place, nothing is copied)."""
    if hardware.shares_host_memory:
        return 0
    weight_bytes = 2 if bf16 else 4
    return int(weight_bytes * hardware.flops / (4 * hardware.h2d_bytes_per_s)) + 1


def step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    """Seconds per optimizer step that each resource alone needs (on the CPU: each part of
    the step, [Note: the CPU as the device])."""
    if hardware.shares_host_memory:
        return _host_device_step_seconds(shape, settings, hardware)
    tokens = settings.tokens_per_pass
    passes = settings.accumulation
    w = settings.weight_bytes
    checkpoint_traffic = (
        _checkpoint_bytes(shape, settings) * _num_checkpoints(shape, settings) if settings.offload_checkpoints else 0
    )
    compute_flops = _block_flops(shape, settings) + 6 * shape.vocab * shape.hidden * tokens
    stash_traffic = settings.stashed_blocks * stash_bytes_per_block(shape, settings)
    bounds = {
        "compute": passes * compute_flops / hardware.flops,
        "host_to_device": passes
        * (2 * w * shape.total_block_params + checkpoint_traffic + stash_traffic)
        / hardware.h2d_bytes_per_s,
        "device_to_host": passes * (w * shape.params + checkpoint_traffic + stash_traffic) / hardware.d2h_bytes_per_s,
        "optimizer": _gpu_machine_optimizer_seconds(shape, settings, hardware),
    }
    if settings.fragment_bytes:
        # Every copy past a block's first costs the link its overhead, twice per weight pass.
        extra = shape.num_blocks * (_pieces_per_block(shape, settings) - 1)
        bounds["host_to_device"] += passes * 2 * extra * FRAGMENT_COPY_OVERHEAD_S
    if settings.nvme:
        bounds["disk"] = _disk_seconds(shape, settings, hardware)
    return bounds


def _gpu_machine_optimizer_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    """One host AdamW pass over every parameter: at the kernel's measured rate where it was
    measured (``megatrain plan --probe``: ``24 + g + s`` bytes per parameter, as on the CPU
    target), else at the host's memory bandwidth at :data:`ADAM_HOST_BYTES_PER_PARAM`."""
    if hardware.adam_bytes_per_s:
        shadow = 2 if settings.bf16 else 0
        return (24 + settings.grad_bytes + shadow) * shape.params / hardware.adam_bytes_per_s
    return ADAM_HOST_BYTES_PER_PARAM * shape.params / hardware.host_memory_bytes_per_s


def _pieces_per_block(shape: ModelShape, settings: RunSettings) -> int:
    block = settings.weight_bytes * shape.block_params
    return -(-block // settings.fragment_bytes) if settings.fragment_bytes else 1


def weight_fill_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    """Seconds per optimizer step the weight pipeline's ends leave exposed beyond the bounds
    of :func:`step_seconds` ([Note: the weight pipeline]); 0 where the device is the host."""
    if hardware.shares_host_memory or not shape.num_blocks:
        return 0.0
    tokens, block = settings.tokens_per_pass, settings.weight_bytes * shape.block_params
    share = 1 / _pieces_per_block(shape, settings)  # of a block's bytes and compute, per piece
    copy = block * share / hardware.h2d_bytes_per_s + FRAGMENT_COPY_OVERHEAD_S
    forward = 2 * shape.block_params * tokens / hardware.flops
    # Backward starts at the last block: its backward (4 P T) and its recompute, unless
    # every block stashes (the last blocks are the recomputed ones, recompute_policy.py).
    recomputed = settings.stashed_blocks < shape.num_blocks
    backward = (6 if recomputed else 4) * shape.block_params * tokens / hardware.flops
    head = 6 * shape.vocab * shape.hidden * tokens / (hardware.head_flops or hardware.flops)
    per_pass = min(copy, forward * share) + min(max(copy - head, 0.0), backward * share)
    return settings.accumulation * per_pass


def _host_device_step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    tokens, passes, params = settings.tokens_per_pass, settings.accumulation, shape.params
    w, g = settings.weight_bytes, settings.grad_bytes
    shadow = 2 if settings.bf16 else 0
    bandwidth = hardware.host_memory_bytes_per_s
    gradient_bytes = passes * 2 * w * params + g * params  # staging copies; the norm's read
    if settings.holds_gradients:
        gradient_bytes += g * params + passes * (2 * g + w) * params  # zeroing; accumulating
    journal_bytes = 2 * _journal_numel(shape, settings) * _journal_bytes_per_element(settings)
    adam_rate = hardware.adam_bytes_per_s or hardware.host_memory_bytes_per_s
    checkpoints = (
        4 * _checkpoint_bytes(shape, settings) * _num_checkpoints(shape, settings)
        if settings.offload_checkpoints
        else 0
    )
    head_flops = 6 * shape.vocab * shape.hidden * tokens
    return {
        "blocks": passes * _block_flops(shape, settings) / (hardware.flops * hardware.block_efficiency),
        "head": passes
        * (head_flops / (hardware.head_flops or hardware.flops) + LOSS_PASSES * tokens * shape.vocab * 4 / bandwidth),
        "gradient_path": (gradient_bytes + journal_bytes) / bandwidth,
        "checkpoints": passes * checkpoints / bandwidth,
        "optimizer": (24 + g + shadow) * params / adam_rate,
        **({"disk": _disk_seconds(shape, settings, hardware)} if settings.nvme else {}),
    }


def _predicted_step(by_bound: dict[str, float], shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    if hardware.shares_host_memory:
        # One set of cores does everything in turn; the disk works beside the optimizer.
        cores = {bound: t for bound, t in by_bound.items() if bound not in ("optimizer", "disk")}
        return sum(cores.values()) + max(by_bound["optimizer"], by_bound.get("disk", 0.0))
    if settings.holds_gradients:
        # [Note: clipping's serialisation] The update needs the global norm, known when
        # backward's last gradient has reached the host: the optimizer pass follows the
        # copies and the compute instead of hiding behind them.
        overlapped = [t for bound, t in by_bound.items() if bound != "optimizer"]
        return max(overlapped) + by_bound["optimizer"]
    # Streams and the optimizer worker overlap; the last block's update cannot hide.
    tail = by_bound["optimizer"] / shape.num_blocks
    return max(by_bound.values()) + tail


def predicted_step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    return _predicted_step(step_seconds(shape, settings, hardware), shape, settings, hardware) + weight_fill_seconds(
        shape, settings, hardware
    )


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
    fill = weight_fill_seconds(shape, settings, hardware)
    step = _predicted_step(by_bound, shape, settings, hardware) + fill
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
        "offload_checkpoints": _num_checkpoints(shape, settings) * _checkpoint_bytes(shape, settings)
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
        predicted_step_seconds=step,
        predicted_tokens_per_second=settings.tokens_per_pass * settings.accumulation / step,
        max_micro_batch=max_micro,
        recommended=recommended,
        predicted_peak_host_bytes=sum(host.values()) + (sum(device.values()) if hardware.shares_host_memory else 0),
        recompute=policies,
        disk_bytes=disk_bytes(shape, settings),
        weight_fill_seconds=fill,
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
        by_bound = step_seconds(shape, _with(settings, accumulation=accumulation), hardware)
        if by_bound["disk"] <= DISK_BOUND_SHARE * _predicted_step(by_bound, shape, settings, hardware):
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
