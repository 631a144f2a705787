"""One locked directory of swap files per run, under the configured ``nvme_path``.

The swap files are working state, not checkpoints: a run never resumes from them (it
resumes from a checkpoint, which holds every tensor). So a run makes its own directory
``<nvme_path>/megatrain-swap-<host>-<pid>-<random>/``, holds an exclusive ``flock`` on its
``owner.lock`` for as long as it lives, and removes the directory at ``close()``.

[Note: swap directories left behind]
A run killed before ``close()`` leaves its directory. The kernel drops a dead process's
``flock``, so at start-up every ``megatrain-swap-*`` directory whose lock can be taken
belonged to a dead run: it is removed, with a warning naming it (its contents are never
read). One whose lock is held belongs to a live run sharing ``nvme_path``: it is left
alone, and each run writes only inside its own directory, so two runs cannot clobber
each other. A ``megatrain-swap-*`` entry without a readable ``owner.json`` is not one of
ours (or was damaged): it is reported and left alone, never used. Nothing else in
``nvme_path`` is touched.

Space is claimed before training: the free space of the filesystem is checked against
the bytes needed (:func:`check_free_space`, also run by preflight), then every file is
preallocated (``posix_fallocate``), so a full disk is found at start-up with the path and
the numbers, not in the middle of a step.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "megatrain-swap-"
OWNER_FILE = "owner.json"
LOCK_FILE = "owner.lock"
FORMAT = "megatrain-swap/1"


class DiskSpaceError(OSError):
    """Not enough free space under ``nvme_path`` for the swap files."""


def check_free_space(nvme_path: str | os.PathLike[str], needed: int) -> None:
    """Raise :class:`DiskSpaceError` naming the path and the bytes unless ``needed`` bytes are free."""
    probe = Path(nvme_path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the directory may not exist yet: its filesystem's space counts
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise DiskSpaceError(
            errno.ENOSPC,
            f"the NVMe tier needs {needed / 2**30:.2f} GiB of swap files but only {free / 2**30:.2f} GiB "
            f"are free: free {(needed - free) / 2**30:.2f} GiB there, point megatrain.nvme_path "
            "(or offload_optimizer.nvme_path) at a larger disk, or keep the optimizer state in host memory",
            str(nvme_path),
        )


def clear_stale(nvme_path: Path) -> list[Path]:
    """Remove the directories of dead runs under ``nvme_path``; see [Note: swap directories
    left behind]. Returns what was removed."""
    removed = []
    for entry in sorted(nvme_path.glob(PREFIX + "*")):
        owner = _read_owner(entry)
        if owner is None:
            logger.warning(
                "megatrain: %s looks like a swap directory but has no readable %s: not ours "
                "(or damaged); left alone and not used",
                entry,
                OWNER_FILE,
            )
            continue
        lock = _try_lock(entry / LOCK_FILE)
        if lock is None:
            logger.info(
                "megatrain: %s belongs to a live run (pid %s on %s); left alone",
                entry,
                owner.get("pid"),
                owner.get("host"),
            )
            continue
        try:
            logger.warning(
                "megatrain: removing the swap directory %s of a run that is gone (pid %s on %s, "
                "started %s): swap files are working state, never resumed from; resume from a "
                "checkpoint",
                entry,
                owner.get("pid"),
                owner.get("host"),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("created", 0))),
            )
            shutil.rmtree(entry)
            removed.append(entry)
        finally:
            os.close(lock)
    return removed


class SwapDirectory:
    """This run's directory of preallocated swap files (see the module docstring).

    Args:
        nvme_path: where to make it (created if missing).
        files: file name -> size in bytes; every file is created and preallocated.
    """

    def __init__(self, nvme_path: str | os.PathLike[str], files: Mapping[str, int]) -> None:
        root = Path(nvme_path)
        root.mkdir(parents=True, exist_ok=True)
        clear_stale(root)
        needed = sum(files.values())
        check_free_space(root, needed)
        name = f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # Made under a name clear_stale does not look at, locked and owned, then renamed
        # into place: a run starting beside this one (another data-parallel rank) never
        # sees it without its owner file or its lock (the lock is on the directory's
        # lock file, which the rename keeps).
        making = root / f".{name}.partial"
        making.mkdir()
        self._lock = _try_lock(making / LOCK_FILE)
        assert self._lock is not None, "a fresh directory's lock is free"
        (making / OWNER_FILE).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "created": time.time(),
                    "files": dict(files),
                }
            )
        )
        self.path = root / name
        making.rename(self.path)
        self.files = {name: str(self.path / name) for name in files}
        try:
            for name, size in files.items():
                preallocate(self.files[name], size)
        except BaseException:
            self.close()
            raise
        self.nbytes = needed

    def close(self) -> None:
        """Remove the directory and its files (the run is over, or failed to start)."""
        if self._lock is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = None


def preallocate(path: str, size: int) -> None:
    """Create ``path`` with ``size`` bytes allocated on disk (reading as zeros)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if size:  # an empty file (a rank's empty window beside frozen weights) has nothing to allocate
            os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskSpaceError(
                error.errno,
                f"the disk filled while preallocating {size} bytes of swap "
                "file: free space there or point megatrain.nvme_path at a "
                "larger disk",
                path,
            ) from None
        raise
    finally:
        os.close(fd)


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive flock, or None if another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read_owner(entry: Path) -> dict | None:
    try:
        owner = json.loads((entry / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("format") != FORMAT or not (entry / LOCK_FILE).exists():
        return None
    return owner
