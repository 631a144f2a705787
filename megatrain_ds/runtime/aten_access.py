"""What an aten op reads and writes, for the race checker (``runtime/stream_check.py``):
its tensor arguments sorted by the op's schema, the bytes of a storage a tensor can touch,
and the engine line that issued it.

The checker sees every aten op of the engine's threads, tens of thousands per step of a
tiny model, so each answer here is computed once where it can be: an op's schema is read
once per op (:func:`op_plan`), and the skip decision of a source file once per code object
(:func:`call_site`). The answers are those of reading them afresh every time.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

ALLOCATIONS = {
    torch.ops.aten.empty,
    torch.ops.aten.empty_like,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
}
"""Ops that only allocate: their outputs are new memory, not yet written."""

_OVERWRITES = {
    torch.ops.aten.copy_,
    torch.ops.aten.zero_,
    torch.ops.aten.fill_,
    torch.ops.aten.normal_,
    torch.ops.aten.uniform_,
    torch.ops.aten.bernoulli_,
    torch.ops.aten.random_,
    torch.ops.aten.exponential_,
}
"""In-place ops that write their ``self`` without reading it (for the host ledger, which
counts an argument updated in place as read and written)."""

_READ_ONLY_MUTABLES = {
    torch.ops.aten._fused_adamw_: ("grads",),
    torch.ops.aten._fused_adam_: ("grads",),
}
"""Arguments the schema marks mutable that the CPU kernel only reads as the engine calls it
(the fused Adam ops write their gradients back only for options the engine never passes:
``grad_scale``, ``maximize``): read, for the host ledger; still writes for the race
checker, as the schema declares."""

READ, OVERWRITTEN, READ_ONLY_MUTABLE, UPDATED = range(4)
"""What an op does to an argument: reads it; writes it without reading it (``out=`` and
:data:`_OVERWRITES`); may write it but only reads it (:data:`_READ_ONLY_MUTABLES`); updates
it in place (reads and writes). All but ``READ`` are writes for the race checker."""


@dataclass(frozen=True)
class OpPlan:
    """One op's schema, read once: its arguments' roles and which outputs are new memory."""

    arguments: tuple[tuple[int, str, int], ...]
    """``(position, name, role)`` of each argument, role as :data:`READ` and the others."""
    returns_alias: bool
    """It returns something, and every return aliases an input without writing it: a view
    when no tensor is passed to an argument it writes."""
    is_view: bool
    """``returns_alias`` and no argument is written: a view whatever it is passed, which
    touches no data."""
    allocates: bool
    """One of :data:`ALLOCATIONS`."""
    fresh_returns: tuple[int, ...]
    """The returns that alias nothing: new memory the op wrote."""
    many_returns: bool
    """The op returns a tuple (else one value)."""
    name: str
    """``str(func)``, as a race's message names the op."""


_PLANS: dict[Any, OpPlan] = {}


def op_plan(func: Any) -> OpPlan:
    """``func``'s (an ``OpOverload``'s) :class:`OpPlan`, read from its schema once."""
    plan = _PLANS.get(func)
    if plan is None:
        plan = _PLANS[func] = _read_plan(func)
    return plan


def _role(func: Any, argument: Any) -> int:
    if argument.alias_info is None or not argument.alias_info.is_write:
        return READ
    if argument.is_out or func.overloadpacket in _OVERWRITES:
        return OVERWRITTEN
    if argument.name in _READ_ONLY_MUTABLES.get(func.overloadpacket, ()):
        return READ_ONLY_MUTABLE
    return UPDATED


def _read_plan(func: Any) -> OpPlan:
    schema = func._schema
    arguments = tuple((position, a.name, _role(func, a)) for position, a in enumerate(schema.arguments))
    returns = schema.returns
    aliasing = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return OpPlan(
        arguments=arguments,
        returns_alias=aliasing,
        is_view=aliasing and all(role == READ for _, _, role in arguments),
        allocates=func.overloadpacket in ALLOCATIONS,
        fresh_returns=tuple(index for index, r in enumerate(returns) if r.alias_info is None),
        many_returns=len(returns) > 1,
        name=str(func),
    )


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's argument (a tensor, a list of them, nested containers)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return []
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


Extent = tuple[int, int, int]
"""``(storage key, first byte, end byte)``: the bytes of one storage a tensor can touch."""


def extent(tensor: torch.Tensor) -> Extent | None:
    """``(storage key, first byte, end byte)`` of what ``tensor`` can touch, or ``None``."""
    if tensor.device.type == "meta" or tensor.layout != torch.strided or tensor.numel() == 0:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    size = tensor.element_size()
    if tensor.is_contiguous():  # the sum below, without a loop: dense strides reach numel - 1
        last = tensor.numel() - 1
    else:
        last = sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    start = int(tensor.storage_offset()) * size  # a real storage: the offset is no SymInt
    return storage.data_ptr(), start, start + (last + 1) * size


def shape(dtype: torch.dtype, size: torch.Size) -> str:
    """A tensor's dtype and shape as a race's message names them: ``float32[4, 16]``."""
    return f"{str(dtype).removeprefix('torch.')}{list(size)}"


_SKIP_FILES = (
    os.sep + "torch" + os.sep,
    *(os.sep + name for name in ("stream_check.py", "aten_access.py", "device_runtime.py")),
    *(os.sep + name for name in ("contextlib.py", "threading.py", "queue.py")),
)

_SITES: dict[CodeType, tuple[bool, bool, str]] = {}
"""Code object -> (skipped, in the engine, its label's file part): read once per code."""


def _site(code: CodeType) -> tuple[bool, bool, str]:
    site = _SITES.get(code)
    if site is None:
        filename = code.co_filename
        marker = filename.rfind(os.sep + "megatrain_ds" + os.sep)
        label = filename[marker + 1 :] if marker >= 0 else os.path.basename(filename)
        site = _SITES[code] = (any(part in filename for part in _SKIP_FILES), marker >= 0, label)
    return site


def call_site(depth: int) -> str:
    """The innermost engine (else caller) frame outside torch and the runtime, from the
    frame ``depth`` levels above the caller of this function."""
    frame = sys._getframe(depth + 1)
    fallback = ""
    while frame is not None:
        skipped, in_engine, label = _site(frame.f_code)
        if not skipped and (in_engine or not fallback):  # only the innermost caller frame is kept
            here = f"{label}:{frame.f_lineno} ({frame.f_code.co_name})"
            if in_engine:
                return here
            fallback = here
        frame = frame.f_back
    return fallback or "?"
