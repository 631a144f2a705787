"""Optimizer state saved in spans: each writer writes the span of every flat state it holds.

With data parallel over several nodes each node holds only its span of Adam's moments and
the held gradients (``distributed/data_parallel.py``: [Note: sharded host state]), so no
rank has the whole optimizer state to write per parameter. Each node's leader writes one
file, in parallel with the others. With the NVMe tier and data parallel each rank keeps
its own window's moments in its own swap files (``state/nvme_tier.py``), so each rank
writes one file, of its windows::

    optimizer-spans-0000k-of-0000n.safetensors   writer k's span of every state, flat:
                                                 "<state>.exp_avg", "<state>.exp_avg_sq"
                                                 (and "<state>.grad" inside an
                                                 accumulation window); the header's
                                                 "spans" maps each state to [start, end)

A state is named by its block (``model.layers.3``) or ``resident``. Loading reads, for
each state, the elements this process holds (:class:`HeldSpan`) from whichever files
cover them, so a checkpoint written by N writers loads on any number of nodes and ranks
(resharded), one process included. The spans of every state must tile it exactly; the
files' CRCs are checked as they are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest, SafetensorsFile, write_safetensors
from megatrain_ds.state.host_store import HostFlatState

SPANS_FORMAT = "megatrain-optimizer-spans"
SPANS_PREFIX = "optimizer-spans-"
RESIDENT = "resident"
"""The state name of the parameters outside the blocks."""


def span_file_name(writer: int, writers: int) -> str:
    return f"{SPANS_PREFIX}{writer + 1:05d}-of-{writers:05d}.safetensors"


@dataclass(frozen=True)
class HeldSpan:
    """Elements ``[start, end)`` of a flat state of ``numel`` elements: the part of its
    optimizer state one writer saves, or one reader fills.

    Attributes:
        tensor: ``kind -> `` the ``end - start`` elements of that kind (a host buffer, or a
            mapping of a swap file).
    """

    numel: int
    start: int
    end: int
    tensor: Callable[[str], torch.Tensor]

    @classmethod
    def of_state(cls, state: HostFlatState) -> HeldSpan:
        """What ``state``'s own buffers hold (:attr:`HostFlatState.held`)."""
        start, end = state.held
        return cls(state.layout.numel, start, end, lambda kind: _held_tensor(state, kind))


def _held_tensor(state: HostFlatState, kind: str) -> torch.Tensor:
    flat = getattr(state, kind)
    assert flat is not None, kind  # held gradients are saved only when they exist
    return flat


def write_span_file(path: Path, held: Mapping[str, HeldSpan], kinds: Sequence[str]) -> FileDigest:
    """Write every state's held span of each of ``kinds`` (views: nothing is copied)."""
    tensors = []
    spans = {}
    for name, part in held.items():
        spans[name] = [part.start, part.end]
        for kind in kinds:
            flat = part.tensor(kind)
            assert flat.numel() >= part.end - part.start, (name, kind)
            tensors.append((f"{name}.{kind}", flat[: part.end - part.start]))
    return write_safetensors(path, tensors, {"format": SPANS_FORMAT, "spans": json.dumps(spans)})


class SpanFiles:
    """The span files of a checkpoint, checked against this engine's states before any is read.

    Args:
        files: ``name -> (opened file, its manifest digest)``.
        numels: every flat state's size, by state name.
        kinds: what each file must hold for every state (the moments; and ``grad``).
    """

    def __init__(
        self,
        files: Mapping[str, tuple[SafetensorsFile, FileDigest]],
        numels: Mapping[str, int],
        kinds: Sequence[str],
    ) -> None:
        self._files = files
        self._kinds = list(kinds)
        self._spans = {name: _spans_of(name, file) for name, (file, _) in files.items()}
        for state_name, numel in numels.items():
            self._check_tiling(state_name, numel)

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
            for kind in self._kinds:
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

    def read_into(self, held: Mapping[str, HeldSpan]) -> None:
        """Fill the held elements of every kind of each state, file by file (CRC checked)."""
        for file_name, (reader, digest) in self._files.items():
            destinations: dict[str, torch.Tensor | None] = {}
            partial: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read into, copy to)
            for state_name, (start, end) in self._spans[file_name].items():
                part = held.get(state_name)
                if part is None:
                    continue
                first, last = part.start, part.end
                lo, hi = max(start, first), min(end, last)
                if lo >= hi:
                    continue
                for kind in self._kinds:
                    flat = part.tensor(kind)
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
