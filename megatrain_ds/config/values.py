"""What every block of the configuration checks its values with: :class:`ConfigError`, integers, ``"auto"``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value the engine cannot use; the message names the key."""


def is_integer_at_least(value: object, minimum: float) -> bool:
    """``value`` is a JSON integer (not a bool, which Python counts as one) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


AUTO = "auto"
"""The placeholder Accelerate and the HF Trainer fill in before calling ``deepspeed.initialize``."""
AUTO_HELP = (
    '"auto" values are filled in by the HF Trainer (from TrainingArguments) or by '
    "Accelerate before they call deepspeed.initialize; this one was not: give a value"
)


def reject_auto(block: Mapping[str, Any], prefix: str) -> None:
    """Raise for a value of ``block`` still ``"auto"`` (``prefix`` names the block)."""
    for key, value in block.items():
        if value == AUTO:
            raise ConfigError(f"{prefix}.{key} is {AUTO!r}: {AUTO_HELP}")
