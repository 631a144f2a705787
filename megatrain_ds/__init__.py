"""megatrain_ds: a DeepSpeed-compatible engine that trains models far larger than GPU memory.

Every persistent tensor (fp32 master weights, Adam state, gradient accumulators) lives in
host memory; each transformer block's weights stream to the GPU just in time.

``deepspeed.initialize`` calls whose config has ``"engine": "megatrain"`` go to
:func:`initialize`, which returns a ``DeepSpeedEngine`` subclass
(:class:`megatrain_ds.integration.deepspeed_adapter.MegatrainDeepSpeedEngine`). The routing is
installed with the package (a ``.pth`` start-up hook), so scripts need not import this
package; importing it installs the routing too (the rules: :mod:`megatrain_ds.integration.deepspeed_hook`;
every patch of DeepSpeed and Accelerate: :mod:`megatrain_ds.integration.compat`).
"""

import _megatrain_ds_hook
from megatrain_ds.config import ConfigError, EngineConfig, MegatrainOptions, parse_engine_config
from megatrain_ds.engine import MegatrainEngine, NonFiniteGradientError
from megatrain_ds.integration.initialize import initialize

__all__ = [
    "ConfigError",
    "EngineConfig",
    "MegatrainEngine",
    "MegatrainOptions",
    "NonFiniteGradientError",
    "initialize",
    "parse_engine_config",
]

_megatrain_ds_hook.install()
