"""Triton kernels for megatrain_ds, importable as ``megatrain_triton``.

Each kernel comes as ``_name_kernel`` (Triton) -> ``name_`` (launcher, in place) with a
pure-torch ``name_reference_`` beside it. On CPU tensors the kernels run only through
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported);
``INTERPRETED`` says which mode this process is in.
"""

from megatrain_triton.adamw import INTERPRETED, adamw_step_
from megatrain_triton.adamw_reference import adamw_step_reference_

__all__ = ["INTERPRETED", "adamw_step_", "adamw_step_reference_"]
