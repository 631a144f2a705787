"""The random number generators' states a checkpoint saves: Python, NumPy, the CPU, CUDA.

Resuming exactly (dropout masks, data order) needs them all. In a checkpoint they are
plain values for ``json_tensors``: Python's state is a tuple of ints, NumPy's is stored as
a dict of its fields (its key vector as a list of ints), torch's are ``uint8`` tensors.

States read from a file are validated by restoring them into throw-away generators
(:func:`rng_from_saved`) before the process's own generators are touched, so a damaged or
forged state is a :class:`CheckpointError` at load time, never a half-restored process.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ds.checkpoint.tensor_files import CheckpointError
from megatrain_ds.runtime.device_runtime import device_rng_states, restore_device_rng_states

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RngState:
    """Every generator's state; ``numpy``/``cuda`` are ``None`` where there was none."""

    python: tuple[Any, ...]
    cpu: torch.Tensor
    numpy: tuple[Any, ...] | None
    """``numpy.random.get_state()``: ``("MT19937", keys (uint32[624]), pos, has_gauss, cached_gaussian)``."""
    cuda: list[torch.Tensor] | None


def capture_rng() -> RngState:
    """The states of this process's generators now."""
    numpy_state = None
    try:
        import numpy

        numpy_state = numpy.random.get_state(legacy=True)
    except ImportError:
        pass
    cuda = device_rng_states()
    return RngState(random.getstate(), torch.get_rng_state(), numpy_state, cuda)  # type: ignore[arg-type]


def rng_to_saved(state: RngState) -> dict[str, Any]:
    """The state as ``json_tensors`` values (NumPy's key vector becomes a list of ints)."""
    saved: dict[str, Any] = {"python": state.python, "cpu": state.cpu}
    if state.numpy is not None:
        algorithm, keys, pos, has_gauss, cached_gaussian = state.numpy
        saved["numpy"] = {
            "algorithm": algorithm,
            "keys": [int(key) for key in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if state.cuda is not None:
        saved["cuda"] = list(state.cuda)
    return saved


def rng_from_saved(saved: Any, source: str) -> RngState:
    """The validated state from what :func:`rng_to_saved` wrote, or from the ``"rng"`` dict
    of a version-1 checkpoint (NumPy's state there is its own tuple).

    Raises:
        CheckpointError: a state the generators would refuse, or of the wrong type.
    """
    if not isinstance(saved, dict) or "python" not in saved or "cpu" not in saved:
        raise CheckpointError(f"{source}: the RNG state is not a dict with 'python' and 'cpu' states")
    python = saved["python"]
    try:
        random.Random().setstate(python)  # a throw-away generator checks it
    except (TypeError, ValueError, OverflowError) as error:
        raise CheckpointError(f"{source}: invalid Python RNG state ({error})") from None
    cpu = _checked_torch_state(saved["cpu"], f"{source}: the CPU RNG state")
    try:
        torch.Generator().set_state(cpu)
    except RuntimeError as error:
        raise CheckpointError(f"{source}: invalid CPU RNG state ({error})") from None
    cuda = saved.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, (list, tuple)):
            raise CheckpointError(f"{source}: the CUDA RNG states are not a list")
        cuda = [_checked_torch_state(item, f"{source}: CUDA RNG state {i}") for i, item in enumerate(cuda)]
    return RngState(python, cpu, _numpy_from_saved(saved.get("numpy"), source), cuda)


def _checked_torch_state(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise CheckpointError(f"{what} is not a 1-D uint8 tensor")
    return value


def _numpy_from_saved(saved: Any, source: str) -> tuple[Any, ...] | None:
    if saved is None:
        return None
    try:
        import numpy
    except ImportError:
        logger.warning("megatrain: %s holds a NumPy RNG state, but NumPy is not installed: not restored", source)
        return None
    if isinstance(saved, dict):  # this format's fields
        fields = ("algorithm", "keys", "pos", "has_gauss", "cached_gaussian")
        if set(saved) != set(fields) or not isinstance(saved["keys"], list):
            raise CheckpointError(f"{source}: the NumPy RNG state does not have exactly the fields {fields}")
        if not all(type(key) is int and 0 <= key < 1 << 32 for key in saved["keys"]):
            raise CheckpointError(f"{source}: the NumPy RNG key vector is not a list of 32-bit unsigned ints")
        saved = (
            saved["algorithm"],
            numpy.array(saved["keys"], dtype=numpy.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    try:
        numpy.random.RandomState().set_state(saved)  # a throw-away generator checks it
    except (TypeError, ValueError, OverflowError, KeyError, IndexError) as error:
        raise CheckpointError(f"{source}: invalid NumPy RNG state ({type(error).__name__}: {error})") from None
    return saved


def restore_rng(state: RngState) -> None:
    """Set this process's generators to ``state`` (already validated)."""
    random.setstate(state.python)
    torch.set_rng_state(state.cpu)
    if state.numpy is not None:
        import numpy

        numpy.random.set_state(state.numpy)
    devices = restore_device_rng_states(state.cuda) if state.cuda is not None else None
    if state.cuda is not None and devices is not None and len(state.cuda) != devices:
        logger.warning(
            "megatrain: the checkpoint has RNG states of %d CUDA devices, this process sees %d; restored the first %d",
            len(state.cuda),
            devices,
            min(devices, len(state.cuda)),
        )
