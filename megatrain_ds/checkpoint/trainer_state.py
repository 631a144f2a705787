"""The engine's trainer state in a checkpoint: counters, optimizer hyperparameters, the lr
scheduler, RNG states and the user's ``client_state``, saved and loaded without pickle.

Written as two files (format version 2)::

    engine_state.json          the state as ``json_tensors`` encodes it
    engine_state.safetensors   the tensors it references (RNG states, tensors in client_state)

Checkpoints of format version 1 hold ``trainer_state.pt``, a ``torch.save`` pickle; it is
read with ``torch.load(weights_only=True)``, which builds only tensors and plain
containers, plus exactly the NumPy types of NumPy's RNG state: a file holding anything else
is refused, never unpickled. (Not ``trainer_state.json``: the Hugging Face Trainer writes a
file of that name one directory up, and the two must not be mistaken for each other.)

Whatever was read is validated (:func:`validated`) and checked against the engine
(:func:`check_compatible`) before the engine is touched, so that applying it
(:func:`apply_trainer_state`) cannot fail half-way.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatrain_ds.checkpoint import json_tensors
from megatrain_ds.checkpoint.directories import checked_digest
from megatrain_ds.checkpoint.rng_state import RngState, capture_rng, restore_rng, rng_from_saved, rng_to_saved
from megatrain_ds.checkpoint.tensor_files import CheckpointError, SafetensorsFile

ENGINE_STATE = "engine_state.json"
ENGINE_TENSORS = "engine_state.safetensors"
LEGACY_TRAINER_STATE = "trainer_state.pt"
"""The pickle of format version 1, read safely, never written."""

# Engine counters restored unless load_module_only; optimizer_steps is the Adam step
# count (bias correction), so it belongs to the optimizer state.
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
OPTIMIZER_COUNTERS = ("optimizer_steps",)


class LossScalerState(Protocol):
    """fp16's loss scaler (``optimizer/loss_scaling.py``): its running state as plain numbers."""

    def state_dict(self) -> dict[str, float | int]: ...

    def load_state_dict(self, state: dict[str, float | int]) -> None: ...


class TrainerStateOwner(Protocol):
    """What the trainer state is taken from and restored into (``MegatrainEngine``)."""

    optimizer: Any
    lr_scheduler: Any

    @property
    def loss_scaling(self) -> LossScalerState: ...

    def gradient_accumulation_steps(self) -> int: ...


@dataclass(frozen=True)
class TrainerState:
    """The trainer state of one checkpoint, validated."""

    counters: dict[str, int]
    param_groups: list[dict[str, Any]]
    """Each optimizer parameter group's hyperparameters (no ``"params"``)."""
    loss_scaler: dict[str, float | int]
    """fp16's loss scale and hysteresis (empty without fp16, and in format version 1)."""
    lr_scheduler: dict[str, Any] | None
    rng: RngState
    gradient_accumulation_steps: int
    mid_window_gradients: bool
    """Saved inside an accumulation window: the optimizer files hold the accumulators."""
    client_state: dict[Any, Any]


def capture(engine: TrainerStateOwner, client_state: Mapping[Any, Any], mid_window: bool) -> TrainerState:
    """The trainer state of ``engine`` now."""
    scheduler = engine.lr_scheduler
    return TrainerState(
        counters={
            name: getattr(engine, name) for name in ENGINE_COUNTERS + OPTIMIZER_COUNTERS if hasattr(engine, name)
        },
        param_groups=[{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups],
        loss_scaler=engine.loss_scaling.state_dict(),
        lr_scheduler=scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        rng=capture_rng(),
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        mid_window_gradients=mid_window,
        client_state=dict(client_state),
    )


@dataclass(frozen=True)
class EncodedTrainerState:
    """The two files' contents, made before anything is written (a value that cannot be
    stored fails the save before it starts)."""

    document: bytes
    tensors: list[tuple[str, torch.Tensor]]


def encode(state: TrainerState) -> EncodedTrainerState:
    """Raises ``ValueError`` naming the key of a value a checkpoint cannot store."""
    tensors: list[tuple[str, torch.Tensor]] = []
    fields = {
        "counters": state.counters,
        "param_groups": state.param_groups,
        "loss_scaler": state.loss_scaler,
        "lr_scheduler": state.lr_scheduler,
        "rng": rng_to_saved(state.rng),
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "mid_window_gradients": state.mid_window_gradients,
        "client_state": state.client_state,
    }
    document = {key: json_tensors.encode(value, tensors, key) for key, value in fields.items()}
    return EncodedTrainerState(json_tensors.dumps(document), tensors)


def read(path: Path, manifest: Mapping[str, Any]) -> TrainerState:
    """The validated trainer state of the tag directory ``path``, by its format version.

    Raises:
        CheckpointError: a missing, damaged or forged file, named.
    """
    if manifest["version"] == 1:
        legacy = _read_legacy(path, manifest)
        if isinstance(legacy, dict):
            legacy.setdefault("loss_scaler", {})  # version 1 predates fp16
        return validated(legacy, str(path / LEGACY_TRAINER_STATE))
    source = str(path / ENGINE_STATE)
    document = json_tensors.loads(_checked_bytes(path, manifest, ENGINE_STATE), source)
    digest = checked_digest(path, manifest, ENGINE_TENSORS)
    file = SafetensorsFile(path / ENGINE_TENSORS, digest.header_crc32)
    # The header fills the file exactly (checked), so these allocations are bounded by its size.
    tensors = {name: torch.empty(record.shape, dtype=record.dtype) for name, record in file.records.items()}
    file.read_into(tensors, digest)
    return validated(json_tensors.decode(document, tensors, source), source)


def _checked_bytes(path: Path, manifest: Mapping[str, Any], name: str) -> bytes:
    digest = checked_digest(path, manifest, name)
    data = (path / name).read_bytes()
    if len(data) != digest.nbytes or zlib.crc32(data) != digest.crc32:
        raise CheckpointError(f"{path / name}: checksum mismatch: the file is corrupted")
    return data


def _read_legacy(path: Path, manifest: Mapping[str, Any]) -> Any:
    data = _checked_bytes(path, manifest, LEGACY_TRAINER_STATE)
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # the parser of untrusted bytes: any failure is a refused file
        raise CheckpointError(
            f"{path / LEGACY_TRAINER_STATE}: the file holds objects a safe load refuses (torch.load with "
            "weights_only=True loads tensors, plain containers and NumPy RNG states only), or is not a torch "
            f"file ({_reason(error)}). A checkpoint is never unpickled: if you wrote this one yourself, load "
            "it with a megatrain_ds that writes format version 1 and save it again"
        ) from None


def _reason(error: Exception) -> str:
    """The line of torch's long message that names the refused object."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = next((line for line in lines if "Unsupported" in line or "WeightsUnpickler error" in line), None)
    return f"{type(error).__name__}: {named or (lines[0] if lines else '')}"[:300]


def _numpy_rng_globals() -> list[Any]:
    """Exactly what a pickled ``numpy.random.get_state()`` references (NumPy 1 and 2 names)."""
    try:
        import numpy
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct  # NumPy 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]  # NumPy 1
    uint32 = type(numpy.dtype(numpy.uint32))
    return [
        numpy.ndarray,
        numpy.dtype,
        uint32,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


_FIELDS = (
    "counters",
    "param_groups",
    "loss_scaler",
    "lr_scheduler",
    "rng",
    "gradient_accumulation_steps",
    "mid_window_gradients",
    "client_state",
)


def validated(raw: Any, source: str) -> TrainerState:
    """``raw`` (decoded JSON, or a version-1 dict) as a :class:`TrainerState`, every field
    of the type the engine restores; raises :class:`CheckpointError` naming the field."""
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        keys = sorted(map(str, raw)) if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{source}: the trainer state must have exactly the fields {list(_FIELDS)}, not {keys}")
    counters, groups, scheduler = raw["counters"], raw["param_groups"], raw["lr_scheduler"]
    if not isinstance(counters, dict) or not all(_is_count(v) for v in counters.values()):
        raise CheckpointError(f"{source}: 'counters' must map counter names to non-negative ints")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" not in g for g in groups):
        raise CheckpointError(f"{source}: 'param_groups' must be a list of hyperparameter dicts (without 'params')")
    scaler = raw["loss_scaler"]
    if not isinstance(scaler, dict) or not all(
        isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) and v >= 0 for k, v in scaler.items()
    ):
        raise CheckpointError(f"{source}: 'loss_scaler' must map names to finite non-negative numbers")
    if scheduler is not None and not (isinstance(scheduler, dict) and all(isinstance(k, str) for k in scheduler)):
        raise CheckpointError(f"{source}: 'lr_scheduler' must be a state dict or null")
    steps, mid_window, client_state = (
        raw["gradient_accumulation_steps"],
        raw["mid_window_gradients"],
        raw["client_state"],
    )
    if not _is_count(steps) or steps < 1:
        raise CheckpointError(f"{source}: 'gradient_accumulation_steps' must be a positive int, not {steps!r:.40}")
    if not isinstance(mid_window, bool):
        raise CheckpointError(f"{source}: 'mid_window_gradients' must be true or false, not {mid_window!r:.40}")
    if not isinstance(client_state, dict):
        raise CheckpointError(f"{source}: 'client_state' must be a dict, not {type(client_state).__name__}")
    return TrainerState(
        counters, groups, scaler, scheduler, rng_from_saved(raw["rng"], source), steps, mid_window, client_state
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def check_compatible(
    engine: TrainerStateOwner, state: TrainerState, path: Path, with_optimizer: bool, with_scheduler: bool
) -> None:
    """Raise :class:`CheckpointError` if ``state`` cannot be applied to ``engine`` whole."""
    if with_optimizer:
        saved, current = len(state.param_groups), len(engine.optimizer.param_groups)
        if saved != current:
            raise CheckpointError(
                f"the checkpoint has {saved} optimizer parameter groups, this engine has "
                f"{current}; pass load_optimizer_states=False to load the weights only"
            )
        for number, (group, live) in enumerate(zip(state.param_groups, engine.optimizer.param_groups)):
            key = next((k for k in group if k in live and not _same_kind(group[k], live[k])), None)
            if key is not None:
                raise CheckpointError(
                    f"{path}: hyperparameter {key!r} of optimizer parameter group {number} is "
                    f"{group[key]!r:.60} in the checkpoint and {live[key]!r:.60} in this engine: not the same kind"
                )
        if state.mid_window_gradients and state.gradient_accumulation_steps != engine.gradient_accumulation_steps():
            raise CheckpointError(
                f"the checkpoint was saved inside an accumulation window of {state.gradient_accumulation_steps} "
                f"micro-batches (micro step {state.counters.get('micro_steps')}); this engine accumulates "
                f"{engine.gradient_accumulation_steps()}: resume with "
                f"gradient_accumulation_steps={state.gradient_accumulation_steps}"
            )
    scheduler = engine.lr_scheduler
    if with_scheduler and scheduler is not None and state.lr_scheduler is not None:
        _check_scheduler(scheduler.state_dict(), state.lr_scheduler, path)


def _check_scheduler(live: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    # Schedulers load a state by updating their attributes with it: a key this scheduler's
    # own state lacks would overwrite another attribute (its optimizer, say).
    differing = sorted(set(live) ^ set(saved))
    key = differing[0] if differing else next((k for k in live if not _same_kind(saved[k], live[k])), None)
    if key is not None:
        raise CheckpointError(
            f"{path}: the saved lr scheduler state does not match this engine's lr scheduler (key {key!r}): "
            "is it another scheduler? load_lr_scheduler_states=False keeps this one's state"
        )


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether ``saved`` can stand where ``live`` is (numbers for numbers, same lengths)."""
    if live is None:
        return True  # an unset option takes any value
    if isinstance(live, bool) or isinstance(saved, bool):
        return isinstance(saved, bool) and isinstance(live, bool)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(live, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(live) and all(map(_same_kind, saved, live))
    if isinstance(live, dict):
        return isinstance(saved, dict) and all(_same_kind(saved[k], live[k]) for k in saved.keys() & live.keys())
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.dtype == live.dtype and saved.shape == live.shape
    return type(saved) is type(live)


def apply_trainer_state(
    engine: TrainerStateOwner, state: TrainerState, with_optimizer: bool, with_scheduler: bool
) -> None:
    """Restore counters, hyperparameters, the scheduler and RNG states (``state`` was
    checked by :func:`check_compatible`)."""
    for name in ENGINE_COUNTERS + (OPTIMIZER_COUNTERS if with_optimizer else ()):
        if name in state.counters and hasattr(engine, name):
            setattr(engine, name, state.counters[name])
    if with_optimizer:
        for group, saved in zip(engine.optimizer.param_groups, state.param_groups):
            group.update(saved)
        # DeepSpeed restores its loss scaler with the optimizer state.
        engine.loss_scaling.load_state_dict(state.loss_scaler)
    scheduler = engine.lr_scheduler
    if with_scheduler and scheduler is not None and state.lr_scheduler is not None:
        scheduler.load_state_dict(state.lr_scheduler)
    restore_rng(state.rng)
