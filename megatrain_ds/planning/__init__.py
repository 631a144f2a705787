"""The cost model: what a run needs in memory and time, checked before it starts.

- ``step_time``: the machine, model and run records; step time by resource and by phase.
- ``planner``: host and device memory, the transfer-hiding batch, the choices, the plan (``megatrain plan``).
- ``preflight``: the memory a run needs, checked before the engine allocates anything.
- ``long_context``: loss-chunk and MLP-tile sizes ("auto"), memory per token.
- ``transfer_hiding``: warns once when a micro-batch is too small to hide weight transfers.
- ``recompute_policy``: which blocks stash their activations (``"recompute"``; ``"auto"``).
- ``fragment_policy``: whether blocks' weights cross in fragments (``"fragment_bytes": "auto"``).

May import: every room below it: ``config`` through ``checkpoint``.
"""
