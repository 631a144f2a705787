"""``"frozen_weights": "compute_dtype"``: frozen weights cast to the compute dtype, once, in place.

A frozen parameter (``requires_grad=False``, or in no optimizer group) is streamed and never
updated. Held in the compute dtype it costs that dtype's bytes once: its flat state keeps it in
the streamed copy alone (``state/host_store.py``: [Note: frozen weights]). One that arrives in
another dtype (an fp32 base model under bf16 compute) is kept exact by default, in the master
or apart (``state/placement.py``: [Note: the placement model]), beside the rounded copy that
is streamed (6 B a parameter in host memory, or on the NVMe tier with ``"all"``);
:func:`cast_frozen_weights` rounds it instead (2 B), before the engine reads the model's
dtypes, so that every later step (preflight, the placement, the migration, saving) sees a
frozen weight in the compute dtype and nothing else.

The cast replaces each parameter's ``.data`` on the user's module, the ``nn.Parameter`` object
kept: the optimizer's groups, tied weights (one parameter reached by two names) and hooks keep
pointing at it, and ``model.parameters()``, ``state_dict()`` and a saved model give the rounded
values the engine trains with.

May import: ``config``, ``runtime``, ``state``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from megatrain_ds.state.flat_layout import FROZEN_GROUP

logger = logging.getLogger(__name__)


def cast_frozen_weights(model: nn.Module, group_of: dict[nn.Parameter, int], compute: torch.dtype) -> int:
    """Cast, in place, every frozen floating-point parameter of ``model`` that is not in
    ``compute`` to it (``group_of``: each parameter's optimizer group, ``FROZEN_GROUP`` for a
    frozen one). Nothing is cast with fp32 compute: a frozen weight is then held in its own
    dtype already. Returns the number of elements cast.

    Each is rounded to nearest (``Tensor.to``), as the streamed copy of an exact weight is; a
    parameter on the meta device (``load_from``) changes dtype only, and its values are
    converted as they are read."""
    if compute.itemsize >= 4:
        return 0
    cast = 0
    for param in model.parameters():  # each parameter once, however many names it has
        if group_of[param] != FROZEN_GROUP or not param.is_floating_point() or param.dtype == compute:
            continue
        # Replacing .data frees the old storage as soon as nothing else holds it: one frozen
        # weight at a time is held twice, never the model.
        param.data = param.data.to(compute)
        cast += param.numel()
    if cast:
        logger.info("megatrain: %d frozen parameter elements cast to %s (frozen_weights: compute_dtype)", cast, compute)
    return cast
