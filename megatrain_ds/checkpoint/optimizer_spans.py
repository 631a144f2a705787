"""Optimizer state saved by node: each node writes the span of every flat state it holds.

With data parallel over several nodes each node holds only its span of Adam's moments and
the held gradients (``distributed/data_parallel.py``: [Note: sharded host state]), so no
rank has the whole optimizer state to write per parameter. Each node's leader writes one
file, in parallel with the others::

    optimizer-spans-0000k-of-0000n.safetensors   node k's span of every state, flat:
                                                 "<state>.exp_avg", "<state>.exp_avg_sq"
                                                 (and "<state>.grad" inside an
                                                 accumulation window; "<state>.master"
                                                 where the fp32 master is sharded too,
                                                 the model files then holding the bf16
                                                 shadow); the header's "spans" maps each
                                                 state to [start, end)

A state is named by its block (``model.layers.3``) or ``resident``. Loading reads, for
each state, the elements this node holds from whichever files cover them, so a checkpoint
written by N nodes loads on any number of nodes (resharded), one node included. The
spans of every state must tile it exactly; the files' CRCs are checked as they are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest, SafetensorsFile, write_safetensors
from megatrain_ds.state.host_store import HostFlatState

SPANS_FORMAT = "megatrain-optimizer-spans"
SPANS_PREFIX = "optimizer-spans-"
RESIDENT = "resident"
"""The state name of the parameters outside the blocks."""


def span_file_name(node: int, nodes: int) -> str:
    return f"{SPANS_PREFIX}{node + 1:05d}-of-{nodes:05d}.safetensors"


MASTER = "master"
"""The kind of a span file's fp32 masters (written where the master is sharded across nodes)."""


def write_span_file(path: Path, states: Mapping[str, HostFlatState], kinds: Sequence[str]) -> FileDigest:
    """Write every state's held span of each of ``kinds`` (views: nothing is copied)."""
    tensors = []
    spans = {}
    for name, state in states.items():
        start, end = state.held
        spans[name] = [start, end]
        for kind in kinds:
            flat = getattr(state, kind)
            first, last = _held_of(state, kind)
            assert flat is not None and first <= start <= end <= last, (name, kind)
            tensors.append((f"{name}.{kind}", flat[start - first : end - first]))
    return write_safetensors(path, tensors, {"format": SPANS_FORMAT, "spans": json.dumps(spans)})


def _held_of(state: HostFlatState, kind: str) -> tuple[int, int]:
    """``[start, end)`` of the state's elements that its buffer of ``kind`` holds: the
    master may be whole where the optimizer state is a span."""
    return state.master_held if kind == MASTER else state.held


def holds_masters(files: Iterable[SafetensorsFile]) -> bool:
    """Whether span files hold the fp32 masters (:data:`MASTER`) of their spans."""
    return any(name.endswith(f".{MASTER}") for file in files for name in file.records)


class SpanFiles:
    """The span files of a checkpoint, checked against this engine's states before any is read.

    Args:
        files: ``name -> (opened file, its manifest digest)``.
        states: this engine's flat states by state name.
        kinds: what each file must hold for every state and is read (the moments, ``grad``,
            :data:`MASTER`).
    """

    def __init__(
        self,
        files: Mapping[str, tuple[SafetensorsFile, FileDigest]],
        states: Mapping[str, HostFlatState],
        kinds: Sequence[str],
    ) -> None:
        self._files = files
        self._states = states
        self.kinds: tuple[str, ...] = tuple(kinds)
        """What is read: the optimizer state, and the masters (:data:`MASTER`) where held."""
        self._spans = {name: _spans_of(name, file) for name, (file, _) in files.items()}
        for state_name, state in states.items():
            self._check_tiling(state_name, state.layout.numel)

    def _check_tiling(self, state_name: str, numel: int) -> None:
        covered = sorted((spans[state_name], file) for file, spans in self._spans.items() if state_name in spans)
        position = 0
        for (start, end), file in covered:
            if start != position or end < start:
                raise CheckpointError(
                    f"{file}: the span [{start}, {end}) of state {state_name!r} does not continue at {position}: "
                    "the span files of this checkpoint do not fit together (files missing or from another run)"
                )
            reader, _ = self._files[file]
            for kind in self.kinds:
                record = reader.records.get(f"{state_name}.{kind}")
                if record is None or list(record.shape) != [end - start]:
                    raise CheckpointError(
                        f"{file}: no tensor {state_name}.{kind} of shape [{end - start}] (is it a checkpoint "
                        "of a different model, or saved outside an accumulation window?)"
                    )
            position = end
        if position != numel:
            raise CheckpointError(
                f"the span files cover elements [0, {position}) of state {state_name!r}, which has {numel}: "
                "is it a checkpoint of a different model?"
            )

    def read_into_states(self) -> None:
        """Fill each state's held elements of every kind, file by file (CRC checked)."""
        for file_name, (reader, digest) in self._files.items():
            destinations: dict[str, torch.Tensor | None] = {}
            partial: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read into, copy to)
            for state_name, (start, end) in self._spans[file_name].items():
                state = self._states.get(state_name)
                if state is None:
                    continue
                for kind in self.kinds:
                    first, last = _held_of(state, kind)
                    lo, hi = max(start, first), min(end, last)
                    if lo >= hi:
                        continue
                    flat = getattr(state, kind)
                    target = flat[lo - first : hi - first]
                    if (lo, hi) == (start, end):
                        destinations[f"{state_name}.{kind}"] = target
                    else:  # resharded: read the file's span whole, keep the part this node holds
                        whole = torch.empty(end - start, dtype=flat.dtype)
                        destinations[f"{state_name}.{kind}"] = whole
                        partial.append((whole[lo - start : hi - start], target))
            reader.read_into(destinations, digest)
            for source, target in partial:
                target.copy_(source)


def _spans_of(file: str, reader: SafetensorsFile) -> dict[str, tuple[int, int]]:
    """The header's ``spans`` of a span file, checked to be ``{name: [start, end]}``."""
    metadata = reader.metadata
    try:
        if metadata.get("format") != SPANS_FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}")
        spans = json.loads(metadata["spans"])
        checked = {}
        for name, bounds in spans.items():
            start, end = bounds
            if not (isinstance(name, str) and type(start) is int and type(end) is int and 0 <= start <= end):
                raise ValueError(f"span {name!r}: {bounds!r}")
            checked[name] = (start, end)
        return checked
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: not a span file of megatrain's optimizer state ({error})") from None
