"""Fill a model's parameters straight from a directory of Hugging Face safetensors shards.

With ``"megatrain": {"load_from": DIR}`` the engine builds its host store from the files
in ``DIR`` (``model.safetensors``, or the shards a ``model.safetensors.index.json``
names) instead of from the parameters' own values. The model may then be built on the
``meta`` device (``accelerate.init_empty_weights()`` or ``with torch.device("meta")``), so
the weights are never in host memory twice: each tensor is read lazily with
``safetensors.safe_open`` and copied, converted to the master dtype, into its slot of
the block's flat master buffer, in pieces of at most ``CHUNK_BYTES``. Each piece is a
view of the file's memory map, which is closed after the piece, so the process never
maps more than one piece of a file (those pages are clean page cache, not a copy).

Buffers left on the meta device (``torch.device("meta")`` builds them there too) are
taken from the files when they are saved there, and otherwise recomputed by the model's
own ``_init_weights`` (Hugging Face models recompute rotary tables this way).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from megatrain_ds.checkpoint.directories import is_plain_name
from megatrain_ds.config import ConfigError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsSource:
    """Tensors by name from the safetensors files of one local directory.

    Args:
        directory: a Hugging Face model directory (or a megatrain checkpoint tag directory).
        aliases: other names of a parameter (tied weights: ``lm_head.weight`` for
            ``model.embed_tokens.weight``); any of them may be the one saved.
    """

    def __init__(self, directory: str | Path, aliases: dict[str, list[str]] | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(f"megatrain.load_from: {self.directory} is not a directory")
        self.aliases = aliases or {}
        self.file_of: dict[str, Path] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.file_of = {name: self.directory / file for name, file in _weight_map(index).items()}
        else:
            files = (
                [self.directory / SINGLE_FILE]
                if (self.directory / SINGLE_FILE).is_file()
                else sorted(self.directory.glob("*.safetensors"))
            )
            if not files:
                raise ConfigError(
                    f"megatrain.load_from: {self.directory} has no {INDEX_FILE}, "
                    f"{SINGLE_FILE} or other *.safetensors file"
                )
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    self.file_of.update((name, file) for name in handle.keys())  # noqa: SIM118 (safe_open is no dict)
        self._used: set[str] = set()

    def scoped(self, prefix: str) -> _ScopedSource:
        """The same source for names relative to ``prefix`` (a block's parameters)."""
        return _ScopedSource(self, prefix)

    def find(self, name: str) -> str | None:
        """The name under which ``name`` (or one of its aliases) is saved, if it is."""
        for candidate in [name, *self.aliases.get(name, [])]:
            if candidate in self.file_of:
                return candidate
        return None

    def copy_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` with the tensor ``name``, converted to ``out.dtype``."""
        saved = self.find(name)
        if saved is None:
            raise ValueError(
                f"megatrain.load_from: {self.directory} has no tensor {name!r} "
                f"(this model's has shape {list(out.shape)})"
            )
        path = self.file_of[saved]
        with safe_open(path, framework="pt") as handle:
            shape = list(handle.get_slice(saved).get_shape())
        if shape != list(out.shape):
            raise ValueError(
                f"tensor {saved!r}: {path.name} in {self.directory} has shape {shape}, "
                f"this model has {list(out.shape)}: load_from holds a different model"
            )
        self._used.add(saved)
        if out.numel() == 0:
            return
        row_bytes = math.prod(shape[1:]) * out.element_size() if len(shape) > 1 else out.element_size()
        rows_per_piece = max(1, CHUNK_BYTES // max(row_bytes, 1))
        if not shape:  # a scalar
            with safe_open(path, framework="pt") as handle:
                out.copy_(handle.get_tensor(saved))
            return
        for first in range(0, shape[0], rows_per_piece):
            # A fresh handle per piece: the memory map (and the pages it faulted in) goes
            # away with it, so at most one piece of the file is mapped at a time.
            with safe_open(path, framework="pt") as handle:
                out[first : first + rows_per_piece].copy_(handle.get_slice(saved)[first : first + rows_per_piece])

    def report_unused(self, known: Iterable[str]) -> None:
        """Warn about saved tensors that are neither loaded nor known to the model."""
        unused = sorted(set(self.file_of) - self._used - set(known))
        if unused:
            logger.warning(
                "megatrain: load_from %s has %d tensor(s) this model does not use: %s",
                self.directory,
                len(unused),
                ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""),
            )


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``, every shard a plain file name beside the index: the
    directory may be downloaded, and a name like ``../x`` must not reach outside it."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ConfigError(
            f"megatrain.load_from: {index} is not a valid index ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"megatrain.load_from: {index}: 'weight_map' must map tensor names to shard file names")
    for name, file in weight_map.items():
        if not is_plain_name(file):
            raise ConfigError(
                f"megatrain.load_from: {index} puts tensor {name!r} in {str(file)[:80]!r}, not a plain file name "
                f"inside {index.parent} (no '/', not '..', not absolute): refusing the directory"
            )
    return weight_map


class _ScopedSource:
    def __init__(self, source: SafetensorsSource, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def copy_into(self, name: str, out: torch.Tensor) -> None:
        self.source.copy_into(self.prefix + name, out)


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter, keyed by each of them (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: [other for other in group if other != name] for group in names.values() for name in group}


def open_source(model: nn.Module, load_from: str | None) -> SafetensorsSource | None:
    """The source the engine migrates from, or ``None`` to use the parameters' own values.

    A model with parameters on the meta device needs ``load_from``.
    """
    if load_from is None:
        meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise ConfigError(
                f"parameter {meta} is on the meta device (the model was built without weights): "
                'set "megatrain": {"load_from": "<directory of safetensors shards>"} to fill it'
            )
        return None
    return SafetensorsSource(load_from, parameter_aliases(model))


def materialize_meta_buffers(model: nn.Module, source: SafetensorsSource | None) -> None:
    """Give every buffer on the meta device a real CPU value (see the module docstring)."""
    to_init: list[nn.Module] = []
    filled: list[tuple[str, nn.Module, str]] = []
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_meta:
                continue
            full = f"{module_name}.{name}" if module_name else name
            # NaN marks "not computed yet", so a buffer no one fills is caught below.
            value = (
                torch.full(buffer.shape, math.nan, dtype=buffer.dtype)
                if buffer.is_floating_point()
                else torch.zeros(buffer.shape, dtype=buffer.dtype)
            )
            if source is not None and source.find(full) is not None:
                source.copy_into(full, value)
            elif module not in to_init:
                to_init.append(module)
            module._buffers[name] = value
            filled.append((full, module, name))
    init = getattr(model, "_init_weights", None)
    for module in to_init:
        if init is None:
            break
        init(module)
    for full, module, name in filled:
        value = module._buffers[name]
        assert value is not None  # filled above; _init_weights replaces buffers, never removes them
        if value.is_meta or (value.is_floating_point() and torch.isnan(value).any()):
            raise ConfigError(
                f"buffer {full} is on the meta device, is not in load_from, and the model cannot "
                "recompute it: build the model with accelerate.init_empty_weights(), which keeps "
                "buffers real"
            )
