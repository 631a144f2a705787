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
                                                 accumulation window; "<state>.master"
                                                 where the fp32 master is sharded too,
                                                 the model files then holding the bf16
                                                 shadow); the header's "spans" maps each
                                                 state to [start, end)

A state is named by its block (``model.layers.3``) or ``resident``. Loading reads, for
each state, the elements this process holds (:class:`HeldSpan`) from whichever files
cover them, so a checkpoint written by N writers loads on any number of nodes and ranks
(resharded), one process included. The spans of every state must tile it exactly; the
files' CRCs are checked as they are read.

[Note: older span files]
Every state is trained-only now (``state/host_store.py``: [Note: frozen weights]), so a
state's spans end at its trained prefix; files written before were read as follows.
- Before the frozen-last layout (no ``layout``: :data:`FROZEN_LAST_LAYOUT`): a span of a
  state with frozen parameters is refused (:class:`SpanFiles` names the fix).
- Before issue 44's trained-only states (fp32 frozen weights under bf16 compute beside a
  master cut across nodes, or across ranks with the weights on the tier): the spans cover
  the whole state, and the masters' part after the trained prefix is the frozen weights'
  exact fp32 value, which the model files hold rounded to bf16 (the shadow, or the gather
  in the compute dtype). The moments of those elements are zero and are not kept;
  ``load.py`` fills the frozen weights this engine holds apart from those masters, over
  the model files' values (:meth:`SpanFiles.masters_past`), for any number of nodes, ranks
  or one process. Where this engine holds them in the master instead (one process, the
  master whole in host memory), the masters' span covers them anyway.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest, SafetensorsFile, write_safetensors
from megatrain_ds.state.host_store import HostFlatState

SPANS_FORMAT = "megatrain-optimizer-spans"
FROZEN_LAST_LAYOUT = "frozen-last"
"""A span file's ``layout``: its states' frozen parameters lie after the trained ones
(``state/flat_layout.py``). Files without it were written when frozen parameters came
first; their spans of a state with frozen parameters hold other elements at each offset."""
SPANS_PREFIX = "optimizer-spans-"
RESIDENT = "resident"
"""The state name of the parameters outside the blocks."""


MASTER = "master"
"""The kind of a span file's fp32 masters (written where the master is sharded across nodes)."""


def span_file_name(writer: int, writers: int) -> str:
    return f"{SPANS_PREFIX}{writer + 1:05d}-of-{writers:05d}.safetensors"


@dataclass(frozen=True)
class HeldSpan:
    """Elements ``[start, end)`` of a flat state of ``numel`` elements: the part of its
    optimizer state one writer saves, or one reader fills.

    Attributes:
        tensor: ``kind -> `` elements ``[start, end)`` of that kind (views of a host buffer,
            or of a mapping of a swap file).
    """

    numel: int
    start: int
    end: int
    tensor: Callable[[str], torch.Tensor]

    @classmethod
    def of_state(
        cls, state: HostFlatState, tensor_of: Callable[[HostFlatState, str], torch.Tensor] = getattr
    ) -> HeldSpan:
        """The optimizer state's part of ``state`` (:attr:`HostFlatState.held`), each kind
        from ``tensor_of(state, kind)`` (its buffer by default)."""
        start, end = state.held
        return cls(state.layout.numel, start, end, lambda kind: _part(state, kind, tensor_of(state, kind), start, end))

    @classmethod
    def of_masters(
        cls, state: HostFlatState, tensor_of: Callable[[HostFlatState, str], torch.Tensor] = getattr
    ) -> HeldSpan:
        """What ``state``'s master holds (:attr:`HostFlatState.master_held`: all of it unless
        it is sharded), to read the masters of span files into."""
        start, end = state.master_held
        return cls(state.layout.numel, start, end, lambda kind: tensor_of(state, kind))


def _part(state: HostFlatState, kind: str, flat: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of ``flat``, the buffer of ``kind``: the master may be whole
    where the optimizer state is a span."""
    assert flat is not None, kind  # held gradients are saved only when they exist
    first, last = state.master_held if kind == MASTER else state.held
    assert first <= start <= end <= last, (kind, start, end, first, last)
    return flat[start - first : end - first]


def holds_masters(files: Iterable[SafetensorsFile]) -> bool:
    """Whether span files hold the fp32 masters (:data:`MASTER`) of their spans."""
    return any(name.endswith(f".{MASTER}") for file in files for name in file.records)


def write_span_file(path: Path, held: Mapping[str, HeldSpan], kinds: Sequence[str]) -> FileDigest:
    """Write every state's held span of each of ``kinds`` (views: nothing is copied)."""
    tensors = []
    spans = {}
    for name, part in held.items():
        spans[name] = [part.start, part.end]
        for kind in kinds:
            flat = part.tensor(kind)
            assert flat.numel() == part.end - part.start, (name, kind)
            tensors.append((f"{name}.{kind}", flat))
    metadata = {"format": SPANS_FORMAT, "spans": json.dumps(spans), "layout": FROZEN_LAST_LAYOUT}
    return write_safetensors(path, tensors, metadata)


class SpanFiles:
    """The span files of a checkpoint, checked against this engine's states before any is read.

    Args:
        files: ``name -> (opened file, its manifest digest)``.
        numels: every flat state's size, by state name.
        frozen_states: the names of the states with frozen parameters, whose layout changed
            (:data:`FROZEN_LAST_LAYOUT`): an older file's span of one is refused.
        kinds: what each file must hold for every state (the moments, ``grad``, :data:`MASTER`).
        trained_numels: each state's trained prefix (``FlatLayout.trained_numel``): its spans
            end there, written by nodes whose optimizer state covers the trained elements
            alone (frozen ones have none: ``state/host_store.py``, [Note: frozen weights]);
            or at its numel, written before every state was trained-only ([Note: older
            span files]); a reader that holds frozen elements keeps their moments at zero.
    """

    def __init__(
        self,
        files: Mapping[str, tuple[SafetensorsFile, FileDigest]],
        numels: Mapping[str, int],
        kinds: Sequence[str],
        frozen_states: Collection[str] = (),
        trained_numels: Mapping[str, int] | None = None,
    ) -> None:
        self._files = files
        self.kinds: tuple[str, ...] = tuple(kinds)
        """What the files are checked to hold (and can be read)."""
        self._spans = {name: _spans_of(name, file) for name, (file, _) in files.items()}
        self._covered: dict[str, int] = {}
        """Each state's elements ``[0, end)`` the files cover (checked: its numel or trained prefix)."""
        for name, (file, _) in files.items():
            older = file.metadata.get("layout") != FROZEN_LAST_LAYOUT
            if older and (stale := sorted(set(self._spans[name]) & set(frozen_states))):
                raise CheckpointError(
                    f"{name}: written by a version of megatrain_ds that laid frozen parameters out first; "
                    f"state(s) {', '.join(stale)} have frozen parameters, whose elements now lie elsewhere. "
                    "Load it with that version and save it again from one process (a one-process "
                    "checkpoint has no span files, and this version reads it by parameter name)"
                )
        for state_name, numel in numels.items():
            self._check_tiling(state_name, numel, (trained_numels or {}).get(state_name, numel))

    def _check_tiling(self, state_name: str, numel: int, trained_numel: int) -> None:
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
        if position not in (numel, trained_numel):
            raise CheckpointError(
                f"the span files cover elements [0, {position}) of state {state_name!r}, which has {numel}: "
                "is it a checkpoint of a different model?"
            )
        self._covered[state_name] = position

    def masters_past(self, state_name: str, trained_numel: int) -> bool:
        """Whether the files hold masters of ``state_name``'s elements after its trained prefix
        (``trained_numel``), its frozen weights: written before every state was trained-only
        ([Note: older span files])."""
        return MASTER in self.kinds and self._covered.get(state_name, 0) > trained_numel

    def read_into(self, held: Mapping[str, HeldSpan], kinds: Sequence[str]) -> None:
        """Fill the held elements of each of ``kinds`` (some of :attr:`kinds`) of each
        state, file by file (CRC checked)."""
        assert set(kinds) <= set(self.kinds), (kinds, self.kinds)
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
                for kind in kinds:
                    target = part.tensor(kind)[lo - first : hi - first]
                    if (lo, hi) == (start, end):
                        destinations[f"{state_name}.{kind}"] = target
                    else:  # resharded: read the file's span whole, keep the part this node holds
                        whole = torch.empty(end - start, dtype=target.dtype)
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
