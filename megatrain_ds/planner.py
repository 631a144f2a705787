"""The engine's cost model: host and GPU memory, transfer-hiding batch, step time.

Pure arithmetic over a :class:`ModelShape`, :class:`RunSettings` and :class:`Hardware`;
``megatrain plan`` (:mod:`megatrain_ds.cli`) prints it. Per optimizer step with ``P_b``
streamed block parameters, ``T`` tokens per weight pass and ``w`` bytes per streamed
weight (2 in bf16, 4 in fp32):

- compute: ``8 * P_b * T`` FLOPs for blocks (forward, recompute, backward) plus
  ``6 * V * h * T`` for the lm_head; the throughput metric counts ``6 * P * T``;
- host->device: ``2 * w * P_b`` bytes (forward and backward) + checkpoints coming back;
- device->host: ``w * P`` bytes of gradients + checkpoints going out;
- host optimizer: ~30 bytes of host memory traffic per parameter (read p, g, m, v;
  write p, m, v, shadow), overlapped with backward on a GPU machine.

Transfers hide behind compute once ``8 * P_b * T / F >= 2 * w * P_b / B``, i.e.
``T >= w * F / (4 * B)``, independent of model size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1 << 30

# Per token per block, bytes of activations a block's recompute holds for backward in
# 16-bit (Korthikanti et al., "Reducing Activation Recomputation", with flash/SDPA
# attention): 34 * hidden. Scaled by bytes per value / 2 for fp32 compute.
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 34

# Host-memory traffic of one AdamW update, bytes per parameter (fp32 p, g, m, v read;
# p, m, v written; bf16 shadow written).
ADAM_HOST_BYTES_PER_PARAM = 30

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
    so nothing overlaps and device memory is host memory."""


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

    @property
    def params(self) -> int:
        return self.total_block_params + self.resident_params


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

    @property
    def tokens_per_pass(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def weight_bytes(self) -> int:
        return 2 if self.bf16 else 4


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
    result = {"master": 4 * params, "adam_m_v": 8 * params}
    if settings.bf16:
        result["bf16_shadow"] = 2 * params
    if settings.accumulation > 1:
        result["gradients"] = 4 * params
    elif settings.clipping:
        result["gradients"] = settings.weight_bytes * params
    result["staging"] = settings.num_staging_buffers * (1 << 22) * settings.weight_bytes
    if settings.offload_checkpoints:
        result["checkpoints"] = _checkpoint_bytes(shape, settings) * _num_checkpoints(shape, settings)
    return result


def gpu_bytes(shape: ModelShape, settings: RunSettings) -> dict[str, int]:
    """Device memory of the run, by component."""
    w = settings.weight_bytes
    tokens = settings.tokens_per_pass
    slots = settings.num_buffers + settings.checkpoint_interval - 1
    checkpoints_on_device = slots if settings.offload_checkpoints else _num_checkpoints(shape, settings)
    return {
        "weight_buffers": slots * shape.block_params * w,
        "resident_params": shape.resident_params * w,
        "resident_grads": shape.resident_params * w,
        "checkpoints": checkpoints_on_device * _checkpoint_bytes(shape, settings),
        "block_activations": settings.checkpoint_interval * tokens * shape.hidden
        * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN * w // 2,
        # Hugging Face upcasts logits to fp32 for the loss: compute-dtype logits, their
        # fp32 copy and its gradient.
        "logits": tokens * shape.vocab * (w + 4 + 4),
    }


def _checkpoint_bytes(shape: ModelShape, settings: RunSettings) -> int:
    return settings.tokens_per_pass * shape.hidden * settings.weight_bytes


def _num_checkpoints(shape: ModelShape, settings: RunSettings) -> int:
    return -(-shape.num_blocks // settings.checkpoint_interval)


def min_tokens_to_hide_transfer(hardware: Hardware, bf16: bool = True) -> int:
    """Tokens per weight pass at which block compute covers the host->device weight copies."""
    weight_bytes = 2 if bf16 else 4
    return int(weight_bytes * hardware.flops / (4 * hardware.h2d_bytes_per_s)) + 1


def step_seconds(shape: ModelShape, settings: RunSettings, hardware: Hardware) -> dict[str, float]:
    """Seconds per optimizer step that each resource alone needs."""
    tokens = settings.tokens_per_pass
    passes = settings.accumulation
    w = settings.weight_bytes
    checkpoint_traffic = (_checkpoint_bytes(shape, settings) * _num_checkpoints(shape, settings)
                          if settings.offload_checkpoints else 0)
    compute_flops = 8 * shape.total_block_params * tokens + 6 * shape.vocab * shape.hidden * tokens
    return {
        "compute": passes * compute_flops / hardware.flops,
        "host_to_device": passes * (2 * w * shape.total_block_params + checkpoint_traffic)
        / hardware.h2d_bytes_per_s,
        "device_to_host": passes * (w * shape.params + checkpoint_traffic) / hardware.d2h_bytes_per_s,
        "optimizer": ADAM_HOST_BYTES_PER_PARAM * shape.params / hardware.host_memory_bytes_per_s,
    }


def _predicted_step(by_bound: dict[str, float], shape: ModelShape, hardware: Hardware) -> float:
    if hardware.shares_host_memory:
        return sum(by_bound.values())  # one set of cores does everything in turn
    # Streams and the optimizer worker overlap; the last block's update cannot hide.
    tail = by_bound["optimizer"] / shape.num_blocks
    return max(by_bound.values()) + tail


def plan(shape: ModelShape, settings: RunSettings, hardware: Hardware,
         host_memory_bytes: int) -> Plan:
    """Memory, speed and recommendations for ``settings`` on ``hardware``."""
    by_bound = step_seconds(shape, settings, hardware)
    step = _predicted_step(by_bound, shape, hardware)
    hide = min_tokens_to_hide_transfer(hardware, settings.bf16)
    max_micro = _max_micro_batch(shape, settings, hardware, host_memory_bytes)
    wanted_micro = max(1, -(-hide // settings.seq_len))
    recommended: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": min(max(wanted_micro, 1), max(max_micro, 1)),
        "offload_checkpoints": _num_checkpoints(shape, settings) * _checkpoint_bytes(shape, settings)
        > 0.25 * hardware.device_memory_bytes,
        "checkpoint_interval": 1,
        "num_buffers": 2,
        "optimizer_device": "gpu" if by_bound["optimizer"] > 24 * shape.params / hardware.h2d_bytes_per_s
        and not hardware.shares_host_memory else "cpu",
    }
    return Plan(
        params=shape.params,
        host_bytes=host_bytes(shape, settings),
        gpu_bytes=gpu_bytes(shape, settings),
        min_tokens_to_hide_transfer=hide,
        step_seconds_by_bound=by_bound,
        predicted_step_seconds=step,
        predicted_tokens_per_second=settings.tokens_per_pass * settings.accumulation / step,
        max_micro_batch=max_micro,
        recommended=recommended,
    )


def _fits(shape: ModelShape, settings: RunSettings, hardware: Hardware, host_memory_bytes: int) -> bool:
    device = sum(gpu_bytes(shape, settings).values())
    host = sum(host_bytes(shape, settings).values())
    if hardware.shares_host_memory:
        return host + device <= host_memory_bytes
    return device <= DEVICE_MEMORY_HEADROOM * hardware.device_memory_bytes and host <= host_memory_bytes


def _max_micro_batch(shape: ModelShape, settings: RunSettings, hardware: Hardware,
                     host_memory_bytes: int) -> int:
    """Largest micro-batch that fits (0 when not even one sequence does)."""
    def fits(micro: int) -> bool:
        return _fits(shape, _with(settings, micro_batch=micro), hardware, host_memory_bytes)

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 1 << 20:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _with(settings: RunSettings, **changes: Any) -> RunSettings:
    return RunSettings(**{**asdict(settings), **changes})
