"""Safetensors files written from views of host buffers and read back into them, checksummed.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length ``N``, ``N`` bytes of JSON (``name -> {dtype, shape, data_offsets}`` plus an optional
``__metadata__`` of strings), then every tensor's bytes back to back. The library's
``save_file`` wants each tensor as its own CPU tensor and its reader hands out new
tensors; here a file is written straight from views of the engine's flat buffers and
read straight into them (``readinto``), so neither direction holds a second copy of
anything. A CRC-32 of the whole file is computed on the way, in file order
(``zlib.crc32`` runs at several GB/s and releases the GIL); it detects truncation, torn
writes and flipped bits, not deliberate tampering.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megatrain_ds.runtime.stream_check import declare_access

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

# Tensors whose dtype differs from their destination's are converted in pieces of this
# many bytes, so a conversion never holds more than this much scratch memory.
CONVERT_CHUNK_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100 << 20  # the library's own limit


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


@dataclass(frozen=True)
class FileDigest:
    """Size and CRC-32 of a file, as recorded in the checkpoint manifest."""

    nbytes: int
    crc32: int
    header_crc32: int | None = None
    """CRC-32 of a safetensors file's header alone, checked before the header is trusted."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a safetensors file: ``[start, end)`` are absolute file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "write views of host buffers"
    # numpy's stub declares the buffer protocol (__buffer__) for Python >= 3.12 only: pyright
    # checks for 3.10, where ndarray exports its buffer all the same.
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]


def write_safetensors(
    path: str | os.PathLike[str], tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None
) -> FileDigest:
    """Write ``tensors`` (contiguous CPU tensors, e.g. views of a flat buffer) to ``path``,
    fsync it, and return its digest. Nothing is copied: each view's bytes go to the file (a
    device tensor's through a host copy)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the library pads the header to 8 bytes too
    prefix = struct.pack("<Q", len(blob)) + blob
    crc = zlib.crc32(prefix)
    with open(path, "xb") as handle:
        handle.write(prefix)
        for _, tensor in tensors:
            declare_access(reads=(tensor,), what=f"writing {path}")  # file I/O bypasses aten
            # A state the GPU tier keeps on the device (state/placement.py): through a host copy.
            data = tensor_bytes(tensor if tensor.device.type == "cpu" else tensor.to("cpu"))
            handle.write(data)
            crc = zlib.crc32(data, crc)
        handle.flush()
        os.fsync(handle.fileno())
    return FileDigest(len(prefix) + offset, crc, zlib.crc32(prefix))


class SafetensorsFile:
    """The parsed, validated header of one safetensors file (no tensor data is read).

    Raises :class:`CheckpointError` naming the file when the header is unreadable or does
    not match ``header_crc32`` (a flipped bit in a tensor name must not pass for another
    model), or the tensors it describes do not exactly fill the rest of the file
    (truncation, or bytes appended).
    """

    def __init__(self, path: str | os.PathLike[str], header_crc32: int | None = None) -> None:
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as handle:
            raw_length = handle.read(8)
            if len(raw_length) < 8:
                raise CheckpointError(f"{self.path}: file is truncated ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", raw_length)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{self.path}: corrupted or truncated header (says {length} bytes, file has {size})"
                )
            self.prefix = raw_length + handle.read(length)
        if header_crc32 is not None and zlib.crc32(self.prefix) != header_crc32:
            raise CheckpointError(f"{self.path}: corrupted header (checksum mismatch)")
        try:
            header = json.loads(self.prefix[8:])
            if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
                raise TypeError("the header is not a JSON object of tensors (and a __metadata__ object)")
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            records = [
                TensorRecord(
                    name,
                    DTYPES_BY_CODE[info["dtype"]],
                    _counts(info["shape"], None),
                    *(8 + length + offset for offset in _counts(info["data_offsets"], 2)),
                )
                for name, info in header.items()
            ]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as error:
            raise CheckpointError(f"{self.path}: corrupted header ({type(error).__name__}: {error})") from None
        records.sort(key=lambda record: record.start)
        position = 8 + length
        for record in records:
            expected = _numel(record.shape) * _itemsize(record.dtype)
            if record.start != position or record.end - record.start != expected:
                raise CheckpointError(
                    f"{self.path}: corrupted header (tensor {record.name} has "
                    f"offsets [{record.start}, {record.end}), expected {expected} bytes at {position})"
                )
            position = record.end
        if position != size:
            state = "truncated" if position > size else "longer than its header says"
            raise CheckpointError(f"{self.path}: file is {state} ({size} bytes, header describes {position})")
        self.nbytes = size
        self.records: dict[str, TensorRecord] = {record.name: record for record in records}

    def read_into(self, destinations: Mapping[str, torch.Tensor | None], expected: FileDigest | None = None) -> None:
        """Read every tensor named in ``destinations`` into its tensor (same shape, any
        dtype: converted in bounded pieces), in file order, checking the CRC of the whole
        file against ``expected``. Tensors not named (or mapped to ``None``) are read only
        for the checksum, through a small scratch buffer.
        """
        crc = zlib.crc32(self.prefix)
        scratch = torch.empty(CONVERT_CHUNK_BYTES, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(len(self.prefix))
            for record in self.records.values():
                target = destinations.get(record.name)
                # A device target (the GPU tier's states) takes the pieces through the scratch buffer.
                direct = target is not None and target.device.type == "cpu" and target.is_contiguous()
                if target is not None and direct and target.dtype == record.dtype:
                    declare_access(writes=(target,), what=f"reading {self.path}")  # file I/O bypasses aten
                    data = tensor_bytes(target)
                    self._read_exactly(handle, data, record)
                    crc = zlib.crc32(data, crc)
                    continue
                flat = None if target is None else target.view(-1)
                itemsize = _itemsize(record.dtype)
                chunk_elements = CONVERT_CHUNK_BYTES // itemsize
                for first in range(0, (record.end - record.start) // itemsize, chunk_elements):
                    count = min(chunk_elements, (record.end - record.start) // itemsize - first)
                    piece = scratch[: count * itemsize]
                    data = tensor_bytes(piece)
                    self._read_exactly(handle, data, record)
                    crc = zlib.crc32(data, crc)
                    if flat is not None:
                        flat[first : first + count].copy_(piece.view(record.dtype))
        if expected is not None and crc != expected.crc32:
            raise CheckpointError(
                f"{self.path}: checksum mismatch (CRC-32 {crc:#010x}, the manifest recorded "
                f"{expected.crc32:#010x}): the file is corrupted"
            )

    def _read_exactly(self, handle: io.FileIO, data: memoryview, record: TensorRecord) -> None:
        done = 0
        while done < len(data):
            count = handle.readinto(data[done:])
            if not count:
                raise CheckpointError(f"{self.path}: file is truncated (ends inside tensor {record.name})")
            done += count


def file_digest(path: str | os.PathLike[str]) -> FileDigest:
    """Size and CRC-32 of a whole file, read in 16 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as handle:
        while block := handle.read(CONVERT_CHUNK_BYTES):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return FileDigest(size, crc)


def _counts(value: object, length: int | None) -> tuple[int, ...]:
    """A header's list of non-negative ints (a shape, offsets); a forged header may hold anything."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise ValueError(f"expected a list of {length or 'any number of'} ints, found {value!r:.60}")
    if not all(type(item) is int and item >= 0 for item in value):
        raise ValueError(f"expected non-negative ints, found {value!r:.60}")
    return tuple(value)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
