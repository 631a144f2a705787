"""Figures of this machine measured once and kept in a JSON file (calibrations, profiles).

The optimizer's calibration (``optimizer/placement.py``), the CPU profile of
``megatrain plan`` (``cli.py``) and the disk's bandwidth (``state/swap_io.py``) are slow to
measure and stable per machine: each is measured the first time under a key naming what
it depends on, and read back afterwards. The file is rewritten through a temporary file
and a rename, so concurrent runs never read half of it; a file that cannot be written
only means measuring again next time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$MEGATRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/megatrain_ds`` (``~/.cache/megatrain_ds``)."""
    root = os.environ.get("MEGATRAIN_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "megatrain_ds"
    )
    return Path(root)


def cached_measurement(
    path: Path, key: str, measure: Callable[[], dict[str, Any]], recalibrate: bool = False
) -> dict[str, Any]:
    """``path``'s entry ``key``, from ``measure()`` (and stored) when absent or ``recalibrate``."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if recalibrate or key not in known:
        known[key] = measure()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_suffix(f".{os.getpid()}.tmp")
            temp.write_text(json.dumps(known, indent=2) + "\n")
            temp.replace(path)  # atomic: concurrent runs never read half a file
        except OSError as error:
            logger.warning(
                "megatrain: could not cache a measurement at %s (%s); it is measured again next time", path, error
            )
    return known[key]
