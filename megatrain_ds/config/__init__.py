"""The engine's configuration, read from a DeepSpeed JSON with ``"engine": "megatrain"``.

Engine options live in a top-level ``"megatrain"`` block (:class:`MegatrainOptions`);
unknown keys and bad values there are rejected with a message naming the key and the
valid choices. The DeepSpeed keys this engine gives a meaning to are read into
:class:`EngineConfig`; other DeepSpeed keys are reported once as ignored.

- ``values``: :class:`ConfigError`, the integer check, ``"auto"`` (what every block checks with).
- ``megatrain_options``: the ``"megatrain"`` block (:class:`MegatrainOptions`, :class:`AioSettings`).
- ``deepspeed_keys``: which DeepSpeed keys are read, ignored or refused; the ``zero_optimization`` block.
- ``deepspeed_blocks``: the ``"optimizer"``, ``"scheduler"`` and ``"fp16"`` blocks.
- ``engine_config``: :class:`EngineConfig` and :func:`parse_engine_config`, the JSON read whole.

The names other modules use are importable from ``megatrain_ds.config`` itself; the modules
here import each other directly, never this package.

May import: nothing of the package (the lowest layer).
"""

from megatrain_ds.config.deepspeed_blocks import Fp16Options, OptimizerSpec, SchedulerSpec
from megatrain_ds.config.engine_config import EngineConfig, is_megatrain_config, load_config_dict, parse_engine_config
from megatrain_ds.config.megatrain_options import NVME_OFFLOAD_LEVELS, AioSettings, MegatrainOptions
from megatrain_ds.config.values import AUTO, ConfigError

__all__ = [
    "AUTO",
    "NVME_OFFLOAD_LEVELS",
    "AioSettings",
    "ConfigError",
    "EngineConfig",
    "Fp16Options",
    "MegatrainOptions",
    "OptimizerSpec",
    "SchedulerSpec",
    "is_megatrain_config",
    "load_config_dict",
    "parse_engine_config",
]
