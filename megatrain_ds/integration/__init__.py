"""The engine as DeepSpeed, Accelerate and the HF Trainer expect to find it.

- ``deepspeed_hook``: routes ``deepspeed.initialize`` for configs with ``"engine": "megatrain"``.
- ``initialize``: DeepSpeed's entry point, returning this engine.
- ``deepspeed_adapter``: ``MegatrainDeepSpeedEngine``, the engine as a ``DeepSpeedEngine``.

May import: everything below it, ``megatrain_ds.engine`` included. The only room that
imports DeepSpeed's engine classes.
"""
