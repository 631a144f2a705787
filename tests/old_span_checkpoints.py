"""Span checkpoints in the form written before every state was trained-only (issue 44),
made from a current one: ``checkpoint/optimizer_spans.py``, [Note: older span files].

Before issue 44 a state with fp32 frozen weights under bf16 compute, whose fp32 master was
cut across nodes (or across ranks, the weights on the tier), kept its master, moments and
spans over all of its elements; its span files' masters held the frozen weights' exact fp32
values, and its model files the bf16 shadow (or the gather in the compute dtype). A current
checkpoint of such a run holds the same exact values in fp32 model files and spans that end
at the trained prefix, so :func:`as_before_issue_44` rewrites it into that older form: the
last span of each such state extended to the state's end (masters: the frozen weights' fp32
values from the model files, in the state's layout; moments and gradients: zeros, as no
step ever changed them), the frozen weights in the model files rounded to bf16, and the
manifest's sizes and checksums made anew.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from megatrain_ds.checkpoint.checkpointed_engine import CheckpointedEngine, entries_by_state, state_names
from megatrain_ds.checkpoint.directories import MANIFEST_FILE, read_manifest, write_latest, write_manifest
from megatrain_ds.checkpoint.optimizer_spans import MASTER, SPANS_PREFIX
from megatrain_ds.checkpoint.tensor_files import FileDigest, write_safetensors


def as_before_issue_44(tag_dir: Path, out: Path, engine: CheckpointedEngine) -> dict[str, torch.Tensor]:
    """Write ``tag_dir`` (a span checkpoint of ``engine``'s model) in the older form to
    ``out/<tag>`` (and ``out/latest``). Returns the exact fp32 frozen weights by name, which
    the model files now hold rounded."""
    target = out / tag_dir.name
    shutil.copytree(tag_dir, target)
    write_latest(out, tag_dir.name)
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(target.glob("model-*.safetensors")):
        weights.update(safetensors.torch.load_file(shard))
    names = state_names(engine)
    frozen = {e.name: weights[e.name] for group in entries_by_state(engine) for e in group if not e.trained}
    # Each state's frozen elements [trained_numel, numel) in its layout, exact (padding zero).
    tails = {}
    for name, state, group in zip(names, engine.states, entries_by_state(engine)):
        tail = torch.zeros(state.layout.numel - state.layout.trained_numel, dtype=torch.float32)
        for entry in (e for e in group if not e.trained):
            start = entry.slot.offset - state.layout.trained_numel
            tail[start : start + entry.slot.numel] = frozen[entry.name].reshape(-1)
        if tail.numel():
            tails[name] = tail
    digests = _extend_last_spans(target, tails)
    for shard in sorted(target.glob("model-*.safetensors")):
        tensors = safetensors.torch.load_file(shard)
        rounded = {n: t.bfloat16() if n in frozen else t for n, t in tensors.items()}
        shard.unlink()  # write_safetensors creates its file (the tensors are read already)
        digests[shard.name] = write_safetensors(shard, list(rounded.items()), {"format": "pt"})
    body = read_manifest(target)
    for file_name, digest in digests.items():
        body["files"][file_name] = {"bytes": digest.nbytes, "crc32": digest.crc32, "header_crc32": digest.header_crc32}
    (target / MANIFEST_FILE).unlink()  # written anew (write_manifest creates its file)
    write_manifest(target, body)
    return frozen


def _extend_last_spans(target: Path, tails: dict[str, torch.Tensor]) -> dict[str, FileDigest]:
    """In every state of ``tails`` whose spans end at its trained prefix, the last span (the
    one ending there) extended over the frozen elements: the masters by ``tails``' values,
    every other kind by zeros. Returns the rewritten files' digests."""
    files = sorted(target.glob(f"{SPANS_PREFIX}*.safetensors"))
    contents = {}
    for path in files:
        with safetensors.safe_open(path, "pt") as opened:
            metadata = opened.metadata()
        contents[path] = (safetensors.torch.load_file(path), metadata, json.loads(metadata["spans"]))
    # Each state's last span: the one that ends at its trained prefix (of empty ones, one).
    last = {state: max(files, key=lambda p, s=state: (*contents[p][2][s], p.name)) for state in tails}
    digests = {}
    for path, (tensors, metadata, spans) in contents.items():
        changed = False
        for state, tail in tails.items():
            if last[state] != path or f"{state}.{MASTER}" not in tensors:
                continue  # not this state's last span, or a checkpoint without masters
            start, end = spans[state]
            for key in [k for k in tensors if k.rsplit(".", 1)[0] == state]:
                extra = tail if key.endswith(f".{MASTER}") else torch.zeros_like(tail, dtype=tensors[key].dtype)
                tensors[key] = torch.cat([tensors[key], extra])
            spans[state] = [start, end + tail.numel()]
            changed = True
        if changed:
            metadata = {**metadata, "spans": json.dumps(spans)}
            path.unlink()
            digests[path.name] = write_safetensors(path, list(tensors.items()), metadata)
    return digests
