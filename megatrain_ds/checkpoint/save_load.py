"""``save_checkpoint``/``load_checkpoint`` of the engine, with DeepSpeed's API.

A checkpoint is a directory ``<save_dir>/<tag>`` (``tag`` defaults to
``global_step<N>``, as in DeepSpeed) that is also a Hugging Face model directory::

    model-0000k-of-0000n.safetensors       master weights (fp32) under Hugging Face names (the
                                           bf16 shadow where several nodes shard the masters:
                                           optimizer_spans.py holds those)
    model.safetensors.index.json           so AutoModelForCausalLM.from_pretrained(<tag dir>) loads it
    config.json, generation_config.json    the model's own, when it has them
    optimizer-0000k-of-0000n.safetensors   Adam m and v per trained parameter (and the gradient
                                           accumulators, when saved inside an accumulation window)
    engine_state.json                      step counters, optimizer hyperparameters, lr scheduler,
    engine_state.safetensors               RNG states (Python, NumPy, CPU, every CUDA device), client_state:
                                           JSON plus the tensors it references (``trainer_state.py``)
    megatrain_checkpoint.json              manifest: size and CRC-32 of every file, written last

and ``<save_dir>/latest`` names the newest complete tag. See ``directories.py`` for
[Note: crash safety].

Memory: the engine's host state is one flat buffer per block (and one for the resident
parameters); a save writes views of those buffers to the files and a load reads the
files straight into them (``tensor_files.py``), so neither holds a second copy of any
tensor: the extra host memory is one 16 MiB scratch buffer, used only for dtype
conversion and for checksumming bytes that are not loaded.

Loading checks everything it can before it touches the engine: the manifest (every file
name in it a plain name inside the tag directory), every file's size, every header, every
tensor's name and shape against this model (the first mismatch is named with both shapes)
and the trainer state (checksum, then every field's type). Nothing is unpickled: a
checkpoint is data, whoever wrote it (see docs/checkpoints.md, "Untrusted checkpoints"). Each shard's
CRC-32 is verified as it is read into the engine's buffers; a mismatch then raises with
the file named, leaving the engine partly loaded (load another checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from megatrain_ds.checkpoint import trainer_state as trainer_states
from megatrain_ds.checkpoint.directories import (
    FORMAT_NAME,
    FORMAT_VERSION,
    check_tag,
    checked_digest,
    make_temp_dir,
    publish_dir,
    read_latest,
    read_manifest,
    report_leftovers,
    resolve_tag_dir,
    write_bytes_durably,
    write_latest,
    write_manifest,
)
from megatrain_ds.checkpoint.optimizer_spans import (
    MASTER,
    RESIDENT,
    SPANS_PREFIX,
    HeldSpan,
    SpanFiles,
    holds_masters,
    span_file_name,
    write_span_file,
)
from megatrain_ds.checkpoint.tensor_files import (
    CheckpointError,
    FileDigest,
    SafetensorsFile,
    file_digest,
    write_safetensors,
)
from megatrain_ds.config import EngineConfig
from megatrain_ds.distributed.data_parallel import DataParallel
from megatrain_ds.distributed.gathered_weights import GatheredWeights
from megatrain_ds.gradients.sink import GradientPort
from megatrain_ds.runtime.device_runtime import DeviceRuntime
from megatrain_ds.state.flat_layout import FROZEN_GROUP, ParamSlot
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.nvme_tier import NvmeTier
from megatrain_ds.streaming.resident_params import ResidentParams
from megatrain_ds.streaming.weight_streamer import WeightStreamer

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 2 << 30
"""Blocks are grouped into weight shards of at most this size (a block is never split)."""
MODEL_INDEX = "model.safetensors.index.json"
_MOMENTS = ("exp_avg", "exp_avg_sq")
_NO_HELD_GRADIENTS = (
    "{path} was saved inside a gradient accumulation window and holds accumulated gradients, but this "
    "engine keeps none (its gradient_clipping and gradient_accumulation_steps differ from the saved run's)"
)


class CheckpointedEngine(Protocol):
    """What saving and loading read and restore of the engine (``MegatrainEngine``; this
    module sits below it). Counters not listed here (``global_samples``, ``skipped_steps``,
    ``optimizer_steps``) are saved when the engine has them."""

    module: torch.nn.Module
    config: EngineConfig
    optimizer: Any
    """The optimizer facade: its ``param_groups`` are saved and restored."""
    lr_scheduler: Any
    data_parallel: DataParallel | None
    runtime: DeviceRuntime
    sink: GradientPort
    streamer: WeightStreamer
    resident: ResidentParams
    states: list[HostFlatState]
    """One flat state per block, in block order, then the resident parameters' state."""
    windows: list[tuple[int, int]]
    """This rank's ``[start, end)`` of each state (all of it without data parallel)."""
    optimizer_states: list[HostFlatState]
    """Views of each state's window: what this rank's optimizer (and NVMe tier) holds."""
    nvme_tier: NvmeTier | None
    """Holds the blocks' Adam moments when the NVMe tier is on (this rank's windows of
    them with data parallel)."""
    gathered_weights: GatheredWeights | None
    """With the weights on the NVMe tier and data parallel: the blocks' weights, which no
    rank holds whole, gathered from every rank's window (its master on its tier)."""
    block_path: str
    global_steps: int
    micro_steps: int

    @property
    def loss_scaling(self) -> trainer_states.LossScalerState:
        """fp16's loss scaler: its running state is saved and restored with the optimizer's."""
        ...

    def gradient_accumulation_steps(self) -> int: ...


@dataclass(frozen=True)
class _Entry:
    """One distinct parameter: its Hugging Face name and its place in a flat host state."""

    name: str
    state: HostFlatState
    slot: ParamSlot

    @property
    def trained(self) -> bool:
        return self.slot.group != FROZEN_GROUP

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.slot.offset : self.slot.offset + self.slot.numel].view(self.slot.shape)

    def weight(self, whole: torch.Tensor) -> torch.Tensor:
        """Its weight in ``whole`` (the state's whole weights), or in the shadow for a frozen
        weight held there alone (``state/host_store.py``: [Note: frozen weights]): written and
        read once, in its own dtype."""
        if self.state.frozen_in_shadow and not self.trained:
            return self.view(self.state.weights_of(self.slot))
        return self.view(whole)


class _StateTensors:
    """A state's flat buffer of a kind; what the NVMe tier holds (Adam moments, and fp32
    masters with bf16 compute) comes mapped from the swap files (``NvmeTier.file_views``),
    kept until :meth:`release`."""

    def __init__(self, on_tier: Callable[[HostFlatState], dict[str, torch.Tensor] | None] | None) -> None:
        self._on_tier = on_tier
        self._mapped: dict[int, dict[str, torch.Tensor] | None] = {}

    def __call__(self, state: HostFlatState, kind: str) -> torch.Tensor:
        if self._on_tier is not None:
            if id(state) not in self._mapped:
                self._mapped[id(state)] = self._on_tier(state)
            mapped = self._mapped[id(state)]
            if mapped is not None and kind in mapped:
                return mapped[kind]
        return getattr(state, kind)

    def release(self) -> None:
        self._mapped.clear()


@contextlib.contextmanager
def _state_tensors(engine: CheckpointedEngine) -> Iterator[_StateTensors]:
    """Checkpoints read and write each tensor in whichever tier holds it."""
    if engine.nvme_tier is None:
        yield _StateTensors(None)
        return
    with engine.nvme_tier.file_views() as on_tier:
        yield _StateTensors(on_tier)


def _windows_on_rank_tiers(engine: CheckpointedEngine) -> bool:
    """With data parallel and the NVMe tier each rank keeps its windows of the blocks'
    moments in its own swap files (``state/nvme_tier.py``): only that rank reads or writes them."""
    return engine.data_parallel is not None and engine.nvme_tier is not None


def _held_spans(engine: CheckpointedEngine, flat_of: _StateTensors) -> dict[str, HeldSpan]:
    """What this process saves and fills of each flat state's optimizer state, by state
    name: the part its node holds (all of it on one node), or with the NVMe tier and data
    parallel this rank's window (:func:`_windows_on_rank_tiers`)."""
    names = {id(state): name for name, state in _states_by_name(engine).items()}
    if not _windows_on_rank_tiers(engine):
        return {names[id(state)]: HeldSpan.of_state(state, flat_of) for state in engine.states}
    return {
        names[id(state)]: HeldSpan(state.layout.numel, start, end, lambda kind, w=window: flat_of(w, kind))
        for state, (start, end), window in zip(engine.states, engine.windows, engine.optimizer_states)
    }


def _entries_by_state(engine: CheckpointedEngine) -> list[list[_Entry]]:
    """Entries of the resident state, then of each block, in flat-buffer order."""
    num_blocks = len(engine.states) - 1  # the resident state comes last
    groups = [[_Entry(slot.name, engine.resident.state, slot) for slot in engine.resident.state.layout.slots]]
    for index, state in enumerate(engine.states[:num_blocks]):
        prefix = f"{engine.block_path}.{index}."
        groups.append([_Entry(prefix + slot.name, state, slot) for slot in state.layout.slots])
    return groups


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in a state dict (Hugging Face saves them; rotary tables are not)."""
    found, seen = [], set()
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            found.append((f"{module_name}.{name}" if module_name else name, buffer))
    return found


def _shards(groups: list[list[_Entry]], max_bytes: int) -> list[list[int]]:
    shards: list[list[int]] = []
    size = 0
    for index, entries in enumerate(groups):
        nbytes = sum(e.slot.numel for e in entries) * (entries[0].state.weights.element_size() if entries else 0)
        if not shards or size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(index)
        size += nbytes
    return shards


class Quiescent(Protocol):
    """What :func:`quiesce` waits for (the engine; also ``whole_masters.py``'s ``MasterHolder``)."""

    sink: GradientPort
    runtime: DeviceRuntime
    data_parallel: DataParallel | None


def quiesce(engine: Quiescent, what: str = "the checkpoint barrier") -> None:
    """No update may be in flight while the host state is read or overwritten (by any
    rank: with data parallel the state is node-shared). Collective with data parallel: a
    barrier of every rank (``what`` names it)."""
    engine.sink.drain()
    engine.runtime.synchronize()
    if engine.data_parallel is not None:
        engine.data_parallel.world_barrier(what)


# -- save ---------------------------------------------------------------------------------


def save_checkpoint(
    engine: CheckpointedEngine,
    save_dir: str,
    tag: Any = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Literal[True]:
    """Write a checkpoint of ``engine`` to ``<save_dir>/<tag>``; see the module docstring.

    With data parallel every rank calls this (as with DeepSpeed). On one node rank 0 writes
    the whole checkpoint from the node's shared copy, which holds every rank's state; on
    several, each node writes its span of the optimizer state and rank 0 the rest
    (:func:`_save_tag_in_parallel`), as each rank writes its window with the NVMe tier.
    Every rank returns when the checkpoint is published (``save_dir`` must be one
    filesystem that every rank sees).
    """
    quiesce(engine)
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    # Encoded first: a client_state value a checkpoint cannot hold fails before anything is written.
    state = trainer_states.capture(engine, client_state or {}, _inside_accumulation_window(engine))
    encoded = trainer_states.encode(state)

    request = _SaveRequest(Path(save_dir), tag, encoded, save_latest, exclude_frozen_parameters, max_shard_bytes)
    dp = engine.data_parallel
    if dp is not None and (dp.num_nodes > 1 or _windows_on_rank_tiers(engine)):
        _save_tag_in_parallel(engine, dp, request)
    elif dp is not None:
        dp.on_rank0(f"saving checkpoint {tag!r}", lambda: _save_tag(engine, request))
    else:
        _save_tag(engine, request)
    return True


@dataclass(frozen=True)
class _SaveRequest:
    """One ``save_checkpoint`` call: where to, and what."""

    root: Path
    tag: str
    encoded: trainer_states.EncodedTrainerState
    save_latest: bool
    exclude_frozen: bool
    max_shard_bytes: int


def _save_tag(engine: CheckpointedEngine, request: _SaveRequest) -> None:
    temp = make_temp_dir(request.root, request.tag)
    try:
        files = _write_model_and_trainer_state(engine, temp, request)
        shards = _shards(_entries_by_state(engine), request.max_shard_bytes)
        files.update(_write_optimizer_files(engine, temp, shards))
        _publish(engine, request, temp, files)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # a failed save leaves the directory as it was
        raise


def _publish(engine: CheckpointedEngine, request: _SaveRequest, temp: Path, files: Mapping[str, FileDigest]) -> None:
    """Write the manifest (last: it makes the directory a checkpoint), rename the directory
    into place and point ``latest`` at it."""
    write_manifest(
        temp,
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "tag": request.tag,
            "exclude_frozen_parameters": request.exclude_frozen,
            "global_steps": engine.global_steps,
            "files": {
                name: {
                    "bytes": d.nbytes,
                    "crc32": d.crc32,
                    **({"header_crc32": d.header_crc32} if d.header_crc32 is not None else {}),
                }
                for name, d in sorted(files.items())
            },
        },
    )
    publish_dir(temp, request.root / request.tag)
    if request.save_latest:
        write_latest(request.root, request.tag)
    logger.info("megatrain: saved checkpoint %s (%d files)", request.root / request.tag, len(files) + 1)


def _save_tag_in_parallel(engine: CheckpointedEngine, dp: DataParallel, request: _SaveRequest) -> None:
    """Several nodes, each holding its span of the optimizer state (or ranks, each holding
    its window on its own NVMe tier): every node's leader (every rank) writes its span file
    into rank 0's temporary directory at once (``optimizer_spans.py``), rank 0 the weights
    (every node holds them whole) and the trainer state; rank 0 then writes the manifest of
    all of them and publishes, or removes the directory if any rank failed.
    ``request.root`` must be one filesystem that every node sees."""
    tag = request.tag
    made = dp.from_rank0(f"creating the directory of checkpoint {tag!r}", lambda: str(make_temp_dir(request.root, tag)))
    temp = Path(made)
    files: dict[str, FileDigest] = {}
    failure = None
    by_rank = _windows_on_rank_tiers(engine)
    try:
        if by_rank or dp.is_node_writer:
            name = (
                span_file_name(dp.rank, dp.world_size) if by_rank else span_file_name(dp.ownership.node, dp.num_nodes)
            )
            with _state_tensors(engine) as flat_of:
                files[name] = write_span_file(temp / name, _held_spans(engine, flat_of), _saved_kinds(engine))
        if dp.rank == 0 or engine.gathered_weights is not None:  # gathered: every rank joins each block's gather
            files.update(_write_model_and_trainer_state(engine, temp, request, writes=dp.rank == 0))
    except Exception as error:  # reported to rank 0, which removes the directory; raised below
        failure = f"rank {dp.rank}: {type(error).__name__}: {error}"
    reports = dp.all_gather_object(f"writing checkpoint {tag!r}", (files, failure))

    def publish() -> None:
        failures = [failed for _, failed in reports if failed is not None]
        if failures:
            shutil.rmtree(temp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint {tag!r} failed on {len(failures)} rank(s): {'; '.join(failures)}")
        _publish(engine, request, temp, {name: digest for written, _ in reports for name, digest in written.items()})

    dp.on_rank0(f"publishing checkpoint {tag!r}", publish)


def _states_by_name(engine: CheckpointedEngine) -> dict[str, HostFlatState]:
    """Every flat state by its name in span files: the resident state, then the blocks."""
    num_blocks = len(engine.states) - 1  # the resident state comes last
    named = {RESIDENT: engine.states[num_blocks]}
    named.update((f"{engine.block_path}.{index}", state) for index, state in enumerate(engine.states[:num_blocks]))
    return named


def _saved_kinds(engine: CheckpointedEngine) -> list[str]:
    """What a node's span file holds: the moments, the held gradients inside an accumulation
    window, and the fp32 masters where they are sharded (the model files then hold the bf16
    shadow: a resume is exact only with the masters)."""
    mid_window = _inside_accumulation_window(engine) and engine.states[0].grad is not None
    masters = any(state.master_sharded for state in engine.states)
    return [*_MOMENTS, *(["grad"] if mid_window else []), *([MASTER] if masters else [])]


def _write_model_and_trainer_state(
    engine: CheckpointedEngine, temp: Path, request: _SaveRequest, writes: bool = True
) -> dict[str, FileDigest]:
    """The weights as a Hugging Face model directory, and the trainer state: everything but
    the optimizer state. The weights are what the node holds whole: the fp32 masters, or
    the bf16 shadow where the masters are sharded across nodes (their spans go in the span
    files). Blocks no rank holds whole (gathered weights) are gathered one at a time, in
    the compute dtype as they are streamed, their exact masters in the span files: every
    rank runs this, only ``writes`` writes, and it joins every gather even after a failed
    write (raised at the end), so that no rank is left waiting in one."""
    files: dict[str, FileDigest] = {}
    groups = _entries_by_state(engine)
    shards = _shards(groups, request.max_shard_bytes)
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    failure: Exception | None = None
    with _state_tensors(engine) as flat_of:
        for number, members in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            tensors = []
            for i in members:
                weights = _whole_weights(engine, i, flat_of)  # a gather on every rank where no node holds them
                tensors += [(e.name, e.weight(weights)) for e in groups[i] if e.trained or not request.exclude_frozen]
            if number == 1:
                tensors += [(n, b.detach().to("cpu").contiguous()) for n, b in _persistent_buffers(engine.module)]
            if writes and failure is None:
                try:
                    files[name] = write_safetensors(temp / name, tensors, {"format": "pt"})
                except Exception as error:  # the other ranks still gather the next shards' blocks
                    failure = error
            weight_map.update((tensor_name, name) for tensor_name, _ in tensors)
            total += sum(t.numel() * t.element_size() for _, t in tensors)
            del tensors
            flat_of.release()  # one shard's masters mapped at a time
        if failure is not None:
            raise failure
        if not writes:
            return files
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files[MODEL_INDEX] = write_bytes_durably(temp / MODEL_INDEX, json.dumps(index, indent=2).encode())
        files.update(_write_model_config(engine, temp))

    document = request.encoded.document
    files[trainer_states.ENGINE_STATE] = write_bytes_durably(temp / trainer_states.ENGINE_STATE, document)
    files[trainer_states.ENGINE_TENSORS] = write_safetensors(
        temp / trainer_states.ENGINE_TENSORS, request.encoded.tensors, {"format": "megatrain-state"}
    )
    return files


def _whole_weights(engine: CheckpointedEngine, group: int, flat_of: _StateTensors) -> torch.Tensor:
    """Every weight of the state of ``group`` (:func:`_entries_by_state`: the resident state,
    then the blocks): what the node holds whole, or gathered from every rank's window."""
    state = engine.resident.state if group == 0 else engine.states[group - 1]
    if state.gathered:
        assert engine.gathered_weights is not None  # the engine gathers every state kept as windows
        return engine.gathered_weights.whole(group - 1)
    return flat_of(state, state.weights_kind)


def _write_optimizer_files(engine: CheckpointedEngine, temp: Path, shards: list[list[int]]) -> dict[str, FileDigest]:
    """Adam's moments (and the held gradients inside an accumulation window) per trained
    parameter, in files grouped as the weights are: a node that holds every state whole."""
    files: dict[str, FileDigest] = {}
    groups = _entries_by_state(engine)
    mid_window = _inside_accumulation_window(engine)
    with _state_tensors(engine) as flat_of:
        for number, members in enumerate(shards, start=1):
            tensors = []
            for e in (e for i in members for e in groups[i] if e.trained):
                tensors += [(f"{e.name}.{kind}", e.view(flat_of(e.state, kind))) for kind in _MOMENTS]
                if mid_window and e.state.grad is not None:
                    tensors.append((f"{e.name}.grad", e.view(e.state.grad)))
            name = f"optimizer-{number:05d}-of-{len(shards):05d}.safetensors"
            files[name] = write_safetensors(temp / name, tensors, {"format": "megatrain-optimizer"})
            del tensors
            flat_of.release()  # one shard's moments mapped at a time
    return files


def _write_model_config(engine: CheckpointedEngine, temp: Path) -> dict[str, FileDigest]:
    """config.json (dtype set to the dtype of the weights written: the master's, or the
    compute dtype's where the masters are sharded) and generation_config.json, when present."""
    config = getattr(engine.module, "config", None)
    written = []
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        sharded = any(state.master_sharded for state in engine.states)
        # What from_pretrained should load as: the dtype of the model files.
        config.dtype = engine.config.compute_dtype if sharded else engine.config.master_dtype
        config.save_pretrained(temp)
        written.append("config.json")
    generation = getattr(engine.module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(temp)
        written.append("generation_config.json")
    digests = {}
    for name in written:
        with open(temp / name, "rb+") as handle:
            os.fsync(handle.fileno())
        digests[name] = file_digest(temp / name)
    return digests


def _inside_accumulation_window(engine: CheckpointedEngine) -> bool:
    return engine.micro_steps % engine.gradient_accumulation_steps() != 0


# -- load ---------------------------------------------------------------------------------


def load_checkpoint(
    engine: CheckpointedEngine,
    load_dir: str,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``<load_dir>/<tag>`` (``tag=None``: the one ``latest`` names) into ``engine``.

    Returns ``(tag directory, client_state)``, or ``(None, None)`` when ``load_dir`` has
    no ``latest`` file (DeepSpeed's behaviour).
    """
    if custom_load_fn is not None:
        raise ValueError("custom_load_fn is not supported by the megatrain engine")
    root = Path(load_dir)
    report_leftovers(root)
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            logger.warning(
                "megatrain: no 'latest' file in %s, so no checkpoint was loaded; pass tag= to load a specific one", root
            )
            return None, None
    path = resolve_tag_dir(root, check_tag(tag))
    manifest = read_manifest(path)
    with_optimizer = load_optimizer_states and not load_module_only

    # Everything that can be checked is checked before the engine is touched.
    trainer_state = trainer_states.read(path, manifest)
    if not load_module_only:
        trainer_states.check_compatible(engine, trainer_state, path, with_optimizer, load_lr_scheduler_states)
    reads = _plan_reads(engine, path, manifest, trainer_state, with_optimizer, load_module_strict)

    quiesce(engine)
    engine.streamer.begin([])  # no prefetched copy of the old weights may survive
    dp = engine.data_parallel
    by_rank = _windows_on_rank_tiers(engine)
    if dp is None or dp.is_node_writer:  # node-shared state: one reader per node
        with _state_tensors(engine) as flat_of:
            _read_weights(engine, reads, flat_of)
            if with_optimizer and not by_rank:
                _read_optimizer_state(engine, reads, flat_of)
            _refresh_shadows(engine, flat_of)
    if with_optimizer and by_rank:  # each rank its windows: on its own tier, disjoint in the node's memory
        with _state_tensors(engine) as flat_of:
            _read_optimizer_state(engine, reads, flat_of)
    if engine.gathered_weights is not None:  # each rank the masters of its windows, on its own tier
        with _state_tensors(engine) as flat_of:
            _read_window_masters(engine, reads, flat_of)
    if dp is not None:
        dp.world_barrier(f"loading checkpoint {tag!r}")  # Sync: every node's copy is read in
    engine.resident.refresh_device()
    if not load_module_only:
        trainer_states.apply_trainer_state(engine, trainer_state, with_optimizer, load_lr_scheduler_states)
    logger.info("megatrain: loaded checkpoint %s", path)
    return str(path), trainer_state.client_state


@dataclass
class _Reads:
    """What a load reads, every file opened and matched to this engine's tensors first."""

    path: Path
    manifest: Mapping[str, Any]
    model_files: dict[str, SafetensorsFile]
    model_targets: dict[str, dict[str, _Entry]]
    """``file path -> {tensor name -> entry whose weights it fills}``."""
    optimizer_files: dict[str, SafetensorsFile]
    optimizer_targets: dict[str, dict[str, tuple[_Entry, str]]]
    """``file path -> {tensor name -> (entry, kind)}`` of per-parameter optimizer files."""
    span_files: SpanFiles | None
    """The optimizer state of a checkpoint written by several nodes (``optimizer_spans.py``),
    and the fp32 masters, where they were sharded."""

    @property
    def exact_masters(self) -> bool:
        """Whether the span files hold the masters (the model files then hold the shadow)."""
        return self.span_files is not None and MASTER in self.span_files.kinds

    def digest(self, file: SafetensorsFile) -> FileDigest:
        return checked_digest(self.path, self.manifest, Path(file.path).name)


def _plan_reads(
    engine: CheckpointedEngine,
    path: Path,
    manifest: Mapping[str, Any],
    trainer_state: trainer_states.TrainerState,
    with_optimizer: bool,
    strict: bool,
) -> _Reads:
    """Open and check every file the load will read (raises before anything is read)."""
    entries = [e for group in _entries_by_state(engine) for e in group]
    model_files = _open_shards(path, manifest, "model-")
    required = [e for e in entries if e.trained or not manifest.get("exclude_frozen_parameters")]
    reads = _Reads(path, manifest, model_files, {}, {}, {}, None)
    if any(name.startswith(SPANS_PREFIX) for name in manifest["files"]):
        reads.span_files = _open_span_files(engine, path, manifest, trainer_state, with_optimizer)
    reads.model_targets = _match_weights(engine, path, model_files, entries, required, strict, reads.exact_masters)
    if with_optimizer and reads.span_files is None:
        reads.optimizer_files = _open_shards(path, manifest, "optimizer-")
        reads.optimizer_targets = _match_optimizer(engine, path, reads.optimizer_files, entries, trainer_state, strict)
    return reads


def _read_weights(engine: CheckpointedEngine, reads: _Reads, flat_of: _StateTensors) -> None:
    """The weights from the model files into the buffer that holds them whole: the master,
    or where it is sharded the shadow (its span is then read from the span files, or, in a
    checkpoint without masters in span files, kept from a whole temporary: :func:`_whole_masters`)."""
    for file in reads.model_files.values():
        with _whole_masters(flat_of, reads.exact_masters) as weights_of:
            wanted = reads.model_targets.get(file.path, {})
            file.read_into(
                {
                    name: entry.weight(weights_of(entry.state))
                    for name, entry in wanted.items()
                    if not entry.state.gathered  # read by every rank: _read_window_masters
                },
                reads.digest(file),
            )
        flat_of.release()  # one file's masters mapped at a time
    if reads.exact_masters:  # the fp32 masters of a checkpoint whose nodes sharded them
        assert reads.span_files is not None
        masters = {
            name: HeldSpan.of_masters(state, flat_of)
            for name, state in _states_by_name(engine).items()
            if not state.gathered
        }
        reads.span_files.read_into(masters, [MASTER])
        flat_of.release()


def _read_window_masters(engine: CheckpointedEngine, reads: _Reads, flat_of: _StateTensors) -> None:
    """This rank's window of the master of every block it keeps only as a window (gathered
    weights): from the span files where they hold the masters (exact), else from the model
    files, each such state read whole into a temporary of which the window is kept."""
    windows = {id(state): window for state, window in zip(engine.states, engine.optimizer_states) if state.gathered}
    if reads.exact_masters:
        assert reads.span_files is not None

        def window_of(state: HostFlatState) -> HeldSpan:
            start, end = state.held
            return HeldSpan(state.layout.numel, start, end, lambda kind: flat_of(windows[id(state)], kind))

        held = {name: window_of(state) for name, state in _states_by_name(engine).items() if state.gathered}
        reads.span_files.read_into(held, [MASTER])
        flat_of.release()
        return
    for file in reads.model_files.values():
        with _whole_windows(windows, flat_of) as whole_of:
            wanted = reads.model_targets.get(file.path, {})
            file.read_into(
                {name: entry.view(whole_of(entry.state)) for name, entry in wanted.items() if entry.state.gathered},
                reads.digest(file),
            )
        flat_of.release()  # one file's windows mapped at a time


@contextlib.contextmanager
def _whole_windows(
    windows: Mapping[int, HostFlatState], flat_of: _StateTensors
) -> Iterator[Callable[[HostFlatState], torch.Tensor]]:
    """Where a model file's weights go for a state this rank keeps only a window of
    (``windows``: by the state's id): a whole fp32 temporary, of which the window's master is kept."""
    temporaries: dict[int, tuple[HostFlatState, torch.Tensor]] = {}

    def whole_of(state: HostFlatState) -> torch.Tensor:
        if id(state) not in temporaries:
            start, end = state.held
            whole = torch.zeros(state.layout.numel, dtype=torch.float32)
            whole[start:end] = flat_of(windows[id(state)], MASTER)  # a tensor the files lack keeps its value
            temporaries[id(state)] = (state, whole)
        return temporaries[id(state)][1]

    yield whole_of
    for state, whole in temporaries.values():
        start, end = state.held
        flat_of(windows[id(state)], MASTER).copy_(whole[start:end])


def _refresh_shadows(engine: CheckpointedEngine, flat_of: _StateTensors) -> None:
    """The streamed copy of every whole master, once all of it is loaded (a sharded
    master's shadow came from the model files or the whole temporary)."""
    for state in engine.states:
        if state.shadow is not None and not state.master_sharded:
            # Only the master's part: frozen weights held in the shadow alone were read there.
            first, last = state.master_held
            state.shadow[first:last].copy_(flat_of(state, "master"))
            flat_of.release()


@contextlib.contextmanager
def _whole_masters(flat_of: _StateTensors, exact_masters: bool) -> Iterator[Callable[[HostFlatState], torch.Tensor]]:
    """Where a model file's weights go: the buffer that holds the state whole
    (:attr:`HostFlatState.weights_kind`), except for a sharded master whose exact values are
    not in span files (a checkpoint of one node: fp32 model files): a whole temporary in the
    master's dtype, whose span is kept in the master and whose rounding is the shadow."""
    temporaries: dict[int, tuple[HostFlatState, torch.Tensor]] = {}

    def weights_of(state: HostFlatState) -> torch.Tensor:
        if not state.master_sharded or exact_masters:
            return flat_of(state, state.weights_kind)
        assert state.shadow is not None  # a sharded master's state streams its shadow
        if id(state) not in temporaries:
            start, end = state.held
            whole = state.shadow.to(state.master.dtype)  # a tensor the files lack keeps its value
            whole[start:end] = state.master
            temporaries[id(state)] = (state, whole)
        return temporaries[id(state)][1]

    yield weights_of
    for state, whole in temporaries.values():
        start, end = state.held
        state.master.copy_(whole[start:end])
        assert state.shadow is not None
        state.shadow.copy_(whole)


def _read_optimizer_state(engine: CheckpointedEngine, reads: _Reads, flat_of: _StateTensors) -> None:
    """Adam's moments (and the held gradients, when saved inside an accumulation window)
    from span files or per-parameter files, into the part of each state this process
    holds (:func:`_held_spans`)."""
    held = _held_spans(engine, flat_of)
    if engine.states[0].grad is not None:
        for part in held.values():
            part.tensor("grad").zero_()  # overwritten below when saved inside an accumulation window
    if reads.span_files is not None:
        # The masters were read with the weights (by the node's reader: _read_weights).
        reads.span_files.read_into(held, [kind for kind in reads.span_files.kinds if kind != MASTER])
    held_of = {id(state): held[name] for name, state in _states_by_name(engine).items()}
    for file in reads.optimizer_files.values():
        with _whole_states(held_of) as whole_of:
            wanted = reads.optimizer_targets.get(file.path, {})
            file.read_into(
                {name: entry.view(whole_of(entry.state, kind)) for name, (entry, kind) in wanted.items()},
                reads.digest(file),
            )
        flat_of.release()  # one file's moments mapped at a time


@contextlib.contextmanager
def _whole_states(held_of: Mapping[int, HeldSpan]) -> Iterator[Callable[[HostFlatState, str], torch.Tensor]]:
    """Per-parameter optimizer files read into states (``held_of``: by the state's id): a
    state this process holds only a part of (several nodes, or a rank's window on its NVMe
    tier) is read into a whole temporary buffer, and its part kept at the end."""
    temporaries: dict[tuple[int, str], tuple[HeldSpan, torch.Tensor]] = {}

    def whole_of(state: HostFlatState, kind: str) -> torch.Tensor:
        part = held_of[id(state)]
        flat = part.tensor(kind)
        # Trained-only state: its trained prefix is all the files have tensors of.
        if (part.start, part.end) == (0, part.numel) or state.trained_only:
            return flat
        if (id(state), kind) not in temporaries:
            temporaries[id(state), kind] = (part, torch.zeros(part.numel, dtype=flat.dtype))
        return temporaries[id(state), kind][1]

    yield whole_of
    for (_, kind), (part, whole) in temporaries.items():
        part.tensor(kind).copy_(whole[part.start : part.end])


def _open_span_files(
    engine: CheckpointedEngine,
    path: Path,
    manifest: Mapping[str, Any],
    trainer_state: trainer_states.TrainerState,
    with_optimizer: bool,
) -> SpanFiles | None:
    """The span files of a checkpoint saved by several nodes, checked against this engine:
    what they hold of the optimizer state when it is loaded, and the fp32 masters when they
    hold them (read even for the weights alone: the model files have them rounded)."""
    files = {}
    for name in sorted(n for n in manifest["files"] if n.startswith(SPANS_PREFIX)):
        digest = checked_digest(path, manifest, name)
        files[name] = (SafetensorsFile(path / name, digest.header_crc32), digest)
    kinds: list[str] = [MASTER] if holds_masters(file for file, _ in files.values()) else []
    if with_optimizer:
        kinds += _MOMENTS
        if trainer_state.mid_window_gradients:
            if engine.states[0].grad is None:
                raise CheckpointError(_NO_HELD_GRADIENTS.format(path=path))
            kinds.append("grad")
    states = _states_by_name(engine)
    numels = {name: state.layout.numel for name, state in states.items()}
    frozen = [name for name, state in states.items() if state.layout.trained_numel < state.layout.numel]
    return SpanFiles(files, numels, kinds, frozen) if kinds else None


def _open_shards(path: Path, manifest: Mapping[str, Any], prefix: str) -> dict[str, SafetensorsFile]:
    names = sorted(n for n in manifest["files"] if n.startswith(prefix) and n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{path}: the manifest lists no {prefix}*.safetensors files")
    files = {}
    for name in names:
        digest = checked_digest(path, manifest, name)  # exists, and has the recorded size
        file = SafetensorsFile(path / name, digest.header_crc32)
        files[file.path] = file
    return files


def _check_shape(name: str, file: SafetensorsFile, record: Any, entry: _Entry, path: Path) -> None:
    if _shape(record.shape) != _shape(entry.slot.shape):
        raise CheckpointError(
            f"tensor {name!r}: the checkpoint ({Path(file.path).name}) has shape {_shape(record.shape)}, "
            f"this model has {_shape(entry.slot.shape)}: {path} is a checkpoint of a different model"
        )


def _shape(shape: Any) -> list[int]:
    return [int(d) for d in shape]


def _index_records(files: Mapping[str, SafetensorsFile]) -> dict[str, tuple[SafetensorsFile, Any]]:
    return {name: (file, record) for file in files.values() for name, record in file.records.items()}


def _match_weights(
    engine: CheckpointedEngine,
    path: Path,
    files: Mapping[str, SafetensorsFile],
    entries: list[_Entry],
    required: list[_Entry],
    strict: bool,
    exact_masters: bool,
) -> dict[str, dict[str, _Entry]]:
    """``file path -> {tensor name -> entry whose weights it fills}``; raises on the first
    mismatch, in the model's parameter order. ``exact_masters``: the span files hold the
    masters (no conversion of the model files' dtype to warn of)."""
    found = _index_records(files)
    aliases: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    by_name = {e.name: e for e in entries}
    required_names = {e.name for e in required}
    targets: dict[str, dict[str, _Entry]] = {}
    used: set[str] = set()
    for name, param in engine.module.named_parameters():
        entry = by_name[name]
        hit = next((alias for alias in aliases[id(param)] if alias in found), None)
        if hit is None:
            if strict and name in required_names:
                raise CheckpointError(
                    f"{path}: the checkpoint has no tensor {name!r} (this model's has shape "
                    f"{_shape(entry.slot.shape)}): is it a checkpoint of a different model? "
                    "load_module_strict=False keeps this model's own value"
                )
            continue
        file, record = found[hit]
        _check_shape(hit, file, record, entry, path)
        held_dtype = entry.state.weights_of(entry.slot).dtype  # a frozen weight may be held in the shadow
        if record.dtype != held_dtype and not exact_masters:
            logger.warning(
                "megatrain: tensor %s is %s in the checkpoint and %s in this engine; converting",
                hit,
                record.dtype,
                held_dtype,
            )
        targets.setdefault(file.path, {})[hit] = entry
        used.update(aliases[id(param)])
    if strict:
        known = used | {name for name, _ in engine.module.named_buffers(remove_duplicate=False)}
        extra = next((name for name in found if name not in known), None)
        if extra is not None:
            raise CheckpointError(
                f"tensor {extra!r} of {Path(found[extra][0].path).name} does not exist in this model: "
                f"{path} is a checkpoint of a different model (load_module_strict=False ignores it)"
            )
    return targets


def _match_optimizer(
    engine: CheckpointedEngine,
    path: Path,
    files: Mapping[str, SafetensorsFile],
    entries: list[_Entry],
    trainer_state: trainer_states.TrainerState,
    strict: bool,
) -> dict[str, dict[str, tuple[_Entry, str]]]:
    """``file path -> {tensor name -> (entry, kind)}`` of the optimizer state to read."""
    found = _index_records(files)
    targets: dict[str, dict[str, tuple[_Entry, str]]] = {}
    kinds = list(_MOMENTS) + (["grad"] if trainer_state.mid_window_gradients else [])
    for entry in (e for e in entries if e.trained):
        for kind in kinds:
            name = f"{entry.name}.{kind}"
            flat = getattr(entry.state, kind)
            if flat is None:
                raise CheckpointError(_NO_HELD_GRADIENTS.format(path=path))
            if name not in found:
                if strict:
                    raise CheckpointError(
                        f"{path}: the checkpoint has no optimizer state {name!r} "
                        "(was this parameter frozen when it was saved?)"
                    )
                continue
            file, record = found[name]
            _check_shape(name, file, record, entry, path)
            targets.setdefault(file.path, {})[name] = (entry, kind)
    return targets
