"""``save_checkpoint`` of the engine, with DeepSpeed's API (``load.py`` reads what it writes).

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
[Note: crash safety].

Memory: the engine's host state is one flat buffer per block (and one for the resident
parameters); a save writes views of those buffers to the files (``tensor_files.py``), so
it holds no second copy of any tensor: the extra host memory is one 16 MiB scratch
buffer, used for checksumming. The states are written in the engine's order
(``checkpointed_engine.py``): the blocks', then the resident parameters'.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from megatrain_ds.checkpoint import trainer_state as trainer_states
from megatrain_ds.checkpoint.checkpointed_engine import (
    MOMENTS,
    CheckpointedEngine,
    Entry,
    StateTensors,
    entries_by_state,
    held_spans,
    inside_accumulation_window,
    quiesce,
    state_tensors,
    windows_on_rank_tiers,
)
from megatrain_ds.checkpoint.directories import (
    FORMAT_NAME,
    FORMAT_VERSION,
    check_tag,
    make_temp_dir,
    publish_dir,
    write_bytes_durably,
    write_latest,
    write_manifest,
)
from megatrain_ds.checkpoint.optimizer_spans import MASTER, span_file_name, write_span_file
from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest, file_digest, write_safetensors
from megatrain_ds.distributed.data_parallel import DataParallel

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 2 << 30
"""Blocks are grouped into weight shards of at most this size (a block is never split)."""
MODEL_INDEX = "model.safetensors.index.json"


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
    state = trainer_states.capture(engine, client_state or {}, inside_accumulation_window(engine))
    encoded = trainer_states.encode(state)

    request = _SaveRequest(Path(save_dir), tag, encoded, save_latest, exclude_frozen_parameters, max_shard_bytes)
    dp = engine.data_parallel
    if dp is not None and (dp.num_nodes > 1 or windows_on_rank_tiers(engine)):
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
        shards = _shards(entries_by_state(engine), request.max_shard_bytes)
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
    by_rank = windows_on_rank_tiers(engine)
    try:
        if by_rank or dp.is_node_writer:
            name = (
                span_file_name(dp.rank, dp.world_size) if by_rank else span_file_name(dp.ownership.node, dp.num_nodes)
            )
            with state_tensors(engine) as flat_of:
                files[name] = write_span_file(temp / name, held_spans(engine, flat_of), _saved_kinds(engine))
        if dp.rank == 0 or engine.placement.weights_gathered:  # gathered: every rank joins each block's gather
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


def _saved_kinds(engine: CheckpointedEngine) -> list[str]:
    """What a node's span file holds: the moments, the held gradients inside an accumulation
    window, and the fp32 masters where they are sharded (the model files then hold the bf16
    shadow: a resume is exact only with the masters)."""
    mid_window = inside_accumulation_window(engine) and engine.states[0].grad is not None
    masters = engine.placement.masters_split
    return [*MOMENTS, *(["grad"] if mid_window else []), *([MASTER] if masters else [])]


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
    groups = entries_by_state(engine)
    shards = _shards(groups, request.max_shard_bytes)
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    failure: Exception | None = None
    with state_tensors(engine) as flat_of:
        for number, members in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            tensors = []
            for i in members:
                weights = _whole_weights(engine, i, flat_of)  # a gather on every rank where no node holds them
                frozen = None if request.exclude_frozen else _gathered_frozen(engine, i, flat_of)
                tensors += [
                    (e.name, e.weight(weights, flat_of, frozen))
                    for e in groups[i]
                    if e.trained or not request.exclude_frozen
                ]
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


def _whole_weights(engine: CheckpointedEngine, index: int, flat_of: StateTensors) -> torch.Tensor:
    """Every weight of ``engine.states[index]``: what the node holds whole, or gathered
    from every rank's window."""
    placement = engine.placement.states[index]
    if placement.gathered:
        assert engine.gathered_weights is not None  # the engine gathers every state kept as windows
        return engine.gathered_weights.whole(index)
    return flat_of(engine.states[index], placement.weights_in)


def _gathered_frozen(engine: CheckpointedEngine, index: int, flat_of: StateTensors) -> torch.Tensor | None:
    """The exact frozen weights of a gathered state whose frozen weights apart are not in the
    compute dtype (an fp32 base under bf16 compute), gathered from every rank's window of
    them in their dtype (a collective, on every rank alike); ``None`` elsewhere: the
    weights :func:`_whole_weights` gives hold them exact (``distributed/gathered_weights.py``)."""
    state, gathered = engine.states[index], engine.gathered_weights
    if not engine.placement.states[index].gathered or state.frozen is None or gathered is None:
        return None
    if state.frozen.dtype == gathered.dtype:
        return None
    return gathered.whole_frozen(index, flat_of(engine.optimizer_states[index], "frozen"))


def _write_optimizer_files(engine: CheckpointedEngine, temp: Path, shards: list[list[int]]) -> dict[str, FileDigest]:
    """Adam's moments (and the held gradients inside an accumulation window) per trained
    parameter, in files grouped as the weights are: a node that holds every state whole."""
    files: dict[str, FileDigest] = {}
    groups = entries_by_state(engine)
    mid_window = inside_accumulation_window(engine)
    with state_tensors(engine) as flat_of:
        for number, members in enumerate(shards, start=1):
            tensors = []
            for e in (e for i in members for e in groups[i] if e.trained):
                tensors += [(f"{e.name}.{kind}", e.view(flat_of(e.state, kind))) for kind in MOMENTS]
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
        # What from_pretrained should load as: the dtype of the model files.
        split = engine.placement.masters_split
        config.dtype = engine.config.compute_dtype if split else engine.config.master_dtype
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


def _shards(groups: list[list[Entry]], max_bytes: int) -> list[list[int]]:
    """The states' indices grouped into files of at most ``max_bytes`` of weights each (a
    state is never split), in order."""
    shards: list[list[int]] = []
    size = 0
    for index, entries in enumerate(groups):
        whole = getattr(entries[0].state, entries[0].placement.weights_in) if entries else None
        size_of = whole.element_size() if whole is not None else 0
        # Frozen weights held apart (on the NVMe tier) are written in their own dtype.
        nbytes = sum(
            e.slot.numel * (size_of if e.trained else e.state.weights_of(e.slot).element_size()) for e in entries
        )
        if not shards or size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(index)
        size += nbytes
    return shards
