"""Where a plan's figures come from: the GPU table, measured on this machine, or a file.

``megatrain plan`` plans with a :class:`~megatrain_ds.planning.step_time.Hardware` whose
figures are the GPU table's (``GPU_HARDWARE``: assumptions), measured here (``--probe``;
the CPU profile with ``--gpu cpu``), or read from an earlier plan's ``--json`` output
(``--hardware``: what a probe measured there, e.g. in ``bench/compare.py``'s first engine
round). A plan names the source of each figure (``"hardware_sources"`` in its JSON, one
``figure ...`` line per figure in its table), so that a figure that was not measured --
the AdamW rate beside copies without a CUDA device -- is never mistaken for one that was,
and the figure that stands in for it is named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatrain_ds.planning.step_time import ADAM_HOST_BYTES_PER_PARAM, Hardware

STAND_INS = {
    "adam_bytes_per_s": f"host_memory_bytes_per_s at {ADAM_HOST_BYTES_PER_PARAM} B/param stands in",
    "adam_beside_copies_bytes_per_s": "adam_bytes_per_s stands in",
}
"""What ``step_time.optimizer_seconds`` takes where a figure is 0 (none given)."""


def figure_argument_problem(gpu: str, probe: bool, recalibrate: bool, hardware: str | None) -> str | None:
    """What is wrong with ``plan``'s arguments on where its figures come from, or ``None``:
    each source measures or reads the figures itself, so two of them would contradict."""
    if probe and gpu == "cpu":
        return "--probe measures a GPU machine's host: with --gpu cpu the profile measures this one (--recalibrate)"
    if hardware is not None and (probe or recalibrate):
        return "--hardware gives the figures: drop --probe and --recalibrate, which would measure them"
    return None


def figure_sources(gpu: str, probed: bool, device_here: bool) -> dict[str, str]:
    """Where each figure of a plan for ``gpu`` came from: measured here (``probed``: by
    ``--probe``; ``device_here``: a CUDA device was there to measure), the GPU table's, or
    (the AdamW rate beside copies) not probed, and which figure stands in for it."""
    if gpu == "cpu":
        return {"all": "measured here (the CPU profile: this machine is the device)"}
    table = f"the {gpu} table's (GPU_HARDWARE, planning/step_time.py)"
    host = "measured here by --probe" if probed else table
    on_device = probed and device_here
    link = "measured here by --probe (pinned copies)" if on_device else table
    beside = (
        "measured here by --probe (the AdamW pass beside pinned copies both ways)"
        if on_device
        else f"not probed ({'no CUDA device here' if probed else 'no --probe'}): adam_bytes_per_s stands in"
    )
    return {
        "flops": table,
        "block_efficiency": "measured here by --probe (one real block on the device)" if on_device else table,
        "h2d_bytes_per_s": link,
        "d2h_bytes_per_s": link,
        "host_memory_bytes_per_s": host,
        "adam_bytes_per_s": host + (" (the run's AdamW pass, alone)" if probed else ""),
        "adam_beside_copies_bytes_per_s": beside,
    }


def hardware_from_file(path: str, gpu: str | None = None) -> tuple[Hardware, dict[str, str]]:
    """``--hardware``: the figures of a plan's ``--json`` output (its ``"hardware"`` and
    ``"hardware_sources"``), or of a ``"hardware"`` object alone, and where they came from.
    ``gpu``: the plan's ``--gpu``, which the figures must be for (a CPU profile's figures
    would plan an H200 as a machine whose device is its host). A file that cannot be read,
    or holds unknown, missing or another device's figures, is a ``ValueError`` naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--hardware {path}: not a plan's JSON ({error})") from None
    figures = data.get("hardware", data) if isinstance(data, dict) else None
    if not isinstance(figures, dict):
        raise ValueError(f'--hardware {path}: no "hardware" object (write one with megatrain plan --json)')
    fields = dataclasses.fields(Hardware)
    known = {field.name for field in fields}
    unknown = sorted(set(figures) - known)
    if unknown:
        raise ValueError(f"--hardware {path}: unknown figures {unknown}; a plan's JSON has {sorted(known)}")
    required = {field.name for field in fields if field.default is dataclasses.MISSING}
    missing = sorted(required - set(figures))
    if missing:
        raise ValueError(f"--hardware {path}: figures {missing} missing; a plan's JSON has them all")
    if gpu is not None and figures["name"] != gpu:
        raise ValueError(f"--hardware {path}: the figures are for --gpu {figures['name']}, not {gpu}")
    sources = data.get("hardware_sources") or {"all": f"read from {path}"}
    return Hardware(**figures), {name: f"{source} (read from {path})" for name, source in sources.items()}


def name_stand_ins(hardware: Hardware, sources: dict[str, str]) -> dict[str, str]:
    """``sources`` with each figure that is 0 -- none given, as the GPU table's AdamW rate --
    saying which figure stands in for it (:data:`STAND_INS`), so that "the h200 table's" is
    never read as a rate the table gives."""
    named = dict(sources)
    for figure, stand_in in STAND_INS.items():
        if figure in named and not getattr(hardware, figure) and "stands in" not in named[figure]:
            named[figure] += f": 0, {stand_in}"
    return named
