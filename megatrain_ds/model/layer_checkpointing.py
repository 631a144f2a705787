"""The model's own activation checkpointing inside streamed blocks: redundant, so switched off.

[Note: layer checkpointing]
The engine already checkpoints every streamed block at its boundary and recomputes it in
backward (``streaming/streamed_blocks.py``). A model may ask for the same thing itself:

- Hugging Face models: ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()``
  (``TrainingArguments(gradient_checkpointing=True)``, TRL's ``SFTConfig`` default) set
  ``gradient_checkpointing = True`` and ``_gradient_checkpointing_func`` on every
  ``GradientCheckpointingLayer``, whose class ``forward`` then runs inside
  ``torch.utils.checkpoint``. The engine never calls a live block's class ``forward`` (it
  replaces it per instance) but runs the block's weightless *template*, a copy that keeps
  the flag. There the checkpoint would recompute the layer in the engine's backward, after
  ``functional_call`` has put the template's ``meta`` parameters back ("Tensor on device cpu
  is not on the expected device meta!"), or refuse ``backward(inputs=...)`` when reentrant.
  So the flag is switched off in every template (:func:`switch_off`), and it is never a
  per-block attribute set on the template (``block_template._scalar_attributes``). The
  model itself is left as the user set it: ``is_gradient_checkpointing`` still reads True,
  and modules outside the blocks (a vision tower's layers, a custom head) keep checkpointing.
- A user's ``torch.utils.checkpoint.checkpoint(block, ...)`` around a live block. With
  ``use_reentrant=False`` it is a no-op: it only acts on tensors saved for backward, and the
  block's autograd node (``_StreamedBlockFn``) saves none. With ``use_reentrant=True`` the
  forward runs the block without a graph and the checkpoint re-runs it inside backward; the
  engine runs that call as a streamed block too, so the gradients are the same, at the cost
  of one more pass over the block's weights. :func:`note_block_called_in_backward` says so,
  once.
Numerics are those of a run without checkpointing: the same kernels on the same inputs, with
the RNG state of the forward replayed by the engine's recompute (dropout masks agree).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FLAG = "gradient_checkpointing"
"""Hugging Face's per-module switch (``GradientCheckpointingLayer``, older models' stacks)."""


def checkpointing_modules(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules (itself: ``""``) with the checkpointing flag on."""
    return [name for name, sub in module.named_modules() if getattr(sub, FLAG, False) is True]


def switch_off(module: nn.Module) -> bool:
    """Turn the checkpointing flag off in ``module`` (a block template, never the user's
    model); returns whether any submodule had it on."""
    names = checkpointing_modules(module)
    for name in names:
        setattr(module.get_submodule(name), FLAG, False)
    return bool(names)


def log_if_requested(blocks: nn.ModuleList, block_path: str) -> bool:
    """One info line when the model asks for checkpointing inside its streamed blocks;
    returns whether it does."""
    requested = sum(1 for block in blocks if checkpointing_modules(block))
    if requested:
        logger.info(
            "megatrain: the model's gradient checkpointing is skipped inside the %d of %d blocks at %s "
            "that request it: the engine already checkpoints every streamed block and recomputes it in "
            "backward (numerics unchanged; modules outside the blocks keep theirs)",
            requested,
            len(blocks),
            block_path,
        )
    return bool(requested)


class ReentrantRerunNotice:
    """Says once per engine that a block ran again inside backward (a reentrant checkpoint)."""

    def __init__(self) -> None:
        self.noticed = False

    def note_block_called_in_backward(self, index: int) -> None:
        """Call when block ``index`` is called with gradients enabled; logs the first time
        that happens inside a backward pass (``torch.utils.checkpoint(use_reentrant=True)``)."""
        # -1 outside backward; torch.utils.checkpoint itself reads it the same way.
        if self.noticed or torch._C._current_graph_task_id() == -1:
            return
        self.noticed = True
        logger.warning(
            "megatrain: block %d ran again inside backward: a torch.utils.checkpoint with "
            "use_reentrant=True wraps it. Gradients are unchanged, but its weights are streamed "
            "once more per step; the engine already checkpoints every block, so remove the wrapper "
            "or pass use_reentrant=False (a no-op here)",
            index,
        )
