"""Crash-safe checkpoint directories: temporary directory, fsync, atomic rename, ``latest``.

[Note: crash safety]
A save writes everything into ``<save_dir>/.tmp-<tag>-<pid>-<random>/``, fsyncs every
file, writes the manifest (sizes and CRC-32 of every file) last, fsyncs the directory,
renames it to ``<save_dir>/<tag>`` and fsyncs ``save_dir``; only then is ``latest``
replaced, through its own fsynced temporary file and an atomic ``os.replace``. So at any
moment of a crash:
- before the rename: ``<tag>`` and ``latest`` are untouched; the temporary directory is a
  leftover that loads ignore (with a message) and the next save in ``save_dir`` removes;
- after the rename, before ``latest``: the new tag is complete but ``latest`` still names
  the previous one;
- a tag saved again over an existing one: the old directory is first renamed aside
  (``.replaced-<tag>-...``), the new one renamed in, then the old one deleted. A crash
  between the two renames leaves no ``<tag>``; :func:`resolve_tag_dir` then finds the
  complete directory set aside and loads it, with a message.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatrain_ds.checkpoint.tensor_files import CheckpointError, FileDigest

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
MANIFEST_FILE = "megatrain_checkpoint.json"
FORMAT_NAME = "megatrain-checkpoint"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-"
_REPLACED_PREFIX = ".replaced-"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not starting with '.')")
    return tag


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (files created or renamed in it) durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_bytes_durably(path: Path, data: bytes) -> FileDigest:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return FileDigest(len(data), zlib.crc32(data))


def make_temp_dir(save_dir: Path, tag: str) -> Path:
    """A fresh temporary directory for a save; removes leftovers of interrupted saves."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for leftover in leftover_dirs(save_dir):
        owner = _owner_pid(leftover)
        if owner is not None and owner != os.getpid() and _is_alive(owner):
            continue  # another process is saving here right now
        logger.warning("megatrain: removing %s, the partial directory of an interrupted save", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
    for stale in save_dir.glob(f"{_TMP_PREFIX}{LATEST_FILE}-*"):
        stale.unlink(missing_ok=True)  # an interrupted update of ``latest``
    for aside in save_dir.glob(f"{_REPLACED_PREFIX}*"):
        tag_name = aside.name[len(_REPLACED_PREFIX) :].rsplit("-", 1)[0]
        if (save_dir / tag_name / MANIFEST_FILE).is_file():
            shutil.rmtree(aside, ignore_errors=True)  # its replacement is complete
    path = save_dir / f"{_TMP_PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def leftover_dirs(save_dir: Path) -> list[Path]:
    if not save_dir.is_dir():
        return []
    return sorted(p for p in save_dir.iterdir() if p.is_dir() and p.name.startswith(_TMP_PREFIX))


def report_leftovers(save_dir: Path) -> None:
    for leftover in leftover_dirs(save_dir):
        logger.warning("megatrain: ignoring %s, the partial directory of an interrupted save", leftover)


def publish_dir(temp: Path, final: Path) -> None:
    """Atomically make the complete directory ``temp`` appear as ``final`` (see the Note)."""
    fsync_dir(temp)
    aside = None
    if final.exists():
        aside = final.parent / f"{_REPLACED_PREFIX}{final.name}-{time.time_ns()}"
        os.rename(final, aside)
    os.rename(temp, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside)


def write_latest(save_dir: Path, tag: str) -> None:
    temp = save_dir / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
    write_bytes_durably(temp, tag.encode())
    os.replace(temp, save_dir / LATEST_FILE)
    fsync_dir(save_dir)


def read_latest(load_dir: Path) -> str | None:
    path = load_dir / LATEST_FILE
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; pass tag= to load_checkpoint")
    return tag


def resolve_tag_dir(load_dir: Path, tag: str) -> Path:
    """The directory of ``tag``, or the complete copy a crashed re-save set aside."""
    path = load_dir / tag
    if path.is_dir():
        return path
    aside = sorted(
        (p for p in load_dir.glob(f"{_REPLACED_PREFIX}{tag}-*") if (p / MANIFEST_FILE).is_file()),
        key=lambda p: int(p.name.rsplit("-", 1)[1]),
    )  # newest last
    if aside:
        logger.warning(
            "megatrain: %s is missing (a save of the same tag was interrupted); loading the previous copy %s",
            path,
            aside[-1],
        )
        return aside[-1]
    raise CheckpointError(f"checkpoint directory {path} does not exist")


def write_manifest(directory: Path, body: dict[str, Any]) -> None:
    """The manifest: file sizes and CRC-32s, plus a CRC-32 of its own content."""
    text = json.dumps(body, sort_keys=True)
    document = {"crc32": zlib.crc32(text.encode()), "body": body}
    write_bytes_durably(directory / MANIFEST_FILE, json.dumps(document, indent=1, sort_keys=True).encode())


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete megatrain checkpoint")
    try:
        document = json.loads(path.read_bytes())
        body, recorded = document["body"], int(document["crc32"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: corrupted manifest ({error})") from None
    if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != recorded:
        raise CheckpointError(f"{path}: corrupted manifest (checksum mismatch)")
    if body.get("format") != FORMAT_NAME or body.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {body.get('format')!r} version {body.get('version')!r} "
            f"is not {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return body


def checked_digest(directory: Path, manifest: Mapping[str, Any], name: str) -> FileDigest:
    """The recorded digest of ``name``, after checking the file exists with that size."""
    record = manifest["files"].get(name)
    path = directory / name
    if record is None:
        raise CheckpointError(f"{path} is not listed in {directory / MANIFEST_FILE}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size
    if size != record["bytes"]:
        state = "truncated" if size < record["bytes"] else "longer than recorded"
        raise CheckpointError(f"{path}: file is {state} ({size} bytes, the manifest recorded {record['bytes']})")
    return FileDigest(record["bytes"], record["crc32"], record.get("header_crc32"))


def _owner_pid(path: Path) -> int | None:
    parts = path.name[len(_TMP_PREFIX) :].rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
