"""The engine as DeepSpeed, Accelerate and the HF Trainer expect to find it.

- ``compat``: every patch of DeepSpeed, Accelerate and transformers (mostly reached through
  Accelerate's config class; the Trainer's ``deepspeed_init`` alone patched), each with the
  contract it relies on and its start-up check.
- ``deepspeed_hook``: the routing rules: which ``deepspeed.initialize`` calls and configs
  are megatrain's, what a minimal or ZeRO-3 megatrain config is read as, and what the
  Trainer's evaluation before training does to one.
- ``initialize``: DeepSpeed's entry point, returning this engine.
- ``deepspeed_adapter``: ``MegatrainDeepSpeedEngine``, the engine as a ``DeepSpeedEngine``.

May import: everything below it, ``megatrain_ds.engine`` included. The only room that
imports DeepSpeed's engine classes, and the only one that patches third-party modules
(``compat`` alone).
"""
