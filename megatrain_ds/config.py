"""The engine's configuration, read from a DeepSpeed JSON with ``"engine": "megatrain"``.

Engine options live in a top-level ``"megatrain"`` block (:class:`MegatrainOptions`);
unknown keys and bad values there are rejected with a message naming the key and the
valid choices. The DeepSpeed keys this engine gives a meaning to are read into
:class:`EngineConfig`; other DeepSpeed keys are reported once as ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

ENGINE_NAME = "megatrain"

# DeepSpeed keys this engine reads; everything else at the top level is ignored with a warning.
_KNOWN_TOP_LEVEL = {
    "engine",
    "megatrain",
    "bf16",
    "fp16",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "optimizer",
    # DeepSpeed semantics added for Accelerate and the HF Trainer (see README):
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_optimization",
    "bfloat16",
    # Accelerate and the HF Trainer add these to every config they prepare; they concern
    # which client optimizers DeepSpeed lets through (this engine checks the class itself).
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    # ZeRO-Infinity's async I/O settings, read for the NVMe tier (AioSettings).
    "aio",
    # DeepSpeed's monitors, written through its own MonitorMaster (integration/deepspeed_adapter.py).
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    # DeepSpeed's training_data loader (integration/initialize.py).
    "dataloader_drop_last",
}
MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")
"""DeepSpeed's monitor blocks (``deepspeed/monitor/config.py``), each a top-level key."""

# DeepSpeed keys read by DeepSpeed's engine that mean nothing to this one: each is ignored with
# a warning saying what the engine does instead (docs/configuration.md, "Every DeepSpeed key").
_IGNORED_TOP_LEVEL = {
    "activation_checkpointing": "the engine checkpoints and recomputes every streamed block itself "
    "(megatrain.checkpoint_interval, offload_checkpoints, recompute)",
    "autotuning": "not run; `megatrain plan` and the preflight size a run",
    "checkpoint": "checkpoints are the engine's own safetensors format (docs/checkpoints.md)",
    "datastates_ckpt": "checkpoints are the engine's own safetensors format (docs/checkpoints.md)",
    "comms_logger": "collectives are not logged; megatrain.trace records the gradient reductions",
    "communication_data_type": "gradients are reduced in the compute dtype, as autograd made them",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "compile": "engine.compile is not supported; torch.compile parts of the model instead",
    "data_efficiency": "the training_data loader is DeepSpeed's plain distributed sampler (no data routing)",
    "data_types": "held gradients are fp32 when accumulating or with fp16, else the compute dtype",
    "disable_allgather": "there is no ZeRO all-gather: every rank holds whole parameters",
    "disable_python_gc": "Python's garbage collector is left as it is",
    "dump_state": "the DeepSpeed state is not printed",
    "flops_profiler": "not run (its module hooks do not see the streamed blocks); megatrain.trace "
    "times each block's compute and `megatrain plan` predicts a step",
    "gradient_predivide_factor": "gradients are summed in full and divided by the world size once",
    "prescale_gradients": "gradients are summed in full and divided by the world size once",
    "hybrid_engine": "there is no inference (generation) engine; call engine.module under torch.no_grad()",
    "log_level": "DeepSpeed's logger level is left as it is",
    "memory_breakdown": "memory is not logged per step; the preflight reports what a run needs",
    "pipeline": "pipeline settings apply to DeepSpeed's PipelineModule only, which this engine does not run",
    "timers": "the throughput timer is not run; wall_clock_breakdown times forward, backward and step",
    "use_data_before_expert_parallelism": "there is no expert parallelism",
    "vocabulary_size": "the vocabulary is the model's",
    "weight_quantization": "weights are not quantized: the masters are fp32 and compute is fp32, bf16 or fp16",
}
_REMOVED_FROM_DEEPSPEED = (
    "amp",
    "compression_training",
    "curriculum_learning",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
)
"""Keys DeepSpeed 0.19 itself refuses (its ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``): refused here too."""
_OPTIMIZER_TYPES = ("adamw", "adam")


def _is_integer_at_least(value: object, minimum: float) -> bool:
    """``value`` is a JSON integer (not a bool, which Python counts as one) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _block_value(value: Any, key: str, default: Any) -> Any:
    return value.get(key, default) if isinstance(value, Mapping) else default


# DeepSpeed keys whose non-default values ask for what this engine cannot do: refused then,
# each with what to do instead (their default values say what the engine does anyway).
_REFUSED_WHEN: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel": (
        lambda v: _block_value(v, "autotp_size", 0) not in (0, 1),
        "tensor parallelism (autotp_size > 1) is not supported: the engine trains data parallel "
        "with whole blocks streamed through each device; remove the block",
    ),
    "sequence_parallel_size": (
        lambda v: v not in (None, 1),
        "sequence parallelism is not supported; remove the key (long sequences: megatrain.loss_chunk_tokens "
        "and mlp_tile_tokens, docs/long-context.md)",
    ),
    "expert_parallel": (
        lambda v: bool(_block_value(v, "enabled", False)),
        "expert parallelism is not supported: experts train data parallel like every other weight; set enabled: false",
    ),
    "torch_autocast": (
        lambda v: bool(_block_value(v, "enabled", False)),
        'torch.autocast is not used: set "bf16": {"enabled": true} (or fp16) instead, which computes in that '
        "dtype with fp32 masters",
    ),
    "managed_gradient_accumulation": (
        lambda v: v is not True,
        "the engine counts micro-batches itself (gradient_accumulation_steps); set it true, and use "
        "engine.set_gradient_accumulation_boundary() to end an accumulation early",
    ),
    "gradient_allreduce_op": (
        lambda v: str(v).lower() != "mean",
        'gradients are averaged over the ranks; only "mean" (DeepSpeed\'s default) is supported',
    ),
}


def _refuse_unsupported(config: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for a DeepSpeed key this engine can neither honour nor ignore."""
    for key in _REMOVED_FROM_DEEPSPEED:
        if key in config:
            raise ConfigError(
                f'"{key}" was removed from DeepSpeed (DeepSpeed 0.19 refuses it too) and has no meaning here: remove it'
            )
    for key, (refused, fix) in _REFUSED_WHEN.items():
        if key in config and refused(config[key]):
            raise ConfigError(f"{key} = {config[key]!r}: {fix}")


def _warn_ignored(config: Mapping[str, Any], zero_ignored: tuple[str, ...]) -> tuple[str, ...]:
    """Warn once about the DeepSpeed keys ignored here, each with what the engine does instead;
    returns them (top-level keys first, then the ``zero_optimization`` ones)."""
    understood = _KNOWN_TOP_LEVEL | _REFUSED_WHEN.keys()
    top_level = tuple(sorted(set(config) - understood))
    reasons = [f"{key} ({_IGNORED_TOP_LEVEL.get(key, 'not a DeepSpeed key this engine knows')})" for key in top_level]
    if zero_ignored:
        reasons.append(f"{', '.join(zero_ignored)} ({ZERO_IGNORED_REASON})")
    if reasons:
        logger.warning("megatrain: ignoring DeepSpeed config keys without meaning here: %s", "; ".join(reasons))
    return top_level + zero_ignored


ZERO_IGNORED_REASON = (
    "ZeRO's partitioning, bucketing and prefetch tuning: the engine keeps whole parameters and their "
    "optimizer state in host memory and streams each block's weights to the device just in time, so there "
    "is nothing to partition, bucket or prefetch"
)
"""What the engine does instead of the ``zero_optimization`` keys it ignores."""

AUTO = "auto"
"""The placeholder Accelerate and the HF Trainer fill in before calling ``deepspeed.initialize``."""
_AUTO_HELP = (
    '"auto" values are filled in by the HF Trainer (from TrainingArguments) or by '
    "Accelerate before they call deepspeed.initialize; this one was not: give a value"
)

# DeepSpeed's defaults for keys it reads (deepspeed/runtime/constants.py, DeepSpeed 0.19).
GRADIENT_CLIPPING_DEFAULT = 1.0


def _reject_auto(block: Mapping[str, Any], prefix: str) -> None:
    for key, value in block.items():
        if value == AUTO:
            raise ConfigError(f"{prefix}.{key} is {AUTO!r}: {_AUTO_HELP}")


# A "zero_optimization" block copied from a ZeRO-3 offload config: this engine's host-resident
# layout replaces every ZeRO stage, so only these keys mean something here; the others are
# listed in the one warning about ignored keys.
_ZERO_UNDERSTOOD = {"stage", "stage3_gather_16bit_weights_on_model_save"}
_ZERO_OFFLOAD_BLOCKS = ("offload_param", "offload_optimizer")
_OFFLOAD_HOST_DEVICES = ("cpu", "none", None)  # host memory is where this engine keeps both
_NVME = "nvme"
NVME_OFFLOAD_LEVELS = ("none", "optimizer", "all")
"""What the NVMe tier holds, least first: nothing, the blocks' optimizer state, their whole state."""


@dataclass(frozen=True)
class _ZeroOffload:
    """What a ``zero_optimization`` block says that this engine reads."""

    pin_memory: bool | None = None
    nvme: dict[str, Any] = field(default_factory=dict)
    """``megatrain`` options implied by ``offload_*.device: "nvme"`` (the NVMe tier)."""
    ignored: tuple[str, ...] = ()


def _zero_optimization(block: Any) -> _ZeroOffload:
    """Read a ``zero_optimization`` block.

    ``offload_param.pin_memory``/``offload_optimizer.pin_memory`` set ``megatrain.pin_memory``
    (unless the ``megatrain`` block sets it; pinned if either says so); offload devices
    ``cpu``/``none`` agree with the engine; any ``stage`` 0-3 is accepted. ZeRO-Infinity's
    ``offload_optimizer.device: "nvme"`` puts the optimizer state on the NVMe tier
    (``nvme_offload: "optimizer"``, its ``nvme_path`` and ``buffer_count``);
    ``offload_param.device: "nvme"`` puts the blocks' weights there too (``nvme_offload: "all"``).
    """
    if not isinstance(block, Mapping):
        raise ConfigError(f'"zero_optimization" must be a JSON object, got {block!r}')
    stage = block.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    pins: list[bool] = []
    ignored: list[str] = []
    nvme: dict[str, Any] = {}
    for key, value in block.items():
        if key in _ZERO_UNDERSTOOD:
            continue
        if key not in _ZERO_OFFLOAD_BLOCKS or not isinstance(value, Mapping):
            ignored.append(f"zero_optimization.{key}")
            continue
        on_nvme = value.get("device") == _NVME
        for sub, sub_value in value.items():
            name = f"zero_optimization.{key}.{sub}"
            if sub == "pin_memory":
                if not isinstance(sub_value, bool):
                    raise ConfigError(f"{name} must be true or false, got {sub_value!r}")
                pins.append(sub_value)
            elif sub == "device" and (sub_value in _OFFLOAD_HOST_DEVICES or sub_value == _NVME):
                continue
            elif on_nvme and sub == "nvme_path":
                nvme.setdefault("nvme_path", sub_value)  # offload_optimizer's, when both say one
            elif on_nvme and sub == "buffer_count" and key == "offload_optimizer":
                nvme["nvme_window_blocks"] = sub_value
            else:
                ignored.append(name)
        if on_nvme:
            # Weights on NVMe take their optimizer state along: a block's master is both.
            level = "all" if key == "offload_param" else "optimizer"
            nvme["nvme_offload"] = "all" if nvme.get("nvme_offload") == "all" else level
    if nvme.get("nvme_offload") and "nvme_path" not in nvme:
        device = "offload_param" if nvme["nvme_offload"] == "all" else "offload_optimizer"
        raise ConfigError(
            f'zero_optimization.{device}.device is "nvme" but no nvme_path is given: '
            'add "nvme_path": "/local_nvme/..." (a directory on a local disk)'
        )
    return _ZeroOffload(pin_memory=(any(pins) if pins else None), nvme=nvme, ignored=tuple(ignored))


@dataclass(frozen=True, kw_only=True)
class AioSettings:
    """How swap files are read and written (``"megatrain": {"nvme_aio": {...}}``, or
    DeepSpeed's top-level ``"aio"`` block, whose keys these are). See ``state/swap_io.py``."""

    engine: str = "auto"
    """"aio" (DeepSpeed's async I/O op, needs libaio), "threads" (O_DIRECT reads and writes
    on a thread pool), or "auto" (the op when it builds, else the threads)."""
    block_size: int = 1 << 20
    """Bytes per I/O piece."""
    queue_depth: int = 8
    """Requests in flight per thread (the op only)."""
    thread_count: int = 1
    """Threads per request (DeepSpeed's ``intra_op_parallelism``/``thread_count``)."""
    single_submit: bool = False
    """Submit requests one by one (the op only)."""
    overlap_events: bool = True
    """Overlap submission and completion (the op only)."""

    @classmethod
    def from_dict(cls, block: Any, name: str) -> AioSettings:
        if isinstance(block, AioSettings):
            return block
        if not isinstance(block, Mapping):
            raise ConfigError(f"{name} must be a JSON object, got {block!r}")
        values = dict(block)
        if "intra_op_parallelism" in values:  # DeepSpeed's newer name
            values.setdefault("thread_count", values.pop("intra_op_parallelism"))
        values.pop("use_gds", None)  # GPUDirect storage: not used (the state goes to host memory)
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - valid)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in {name}: {', '.join(unknown)}; valid keys: "
                f"{', '.join(sorted(valid | {'intra_op_parallelism'}))}"
            )
        settings = cls(**values)
        if settings.engine not in ("auto", "aio", "threads"):
            raise ConfigError(f'{name}.engine must be one of "auto", "aio", "threads"; got {settings.engine!r}')
        for key in ("block_size", "queue_depth", "thread_count"):
            value = getattr(settings, key)
            if not _is_integer_at_least(value, 1):
                raise ConfigError(f"{name}.{key} must be an integer >= 1, got {value!r}")
        if settings.block_size % 4096:
            raise ConfigError(
                f"{name}.block_size must be a multiple of 4096 bytes (O_DIRECT), got {settings.block_size}"
            )
        for key in ("single_submit", "overlap_events"):
            if not isinstance(getattr(settings, key), bool):
                raise ConfigError(f"{name}.{key} must be true or false, got {getattr(settings, key)!r}")
        return settings


RECOMPUTE_CHOICES = ("full", "none", "auto")
"""The named values of ``megatrain.recompute``; an integer is the fourth form."""


class ConfigError(ValueError):
    """A configuration value the engine cannot use; the message names the key."""


@dataclass(kw_only=True)
class MegatrainOptions:
    """The ``"megatrain"`` block of the DeepSpeed JSON."""

    block_path: str | None = None
    """Dotted path of the ``nn.ModuleList`` of transformer blocks (found automatically if unset)."""
    checkpoint_interval: int = 1
    """Blocks per activation checkpoint (K). 1 keeps every block input; larger keeps fewer
    checkpoints but holds K blocks' weights on the device during backward."""
    offload_checkpoints: bool = True
    """Park activation checkpoints in host memory between forward and backward, so device
    memory does not grow with depth; costs 2*T*hidden bytes of host->device traffic per
    checkpoint. Set false when the checkpoints fit on the device."""
    recompute: str | int = "full"
    """What each block's backward starts from. "full" (default): every block is recomputed
    from its activation checkpoint (8*P*T FLOPs per step instead of 6*P*T). "none": every
    block *stashes* what autograd saves in its forward (its saved activations, not its
    weights) in host memory -- copied device-to-host on a side stream on a GPU, kept where
    it is on the CPU -- and backward runs from the stash without recomputing. An integer N:
    the last N blocks are recomputed, the others stashed. "auto": the planner chooses N
    from the measured bandwidth, block compute time and the host memory left (logged once).
    See ``streaming/activation_stash.py``."""
    fragment_bytes: int | str | None = "auto"
    """Copy each block's weights host-to-device in pieces of about this many bytes (>= 4096),
    each with its own event, in the order the block's modules use them: a module starts as
    soon as its pieces have arrived instead of waiting for the whole block (bytes per step
    are unchanged; the device buffers stay sized by whole blocks). None or 0: whole blocks.
    "auto" (default): the planner decides at the first training forward, on where it
    predicts a step at least 2% shorter (its model: the wait for the first and last
    blocks' weights of each pass, against the cost of more copies; see
    ``planning/fragment_policy.py``), off otherwise and always off on the CPU, where
    nothing is copied. See ``streaming/weight_fragments.py``."""
    loss_chunk_tokens: int | Literal["auto"] = "auto"
    """A Hugging Face causal LM's labelled training loss is computed this many tokens at a
    time from the final hidden states (logits, loss and the lm_head/hidden gradients of one
    chunk at once, ``model/causal_lm_loss.py``), never ``tokens x vocab`` logits whole; the
    output then has the loss and no logits. 0 lets the model compute its logits and loss
    itself. "auto": chosen by ``planning/long_context.py`` from the vocabulary and the
    device memory, and 0 for models that transform their logits after the projection
    (Gemma 2's softcapping) or whose loss is not ``ForCausalLMLoss``."""
    mlp_tile_tokens: int | Literal["auto"] = "auto"
    """Inside streamed blocks the MLP (the ``mlp``/``feed_forward`` submodule: token-wise)
    runs over sequence tiles of this many tokens, in forward and in the recompute, and its
    backward recomputes one tile at a time, so its ``tokens x FFN`` intermediate never
    exists whole (``streaming/tiled_mlp.py``); costs one more MLP forward per block in
    backward when a sequence is longer than a tile. 0 runs the MLP whole. "auto": chosen by
    ``planning/long_context.py`` from the FFN width and the device memory."""
    num_buffers: int = 2
    """Device weight buffers for streaming (2 = double buffering)."""
    master_dtype: str = "fp32"
    """Dtype of the master weights: "fp32" (default) or "bf16" (rounds small updates away)."""
    pin_memory: bool = True
    """Page-lock host buffers when CUDA is used (needed for asynchronous copies)."""
    num_staging_buffers: int = 4
    """Pinned host buffers (4M elements each) for device-to-host gradient copies."""
    load_from: str | None = None
    """A local directory of Hugging Face safetensors shards (``model.safetensors`` or a
    ``model.safetensors.index.json`` and its shards) to fill the parameters from, block by
    block, converted to the master dtype; lets a model built on the meta device
    (``accelerate.init_empty_weights()``) be trained without ever holding it twice."""
    preflight: bool = True
    """Check before allocating that the run fits in host (and device) memory, and fail at
    once with the numbers and the settings that would fit."""
    trace: str | None = None
    """Write a Chrome/Perfetto trace (JSON) of the weight copies, block compute, gradient
    copies and the optimizer worker to this path, for ``trace_steps`` optimizer steps after
    one warm-up step; open it at https://ui.perfetto.dev or draw a step with
    ``bench/timeline.py``. See ``runtime/trace.py``."""
    trace_steps: int = 3
    """Optimizer steps written to ``trace``."""
    optimizer_device: str = "auto"
    """Where AdamW runs: "cpu" (host SIMD kernel, overlapping backward), "gpu" (optimizer
    state streamed through the device and a fused Triton kernel), or "auto": measured at
    start-up (cached per machine), possibly splitting blocks between the two; "cpu"
    without CUDA. See ``optimizer/placement.py``."""
    cpu_adam_kernel: str = "auto"
    """The CPU AdamW kernel: "deepspeed" (DeepSpeed's CPU Adam kernel, JIT-built on first
    use), "torch_fused" (ATen's fused kernel), "torch" (op by op), or "auto" (the first that
    runs, in that order); one that cannot run here falls back with a logged reason. See
    ``optimizer/cpu_adam.py``."""
    speculative_blocks: int | str = "auto"
    """Blocks whose update may run during backward before the global gradient norm is
    known (then validated, and undone exactly if clipping or a non-finite norm says so).
    Each keeps a journal of 12 bytes per parameter (14 with a bf16 shadow) of host memory;
    "auto" takes as many as fit in 0.5 bytes per model parameter. See
    ``optimizer/speculative_step.py``."""
    non_finite_steps: str = "auto"
    """What a step with a non-finite gradient norm does: "skip" (weights and optimizer
    state untouched; needs the gradients held until the norm is known, which costs
    nothing with clipping or accumulation and 2-4 bytes/param without), "raise", or "auto"
    ("skip" when gradients are held anyway, else "raise")."""
    max_consecutive_skips: int = 10
    """Non-finite steps skipped in a row before the engine gives up: the next one raises
    ``NonFiniteGradientError`` (the state is still intact then)."""
    collective_timeout_s: float = 600.0
    """Data parallel: the longest any collective waits for the other ranks. A rank that
    died breaks the connections at once; one that hangs is reported after this long."""
    nvme_offload: str = "none"
    """The NVMe tier: "optimizer" keeps every block's Adam m and v (8 bytes/param; with bf16
    compute the fp32 master too, 12 bytes/param) in swap files under ``nvme_path``, read
    ahead of each block's update and written back behind it through a window of
    ``nvme_window_blocks`` blocks in host memory; "all" keeps the blocks' weights there too
    (the fp32 master, m and v: every byte of a block's state but its held gradient), read
    ahead of forward and backward through a second window; "auto" picks the least of
    these that fits in host memory; "none" keeps everything in host memory. ZeRO-Infinity's
    ``offload_optimizer.device: "nvme"`` sets "optimizer", ``offload_param.device: "nvme"``
    sets "all". See ``state/nvme_tier.py`` and ``state/nvme_weights.py``."""
    nvme_path: str | None = None
    """Directory (on a local disk) for the NVMe tier's swap files; each run makes and locks
    its own sub-directory and removes it at ``engine.destroy()``."""
    nvme_window_blocks: int = 4
    """Blocks of optimizer state the NVMe tier holds in host memory at once (read-ahead
    and write-behind together, at least 2; ZeRO-Infinity's ``buffer_count``)."""
    nvme_aio: AioSettings = field(default_factory=AioSettings)
    """How swap files are read and written (:class:`AioSettings`; DeepSpeed's ``"aio"``)."""

    def __post_init__(self) -> None:
        self._check_paths()
        self._check_choices()
        self._check_counts()
        self.nvme_aio = AioSettings.from_dict(self.nvme_aio, "megatrain.nvme_aio")
        if self.nvme_offload not in NVME_OFFLOAD_LEVELS + ("auto",):
            raise ConfigError(
                f'megatrain.nvme_offload must be one of "none", "optimizer", "all", "auto"; got {self.nvme_offload!r}'
            )
        if self.nvme_offload != "none" and not (isinstance(self.nvme_path, (str, os.PathLike)) and str(self.nvme_path)):
            raise ConfigError(
                f"megatrain.nvme_offload is {self.nvme_offload!r} but megatrain.nvme_path is "
                f"{self.nvme_path!r}: give a directory on a local disk for the swap files"
            )

    def _check_paths(self) -> None:
        if self.block_path is not None and not isinstance(self.block_path, str):
            raise ConfigError(f"megatrain.block_path must be a string, got {self.block_path!r}")
        if self.load_from is not None and not isinstance(self.load_from, (str, os.PathLike)):
            raise ConfigError(f"megatrain.load_from must be a directory path, got {self.load_from!r}")
        if self.trace is not None and not (isinstance(self.trace, (str, os.PathLike)) and str(self.trace)):
            raise ConfigError(f"megatrain.trace must be a file path (a .json), got {self.trace!r}")

    def _check_choices(self) -> None:
        """The keys that take one of a few words (or, for some, a number as well)."""
        for name, choices in (
            ("optimizer_device", ("auto", "cpu", "gpu")),
            ("cpu_adam_kernel", ("auto", "deepspeed", "torch_fused", "torch")),
            ("non_finite_steps", ("auto", "skip", "raise")),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"megatrain.{name} must be one of {', '.join(map(repr, choices))}; got {getattr(self, name)!r}"
                )
        if self.master_dtype not in ("fp32", "bf16"):
            raise ConfigError(f'megatrain.master_dtype must be one of "fp32", "bf16"; got {self.master_dtype!r}')
        for name in ("pin_memory", "offload_checkpoints", "preflight"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"megatrain.{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative_blocks != "auto" and not _is_integer_at_least(self.speculative_blocks, 0):
            raise ConfigError(
                f'megatrain.speculative_blocks must be "auto" or an integer >= 0, got {self.speculative_blocks!r}'
            )
        if self.recompute not in RECOMPUTE_CHOICES and not _is_integer_at_least(self.recompute, 0):
            raise ConfigError(
                'megatrain.recompute must be "full" (recompute every block), "none" (stash '
                'every block\'s activations in host memory), "auto" (the planner chooses) or an '
                f"integer >= 0 (blocks recomputed, the rest stashed); got {self.recompute!r}"
            )
        if self.fragment_bytes not in ("auto", None, 0) and not _is_integer_at_least(self.fragment_bytes, 4096):
            raise ConfigError(
                'megatrain.fragment_bytes must be "auto" (the planner decides), a number of bytes '
                ">= 4096 (a piece of a block's weights per copy), or null or 0 for whole blocks; "
                f"got {self.fragment_bytes!r}"
            )
        for name in ("loss_chunk_tokens", "mlp_tile_tokens"):
            value = getattr(self, name)
            if value != "auto" and not _is_integer_at_least(value, 0):
                raise ConfigError(f'megatrain.{name} must be "auto", 0 (off) or a number of tokens >= 1, got {value!r}')

    def _check_counts(self) -> None:
        for name, minimum in (
            ("trace_steps", 1),
            ("checkpoint_interval", 1),
            ("num_buffers", 2),
            ("num_staging_buffers", 1),
            ("max_consecutive_skips", 0),
            ("nvme_window_blocks", 2),
        ):
            value = getattr(self, name)
            if not _is_integer_at_least(value, minimum):
                raise ConfigError(f"megatrain.{name} must be an integer >= {minimum}, got {value!r}")
        if (
            not isinstance(self.collective_timeout_s, (int, float))
            or isinstance(self.collective_timeout_s, bool)
            or not self.collective_timeout_s > 0
        ):
            raise ConfigError(
                f"megatrain.collective_timeout_s must be a number of seconds > 0, got {self.collective_timeout_s!r}"
            )

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> MegatrainOptions:
        if not isinstance(block, Mapping):
            raise ConfigError(f'"megatrain" must be a JSON object, got {block!r}')
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(block) - valid)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in megatrain config: {', '.join(unknown)}; valid keys: {', '.join(sorted(valid))}"
            )
        return cls(**block)


_ACCEPTED_ADAM_FLAGS = {"adam_w_mode", "torch_adam", "bias_correction", "amsgrad", "fp32_optimizer_states", "foreach"}
"""optimizer.params keys read as flags (or ignored) besides the hyperparameters."""


@dataclass(kw_only=True)
class OptimizerSpec:
    """The ``"optimizer"`` block: AdamW (or Adam with ``adam_w_mode``), read as DeepSpeed does.

    ``"AdamW"`` is always decoupled; ``"Adam"`` is too unless ``adam_w_mode`` is false
    (then L2). The weight decay defaults to 0 (DeepSpeed's FusedAdam/DeepSpeedCPUAdam),
    or to 0.01 with ``torch_adam`` in decoupled mode (``torch.optim.AdamW``'s default).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    decoupled: bool = True
    """AdamW-style decoupled weight decay (``adam_w_mode``); False is Adam with L2."""

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> OptimizerSpec:
        kind = str(block.get("type", "")).lower()
        if kind not in _OPTIMIZER_TYPES:
            raise ConfigError(f'optimizer.type {block.get("type")!r} is not supported; valid: "AdamW", "Adam"')
        params = dict(block.get("params", {}))
        _reject_auto(params, "optimizer.params")
        if "max_grad_norm" in params:  # DeepSpeed's own message
            raise ConfigError(
                "'max_grad_norm' is not supported as an optimizer parameter, please switch "
                "to using the deepspeed parameter 'gradient_clipping'"
            )
        adam_w_mode = bool(params.pop("adam_w_mode", True))
        decoupled = kind == "adamw" or adam_w_mode  # DeepSpeed: "AdamW" forces AdamW
        torch_adam = bool(params.pop("torch_adam", False))  # the host step is always the engine's own
        # Options of DeepSpeed's Adam classes that only this value agrees with the engine's Adam.
        for key, required in (("bias_correction", True), ("amsgrad", False), ("fp32_optimizer_states", True)):
            if key in params and bool(params.pop(key)) != required:
                raise ConfigError(f"optimizer.params.{key} must be {str(required).lower()} with this engine")
        params.pop("foreach", None)  # a torch implementation choice, no effect on the result
        allowed = {"lr", "betas", "eps", "weight_decay"}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown optimizer.params key(s): {', '.join(unknown)}; valid: "
                f"{', '.join(sorted(allowed | _ACCEPTED_ADAM_FLAGS))}"
            )
        default_wd = 0.01 if torch_adam and decoupled else 0.0
        spec = cls(
            lr=float(params.get("lr", 1e-3)),
            betas=tuple(float(b) for b in params.get("betas", (0.9, 0.999))),  # type: ignore[arg-type]
            eps=float(params.get("eps", 1e-8)),
            weight_decay=float(params.get("weight_decay", default_wd)),
            decoupled=decoupled,
        )
        if len(spec.betas) != 2:
            raise ConfigError(f"optimizer.params.betas must have two values, got {spec.betas!r}")
        return spec


@dataclass(kw_only=True)
class SchedulerSpec:
    """The ``"scheduler"`` block; built with DeepSpeed's own classes (``deepspeed_adapter``)."""

    type: str
    """A class of ``deepspeed.runtime.lr_schedules`` (``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) or of ``torch.optim.lr_scheduler``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of that class."""

    @classmethod
    def from_dict(cls, block: Any) -> SchedulerSpec:
        if not isinstance(block, Mapping):
            raise ConfigError(f'"scheduler" must be a JSON object, got {block!r}')
        kind = block.get("type")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f'scheduler.type must name a scheduler such as "WarmupLR", got {kind!r}')
        params = block.get("params", {})
        if not isinstance(params, Mapping):
            raise ConfigError(f"scheduler.params must be a JSON object, got {params!r}")
        _reject_auto(params, "scheduler.params")
        return cls(type=kind, params=dict(params))


# DeepSpeed's "fp16" keys and defaults (DeepSpeedFP16Config, deepspeed/runtime/precision_config.py,
# DeepSpeed 0.19; tests/test_fp16.py checks them against it).
_FP16_KEYS = ("enabled", "auto_cast", "fp16_master_weights_and_grads")


@dataclass(frozen=True, kw_only=True)
class Fp16Options:
    """The ``"fp16"`` block when enabled: fp16 compute, fp32 masters, loss scaling.

    The scaling rules are DeepSpeed's own loss scalers' (``optimizer/loss_scaling.py``);
    these are the values they are built from.
    """

    loss_scale: float = 0.0
    """0: dynamic loss scaling; any other value: this static scale."""
    initial_scale_power: int = 16
    """The dynamic scale starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Steps without an overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows (each a skipped step) before the dynamic scale halves (DeepSpeed's delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without an overflow (else only when the scale grows)."""
    min_loss_scale: int = 1
    """The dynamic scale's floor: an overflow there raises DeepSpeed's error."""

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> Fp16Options:
        """Validate an enabled ``"fp16"`` block (DeepSpeed's checks, and hysteresis >= 1)."""
        known = _FP16_KEYS + tuple(f.name for f in fields(cls))
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise ConfigError(f"unknown fp16 key(s) {', '.join(unknown)}; valid: {', '.join(known)}")
        _reject_auto({k: v for k, v in block.items() if k != "enabled"}, "fp16")
        for key in ("auto_cast", "fp16_master_weights_and_grads"):
            if block.get(key, False) is not False:
                raise ConfigError(
                    f"fp16.{key} must be false with this engine (its masters are fp32 and the model "
                    f"computes in fp16 already), got {block[key]!r}"
                )
        options = cls(**{k: v for k, v in block.items() if k not in _FP16_KEYS})
        scale = options.loss_scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0:
            raise ConfigError(f"fp16.loss_scale must be a finite number >= 0 (0: dynamic loss scaling), got {scale!r}")
        if not isinstance(options.consecutive_hysteresis, bool):
            raise ConfigError(
                f"fp16.consecutive_hysteresis must be true or false, got {options.consecutive_hysteresis!r}"
            )
        # Window and floor only matter with dynamic scaling, and DeepSpeed checks them only then.
        minimum = 1 if options.dynamic else -math.inf
        for key, least in (
            ("initial_scale_power", -math.inf),
            ("loss_scale_window", minimum),
            ("hysteresis", 1),
            ("min_loss_scale", minimum),
        ):
            value = getattr(options, key)
            if not _is_integer_at_least(value, least):
                bound = "" if least == -math.inf else f" >= {least}"
                raise ConfigError(f"fp16.{key} must be an integer{bound}, got {value!r}")
        return dataclasses.replace(options, loss_scale=float(scale))


def _fp16_options(config: Mapping[str, Any], bf16_enabled: Any) -> Fp16Options | None:
    """The ``"fp16"`` block: ``None`` unless enabled (``"auto"`` counts as off until the HF
    Trainer's ``--fp16`` or Accelerate's ``mixed_precision`` fills it in, as for bf16)."""
    block = config.get("fp16") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f'"fp16" must be an object like {{"enabled": true}}, got {block!r}')
    enabled = block.get("enabled", False)
    if enabled not in (True, False, AUTO):
        raise ConfigError(f'fp16.enabled must be true, false or "auto", got {enabled!r}')
    if enabled is not True:
        return None
    if bf16_enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true: enable one of them (bf16 needs no loss scaling)"
        )
    return Fp16Options.from_dict(block)


@dataclass(kw_only=True)
class EngineConfig:
    """Everything the engine reads from the DeepSpeed JSON."""

    options: MegatrainOptions = field(default_factory=MegatrainOptions)
    bf16: bool = False
    """Compute (and stream) in bf16; master weights and optimizer state stay fp32."""
    fp16: Fp16Options | None = None
    """Compute (and stream) in fp16 with loss scaling; master weights and optimizer state stay fp32."""
    gradient_clipping: float = 0.0
    """Global-norm clipping threshold; 0 disables clipping."""
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int = 1
    train_batch_size: int = 1
    optimizer: OptimizerSpec | None = None
    ignored_keys: tuple[str, ...] = ()
    scheduler: SchedulerSpec | None = None
    """Built on the engine's optimizer unless ``deepspeed.initialize`` gets ``lr_scheduler=``
    (DeepSpeed's precedence)."""
    steps_per_print: int | None = None
    """Log ``step=, lr=, mom=`` every this many optimizer steps (None: never, DeepSpeed's default)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step, and log them at every optimizer step."""
    monitor: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    """DeepSpeed's monitor blocks as given (``tensorboard``, ``wandb``, ``csv_monitor``,
    ``comet``): written to through DeepSpeed's own ``MonitorMaster``, which validates them."""
    dataloader_drop_last: bool = False
    """The ``training_data`` loader drops a last partial micro-batch (DeepSpeed's key)."""
    source: Mapping[str, Any] = field(default_factory=dict)
    """The DeepSpeed JSON as given (its "auto" values filled by Accelerate/the HF Trainer)."""

    def get(self, key: str, default: Any = None) -> Any:
        """``dict.get`` on the DeepSpeed JSON: DeepSpeed's ``engine.config`` is that dict, and
        code written for DeepSpeed (the HF Trainer) reads it so."""
        return self.source.get(key, default)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.fp16 is not None:
            return torch.float16
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.options.master_dtype == "bf16" else torch.float32

    @property
    def holds_gradients(self) -> bool:
        """Whether gradients must be kept on the host until backward ends."""
        return (
            self.gradient_clipping > 0
            or self.gradient_accumulation_steps > 1
            or self.options.non_finite_steps == "skip"
            or self.fp16 is not None  # an overflow skips the step: nothing may be applied before
        )

    @property
    def held_gradient_dtype(self) -> torch.dtype:
        """Dtype of the held gradients: fp32 to accumulate micro-batches, and with fp16, where
        gradients are unscaled as they arrive (an unscaled fp16 gradient would underflow);
        else the compute dtype."""
        if self.gradient_accumulation_steps > 1 or self.fp16 is not None:
            return torch.float32
        return self.compute_dtype

    @property
    def skips_non_finite(self) -> bool:
        """Whether a non-finite step is skipped (else it raises); see ``non_finite_steps``."""
        return self.options.non_finite_steps == "skip" or (
            self.options.non_finite_steps == "auto" and self.holds_gradients
        )


def load_config_dict(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config given as a dict or a JSON file path, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    with open(config, encoding="utf-8") as handle:
        return json.load(handle)


def is_megatrain_config(config: Mapping[str, Any] | None) -> bool:
    return isinstance(config, Mapping) and config.get("engine") == ENGINE_NAME


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None or value == AUTO:  # "auto": derived from the other two, as Accelerate does
        return None
    if not _is_integer_at_least(value, 1):
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _batch_sizes(config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rules: any two of the three batch keys determine the third."""
    train = _positive_int(config, "train_batch_size")
    micro = _positive_int(config, "train_micro_batch_size_per_gpu")
    accumulation = _positive_int(config, "gradient_accumulation_steps")
    if train is not None and micro is not None and accumulation is not None:
        pass
    elif train is not None and micro is not None:
        accumulation = train // micro // world_size
    elif train is not None and accumulation is not None:
        micro = train // world_size // accumulation
    elif micro is not None and accumulation is not None:
        train = micro * accumulation * world_size
    elif train is not None:
        accumulation, micro = 1, train // world_size
    elif micro is not None:
        accumulation, train = 1, micro * world_size
    else:
        autos = [key for key in ("train_batch_size", "train_micro_batch_size_per_gpu") if config.get(key) == AUTO]
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"
            + (
                f" ({', '.join(autos)} is {AUTO!r}: {_AUTO_HELP})"
                if autos
                else " (the HF Trainer and Accelerate fill both in when the config leaves them out; "
                "called directly, deepspeed.initialize needs train_micro_batch_size_per_gpu)"
            )
        )
    if micro < 1 or accumulation < 1 or train != micro * accumulation * world_size:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {world_size}"
            + (
                f" (world_size: the {world_size} ranks of torch.distributed; without a GPU, `accelerate launch` "
                'runs DeepSpeed\'s ranks as if each were alone, filling "auto" for one rank and not sharding '
                "the data, so DeepSpeed itself fails here too: launch the ranks with torchrun instead)"
                if world_size > 1
                else ""
            )
        )
    return train, micro, accumulation


def launcher_world_size() -> int:
    """The number of data-parallel ranks: the process group's, else the launcher's ``WORLD_SIZE``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_engine_config(config: Mapping[str, Any], world_size: int | None = None) -> EngineConfig:
    """Read an ``"engine": "megatrain"`` DeepSpeed config; raise :class:`ConfigError` on bad input.

    ``world_size`` (default: :func:`launcher_world_size`) enters DeepSpeed's batch rule
    ``train_batch_size = micro_batch * gradient_accumulation_steps * world_size``.
    """
    if world_size is None:
        world_size = launcher_world_size()
    train, micro, accumulation = _batch_sizes(config, world_size)
    clipping = config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    if clipping == AUTO:  # what Accelerate fills in, and the HF Trainer's max_grad_norm default
        clipping = GRADIENT_CLIPPING_DEFAULT
    if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
        raise ConfigError(f"gradient_clipping must be a number >= 0, got {clipping!r}")
    bf16 = config.get("bf16", config.get("bfloat16")) or {}  # DeepSpeed's old name is an alias
    if not isinstance(bf16, Mapping):
        raise ConfigError(f'"bf16" must be an object like {{"enabled": true}}, got {bf16!r}')
    bf16_enabled = bf16.get("enabled", False)
    if bf16_enabled == AUTO:  # Accelerate's and the HF Trainer's default: no mixed precision
        bf16_enabled = False
    fp16 = _fp16_options(config, bf16_enabled)
    optimizer = config.get("optimizer")
    steps_per_print = config.get("steps_per_print")
    if steps_per_print == float("inf"):  # what Accelerate sets to silence DeepSpeed
        steps_per_print = None
    if steps_per_print is not None:
        steps_per_print = _positive_int(config, "steps_per_print")
    drop_last = config.get("dataloader_drop_last", False)
    if not isinstance(drop_last, bool):
        raise ConfigError(f"dataloader_drop_last must be true or false, got {drop_last!r}")
    wall_clock_breakdown = config.get("wall_clock_breakdown", False)
    if not isinstance(wall_clock_breakdown, bool):
        raise ConfigError(f"wall_clock_breakdown must be true or false, got {wall_clock_breakdown!r}")
    options = config.get("megatrain", {})
    zero = _zero_optimization(config.get("zero_optimization", {}))
    if isinstance(options, Mapping):  # the megatrain block has the last word
        implied: dict[str, Any] = dict(zero.nvme)
        if zero.pin_memory is not None:
            implied["pin_memory"] = zero.pin_memory
        if config.get("aio") is not None:
            implied["nvme_aio"] = AioSettings.from_dict(config["aio"], "aio")
        options = {**implied, **options}
    _refuse_unsupported(config)
    ignored = _warn_ignored(config, zero.ignored)
    engine_options = MegatrainOptions.from_dict(options)
    if fp16 is not None:
        _check_fp16_options(engine_options)
    return EngineConfig(
        options=engine_options,
        bf16=bool(bf16_enabled),
        fp16=fp16,
        gradient_clipping=float(clipping),
        gradient_accumulation_steps=accumulation,
        train_micro_batch_size_per_gpu=micro,
        train_batch_size=train,
        optimizer=OptimizerSpec.from_dict(optimizer) if optimizer is not None else None,
        ignored_keys=ignored,
        scheduler=SchedulerSpec.from_dict(config["scheduler"]) if config.get("scheduler") is not None else None,
        steps_per_print=steps_per_print,
        wall_clock_breakdown=wall_clock_breakdown,
        monitor=_monitor_blocks(config),
        dataloader_drop_last=drop_last,
        source=config,
    )


def _monitor_blocks(config: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """DeepSpeed's monitor blocks present in ``config``; their keys are checked by DeepSpeed's
    own config model when the monitors are built (``integration/deepspeed_adapter.py``)."""
    blocks: dict[str, Mapping[str, Any]] = {}
    for key in MONITOR_KEYS:
        block = config.get(key)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ConfigError(f'"{key}" must be a JSON object like {{"enabled": true, ...}}, got {block!r}')
        _reject_auto(block, key)
        blocks[key] = dict(block)
    return blocks


def _check_fp16_options(options: MegatrainOptions) -> None:
    """Engine options that cannot go with fp16 compute."""
    if options.non_finite_steps == "raise":
        raise ConfigError(
            'megatrain.non_finite_steps "raise" cannot go with fp16: an overflow of the loss scale is '
            'a skipped step by design; use "auto" or "skip"'
        )
    if options.optimizer_device == "gpu":
        raise ConfigError(
            'megatrain.optimizer_device "gpu" does not support fp16 yet (its kernel writes bf16 copies); '
            'use "cpu" or "auto"'
        )
    if options.master_dtype != "fp32":
        raise ConfigError('megatrain.master_dtype must be "fp32" with fp16 compute')
