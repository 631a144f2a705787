"""Nested Python values as a JSON document plus named tensors: state saved without pickle.

The engine's trainer state (counters, hyperparameters, the lr scheduler's ``state_dict``,
RNG states, the user's ``client_state``) is a tree of dicts, lists, tuples, scalars and
tensors. Pickle would store any object, and unpickling a downloaded file runs whatever
code its author chose; this encoding stores exactly these types and nothing else:

- ``None``, ``bool``, ``int``, ``str``, finite ``float``, ``list``: JSON as they are;
- a ``dict`` with ``str`` keys none of which starts with ``$``: a JSON object;
- everything else is an object with a single ``$`` key:
  ``{"$tuple": [...]}``, ``{"$dict": [[key, value], ...]}`` (keys that are not plain
  strings: ``int``, ``float``, ``bool``, ``None`` or ``$``-strings),
  ``{"$float": "nan" | "inf" | "-inf"}`` and ``{"$tensor": "<name>"}``, the name of a
  tensor stored beside the document (a safetensors file).

:func:`encode` raises ``ValueError`` naming the key of a value it cannot store, so a
save fails at once rather than writing a checkpoint that cannot be loaded;
:func:`decode` raises :class:`CheckpointError` for any document it did not write.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from megatrain_ds.checkpoint.tensor_files import DTYPE_CODES, CheckpointError

MAX_DEPTH = 64
"""Nesting deeper than this is refused on both sides (a cycle, or a forged document)."""

_TAG = "$"
_KEY_TYPES = (str, int, float, bool, type(None))
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(value: Any, tensors: list[tuple[str, torch.Tensor]], where: str) -> Any:
    """``value`` as a JSON-serialisable tree; its tensors are appended to ``tensors`` (as
    contiguous CPU tensors, named by position) and referenced by name.

    Args:
        value: the tree to store.
        tensors: receives ``(name, tensor)`` for every tensor found.
        where: how the caller names ``value`` in error messages (``"client_state"``).

    Raises:
        ValueError: a value of a type this encoding does not store, named by its key path.
    """
    return _encode(value, tensors, where, 0)


def _encode(value: Any, tensors: list[tuple[str, torch.Tensor]], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep (a reference cycle?)")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPE_CODES:
            raise ValueError(
                f"{where}: a checkpoint stores tensors of {sorted(map(str, DTYPE_CODES))}, not {value.dtype}"
            )
        name = f"tensor_{len(tensors)}"
        tensors.append((name, value.detach().to("cpu").contiguous()))
        return {"$tensor": name}
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(item, tensors, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]}
    if isinstance(value, dict):
        return _encode_dict(value, tensors, where, depth)
    raise ValueError(
        f"{where}: cannot save a {type(value).__module__}.{type(value).__qualname__} in a checkpoint: "
        "checkpoints store None, bool, int, float, str, lists, tuples, dicts and torch tensors "
        "(no pickle, so that loading a checkpoint cannot run code); convert it to one of those"
    )


def _encode_dict(value: dict[Any, Any], tensors: list[tuple[str, torch.Tensor]], where: str, depth: int) -> Any:
    for key in value:
        if not isinstance(key, _KEY_TYPES):
            raise ValueError(
                f"{where}: key {key!r} is a {type(key).__qualname__}; checkpoints store dict keys "
                "that are str, int, float, bool or None"
            )
    if all(isinstance(key, str) and not key.startswith(_TAG) for key in value):
        return {key: _encode(item, tensors, f"{where}[{key!r}]", depth + 1) for key, item in value.items()}
    return {"$dict": [[key, _encode(item, tensors, f"{where}[{key!r}]", depth + 1)] for key, item in value.items()]}


def dumps(document: Any) -> bytes:
    """Strict JSON (non-finite floats were encoded as tags)."""
    return json.dumps(document, allow_nan=False, sort_keys=False).encode()


def loads(data: bytes, source: str) -> Any:
    """Parse strict JSON from an untrusted file, any failure a :class:`CheckpointError`."""

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not strict JSON")

    try:
        return json.loads(data, parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CheckpointError(f"{source}: not a valid JSON document ({type(error).__name__}: {error})") from None


def decode(document: Any, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    """The tree :func:`encode` stored as ``document``, its tensors taken from ``tensors``.

    Raises:
        CheckpointError: ``document`` is not something :func:`encode` writes, or names a
            tensor ``tensors`` lacks; the message names ``source`` and the key path.
    """
    return _decode(document, tensors, source, "", 0)


def _decode(document: Any, tensors: Mapping[str, torch.Tensor], source: str, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{source}: {where or 'the document'} is nested more than {MAX_DEPTH} levels deep")
    if document is None or isinstance(document, (bool, int, float, str)):
        return document
    if isinstance(document, list):
        return [_decode(item, tensors, source, f"{where}[{i}]", depth + 1) for i, item in enumerate(document)]
    assert isinstance(document, dict), "json.loads makes only these types"
    tags = [key for key in document if key.startswith(_TAG)]
    if not tags:
        return {key: _decode(item, tensors, source, f"{where}[{key!r}]", depth + 1) for key, item in document.items()}
    if len(document) != 1:
        raise CheckpointError(f"{source}: {where or 'the document'} mixes the tag {tags[0]!r} with other keys")
    tag, body = next(iter(document.items()))
    return _decode_tagged(tag, body, tensors, source, where, depth)


def _decode_tagged(
    tag: str, body: Any, tensors: Mapping[str, torch.Tensor], source: str, where: str, depth: int
) -> Any:
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_decode(item, tensors, source, f"{where}[{i}]", depth + 1) for i, item in enumerate(body))
    if tag == "$float" and isinstance(body, str) and body in _NON_FINITE:
        return _NON_FINITE[body]
    if tag == "$tensor" and isinstance(body, str):
        if body not in tensors:
            raise CheckpointError(f"{source}: {where} names tensor {body!r}, which the tensor file does not hold")
        return tensors[body]
    if tag == "$dict" and isinstance(body, list):
        result = {}
        for i, pair in enumerate(body):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _KEY_TYPES)):
                raise CheckpointError(f"{source}: {where}[{i}] is not a [key, value] pair of a dict")
            result[pair[0]] = _decode(pair[1], tensors, source, f"{where}[{pair[0]!r}]", depth + 1)
        return result
    raise CheckpointError(
        f"{source}: {where or 'the document'} holds {tag!r}: {body!r:.80}, not a value this format writes"
    )
