"""Span files of the optimizer state (several nodes), without processes: written by one
partition of the states, read back by another (resharding), and refused when forged.

The node-parallel save and the resumes on other numbers of nodes are run for real in
tests/test_data_parallel.py; here every partition is made in one process, and the values
read are compared element for element with the ones written.
"""

import json
import struct
from pathlib import Path

import pytest
import torch
from placement_check import planned_state

from megatrain_ds.checkpoint.optimizer_spans import (
    HeldSpan,
    SpanFiles,
    holds_masters,
    span_file_name,
    write_span_file,
)
from megatrain_ds.checkpoint.tensor_files import CheckpointError, SafetensorsFile, file_digest
from megatrain_ds.distributed.ownership import Ownership
from megatrain_ds.state.flat_layout import build_flat_layout
from megatrain_ds.state.host_store import HostFlatState
from megatrain_ds.state.placement import Topology

KINDS = ("exp_avg", "exp_avg_sq", "grad")
NUMELS = {"resident": 1000, "model.layers.0": 5 * 64 + 3, "model.layers.1": 64}  # one smaller than the windows


def _planned(numel: int, compute: torch.dtype, topology: Topology, grad_itemsize: int | None = None):
    """The placement of a state of one ``numel``-element fp32 parameter, as an engine plans it."""
    param = torch.nn.Parameter(torch.empty(numel, device="meta"))
    return planned_state([("w", param)], {param: 0}, (torch.float32, compute), topology, grad_itemsize=grad_itemsize)


def node_states(nodes: int, per_node: int, node: int, values: dict[str, torch.Tensor] | None) -> dict:
    """The states one node holds in an engine of ``nodes`` x ``per_node`` ranks: its span of
    each kind, taken from ``values`` (the whole state) or zero."""
    ownership = Ownership.of([range(n * per_node, (n + 1) * per_node) for n in range(nodes)], node * per_node)
    states = {}
    for name, numel in NUMELS.items():
        layout = build_flat_layout([("w", torch.Size([numel]), 0)])
        start, end = ownership.span(layout.numel)
        topology = Topology(node_ranks=per_node, span_of=ownership.span)
        held = {
            kind: (values[f"{name}.{kind}"][start:end].clone() if values else torch.zeros(end - start))
            for kind in KINDS
        }
        states[name] = HostFlatState(
            layout=layout,
            master=torch.zeros(layout.numel),
            shadow=None,
            exp_avg=held["exp_avg"],
            exp_avg_sq=held["exp_avg_sq"],
            grad=held["grad"],
            span=(start, end),
            placement=_planned(numel, torch.float32, topology, grad_itemsize=4),
        )
    return states


def held_spans(states: dict[str, HostFlatState]) -> dict[str, HeldSpan]:
    return {name: HeldSpan.of_state(state) for name, state in states.items()}


def numels(states: dict[str, HostFlatState]) -> dict[str, int]:
    return {name: state.layout.numel for name, state in states.items()}


def whole_values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"{name}.{kind}": torch.randn(build_flat_layout([("w", torch.Size([numel]), 0)]).numel, generator=generator)
        for name, numel in NUMELS.items()
        for kind in KINDS
    }


def save(directory: Path, nodes: int, per_node: int, values: dict[str, torch.Tensor]) -> dict:
    files = {}
    for node in range(nodes):
        name = span_file_name(node, nodes)
        digest = write_span_file(directory / name, held_spans(node_states(nodes, per_node, node, values)), KINDS)
        files[name] = (SafetensorsFile(directory / name, digest.header_crc32), digest)
    return files


@pytest.mark.parametrize(("saved", "loaded"), [((2, 1), (1, 1)), ((2, 2), (4, 1)), ((4, 1), (3, 2)), ((1, 1), (2, 1))])
def test_spans_written_by_one_partition_are_read_by_another(
    tmp_path: Path, saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    values = whole_values()
    files = save(tmp_path, *saved, values)
    nodes, per_node = loaded
    for node in range(nodes):
        states = node_states(nodes, per_node, node, None)
        SpanFiles(files, numels(states), KINDS).read_into(held_spans(states), KINDS)
        for name, state in states.items():
            start, end = state.held
            for kind in KINDS:
                assert torch.equal(getattr(state, kind), values[f"{name}.{kind}"][start:end]), (name, kind, node)


def _forge_spans(path: Path, edit) -> None:
    """Rewrite the ``spans`` of a span file's header (tensor offsets count from the data, so
    the data stays as it is)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    spans = json.loads(header["__metadata__"]["spans"])
    edit(spans)
    header["__metadata__"]["spans"] = json.dumps(spans)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + length :])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda spans: spans.update({"resident": [0, 400]}), r"no tensor resident.exp_avg of shape \[400\]"),
        (lambda spans: spans.update({"resident": [1, 513]}), "does not continue at"),  # shifted
        (lambda spans: spans.pop("model.layers.0"), "span .* of state 'model.layers.0' does not continue at 0"),
        (lambda spans: spans.update({"resident": [0, "9"]}), "not a span file"),
        (lambda spans: spans.update({"resident": [5, 1]}), "not a span file"),
    ],
)
def test_forged_spans_are_refused_before_anything_is_read(tmp_path: Path, edit, message: str) -> None:
    save(tmp_path, 2, 1, whole_values())
    first = tmp_path / span_file_name(0, 2)
    _forge_spans(first, edit)
    files = {
        path.name: (SafetensorsFile(path), file_digest(path))  # re-stamped: only the checks below stop it
        for path in sorted(tmp_path.glob("*.safetensors"))
    }
    states = node_states(1, 1, 0, None)
    with pytest.raises(CheckpointError, match=message):
        SpanFiles(files, numels(states), KINDS)
    assert all(not getattr(state, kind).any() for state in states.values() for kind in KINDS)  # untouched


def test_a_missing_file_a_missing_kind_and_a_flipped_byte_are_named(tmp_path: Path) -> None:
    values = whole_values()
    files = save(tmp_path, 2, 1, values)
    first = span_file_name(0, 2)
    with pytest.raises(CheckpointError, match=r"cover elements \[0, 512\) of state 'resident', which has 1024"):
        SpanFiles({first: files[first]}, numels(node_states(1, 1, 0, None)), KINDS)
    with pytest.raises(CheckpointError, match=r"no tensor resident\.grad_held of shape \[512\]"):
        SpanFiles(files, numels(node_states(1, 1, 0, None)), ("exp_avg", "grad_held"))  # a kind no file has
    path = tmp_path / span_file_name(1, 2)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # in the data of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        states = node_states(1, 1, 0, None)
        SpanFiles(files, numels(states), KINDS).read_into(held_spans(states), KINDS)


def _master_states(nodes: int, node: int, masters: dict[str, torch.Tensor] | None, sharded: bool) -> dict:
    """Node ``node`` of ``nodes`` (a rank each): its span of the moments, and of the fp32
    master where ``sharded`` (bf16 compute), else the whole master; from ``masters`` or zero."""
    states = {}
    for name, numel in NUMELS.items():
        layout = build_flat_layout([("w", torch.Size([numel]), 0)])
        span_of = Ownership.of([[n] for n in range(nodes)], node).span if nodes > 1 else None
        placement = _planned(numel, torch.bfloat16 if sharded else torch.float32, Topology(1, span_of))
        span = span_of(layout.numel) if span_of is not None else None
        start, end = span if span is not None else (0, layout.numel)
        first, last = (start, end) if placement.master_split else (0, layout.numel)
        states[name] = HostFlatState(
            layout=layout,
            master=masters[name][first:last].clone() if masters else torch.zeros(last - first),
            shadow=torch.zeros(layout.numel, dtype=torch.bfloat16) if sharded else None,
            exp_avg=torch.zeros(end - start),
            exp_avg_sq=torch.zeros(end - start),
            span=span,
            placement=placement,
        )
    return states


@pytest.mark.parametrize(("saved", "loaded", "sharded"), [(2, 1, False), (2, 4, True), (4, 3, True), (2, 2, False)])
def test_sharded_masters_in_span_files_are_read_by_any_partition(
    tmp_path: Path, saved: int, loaded: int, sharded: bool
) -> None:
    """Nodes that shard the fp32 master (bf16 compute) write their span of it as "master";
    one process (a whole master), other numbers of nodes sharding it, and nodes holding it
    whole (fp32 compute: only the moments sharded) read back exactly the values written."""
    generator = torch.Generator().manual_seed(1)
    masters = {
        name: torch.randn(build_flat_layout([("w", torch.Size([n]), 0)]).numel, generator=generator)
        for name, n in NUMELS.items()
    }
    kinds = ("exp_avg", "master")
    files = {}
    for node in range(saved):
        name = span_file_name(node, saved)
        digest = write_span_file(tmp_path / name, held_spans(_master_states(saved, node, masters, True)), kinds)
        files[name] = (SafetensorsFile(tmp_path / name, digest.header_crc32), digest)
    assert holds_masters(file for file, _ in files.values())
    for node in range(loaded):
        states = _master_states(loaded, node, None, sharded)
        spans = SpanFiles(files, numels(states), kinds)
        spans.read_into({name: HeldSpan.of_masters(state) for name, state in states.items()}, ["master"])
        spans.read_into(held_spans(states), ["exp_avg"])
        for name, state in states.items():
            first, last = state.master_held
            assert state.master.numel() == last - first and torch.equal(state.master, masters[name][first:last])
    (tmp_path / "moments").mkdir()  # span files of fp32 nodes: no masters in them
    assert not holds_masters(file for file, _ in save(tmp_path / "moments", 2, 1, whole_values()).values())


def _drop_layout(path: Path) -> None:
    """Make a span file as versions before the frozen-last layout wrote it (no ``layout``)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    del header["__metadata__"]["layout"]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + length :])


def test_an_older_layouts_span_of_a_state_with_frozen_parameters_is_refused(tmp_path: Path) -> None:
    """Frozen parameters now lie after the trained ones (``state/flat_layout.py``): an older
    file's span of a state that has frozen parameters holds other elements at each offset,
    so reading it would scramble the state silently. States without frozen parameters kept
    their layout: the same file still loads for them."""
    values = whole_values()
    files = save(tmp_path, 2, 1, values)
    for path in sorted(tmp_path.glob("*.safetensors")):
        _drop_layout(path)
    files = {path.name: (SafetensorsFile(path), file_digest(path)) for path in sorted(tmp_path.glob("*.safetensors"))}
    states = node_states(1, 1, 0, None)
    with pytest.raises(CheckpointError, match=r"laid frozen parameters out first; state\(s\) model.layers.1 have"):
        SpanFiles(files, numels(states), KINDS, frozen_states=["model.layers.1"])
    SpanFiles(files, numels(states), KINDS).read_into(held_spans(states), KINDS)  # no frozen parameters: read
    assert torch.equal(states["resident"].exp_avg, values["resident.exp_avg"])
