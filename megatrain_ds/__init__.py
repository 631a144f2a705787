"""megatrain_ds: a DeepSpeed-compatible engine that trains models far larger than GPU memory.

Every persistent tensor (fp32 master weights, Adam state, gradient accumulators) lives in
host memory; each transformer block's weights stream to the GPU just in time.

Importing this package routes ``deepspeed.initialize`` calls whose config has
``"engine": "megatrain"`` to :func:`initialize` (see :mod:`megatrain_ds.deepspeed_hook`).
"""

from megatrain_ds import deepspeed_hook
from megatrain_ds.config import ConfigError, EngineConfig, MegatrainOptions, parse_engine_config
from megatrain_ds.engine import MegatrainEngine
from megatrain_ds.initialize import initialize

__all__ = [
    "ConfigError",
    "EngineConfig",
    "MegatrainEngine",
    "MegatrainOptions",
    "initialize",
    "parse_engine_config",
]

deepspeed_hook.install()
