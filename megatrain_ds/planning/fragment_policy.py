"""Whether blocks' weights cross in fragments: ``"megatrain": {"fragment_bytes": "auto"}``.

``"auto"`` (the default) is decided at the first training forward, when the tokens per
weight pass are known, by the planner (:func:`~megatrain_ds.planning.planner.choose_fragment_bytes`,
[Note: the weight pipeline] in ``planning/step_time.py``) from the same figures as
``"recompute": "auto"`` (``planning/recompute_policy.py``: the device's compute rate, the
host<->device copy rates measured here, the blocks stashed). Fragments only shorten the
ends of each weight pass -- forward waits for the first block's weights, backward for the
last block's -- by about a block's copy less a fragment's, and every further copy costs
the link a little, so the planner turns them on only where it predicts a step shorter by
:data:`~megatrain_ds.planning.planner.FRAGMENT_GAIN_MARGIN`: shallow models with large
blocks, rarely deep ones (the gain is at most about one block's share of a pass). Never on
the CPU, where nothing is copied. Until the decision the blocks cross whole.

The choice is logged once with the predicted step with and without fragments, and the
engine puts it in the trace's metadata.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatrain_ds.planning.planner import Hardware, ModelShape, RunSettings, fragment_policies

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FragmentChoice:
    """What the first training forward decided for ``"fragment_bytes": "auto"``."""

    fragment_bytes: int
    """Bytes per piece of a block's weight copy; 0: whole blocks."""
    predicted: dict[str, dict[str, float]]
    """:func:`~megatrain_ds.planning.planner.fragment_policies` for this run."""


def choose_fragments(run: tuple[ModelShape, RunSettings, Hardware]) -> FragmentChoice:
    """Decide ``"fragment_bytes": "auto"`` for the weight pass ``run`` describes
    (:func:`~megatrain_ds.planning.recompute_policy.planned_run`, with the blocks stashed
    already decided) and log the decision."""
    shape, settings, hardware = run
    predicted = fragment_policies(shape, settings, hardware)
    choice = FragmentChoice(int(predicted["chosen"]["fragment_bytes"]), predicted)
    whole, best = predicted["whole"], predicted["fragments"]
    if hardware.shares_host_memory:
        reason = "the device is the host: nothing is copied"
    elif not best["fragment_bytes"]:
        reason = "a block is too small to cut"
    else:
        reason = (
            f"best fragment {best['fragment_bytes'] / 2**20:.3g} MiB: predicted step "
            f"{best['predicted_step_seconds']:.4g} s, whole blocks {whole['predicted_step_seconds']:.4g} s"
        )
    logger.info(
        "megatrain: fragment_bytes auto: %s on %s at %d tokens per weight pass (%s)",
        f"{choice.fragment_bytes} bytes" if choice.fragment_bytes else "whole blocks",
        hardware.name,
        settings.tokens_per_pass,
        reason,
    )
    return choice
