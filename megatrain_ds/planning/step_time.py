"""What a training step costs in seconds: the machine, the model, the run, and the model of time.

Pure arithmetic over a :class:`ModelShape`, :class:`RunSettings` and :class:`Hardware`
(``planning/planner.py`` adds memory and the choices built on both; ``megatrain plan``
prints them). Per optimizer step with ``P_b`` streamed block parameters, ``T`` tokens per
weight pass and ``w`` bytes per streamed weight (2 in bf16, 4 in fp32):

- compute: ``8 * P_b * T`` FLOPs for blocks (forward, recompute, backward) at
  ``flops * block_efficiency`` (a real block of the model, measured), plus
  ``6 * V * h * T`` for the lm_head; the throughput metric counts ``6 * P * T``;
- host->device: ``2 * w * P_b`` bytes (forward and backward) + checkpoints coming back;
- device->host: ``w * P`` bytes of gradients + checkpoints going out;
- host optimizer: ``24 + g + s`` bytes of host memory traffic per parameter (read p, g,
  m, v; write p, m, v, shadow) at the engine's CPU AdamW kernel's measured rate on states
  past the caches; states streamed through the device (``RunSettings.device_optimizer_share``)
  cross the link instead, ``12 + g`` bytes in and ``12 + s`` out.

:func:`step_seconds` is each resource alone (the floor: the step if everything else hid);
:func:`phase_seconds` and :func:`predicted_step_seconds` the step as the engine runs it.

[Note: a step's phases]
Forward, backward and the optimizer's finish are phases one after another, each bounded on
its own: what overlaps is the copies and the compute *within* a phase, not across phases.
The first GPU runs showed what the single all-overlapped bound missed (940M Llama on an
H200, 4 x 1024 tokens, clipping: 0.45 s measured, 0.14 s predicted by it):

- forward: ``max(2 P_b T at the block rate + the head's forward, w P_b over the
  link in, checkpoints and stash out)``; the weight copies bound it at 940M (35 ms);
- backward: ``max(6 P_b T at the block rate + the head's backward, w P_b + checkpoints
  + stash in, w P of gradients out)``, plus the weight pipeline's ends
  ([Note: the weight pipeline]). The block rate is one real block's forward and backward
  (``Hardware.block_efficiency``): there a block's backward took 4.4x its forward for 2x
  the FLOPs, which a rate from forward alone, or the table's matmul rate, misses. (The
  second H200 run's trace showed the device idle 2.2-2.5 ms before each block's recompute,
  34 ms of its backward: the checkpoints' prefetch was dropped. Fixed in
  ``streaming/streamed_blocks.py``; the third run's trace has 11 ms of gaps left in all, so
  the term that modelled the wait is gone);
- the optimizer's finish (clipping's serialisation, below) at the CPU kernel's rate
  *alone*: little else runs on the host then (the second run's trace: 12 block states at
  4.18 G elements/s, ``bench/host_contention.py``'s 4.19 alone at 16 threads). The states
  are walked one after another, so the device-streamed share adds its link time to the
  host share's instead of overlapping it. Where the finish pipelines
  (``optimizer/pipelined_finish.py``: one process, the state in host memory) it runs
  behind the next forward instead of after backward, block by block, each block's forward
  waiting for its update: forward and finish together take ``max(forward, finish + one
  block's forward)`` (the third H200 run: a 0.29 s forward for a 35 ms one).

The Adam rate must be measured on states past the last-level cache: the first H200 probe
timed 16M elements (256 MB, inside that host's L3) at 391 GB/s against 117 GB/s on 100M
elements, and under-predicted the finish 3.4x (``cli.py``'s probe sizes its arrays from
the cache now). With measured figures the model comes within 16% and 15% of the third H200
run's steps (940M and ~3B, the finish pipelined; both short, the finish ran at 2.9-3.1 G
elements/s behind the forward against the kernel's 4.19 alone: ``tests/test_planner_gpu_runs.py``),
where the all-overlapped bound was 33-40% short of the second run's.

[Note: clipping's serialisation]
With clipping (or accumulation, fp16, skipped non-finite steps) the engine holds the
gradients and updates nothing before the global norm is known, i.e. before backward's
last gradient has reached the host (``optimizer/speculative_step.py``). So on a GPU
machine the step is forward + backward *plus* the whole optimizer pass. Only without held
gradients does the optimizer run behind backward, chunk by chunk, beside the gradient
copies (at the Adam rate measured beside pinned copies both ways:
``Hardware.adam_beside_copies_bytes_per_s``, ``megatrain plan --probe`` with a CUDA device;
1.8x slower than alone on the H200 host), and
then only the last block's update is exposed. The NVMe tier's disk works beside the
copies and the compute: one more bound against forward + backward.

With ``n`` blocks stashing their activations instead of recomputing
(``"megatrain": {"recompute": ...}``, ``streaming/activation_stash.py``) the blocks'
compute falls by ``2 * n * P_b * T`` FLOPs, and each stashed block's saved activations
(:func:`stash_bytes_per_block`) cross device->host in forward and host->device in
backward, and are held in host memory between the two (on the CPU: held, nothing moves).

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
``planner.choose_fragment_bytes`` is ``"auto"``. The device's weight buffers stay sized by
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

With the NVMe tier (``RunSettings.nvme``, ``state/nvme_tier.py``) the blocks' Adam m and v
(8 bytes per block parameter; 12 with the fp32 master, which joins them with bf16 compute)
live on disk and a window of ``nvme_window_blocks`` blocks of them in host memory; every
optimizer step reads and writes them once (``disk``: ``t * P_b / read + t * P_b / write``,
``t`` those bytes per parameter, at the disk's measured sequential bandwidth), however
many micro-batches it accumulates. On the CPU the optimizer's part of the sum becomes
``max(optimizer, disk)``. With the weights on the tier too (``RunSettings.nvme_weights``,
``state/nvme_weights.py``) each weight pass reads every block's fp32 master from disk
twice, forward and backward (``passes * 8 * P_b / read`` more in ``disk``; the window's
reuse of the last forward blocks in backward is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from megatrain_ds.optimizer.journal import choose_journal_extents
from megatrain_ds.optimizer.pipelined_finish import refusal

GIB = 1 << 30

# Host-memory traffic of one AdamW update, bytes per parameter (fp32 p, g, m, v read;
# p, m, v written; bf16 shadow written), where the kernel's own rate was not measured.
ADAM_HOST_BYTES_PER_PARAM = 30

# Values per token that autograd saves inside one pre-norm block with a gated MLP and fused
# attention (Llama, Mistral, Qwen with SDPA; counted by activation_stash on Hugging Face's
# Llama): the block input, both norms' inputs and outputs and the attention output with its
# o_proj input (8 * hidden), k and v (2 * kv_hidden), gate, up, act(gate) and their product
# (4 * intermediate). Norm statistics, softmax log-sum-exp and rotary tables add under 1%;
# eager attention adds its probabilities (heads * seq_len per token).
STASH_HIDDEN_VALUES, STASH_KV_VALUES, STASH_INTERMEDIATE_VALUES = 8, 2, 4

# Passes over the fp32 logits outside the lm_head matmul: the loss's log-softmax written
# and read, its gradient written, read and handed to the head (Hugging Face's loss).
LOSS_PASSES = 6

# Time one more host-to-device copy costs the link: the gap between back-to-back
# cudaMemcpyAsync calls on one stream and the event recorded after each (a few
# microseconds; an assumption, not measured here).
FRAGMENT_COPY_OVERHEAD_S = 10e-6


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
    """Fraction of ``flops`` one real block of the model achieves, forward and then forward
    and backward as the engine runs it: measured on the CPU by the profile, on a GPU machine
    by ``megatrain plan --probe`` (the block on the device); 1.0, the table's figures: the
    matmuls dominate, which a 940M block on an H200 does not (it reached 0.27 of 790 TFLOP/s).
    The probe's block runs its MLP in the engine's sequence tiles, so a tiled backward's
    extra MLP forward (not in :func:`block_flops`) is in this figure, at the probe's tokens."""
    adam_bytes_per_s: float = 0.0
    """The host AdamW kernel alone making the run's pass (its gradient dtype, shadow and
    clipping scale, on a worker thread, a block's state per call: ``planning/host_probe.py``),
    bytes of state touched per second, on states past the last-level cache ([Note: a step's
    phases]); 0: bound by ``host_memory_bytes_per_s`` at :data:`ADAM_HOST_BYTES_PER_PARAM`."""
    adam_beside_copies_bytes_per_s: float = 0.0
    """The same pass while pinned copies run both ways at full speed (the optimizer behind
    backward, no gradient held: [Note: clipping's serialisation]), probed by ``megatrain plan
    --probe`` with a CUDA device (``planning/host_probe.py``); 0: not probed,
    ``adam_bytes_per_s`` stands in (the plan's ``hardware_sources`` says so)."""
    head_flops: float = 0.0
    """Matmul throughput at the lm_head's shape, FLOP/s (measured on the CPU, where a small
    hidden size makes block matmuls much slower than the head's); 0: ``flops``."""
    disk_read_bytes_per_s: float = 0.0
    """Sequential O_DIRECT read bandwidth of the NVMe tier's disk (``megatrain plan --nvme``)."""
    disk_write_bytes_per_s: float = 0.0
    device_memory_bytes_per_s: float = 0.0
    """Achievable device memory bandwidth (the GPU tier's update, ``RunSettings.device_state_share``);
    0: its update is not timed (no figure for the device)."""


# Achievable (not peak) figures: ~80% of dense bf16 peak, measured PCIe Gen5 x16 copy
# rates, typical dual-socket DDR5 host bandwidth; GH200 uses NVLink-C2C and LPDDR5X.
GPU_HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 790e12, 50e9, 50e9, 200e9, 80 * GIB, device_memory_bytes_per_s=2.7e12),
    "h200": Hardware("h200", 790e12, 50e9, 50e9, 200e9, 141 * GIB, device_memory_bytes_per_s=3.8e12),
    "gh200": Hardware("gh200", 790e12, 400e9, 400e9, 450e9, 96 * GIB, device_memory_bytes_per_s=3.2e12),
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
    frozen_resident_params: int = 0
    """Frozen parameters among the resident ones: their weights alone are held beside the
    NVMe tier too (the resident state stays in host memory)."""
    frozen_in_bf16: bool = False
    """Whether every frozen parameter is bf16: with bf16 compute held in the shadow alone (or
    cast to it: ``RunSettings.frozen_weights``)."""
    block_sizes: tuple[tuple[int, int], ...] = ()
    """Each block's ``(parameters, frozen parameters)``, in order, where the blocks differ
    (LoRA on some layers only, blocks frozen whole): the memory model places each as it is
    (``planning/planner.py``: ``placement_of``). Empty: the largest block's sizes, the
    others sharing the rest evenly."""

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
    master_bytes: int = 4
    """Bytes per master element (``megatrain.master_dtype``: fp32, or 2 for bf16; a shadow is
    streamed where it differs from :attr:`weight_bytes`)."""
    device_optimizer_share: float = 0.0
    """Fraction of the parameters whose AdamW state streams through the device and is
    updated there (``"optimizer_device": "gpu"``: 1; ``"auto"``: its split, which the engine
    logs and ``bench/compare.py`` records); the rest steps on the host's CPU kernel."""
    device_state_share: float = 0.0
    """Fraction of the trained parameters the GPU tier keeps whole on the device
    (``"device_state"``; the longest prefix of the states within it, the resident state first:
    ``state/placement.py``: [Note: the GPU tier]): updated there at the device's memory
    bandwidth, no host pass and no gradient copy for them; one process without the NVMe tier."""
    frozen_weights: str = "exact"
    """``megatrain.frozen_weights``: "compute_dtype" casts every frozen weight to the compute
    dtype at ``initialize``, so with 2-byte compute each is held in it whatever dtype the
    model's was (:func:`frozen_in_compute_dtype`)."""

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


def stash_bytes_per_block(shape: ModelShape, settings: RunSettings) -> int:
    """Host bytes one stashed block holds between its forward and backward (an estimate for
    Llama-like blocks, see :data:`STASH_HIDDEN_VALUES`; the engine measures its own)."""
    values = (
        STASH_HIDDEN_VALUES * shape.hidden
        + STASH_KV_VALUES * (shape.kv_hidden or shape.hidden)
        + STASH_INTERMEDIATE_VALUES * (shape.intermediate or 4 * shape.hidden)
    )
    return values * settings.tokens_per_pass * settings.weight_bytes


def block_flops(shape: ModelShape, settings: RunSettings) -> int:
    """FLOPs of the blocks per weight pass: forward, backward, and the recompute of the
    blocks that do not stash."""
    return (8 * shape.total_block_params - 2 * settings.stashed_blocks * shape.block_params) * settings.tokens_per_pass


def tier_bytes_per_param(settings: RunSettings) -> int:
    """What the NVMe tier holds per block parameter: m and v, and the master where a shadow
    is streamed instead or the weights are on the tier (``state/placement.py``'s kinds)."""
    return 12 if settings.weight_bytes != settings.master_bytes or settings.nvme_weights else 8


def frozen_in_compute_dtype(shape: ModelShape, settings: RunSettings) -> bool:
    """Whether the frozen weights are held in the (2-byte) compute dtype: every one arrives in
    bf16, or ``frozen_weights`` is "compute_dtype" (the engine casts them before it reads the
    model, ``model/frozen_weights.py``; :func:`shape_of` reads the model as it is given)."""
    return settings.weight_bytes == 2 and (shape.frozen_in_bf16 or settings.frozen_weights == "compute_dtype")


def stepped_block_params(shape: ModelShape) -> tuple[int, int]:
    """Elements the optimizer state covers of the largest block and of every block: their
    trained prefix (every state is trained-only: ``state/placement.py``, [Note: the
    placement model])."""
    frozen_in_blocks = shape.frozen_params - shape.frozen_resident_params
    return shape.block_params - shape.frozen_block_params, shape.total_block_params - frozen_in_blocks


def frozen_tier_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """Bytes of the blocks' frozen weights on the tier, in their own files, with the weights
    there: in bf16 where every frozen weight and the compute are, else in the master's dtype."""
    if not (settings.nvme and settings.nvme_weights):
        return 0
    return (2 if frozen_in_compute_dtype(shape, settings) else settings.master_bytes) * (
        shape.frozen_params - shape.frozen_resident_params
    )


def disk_bytes(shape: ModelShape, settings: RunSettings) -> int:
    """Bytes of the NVMe tier's swap files (every block's :func:`tier_bytes_per_param`, and
    the frozen weights' files); 0 without the tier."""
    if not settings.nvme:
        return 0
    return tier_bytes_per_param(settings) * stepped_block_params(shape)[1] + frozen_tier_bytes(shape, settings)


def _disk_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    """Seconds per optimizer step the disk needs to read and write every block's state on the
    tier, and with the weights there to read every block's master (and frozen weights) in each
    forward and backward."""
    frozen = frozen_tier_bytes(shape, settings)  # read with the weights, never written
    swap = disk_bytes(shape, settings) - frozen
    if not settings.nvme:
        return 0.0
    if not (hardware.disk_read_bytes_per_s and hardware.disk_write_bytes_per_s):
        raise ValueError("planning the NVMe tier needs the disk's bandwidth: megatrain plan --nvme PATH")
    trained = stepped_block_params(shape)[1]
    weights = settings.accumulation * 2 * (4 * trained + frozen) if settings.nvme_weights else 0
    return (swap + weights) / hardware.disk_read_bytes_per_s + swap / hardware.disk_write_bytes_per_s


def checkpoint_bytes(shape: ModelShape, settings: RunSettings) -> int:
    return settings.tokens_per_pass * shape.hidden * settings.weight_bytes


def num_checkpoints(shape: ModelShape, settings: RunSettings) -> int:
    """Segments of recomputed blocks (a stashed block keeps no checkpoint)."""
    return -(-max(shape.num_blocks - settings.stashed_blocks, 0) // settings.checkpoint_interval)


def journal_bytes_per_element(settings: RunSettings) -> int:
    """Master, m and v (fp32) and the bf16 shadow, as ``optimizer/journal.py`` journals them."""
    return 12 + (2 if settings.bf16 else 0)


def journal_numel(shape: ModelShape, settings: RunSettings) -> int:
    """Elements the speculative-step journal holds: the engine's ``"auto"`` rule, the last
    blocks' trailing elements within the budget (``optimizer/journal.py``)."""
    if not settings.holds_gradients:
        return 0
    trained = stepped_block_params(shape)[0]  # frozen: never stepped
    per_element = journal_bytes_per_element(settings)
    extents = choose_journal_extents([trained] * shape.num_blocks, per_element, shape.params, "auto")
    return sum(extent.numel for extent in extents)


def min_tokens_to_hide_transfer(hardware: Hardware, bf16: bool = True) -> int:
    """Tokens per weight pass at which block compute covers the host->device weight copies
    (0 where the device is the host: blocks are computed on in place, nothing is copied)."""
    if hardware.shares_host_memory:
        return 0
    weight_bytes = 2 if bf16 else 4
    return int(weight_bytes * hardware.flops / (4 * hardware.h2d_bytes_per_s)) + 1


def step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    """Seconds per optimizer step that each resource alone needs (on the CPU: each part of
    the step, [Note: the CPU as the device]); on a GPU machine their largest is the floor."""
    if hardware.shares_host_memory:
        return _host_device_step_seconds(shape, settings, hardware)
    forward, backward = (
        _pass_bounds(shape, settings, hardware, "forward"),
        _pass_bounds(shape, settings, hardware, "backward"),
    )
    bounds = {
        resource: settings.accumulation * (forward[resource] + backward[resource])
        for resource in ("compute", "host_to_device", "device_to_host")
    }
    bounds["optimizer"] = optimizer_seconds(shape, settings, hardware)
    if settings.nvme:
        bounds["disk"] = _disk_seconds(shape, settings, hardware)
    return bounds


def _pass_bounds(shape: ModelShape, settings: RunSettings, hardware: Hardware, phase: str) -> dict[str, float]:
    """Seconds each resource needs in one micro-batch's ``phase`` (``"forward"`` or
    ``"backward"``) on a GPU machine ([Note: a step's phases])."""
    tokens, w = settings.tokens_per_pass, settings.weight_bytes
    blocks_rate = hardware.flops * hardware.block_efficiency
    head_rate = hardware.head_flops or hardware.flops
    head_forward = 2 * shape.vocab * shape.hidden * tokens
    forward_flops = 2 * shape.total_block_params * tokens
    checkpoints = (
        checkpoint_bytes(shape, settings) * num_checkpoints(shape, settings) if settings.offload_checkpoints else 0
    )
    stash = settings.stashed_blocks * stash_bytes_per_block(shape, settings)
    # Every copy past a block's first costs the link its overhead, once per crossing.
    pieces = shape.num_blocks * (_pieces_per_block(shape, settings) - 1) * FRAGMENT_COPY_OVERHEAD_S
    weights = w * shape.total_block_params / hardware.h2d_bytes_per_s + pieces
    if phase == "forward":
        return {
            "compute": forward_flops / blocks_rate + head_forward / head_rate,
            "host_to_device": weights,
            "device_to_host": (checkpoints + stash) / hardware.d2h_bytes_per_s,
        }
    return {
        "compute": (block_flops(shape, settings) - forward_flops) / blocks_rate + 2 * head_forward / head_rate,
        "host_to_device": weights + (checkpoints + stash) / hardware.h2d_bytes_per_s,
        "device_to_host": w * shape.params / hardware.d2h_bytes_per_s,
    }


def optimizer_seconds(
    shape: ModelShape, settings: RunSettings, hardware: Hardware, beside_copies: bool = False
) -> float:
    """One AdamW pass over every parameter on a GPU machine: the host share at the CPU
    kernel's measured rate (``24 + g + s`` bytes per parameter; alone, or ``beside_copies``
    where it runs behind backward), else at the host's memory bandwidth at
    :data:`ADAM_HOST_BYTES_PER_PARAM`; the device share over the link, ``12 + g`` bytes in
    and ``12 + s`` out at once. The engine walks the states one after another, so the two
    add ([Note: a step's phases]). The GPU tier's share (``device_state_share``) is no part
    of either: updated in the device's memory, ``24 + g + s`` bytes per parameter at its
    bandwidth, where the hardware gives one."""
    g, shadow = settings.grad_bytes, 2 if settings.bf16 else 0
    resident = settings.device_state_share * shape.params
    on_device = settings.device_optimizer_share * (shape.params - resident)
    on_host = shape.params - resident - on_device
    in_device_memory = (
        (24 + g + shadow) * resident / hardware.device_memory_bytes_per_s if hardware.device_memory_bytes_per_s else 0.0
    )
    if hardware.adam_bytes_per_s:
        alone = hardware.adam_bytes_per_s
        rate = (hardware.adam_beside_copies_bytes_per_s or alone) if beside_copies else alone
        host = (24 + g + shadow) * on_host / rate
    else:
        host = ADAM_HOST_BYTES_PER_PARAM * on_host / hardware.host_memory_bytes_per_s
    device = on_device * max((12 + g) / hardware.h2d_bytes_per_s, (12 + shadow) / hardware.d2h_bytes_per_s)
    return host + device + in_device_memory


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
    blocks_rate = hardware.flops * hardware.block_efficiency
    forward = 2 * shape.block_params * tokens / blocks_rate
    # Backward starts at the last block: its backward (4 P T) and its recompute, unless
    # every block stashes (the last blocks are the recomputed ones, recompute_policy.py).
    recomputed = settings.stashed_blocks < shape.num_blocks
    backward = (6 if recomputed else 4) * shape.block_params * tokens / blocks_rate
    head = 6 * shape.vocab * shape.hidden * tokens / (hardware.head_flops or hardware.flops)
    per_pass = min(copy, forward * share) + min(max(copy - head, 0.0), backward * share)
    return settings.accumulation * per_pass


def phase_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    """The step as the engine runs it, per optimizer step: on a GPU machine forward and
    backward (each the longest of its bounds), the weight pipeline's ends and the optimizer
    pass ([Note: a step's phases]); where the device is the host, its parts
    (:func:`step_seconds`)."""
    if hardware.shares_host_memory:
        return step_seconds(shape, settings, hardware)
    passes = settings.accumulation
    phases = {
        "forward": passes * max(_pass_bounds(shape, settings, hardware, "forward").values()),
        "backward": passes * max(_pass_bounds(shape, settings, hardware, "backward").values()),
        "weight_fill": weight_fill_seconds(shape, settings, hardware),
        "optimizer": optimizer_seconds(shape, settings, hardware),
    }
    if settings.nvme:
        phases["disk"] = _disk_seconds(shape, settings, hardware)
    return phases


def predicted_from_phases(
    phases: dict[str, float], shape: ModelShape, settings: RunSettings, hardware: Hardware
) -> float:
    """The predicted step from :func:`phase_seconds`."""
    if hardware.shares_host_memory:
        # One set of cores does everything in turn; the disk works beside the optimizer.
        cores = {part: t for part, t in phases.items() if part not in ("optimizer", "disk")}
        return sum(cores.values()) + max(phases["optimizer"], phases.get("disk", 0.0))
    ends = phases["weight_fill"]
    if settings.holds_gradients and finish_pipelines(settings):
        # The pass runs behind the next forward, which takes each block once its update has
        # landed: the last block computes after the whole pass ([Note: a step's phases]).
        last_block = phases["forward"] / max(shape.num_blocks, 1)
        passes = max(phases["forward"], phases["optimizer"] + last_block) + phases["backward"] + ends
        return max(passes, phases.get("disk", 0.0))
    if settings.holds_gradients:
        # [Note: clipping's serialisation] The update needs the global norm, known when
        # backward's last gradient has reached the host: the optimizer pass follows.
        passes = phases["forward"] + phases["backward"] + ends
        return max(passes, phases.get("disk", 0.0)) + phases["optimizer"]
    # The optimizer runs behind backward beside the copies; the last block's update is exposed.
    behind = optimizer_seconds(shape, settings, hardware, beside_copies=True)
    passes = phases["forward"] + max(phases["backward"], behind) + ends
    return max(passes, phases.get("disk", 0.0)) + behind / shape.num_blocks


def finish_pipelines(settings: RunSettings) -> bool:
    """Whether the engine runs this configuration's optimizer finish behind the next forward
    (one process; the engine's rule, :func:`~megatrain_ds.optimizer.pipelined_finish.refusal`)."""
    return (
        refusal(
            holds_gradients=settings.holds_gradients,
            data_parallel=False,
            nvme_tier=settings.nvme,
            on_host_only=settings.device_optimizer_share == 0,
        )
        is None
    )


def predicted_step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> float:
    return predicted_from_phases(phase_seconds(shape, settings, hardware), shape, settings, hardware)


def _host_device_step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    tokens, passes, params = settings.tokens_per_pass, settings.accumulation, shape.params
    w, g = settings.weight_bytes, settings.grad_bytes
    shadow = 2 if settings.bf16 else 0
    bandwidth = hardware.host_memory_bytes_per_s
    gradient_bytes = passes * 2 * w * params + g * params  # staging copies; the norm's read
    if settings.holds_gradients:
        gradient_bytes += g * params + passes * (2 * g + w) * params  # zeroing; accumulating
    journal_bytes = 2 * journal_numel(shape, settings) * journal_bytes_per_element(settings)
    adam_rate = hardware.adam_bytes_per_s or hardware.host_memory_bytes_per_s
    checkpoints = (
        4 * checkpoint_bytes(shape, settings) * num_checkpoints(shape, settings) if settings.offload_checkpoints else 0
    )
    head_flops = 6 * shape.vocab * shape.hidden * tokens
    return {
        "blocks": passes * block_flops(shape, settings) / (hardware.flops * hardware.block_efficiency),
        "head": passes
        * (head_flops / (hardware.head_flops or hardware.flops) + LOSS_PASSES * tokens * shape.vocab * 4 / bandwidth),
        "gradient_path": (gradient_bytes + journal_bytes) / bandwidth,
        "checkpoints": passes * checkpoints / bandwidth,
        "optimizer": (24 + g + shadow) * params / adam_rate,
        **({"disk": _disk_seconds(shape, settings, hardware)} if settings.nvme else {}),
    }
