"""``load_checkpoint`` of the engine, with DeepSpeed's API: reads what ``save.py`` writes.

Loading checks everything it can before it touches the engine: the manifest (every file
name in it a plain name inside the tag directory), every file's size, every header, every
tensor's name and shape against this model (the first mismatch is named with both shapes)
and the trainer state (checksum, then every field's type). Nothing is unpickled: a
checkpoint is data, whoever wrote it (see docs/checkpoints.md, "Untrusted checkpoints"). Each shard's
CRC-32 is verified as it is read into the engine's buffers; a mismatch then raises with
the file named, leaving the engine partly loaded (load another checkpoint).

Memory: the files are read straight into the engine's flat host buffers (``tensor_files.py``,
a 16 MiB scratch buffer for dtype conversion and for checksumming bytes that are not
loaded), except where this process holds only part of a state and a file holds its
tensors whole: those are read into one whole temporary per state, of which the part is
kept (``reshard.py``), one file at a time. Tensors are matched by name, so a checkpoint
loads whatever order or number of files it was written in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain_ds.checkpoint import trainer_state as trainer_states
from megatrain_ds.checkpoint.checkpointed_engine import (
    MOMENTS,
    NO_HELD_GRADIENTS,
    CheckpointedEngine,
    Entry,
    StateTensors,
    entries_by_state,
    held_spans,
    quiesce,
    state_tensors,
    states_by_name,
    windows_on_rank_tiers,
)
from megatrain_ds.checkpoint.directories import (
    check_tag,
    checked_digest,
    read_latest,
    read_manifest,
    report_leftovers,
    resolve_tag_dir,
)
from megatrain_ds.checkpoint.optimizer_spans import MASTER, SPANS_PREFIX, HeldSpan, SpanFiles, holds_masters
from megatrain_ds.checkpoint.reshard import WholeTemporaries, reshard
from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest, SafetensorsFile
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.state_placement import Where

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadRequest:
    """One ``load_checkpoint`` call, with DeepSpeed's arguments and defaults."""

    load_dir: str | Path
    tag: Any = None
    """The tag directory to load; ``None``: the one ``<load_dir>/latest`` names."""
    load_module_strict: bool = True
    """Every tensor of the model must be in the checkpoint, and nothing else."""
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    """Only the weights: no optimizer state, counters, scheduler or client state."""
    custom_load_fn: Any = None
    """DeepSpeed's hook; refused (ValueError)."""

    @property
    def with_optimizer(self) -> bool:
        return self.load_optimizer_states and not self.load_module_only


def load_checkpoint(engine: CheckpointedEngine, request: LoadRequest) -> tuple[str | None, dict[str, Any] | None]:
    """Load ``request``'s tag directory into ``engine``.

    Returns ``(tag directory, client_state)``, or ``(None, None)`` when ``load_dir`` has
    no ``latest`` file (DeepSpeed's behaviour). Collective with data parallel: every rank
    calls it (barriers; each node reads its copy, each rank its windows).
    """
    if request.custom_load_fn is not None:
        raise ValueError("custom_load_fn is not supported by the megatrain engine")
    path = _tag_directory(request)
    if path is None:
        return None, None
    manifest = read_manifest(path)
    with_optimizer = request.with_optimizer

    # Everything that can be checked is checked before the engine is touched.
    trainer_state = trainer_states.read(path, manifest)
    if not request.load_module_only:
        trainer_states.check_compatible(engine, trainer_state, path, with_optimizer, request.load_lr_scheduler_states)
    reads = _plan_reads(engine, path, manifest, trainer_state, request)

    quiesce(engine)
    engine.streamer.begin([])  # no prefetched copy of the old weights may survive
    dp = engine.data_parallel
    by_rank = windows_on_rank_tiers(engine)
    if dp is None or dp.is_node_writer:  # node-shared state: one reader per node
        with state_tensors(engine) as flat_of:
            _read_weights(engine, reads, flat_of)
            if with_optimizer and not by_rank:
                _read_optimizer_state(engine, reads, flat_of)
            _refresh_shadows(engine, flat_of)
    if with_optimizer and by_rank:  # each rank its windows: on its own tier, disjoint in the node's memory
        with state_tensors(engine) as flat_of:
            _read_optimizer_state(engine, reads, flat_of)
    if engine.placement.weights_gathered:  # each rank the masters of its windows, on its own tier
        with state_tensors(engine) as flat_of:
            _read_window_masters(engine, reads, flat_of)
    if dp is not None:
        dp.world_barrier(f"loading checkpoint {path}")  # Sync: every node's copy is read in
    engine.resident.refresh_device()
    if not request.load_module_only:
        trainer_states.apply_trainer_state(engine, trainer_state, with_optimizer, request.load_lr_scheduler_states)
    logger.info("megatrain: loaded checkpoint %s", path)
    return str(path), trainer_state.client_state


def _tag_directory(request: LoadRequest) -> Path | None:
    """The tag directory to load, or ``None`` (with a warning) where no ``latest`` names one."""
    root = Path(request.load_dir)
    report_leftovers(root)
    tag = request.tag
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            logger.warning(
                "megatrain: no 'latest' file in %s, so no checkpoint was loaded; pass tag= to load a specific one", root
            )
            return None
    return resolve_tag_dir(root, check_tag(tag))


@dataclass
class _Reads:
    """What a load reads, every file opened and matched to this engine's tensors first."""

    path: Path
    manifest: Mapping[str, Any]
    model_files: dict[str, SafetensorsFile]
    model_targets: dict[str, dict[str, Entry]]
    """``file path -> {tensor name -> entry whose weights it fills}``."""
    optimizer_files: dict[str, SafetensorsFile]
    optimizer_targets: dict[str, dict[str, tuple[Entry, str]]]
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
    request: LoadRequest,
) -> _Reads:
    """Open and check every file the load will read (raises before anything is read)."""
    entries = [e for group in entries_by_state(engine) for e in group]
    model_files = _open_shards(path, manifest, "model-")
    required = [e for e in entries if e.trained or not manifest.get("exclude_frozen_parameters")]
    strict = request.load_module_strict
    reads = _Reads(path, manifest, model_files, {}, {}, {}, None)
    if any(name.startswith(SPANS_PREFIX) for name in manifest["files"]):
        reads.span_files = _open_span_files(engine, path, manifest, trainer_state, request.with_optimizer)
    matching = _Matching(engine, path, entries, strict)
    reads.model_targets = _match_weights(matching, model_files, required, reads.exact_masters)
    if request.with_optimizer and reads.span_files is None:
        reads.optimizer_files = _open_shards(path, manifest, "optimizer-")
        reads.optimizer_targets = _match_optimizer(matching, reads.optimizer_files, trainer_state)
    return reads


def _read_weights(engine: CheckpointedEngine, reads: _Reads, flat_of: StateTensors) -> None:
    """The weights from the model files into the buffer that holds them whole: the master,
    or where it is sharded the shadow. A sharded master's span then comes from the span
    files, or, in a checkpoint without masters in span files (one node's: fp32 model
    files), from a whole temporary in the master's dtype, whose rounding is the shadow."""
    for file in reads.model_files.values():
        with reshard() as temporaries:

            def weights_of(entry: Entry) -> torch.Tensor:
                state = entry.state
                if entry.placement.master.where is not Where.NODE_SPAN or reads.exact_masters:
                    return flat_of(state, entry.placement.weights_in)
                assert state.shadow is not None  # a sharded master's state streams its shadow
                masters = HeldSpan.of_masters(state)
                return temporaries.whole(id(state), masters, MASTER, outside=state.shadow, whole_into=state.shadow)

            wanted = reads.model_targets.get(file.path, {})
            file.read_into(
                {
                    name: entry.weight(weights_of(entry), flat_of)
                    for name, entry in wanted.items()
                    if not entry.placement.gathered  # read by every rank: _read_window_masters
                },
                reads.digest(file),
            )
        flat_of.release()  # one file's masters mapped at a time
    if reads.exact_masters:  # the fp32 masters of a checkpoint whose nodes sharded them
        assert reads.span_files is not None
        masters = {
            name: HeldSpan.of_masters(state, flat_of)
            for (name, state), placement in zip(states_by_name(engine).items(), engine.placement.states)
            if not placement.gathered
        }
        reads.span_files.read_into(masters, [MASTER])
        flat_of.release()
    _read_frozen_from_masters(engine, reads, flat_of, gathered=False)


def _read_frozen_from_masters(engine: CheckpointedEngine, reads: _Reads, flat_of: StateTensors, gathered: bool) -> None:
    """The frozen weights held apart (of the gathered states, this rank's window of them; of
    the others, all of them) from the span files' masters where those cover them, over what
    the model files gave: a checkpoint written by several nodes (or ranks, the weights on the
    tier) before every state was trained-only kept an fp32 frozen weight under bf16 compute
    exact only there, its model files holding the bf16 shadow (``optimizer_spans.py``:
    [Note: older span files]). Newer span files' masters end at the trained prefix: nothing
    is read."""
    spans = reads.span_files
    if spans is None or not reads.exact_masters:
        return
    placements = engine.placement.states
    held = {}
    for (name, state), window, placement in zip(states_by_name(engine).items(), engine.optimizer_states, placements):
        if placement.gathered is not gathered or placement.frozen_in != "frozen":
            continue
        if not spans.masters_past(name, state.layout.trained_numel):
            continue
        holder = window if gathered else state  # a gathered state's frozen window is its rank's window's
        start, end = state.frozen_window or (state.layout.trained_numel, state.layout.numel)
        held[name] = HeldSpan(state.layout.numel, start, end, lambda _kind, h=holder: flat_of(h, "frozen"))
    spans.read_into(held, [MASTER])  # converted to the frozen weights' dtype as read: exact in fp32
    flat_of.release()


def _read_window_masters(engine: CheckpointedEngine, reads: _Reads, flat_of: StateTensors) -> None:
    """This rank's window of the master of every block it keeps only as a window (gathered
    weights): from the span files where they hold the masters (exact), else from the model
    files, each such state read whole into a temporary of which the window is kept; and its
    window of the frozen weights kept apart, from the model files, which hold them in their
    own dtype, into the file of them (``state/frozen_files.py``: a checkpoint load is its one
    writer)."""
    placements = engine.placement.states
    windows = {
        id(state): window
        for state, window, placement in zip(engine.states, engine.optimizer_states, placements)
        if placement.gathered
    }

    def window_of(state: HostFlatState) -> HeldSpan:
        start, end = state.held
        return HeldSpan(state.layout.numel, start, end, lambda kind: flat_of(windows[id(state)], kind))

    def frozen_of(state: HostFlatState) -> HeldSpan:
        assert state.frozen_window is not None
        return HeldSpan(state.layout.numel, *state.frozen_window, lambda kind: flat_of(windows[id(state)], kind))

    def target(entry: Entry, temporaries: WholeTemporaries) -> torch.Tensor | None:
        state = entry.state
        if entry.trained or entry.placement.frozen_in != "frozen":  # in the master
            return None if reads.exact_masters else entry.view(temporaries.whole(id(state), window_of(state), MASTER))
        window = state.frozen_window
        if window is None or window[0] == window[1]:  # this rank's window of the frozen weights is empty
            return None
        return entry.view(temporaries.whole(id(state), frozen_of(state), "frozen"))

    if reads.exact_masters:
        assert reads.span_files is not None
        held = {name: window_of(state) for name, state in states_by_name(engine).items() if id(state) in windows}
        reads.span_files.read_into(held, [MASTER])
        flat_of.release()
    for file in reads.model_files.values():
        with reshard() as temporaries:
            wanted = reads.model_targets.get(file.path, {})
            targets = {name: target(entry, temporaries) for name, entry in wanted.items() if entry.placement.gathered}
            file.read_into({name: view for name, view in targets.items() if view is not None}, reads.digest(file))
        flat_of.release()  # one file's windows mapped at a time
    _read_frozen_from_masters(engine, reads, flat_of, gathered=True)


def _refresh_shadows(engine: CheckpointedEngine, flat_of: StateTensors) -> None:
    """The streamed copy of every whole master, once all of it is loaded (a sharded
    master's shadow came from the model files or the whole temporary)."""
    for state, placement in zip(engine.states, engine.placement.states):
        if state.shadow is not None and placement.master.where is not Where.NODE_SPAN:
            # Only the master's part: frozen weights held in the shadow alone were read there.
            first, last = state.master_held
            state.shadow[first:last].copy_(flat_of(state, "master"))
            flat_of.release()
        if state.shadow is not None and state.frozen is not None and placement.frozen.where.on_host:
            # Frozen weights apart beside the shadow (a cut fp32 master): their streamed rounding.
            state.shadow[state.layout.trained_numel :].copy_(state.frozen)


def _read_optimizer_state(engine: CheckpointedEngine, reads: _Reads, flat_of: StateTensors) -> None:
    """Adam's moments (and the held gradients, when saved inside an accumulation window)
    from span files or per-parameter files, into the part of each state this process
    holds (:func:`held_spans`): a state it holds only a part of (several nodes, or a
    rank's window on its NVMe tier) through a whole temporary (``reshard.py``)."""
    held = held_spans(engine, flat_of)
    if engine.states[0].grad is not None:
        for part in held.values():
            part.tensor("grad").zero_()  # overwritten below when saved inside an accumulation window
    if reads.span_files is not None:
        # The masters were read with the weights (by the node's reader: _read_weights).
        reads.span_files.read_into(held, [kind for kind in reads.span_files.kinds if kind != MASTER])
    held_of = {id(state): held[name] for name, state in states_by_name(engine).items()}
    for file in reads.optimizer_files.values():
        with reshard() as temporaries:

            def whole_of(state: HostFlatState, kind: str) -> torch.Tensor:
                part = held_of[id(state)]
                # A trained-only state holding its whole trained prefix: all the files have tensors of.
                if (part.start, part.end) in ((0, part.numel), (0, state.stepped_numel)):
                    return part.tensor(kind)
                return temporaries.whole(id(state), part, kind)

            wanted = reads.optimizer_targets.get(file.path, {})
            file.read_into(
                {name: entry.view(whole_of(entry.state, kind)) for name, (entry, kind) in wanted.items()},
                reads.digest(file),
            )
        flat_of.release()  # one file's moments mapped at a time


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
        kinds += MOMENTS
        if trainer_state.mid_window_gradients:
            if engine.states[0].grad is None:
                raise CheckpointError(NO_HELD_GRADIENTS.format(path=path))
            kinds.append("grad")
    states = states_by_name(engine)
    numels = {name: state.layout.numel for name, state in states.items()}
    frozen = [name for name, state in states.items() if state.layout.trained_numel < state.layout.numel]
    trained = {name: state.layout.trained_numel for name, state in states.items()}
    return SpanFiles(files, numels, kinds, frozen, trained) if kinds else None


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


def _check_shape(name: str, file: SafetensorsFile, record: Any, entry: Entry, path: Path) -> None:
    if _shape(record.shape) != _shape(entry.slot.shape):
        raise CheckpointError(
            f"tensor {name!r}: the checkpoint ({Path(file.path).name}) has shape {_shape(record.shape)}, "
            f"this model has {_shape(entry.slot.shape)}: {path} is a checkpoint of a different model"
        )


def _shape(shape: Any) -> list[int]:
    return [int(d) for d in shape]


def _index_records(files: Mapping[str, SafetensorsFile]) -> dict[str, tuple[SafetensorsFile, Any]]:
    return {name: (file, record) for file in files.values() for name, record in file.records.items()}


@dataclass(frozen=True)
class _Matching:
    """What a checkpoint's tensors are matched against: this engine's entries."""

    engine: CheckpointedEngine
    path: Path
    """The tag directory (named in every error)."""
    entries: list[Entry]
    """Every parameter of the engine, in the engine's state order."""
    strict: bool
    """``load_module_strict``: a tensor missing, or one this model lacks, is an error."""


def _match_weights(
    matching: _Matching, files: Mapping[str, SafetensorsFile], required: list[Entry], exact_masters: bool
) -> dict[str, dict[str, Entry]]:
    """``file path -> {tensor name -> entry whose weights it fills}``; raises on the first
    mismatch, in the model's parameter order. ``exact_masters``: the span files hold the
    masters (no conversion of the model files' dtype to warn of)."""
    engine, path, strict = matching.engine, matching.path, matching.strict
    found = _index_records(files)
    aliases: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    by_name = {e.name: e for e in matching.entries}
    required_names = {e.name for e in required}
    targets: dict[str, dict[str, Entry]] = {}
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
    matching: _Matching, files: Mapping[str, SafetensorsFile], trainer_state: trainer_states.TrainerState
) -> dict[str, dict[str, tuple[Entry, str]]]:
    """``file path -> {tensor name -> (entry, kind)}`` of the optimizer state to read."""
    path = matching.path
    found = _index_records(files)
    targets: dict[str, dict[str, tuple[Entry, str]]] = {}
    kinds = list(MOMENTS) + (["grad"] if trainer_state.mid_window_gradients else [])
    for entry in (e for e in matching.entries if e.trained):
        for kind in kinds:
            name = f"{entry.name}.{kind}"
            flat = getattr(entry.state, kind)
            if flat is None:
                raise CheckpointError(NO_HELD_GRADIENTS.format(path=path))
            if name not in found:
                if matching.strict:
                    raise CheckpointError(
                        f"{path}: the checkpoint has no optimizer state {name!r} "
                        "(was this parameter frozen when it was saved?)"
                    )
                continue
            file, record = found[name]
            _check_shape(name, file, record, entry, path)
            targets.setdefault(file.path, {})[name] = (entry, kind)
    return targets
