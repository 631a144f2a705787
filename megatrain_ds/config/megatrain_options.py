"""The ``"megatrain"`` block of the DeepSpeed JSON: :class:`MegatrainOptions`.

Its ``nvme_aio`` (or DeepSpeed's top-level ``"aio"``) is :class:`AioSettings`. Unknown keys and
bad values are rejected with a message naming the key and the valid choices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from megatrain_ds.config.values import ConfigError, is_integer_at_least

NVME_OFFLOAD_LEVELS = ("none", "optimizer", "all")
"""What the NVMe tier holds, least first: nothing, the blocks' optimizer state, their whole state."""


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
            if not is_integer_at_least(value, 1):
                raise ConfigError(f"{name}.{key} must be an integer >= 1, got {value!r}")
        if settings.block_size % 4096:
            raise ConfigError(
                f"{name}.block_size must be a multiple of 4096 bytes (O_DIRECT), got {settings.block_size}"
            )
        for key in ("single_submit", "overlap_events"):
            if not isinstance(getattr(settings, key), bool):
                raise ConfigError(f"{name}.{key} must be true or false, got {getattr(settings, key)!r}")
        return settings


FROZEN_WEIGHTS_CHOICES = ("exact", "compute_dtype")
"""The values of ``megatrain.frozen_weights``: frozen weights kept exact, or cast to the compute dtype."""

RECOMPUTE_CHOICES = ("full", "none", "auto")
"""The named values of ``megatrain.recompute``; an integer is the fourth form."""


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
    frozen_weights: str = "exact"
    """How a frozen parameter (``requires_grad=False``, or in no optimizer group) that is
    not in the compute dtype is held with bf16 or fp16 compute: "exact" (default) keeps its
    values bit for bit, beside the rounded copy that is streamed (6 bytes/param for an fp32
    weight with bf16 compute, and every buffer where the fp32 master is cut: on the NVMe
    tier with "optimizer", or in several nodes' spans); "compute_dtype" casts it in place,
    on the user's module, to the compute dtype once at ``initialize`` (2 bytes/param with
    bf16, held once and streamed as it is), so what is trained and saved are the rounded
    values. No effect with fp32 compute. See ``model/frozen_weights.py``."""
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
    device_state: str | float = "auto"
    """The GPU tier: keep a prefix of the optimizer states (the resident parameters', then
    blocks 0, 1, ... whole) on the compute device, updated there by the Triton kernel, their
    weights never copied and their gradients never leaving it: "auto" (the default: as much
    as fits in ``DEVICE_STATE_AUTO_SHARE`` of the free device memory left after the engine's
    own planned peak, and none, with the reason logged at INFO, where the tier cannot run:
    no CUDA, fp16, a bf16 master, the NVMe tier, data parallel), "none" (every state in host
    memory), or a fraction 0..1 of the trained elements (refused where the tier cannot run).
    DeepSpeed's ``offload_optimizer.ratio`` sets ``1 - ratio`` (ignored with a warning where
    the tier cannot run; 1.0 keeps every state in host memory). See ``state/placement.py``:
    [Note: the GPU tier]."""
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
            ("frozen_weights", FROZEN_WEIGHTS_CHOICES),
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
        if self.device_state not in ("none", "auto") and not _is_fraction(self.device_state):
            raise ConfigError(
                'megatrain.device_state must be "none", "auto" or a fraction of the trained elements '
                f"from 0 to 1 (kept on the GPU); got {self.device_state!r}"
            )
        if self.speculative_blocks != "auto" and not is_integer_at_least(self.speculative_blocks, 0):
            raise ConfigError(
                f'megatrain.speculative_blocks must be "auto" or an integer >= 0, got {self.speculative_blocks!r}'
            )
        if self.recompute not in RECOMPUTE_CHOICES and not is_integer_at_least(self.recompute, 0):
            raise ConfigError(
                'megatrain.recompute must be "full" (recompute every block), "none" (stash '
                'every block\'s activations in host memory), "auto" (the planner chooses) or an '
                f"integer >= 0 (blocks recomputed, the rest stashed); got {self.recompute!r}"
            )
        if self.fragment_bytes not in ("auto", None, 0) and not is_integer_at_least(self.fragment_bytes, 4096):
            raise ConfigError(
                'megatrain.fragment_bytes must be "auto" (the planner decides), a number of bytes '
                ">= 4096 (a piece of a block's weights per copy), or null or 0 for whole blocks; "
                f"got {self.fragment_bytes!r}"
            )
        for name in ("loss_chunk_tokens", "mlp_tile_tokens"):
            value = getattr(self, name)
            if value != "auto" and not is_integer_at_least(value, 0):
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
            if not is_integer_at_least(value, minimum):
                raise ConfigError(f"megatrain.{name} must be an integer >= {minimum}, got {value!r}")
        if (
            not isinstance(self.collective_timeout_s, (int, float))
            or isinstance(self.collective_timeout_s, bool)
            or not self.collective_timeout_s > 0
        ):
            raise ConfigError(
                f"megatrain.collective_timeout_s must be a number of seconds > 0, got {self.collective_timeout_s!r}"
            )

    @property
    def wants_device_state(self) -> bool:
        """Whether any state may go on the device ("auto", or a fraction above 0)."""
        setting = self.device_state
        return setting == "auto" or (not isinstance(setting, str) and _is_fraction(setting) and setting > 0)

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


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


DEVICE_STATE_AUTO_SHARE = 0.8
"""``device_state: "auto"`` keeps states on the device within this share of the device memory
free after the engine's own planned peak and ``DEVICE_STATE_HEADROOM_BYTES``: the rest is the
allocator's fragmentation and the activations' variation between batches."""
DEVICE_STATE_HEADROOM_BYTES = 4 << 30
"""Device memory ``"auto"`` leaves free before its share (CUDA context, allocator caches)."""
